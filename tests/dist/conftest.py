"""Shared failure-free reference runs (one per dtype) for the recovery tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_job
from events import failures


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``reference(dtype, steps)`` -> (report, params) of a failure-free run, computed once."""
    cache: dict[str, Any] = {}

    def get(dtype: str = "float64", steps: int = 6) -> Any:
        key = f"{dtype}-{steps}"
        if key not in cache:
            out: Path = tmp_path_factory.mktemp(f"reference-{key}")
            report, params, _ = run_job(out, dtype=dtype, steps=steps)
            assert not failures(report)
            cache[key] = (report, params)
        return cache[key]

    return get
