"""Chameleon: adaptive fault tolerance for data x pipeline parallel LLM training.

The planning core (``spec``, ``profile``, ``plan``, ``perf``, ``recovery``, ``policy``,
``sim``) is pure Python and never imports torch; only ``runtime`` does.

What a training script needs is importable from here: :func:`train` (the runtime as a
library, the same machinery as ``chameleon train``), :func:`load_config` and
:class:`Config`, the learning-rate schedules (:class:`LRSchedule`, :class:`ScheduleKind`,
and :class:`TorchLRSchedule` for ``torch.optim.lr_scheduler`` schedulers), the fault
types (:class:`Fault`, :class:`FaultKind`, :class:`FaultPhase`, :func:`parse_fault`),
:class:`WorkerFailure` and the reference trainer :func:`train_reference`. Each is the
object of the module that defines it, imported on first use: ``import chameleon_ft``
stays cheap and imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "train": "chameleon_ft.runtime.workload.api",
    "load_config": "chameleon_ft.spec.config",
    "Config": "chameleon_ft.spec.config",
    "LRSchedule": "chameleon_ft.runtime.workload.schedules",
    "TorchLRSchedule": "chameleon_ft.runtime.workload.schedules",
    "ScheduleKind": "chameleon_ft.spec.optimizer",
    "Fault": "chameleon_ft.spec.train",
    "FaultKind": "chameleon_ft.spec.train",
    "FaultPhase": "chameleon_ft.spec.train",
    "parse_fault": "chameleon_ft.spec.train",
    "WorkerFailure": "chameleon_ft.runtime.coordinator.shell",
    "train_reference": "chameleon_ft.runtime.workload.reference",
}
"""Each public name and the module that defines it."""

__all__ = [
    "Config",
    "Fault",
    "FaultKind",
    "FaultPhase",
    "LRSchedule",
    "ScheduleKind",
    "TorchLRSchedule",
    "WorkerFailure",
    "__version__",
    "load_config",
    "parse_fault",
    "train",
    "train_reference",
]

if TYPE_CHECKING:  # what type checkers and editors see: the real objects
    from chameleon_ft.runtime.coordinator.shell import WorkerFailure
    from chameleon_ft.runtime.workload.api import train
    from chameleon_ft.runtime.workload.reference import train_reference
    from chameleon_ft.runtime.workload.schedules import LRSchedule, TorchLRSchedule
    from chameleon_ft.spec.config import Config, load_config
    from chameleon_ft.spec.optimizer import ScheduleKind
    from chameleon_ft.spec.train import Fault, FaultKind, FaultPhase, parse_fault


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'chameleon_ft' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
