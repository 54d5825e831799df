"""What the CLI tests share: how to run the command, and the tiny 4-worker layout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYOUT = """
[cluster]
num_nodes = 2
devices_per_node = 2
device = "cpu"

[job]
pp = 2
dp = 2
global_batch = 8
micro_batch = 2
"""
"""4 workers: 2 nodes of 2, dp 2 x pp 2, 4 micro-batches of 2 samples per step."""

TINY_MODEL = """
[model]
name = "tinyjob"
num_blocks = 2
hidden_size = 32
num_heads = 2
vocab_size = 256
seq_len = 32
"""
"""A 2-block GPT: about 20 ms of compute per step."""


def cmd(*args: str) -> list[str]:
    """``chameleon ARGS`` with this interpreter."""
    return [sys.executable, "-m", "chameleon_ft", *args]


def env(**extra: str) -> dict[str, str]:
    """The environment of a CLI run: one thread per process."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def chameleon(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``chameleon ARGS`` from the repository root; its output as text."""
    return subprocess.run(cmd(*args), capture_output=True, text=True, cwd=ROOT, timeout=120,
                          check=False)


def paper32_with_spares(folder: Path, spare_nodes: int = 1) -> Path:
    """``examples/paper32.toml`` with ``spare_nodes`` warm spare nodes, written in
    ``folder``; returns the job file."""
    job = folder / "spares.toml"
    job.write_text((ROOT / "examples/paper32.toml").read_text().replace(
        "num_nodes = 4", f"num_nodes = 4\nspare_nodes = {spare_nodes}"))
    return job
