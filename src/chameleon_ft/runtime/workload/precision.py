"""The run's numerics: the dtype names a job file uses, as torch dtypes."""

from __future__ import annotations

import torch


def torch_dtype(name: str) -> torch.dtype:
    """``float32`` / ``float64`` -> the torch dtype."""
    return {"float32": torch.float32, "float64": torch.float64}[name]
