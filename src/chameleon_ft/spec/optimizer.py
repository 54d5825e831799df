"""The optimizer (section ``[optimizer]``): a ``torch.optim`` class, its keyword arguments
and a learning-rate schedule. Used by the runtime only.

The table's own keys are ``name``, ``schedule``, ``warmup_steps``, ``decay_steps``,
``min_lr`` and ``clip_grad_norm``; every other key is a keyword argument of the optimizer class (``lr``, ``betas``,
``eps``, ``weight_decay``, ``momentum``...). This module stays pure: whether the class and
its arguments exist is checked by the runtime against the class's signature
(``chameleon_ft.runtime.workload.optim``), still before any worker starts.

``[train] lr`` and ``[train] weight_decay`` are shorthands: they apply when ``[optimizer]``
does not set the same key; setting both to different values is an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from chameleon_ft.spec._fields import check_choice, check_int, check_positive, fail


class ScheduleKind(StrEnum):
    """Learning-rate schedules."""

    CONSTANT = "constant"
    COSINE = "cosine"


OWN_KEYS = ("name", "schedule", "warmup_steps", "decay_steps", "min_lr", "clip_grad_norm")
"""Keys of ``[optimizer]`` that are not arguments of the optimizer class."""


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """The ``[optimizer]`` table."""

    name: str = "AdamW"
    """A class of ``torch.optim`` (``AdamW``, ``Adam``, ``SGD``, ``RMSprop``...)."""
    args: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class (every other key of the table); numbers, booleans,
    strings, or lists of numbers (passed as tuples, e.g. ``betas``)."""
    schedule: str = ScheduleKind.CONSTANT.value
    """``constant``: the base learning rate after a linear warm-up; ``cosine``: warm-up, then
    a half cosine from the base rate down to ``min_lr`` at ``decay_steps``."""
    warmup_steps: int = 0
    """Steps of linear warm-up from ``lr / warmup_steps`` to ``lr``."""
    decay_steps: int = 0
    """For ``cosine``: the step at which the rate reaches ``min_lr`` (0: ``[train] steps``)."""
    min_lr: float = 0.0
    """For ``cosine``: the final learning rate."""
    clip_grad_norm: float = 0.0
    """Clip the gradients by their global norm before each step, as
    ``torch.nn.utils.clip_grad_norm_`` over the whole model does: the norm of every
    parameter's gradient (each parameter once: one replica, a tied pair once, frozen
    parameters none), and when it exceeds this value every gradient is scaled by
    ``clip_grad_norm / (norm + 1e-6)``. 0 (default): no clipping."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            fail("name", f"{self.name!r} is not a class name of torch.optim")
        check_choice("schedule", self.schedule, [k.value for k in ScheduleKind])
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_int("decay_steps", self.decay_steps, minimum=0)
        check_positive("min_lr", self.min_lr, allow_zero=True)
        check_positive("clip_grad_norm", self.clip_grad_norm, allow_zero=True)
        for key, value in self.args.items():
            if key in ("params", "self"):
                fail(key, "is set by the runtime (one layer's parameters), not the config")
            _check_arg(key, value)

    def is_default_schedule(self) -> bool:
        """Whether the learning rate is constant (no warm-up, no decay)."""
        return self.schedule == ScheduleKind.CONSTANT and self.warmup_steps == 0


def _check_arg(key: str, value: Any) -> None:
    if isinstance(value, (bool, str)):
        return
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            fail(key, f"must be finite, got {value!r}")
        return
    if isinstance(value, tuple) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return
    fail(key, f"must be a number, a boolean, a string or a list of numbers, got {value!r}")


def optimizer_from_mapping(data: Mapping[str, Any],
                           train: Mapping[str, Any]) -> OptimizerSpec:
    """Build the ``[optimizer]`` spec from its TOML table.

    Args:
        data: the ``[optimizer]`` table.
        train: the ``[train]`` table as written (to reject conflicting shorthands).

    Raises:
        ValueError: naming ``optimizer.<key>`` (or ``train.<key>`` for a conflict).
    """
    if not isinstance(data, Mapping):
        fail("optimizer", f"must be a table, got {data!r}")
    own: dict[str, Any] = {}
    args: dict[str, Any] = {}
    for key, value in data.items():
        if key in OWN_KEYS:
            own[key] = value
        else:
            args[key] = tuple(value) if isinstance(value, list) else value
    for key, kind in (("name", str), ("schedule", str), ("warmup_steps", int),
                      ("decay_steps", int), ("min_lr", float), ("clip_grad_norm", float)):
        value = own.get(key)
        if value is None:
            continue
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              if kind is float else isinstance(value, kind) and not isinstance(value, bool))
        if not ok:
            fail(f"optimizer.{key}", f"must be a {kind.__name__}, got {value!r}")
        if kind is float:
            own[key] = float(value)
    for shorthand in ("lr", "weight_decay"):
        if shorthand in args and shorthand in train and float(args[shorthand]) != float(
                train[shorthand]):
            fail(f"train.{shorthand}", f"{train[shorthand]!r} conflicts with optimizer."
                 f"{shorthand} {args[shorthand]!r}; set it in one place")
    try:
        return OptimizerSpec(args=args, **own)
    except ValueError as exc:
        raise ValueError(f"optimizer.{exc}") from None
