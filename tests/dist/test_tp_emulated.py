"""The emulated-device testbed's model (``examples/emulated_device.py``) sharded by its own
tensor-parallel plan (design 4.11, a user's model): at tp 2 its layers are column- and
row-parallel over each worker's two processes, its collectives run on the worker's group,
and, float64, the final parameters equal plain single-process (tp 1) training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dist_harness import alive, max_abs_diff, run_job

from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec.config import config_from_mapping

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def emulated_job(tp: int) -> Any:
    """pp 2 x dp 1 of the emulated model at ``tp``: 2 workers, ``2 tp`` processes, two
    steps of two micro-batches of 2 samples (about 0.2 s of waits a step at tp 1)."""
    return config_from_mapping({
        "model": {"source": "python", "factory": "emulated_device:build_model"},
        "data": {"kind": "python", "factory": "emulated_device:build_data"},
        "cluster": {"num_nodes": 2, "devices_per_node": tp, "device": "cpu"},
        "job": {"pp": 2, "dp": 1, "tp": tp, "global_batch": 4, "micro_batch": 2},
        "profile": {"kind": "uniform", "num_layers": 8, "fwd_s": 0.006,
                    "bwd_input_s": 0.006, "bwd_weight_s": 0.006},
        "optimizer": {"name": "SGD", "lr": 0.05, "momentum": 0.9, "clip_grad_norm": 0.05},
        "recovery": {"detect_s": 0.05, "restart_s": 1.0, "checkpoint_load_s": 0.1,
                     "checkpoint_interval_s": 5.0},
        "train": {"steps": 2, "dtype": "float64", "timeout_s": 6.0, "heartbeat_s": 0.1,
                  "checkpoint_every": 2},
    }, base_dir=str(EXAMPLES))


def test_emulated_model_at_tp2_equals_tp1_training(tmp_path: Path) -> None:
    config = emulated_job(2)
    report, params, pids = run_job(tmp_path, policy="dynamic", config=config)
    assert len(pids) == 4 and not [p for p in pids if alive(p)]
    assert [s["step"] for s in report["steps"]] == [0, 1]
    peaks = report["peak_memory_bytes"]  # each worker's peak per process (rank)
    assert sorted(peaks) == ["0", "1"] and all(len(r) == 2 and min(r) > 100 * 2**20
                                               for r in peaks.values())
    reference = train_reference(emulated_job(1))
    assert min(reference.grad_norms) > 0.05, "clipping must be active"
    assert max_abs_diff(params, reference.params) < 1e-9
