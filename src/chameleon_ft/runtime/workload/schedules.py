"""Learning-rate schedules: what the runtime applies is the rate of each 0-based step.

:class:`LRSchedule` is the built-in one (``[optimizer] schedule``: linear warm-up, then
constant or a half cosine). :class:`TorchLRSchedule` takes PyTorch's own
``torch.optim.lr_scheduler`` schedulers where a schedule is accepted (``chameleon_ft.train``
``lr_schedule``, ``train_reference``): a scheduler class or factory (``optimizer ->
scheduler``, e.g. ``functools.partial(CosineAnnealingLR, T_max=1000)``) or a scheduler
instance. The runtime has one optimizer per layer, in several processes, so a scheduler
cannot drive them; each worker instead replays the scheduler once, over a throw-away
optimizer built from the job's optimizer factory, and reads the rate a single-process
loop's optimizer has at each step (``optimizer.step()``, then ``scheduler.step()``). A
schedule that follows a metric (``ReduceLROnPlateau``) is refused: it is no function of
the step. This module imports torch only inside the functions that need it.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chameleon_ft.spec.optimizer import ScheduleKind


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up, then constant or a half cosine down to ``min_lr``."""

    lr: float
    """The base (peak) learning rate."""
    kind: str = ScheduleKind.CONSTANT.value
    warmup_steps: int = 0
    decay_steps: int = 0
    """Step at which ``cosine`` reaches ``min_lr``."""
    min_lr: float = 0.0

    def __call__(self, step: int) -> float:
        """The learning rate of 0-based step ``step``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == ScheduleKind.CONSTANT:
            return self.lr
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def _scheduler_class(obj: Any) -> type | None:
    """The ``torch.optim.lr_scheduler`` class ``obj`` is, builds (a partial of it) or is an
    instance of; None for anything else."""
    from torch.optim import lr_scheduler

    bases = (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)
    if isinstance(obj, bases):
        return type(obj)
    target = obj.func if isinstance(obj, functools.partial) else obj
    if isinstance(target, type) and issubclass(target, bases):
        return target
    return None


def is_scheduler_instance(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.optim.lr_scheduler`` scheduler bound to an optimizer."""
    from torch.optim import lr_scheduler

    return isinstance(obj, lr_scheduler.LRScheduler | lr_scheduler.ReduceLROnPlateau)


class TorchLRSchedule:
    """A ``torch.optim.lr_scheduler`` schedule as the rate of each 0-based step.

    Args:
        scheduler: a scheduler class or factory ``optimizer -> scheduler``, started on an
            optimizer from ``optimizer`` as a training loop starts it (replayed lazily,
            where the rates are used: the workers); or a scheduler instance, taken from
            where it is (its next rate is step 0's) and read at once for ``steps`` steps
            from a copy (the instance and its optimizer are left as they are, and not
            kept: a live scheduler does not pickle).
        optimizer: the job's optimizer factory ``params -> optimizer``; its rate is where a
            factory's schedule starts (not used for an instance).
        steps: the steps an instance is read for (required for one).

    Raises:
        ValueError: naming ``lr_schedule`` for a schedule that follows a metric, a factory
            without an optimizer factory, or an instance without ``steps``.
    """

    def __init__(self, scheduler: Any, optimizer: Callable[..., Any] | None = None,
                 steps: int | None = None) -> None:
        from torch.optim import lr_scheduler

        cls = _scheduler_class(scheduler)
        if cls is not None and issubclass(cls, lr_scheduler.ReduceLROnPlateau):
            raise ValueError("lr_schedule: ReduceLROnPlateau follows a metric, not the step; "
                             "give a schedule of the step (a torch.optim.lr_scheduler class "
                             "or factory, or step -> learning rate)")
        self.factory: Any = None
        self.optimizer = optimizer
        self._rates: list[float] = []
        self._live: Any = None
        if isinstance(scheduler, lr_scheduler.LRScheduler):
            if steps is None:
                raise ValueError("lr_schedule: a scheduler instance is read for the run's "
                                 "steps; give steps (or a class or factory)")
            self._live = copy.deepcopy(scheduler)
            if steps > 0:
                self(steps - 1)
            self._live = None  # every rate of the run is read; the copy is not kept
            return
        if not callable(scheduler):
            raise ValueError("lr_schedule: give a torch.optim.lr_scheduler class, factory "
                             "(optimizer -> scheduler) or instance")
        if optimizer is None:
            raise ValueError("lr_schedule: a scheduler factory needs the optimizer factory "
                             "whose rate it starts from")
        self.factory = scheduler

    @classmethod
    def wrap(cls, schedule: Any, optimizer: Callable[..., Any] | None, steps: int) -> Any:
        """``schedule`` as the runtime takes it: a torch scheduler (class, partial of a
        class, instance) wrapped, anything else as it is.

        Raises:
            ValueError: for a torch scheduler the runtime cannot replay.
        """
        if isinstance(schedule, TorchLRSchedule):
            if schedule.factory is not None and schedule.optimizer is None:
                return cls(schedule.factory, optimizer)
            return schedule
        if _scheduler_class(schedule) is None:
            return schedule
        return cls(schedule, optimizer, steps)

    def start(self, optimizer: Any) -> Any:
        """A scheduler of this schedule driving ``optimizer`` (a single-process loop's),
        or None for one read from an instance (its rates are then set by hand)."""
        return None if self.factory is None else self.factory(optimizer)

    def __call__(self, step: int) -> float:
        """The learning rate of 0-based step ``step``: the first group's rate when a
        single-process loop's optimizer takes its ``step``-th step.

        Raises:
            ValueError: for a negative step, or one past the steps an instance was read for.
        """
        if step < 0:
            raise ValueError(f"lr_schedule: step {step} is negative")
        if step >= len(self._rates) and self._live is None:
            if self.factory is None:
                raise ValueError(f"lr_schedule: the scheduler instance was read for "
                                 f"{len(self._rates)} steps, not {step + 1}")
            import torch

            assert self.optimizer is not None
            # a throw-away optimizer of one parameter without a gradient: its steps move
            # nothing, its rate is the schedule's
            self._live = self.factory(self.optimizer([torch.nn.Parameter(torch.zeros(1))]))
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore", UserWarning)
            while len(self._rates) <= step:
                self._rates.append(float(self._live.optimizer.param_groups[0]["lr"]))
                self._live.step()
        return self._rates[step]

    def __getstate__(self) -> dict[str, Any]:
        # a factory is replayed where it is used; an instance's rates travel as they are
        rates = [] if self.factory is not None else list(self._rates)
        return {"factory": self.factory, "optimizer": self.optimizer, "_rates": rates,
                "_live": None}

    def __repr__(self) -> str:
        what = self.factory if self.factory is not None else f"{len(self._rates)} rates"
        return f"TorchLRSchedule({what!r})"
