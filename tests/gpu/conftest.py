"""The GPU suite: skipped where no CUDA device is visible (CI, CPU machines), except for
a dry run of ``test_gpu_field.py`` on CPU processes (``CHAMELEON_GPU_SUITE_DEVICE=cpu``).
Each check's outcome is one line of the summary (``GPU CHECK ...``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dist"))

collect_ignore: list[str] = []
DRY_RUN = os.environ.get("CHAMELEON_GPU_SUITE_DEVICE") == "cpu"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        path = str(item.fspath)
        if "tests/gpu" in path and not (DRY_RUN and path.endswith("test_gpu_field.py")):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per check of this folder: its name, outcome and, for a skip or a failure,
    why."""
    lines = []
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            if "tests/gpu/" not in nodeid or getattr(report, "when", "call") == "teardown":
                continue
            why = ""
            if outcome == "skipped" and isinstance(report.longrepr, tuple):
                why = f" ({report.longrepr[2]})"
            elif outcome in ("failed", "error"):
                why = f" ({str(report.longrepr).strip().splitlines()[-1][:160]})"
            lines.append(f"GPU CHECK {nodeid.split('::', 1)[1]}: {outcome}{why}")
    if lines:
        terminalreporter.write_sep("-", "GPU checks")
        for line in lines:
            terminalreporter.write_line(line)
