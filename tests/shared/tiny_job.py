"""The multi-process tests' job, as a config mapping (pure: no torch)."""

from __future__ import annotations

from typing import Any

TINY: dict[str, Any] = {
    "model": {"name": "tiny", "num_blocks": 2, "hidden_size": 32, "num_heads": 2,
              "vocab_size": 256, "seq_len": 32},
    "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
    "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
    "profile": {"kind": "analytic"},
    "recovery": {"detect_s": 0.05, "rebuild_s": 0.05, "restart_s": 1.0,
                 "checkpoint_load_s": 0.1, "checkpoint_interval_s": 5.0},
    "train": {"steps": 6, "dtype": "float64", "lr": 3e-3, "timeout_s": 2.0,
              "heartbeat_s": 0.1, "checkpoint_every": 2},
}
"""4 workers (dp 2 x pp 2) of a 2-block GPT: about 20 ms of compute per step."""
