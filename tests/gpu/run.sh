#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA device (tests/gpu/*.py): bf16 on the
# device against the CPU run, a worker lost in the all-reduce recovered by abort and
# rebuild (NCCL where there are 2+ GPUs), reloads from the checkpoint and from memory
# copies, no context on another worker's GPU, device memory flat over 20 generations,
# NCCL point-to-point with activations past its buffers (2+ GPUs; rerouted with 4+), the
# recovery tests on CUDA, and measured layer times. Results go to $OUT (default
# out/gpu): device.txt, pytest.txt, summary.txt (one line per check), layer_times.json.
# `tests/gpu/run.sh --cpu` is a dry run of the suite's code on CPU processes.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ "$PYTHON" = python ]; then PYTHON=.venv/bin/python; fi
if [ "${1:-}" = "--cpu" ]; then export CHAMELEON_GPU_SUITE_DEVICE=cpu; fi
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda:", torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "")' | tee "$OUT/device.txt"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv >> "$OUT/device.txt"
OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu -rs 2>&1 | tee "$OUT/pytest.txt"
status=${PIPESTATUS[0]}
grep '^GPU CHECK' "$OUT/pytest.txt" | tee "$OUT/summary.txt"
exit "$status"
