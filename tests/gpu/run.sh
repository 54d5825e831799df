#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA device: the runtime's recovery on
# CUDA (gloo with a shared GPU; NCCL where there is a GPU per worker) and measured layer
# times. Results (pytest's log and layer_times.json) go to $OUT (default: out/gpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
python -c 'import torch; print("cuda:", torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda)' | tee "$OUT/device.txt"
OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu -rs 2>&1 | tee "$OUT/pytest.txt"
