"""What a run records as it goes: committed steps and failures, and the measured
transition of each recovery (pure Python)."""

from __future__ import annotations

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


MEDIAN_STEPS = 32
"""Steps of the new plan whose median is its own step time (the first ones after the
first commit of its generation)."""


@dataclass
class _Measuring:
    event: Event
    gen: int
    first_step_s: float
    after: list[float] = field(default_factory=list)


class TransitionMeter:
    """Measures each recovery's transition as commits arrive, holding only the recoveries
    not measured yet (a bounded sample of each one's steps), never the commits.

    An event's transition is from the fault (or its detection) to the first commit after
    it, minus the new plan's own step time: the median of the steps its generation
    committed after that first one (at most ``MEDIAN_STEPS``), or the first one's when it
    committed no other. The first commit after an event ends its recovery even if a later
    restart threw it away.
    """

    def __init__(self) -> None:
        self.waiting: list[Event] = []
        """Events whose recovery committed nothing yet."""
        self.measuring: list[_Measuring] = []

    def failed(self, event: Event) -> None:
        """A failure was detected (an idle worker's death is never measured)."""
        if not event.idle:
            self.waiting.append(event)

    def committed(self, record: StepRecord) -> list[Event]:
        """A step committed; returns the events whose recovery it ends."""
        still = []
        for m in self.measuring:
            if m.gen == record.gen:
                m.after.append(record.step_s)
            if m.gen == record.gen and len(m.after) < MEDIAN_STEPS:
                still.append(m)
            else:  # its generation ended, or the sample is full
                _finish(m)
        self.measuring = still
        resumed = [e for e in self.waiting if record.committed_at_s > e.detected_at_s]
        self.waiting = [e for e in self.waiting if e not in resumed]
        for event in resumed:
            if event.idle:  # made idle after it was recorded: nothing to measure
                continue
            event.resumed_at_s = record.committed_at_s
            self.measuring.append(_Measuring(event, record.gen, record.step_s))
        return resumed

    def close(self) -> None:
        """The run ended: measure what is open."""
        for m in self.measuring:
            _finish(m)
        self.measuring = []


def _finish(m: _Measuring) -> None:
    own_s = statistics.median(m.after) if m.after else m.first_step_s
    event = m.event
    start = event.fault_at_s if event.fault_at_s is not None else event.detected_at_s
    assert event.resumed_at_s is not None
    event.transition_s = event.resumed_at_s - start - own_s


def measure_transitions(events: list[Event], commits: list[StepRecord]) -> None:
    """Set each event's transition from every commit in time order (steps a later restart
    redid included): what :class:`TransitionMeter` measures as they arrive."""
    meter = TransitionMeter()
    pending = sorted(events, key=lambda e: e.detected_at_s)
    for record in commits:
        while pending and pending[0].detected_at_s < record.committed_at_s:
            meter.failed(pending.pop(0))
        meter.committed(record)
    meter.close()
