"""The observations and effects of fail-slow handling (``messages`` names them with the
rest): the workers' step timings and probes in, the policy's question and the report's
records out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.runtime.control.decider import DecisionLike

# ---------------------------------------------------------------------- observations


@dataclass(frozen=True)
class OpTimes:
    """The compute seconds each worker of ``gen``'s plan reported for the committed
    ``step`` (its forward and backward operations; bounded by the shell with
    ``slowness.compute_seconds``: a worker without a usable report is left out)."""

    now_s: float
    gen: int
    step: int
    compute_s: Mapping[int, float]


@dataclass(frozen=True)
class Probes:
    """Probes of slow workers out of the plan: worker -> (its probe's number, its time
    over the worker's own probe at start)."""

    now_s: float
    readings: Mapping[int, tuple[int, float]]


@dataclass(frozen=True)
class SlowDecision:
    """The policy's answer to a :class:`DecideSlow` effect (None: it gave none,
    ``error`` says why)."""

    now_s: float
    worker: int
    end: bool
    gen: int
    decision: DecisionLike | None
    error: str = ""
    decide_s: float = 0.0


# ---------------------------------------------------------------------- effects


@dataclass(frozen=True)
class DecideSlow:
    """Ask the policy how to answer ``worker`` running ``factor`` times slower under
    ``plan`` (``end``: how to plan now that its slowdown ended); answer with
    :class:`SlowDecision`."""

    worker: int
    factor: float
    end: bool
    gen: int
    plan: ExecutionPlan
    alive: frozenset[int]
    """Live workers the answer may use (slow ones out of the plan left out)."""
    slow: Mapping[int, float] = field(default_factory=dict)
    """The other slow workers and their factors."""


@dataclass(frozen=True)
class SlowEvent:
    """A worker was declared slow (``cause`` ``slow``) or fast again (``slow-end``): a
    record in the report, before the policy's answer."""

    worker: int
    cause: str
    factor: float
    """The factor it was declared with."""
    gen: int
    step: int
    """The step in flight when it was noticed."""
    detected_s: float
    measured: float
    """The median factor of the readings that decided it (declared: the same as
    ``factor``; cleared: the readings at full speed)."""


@dataclass(frozen=True)
class SlowResolved:
    """The policy's answer about a slow worker was taken (its record in the report)."""

    worker: int
    cause: str
    strategy: str
    reason: str
    decision: Mapping[str, Any] = field(default_factory=dict)
    decide_s: float = 0.0
    plan: ExecutionPlan | None = None
    """The plan switched to at the next step boundary (None: none)."""
