"""What a run records as it goes: committed steps and failures, and the measured
transition of each recovery (pure Python)."""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepRecord:
    """One committed step."""

    step: int
    loss: float
    step_s: float
    gen: int
    committed_at_s: float
    num_workers: int
    grad_norm: float | None = None
    """The global gradient norm before clipping (every parameter of the model once)."""
    lr: float | None = None
    """The learning rate the step applied."""


def step_metrics(timings: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """The step's global gradient norm and learning rate from the workers' reports: each
    worker's share of the squared norm (``grad_norm_sq``, its lowest-id layers) added up,
    and the rate any of them applied. The shares are taken out of ``timings``."""
    shares = [t.pop("grad_norm_sq") for t in timings if "grad_norm_sq" in t]
    rates = [t.pop("lr") for t in timings if "lr" in t]
    norm = math.sqrt(math.fsum(shares)) if shares else None
    lr = next((r for r in rates if r is not None), None)
    return norm, lr


@dataclass
class Event:
    """One failure and the recovery from it."""

    workers: list[int]
    cause: str
    """``exit``, ``heartbeat``, ``error`` or ``reported`` (named by peers)."""
    gen: int
    """The generation that failed."""
    step: int
    """The step that was in flight (discarded and redone)."""
    fault_at_s: float | None
    detected_at_s: float
    detected_after_s: float | None
    strategy: str = ""
    reason: str = ""
    decision: dict[str, Any] = field(default_factory=dict)
    decide_s: float = 0.0
    resumed_at_s: float | None = None
    """When the first step after the recovery committed."""
    transition_s: float | None = None
    """Kill to first committed step after recovery, minus the new plan's step time."""
    lost_steps: int = 0
    """Committed steps thrown away by a checkpoint restart."""
    idle: bool = False
    """Only idle workers died: nothing was aborted or recovered."""
    from_memory_layers: int = 0
    """Layers the recovery reloaded from peers' memory instead of storage (checkpoints in
    memory), counted over the workers that loaded them."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dict(vars(self))


def measure_transitions(events: list[Event], commits: list[StepRecord]) -> None:
    """Set each event's transition: fault to first commit after it, minus the new plan's step.

    ``commits`` is every commit in time order, steps that a later restart redid included:
    the first commit after an event ends its recovery even if a restart threw it away.
    """
    times = [r.committed_at_s for r in commits]
    for event in events:
        if event.idle:
            continue
        i = bisect.bisect_right(times, event.detected_at_s)
        if i == len(commits):
            continue
        first = commits[i]
        # generations follow one another in time: the first's later commits are the run
        # that follows it
        end = i + 1
        while end < len(commits) and commits[end].gen == first.gen:
            end += 1
        same_gen = commits[i + 1:end]
        own_s = statistics.median(r.step_s for r in same_gen) if same_gen else first.step_s
        event.resumed_at_s = first.committed_at_s
        start = event.fault_at_s if event.fault_at_s is not None else event.detected_at_s
        event.transition_s = first.committed_at_s - start - own_s
