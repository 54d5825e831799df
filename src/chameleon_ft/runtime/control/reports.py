"""What the workers of a run being taken over report, as the control plane keeps it
(pure): each one's process, the newest generation it followed and the state it holds
(:mod:`~chameleon_ft.runtime.control.reattach` decides from them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from chameleon_ft.plan import ExecutionPlan


@dataclass(frozen=True)
class Held:
    """Layers a worker holds as committed after ``step`` steps, placed by ``plan`` (the
    plan of generation ``gen``, whose commit or load made them)."""

    step: int
    gen: int
    plan: ExecutionPlan
    layers: frozenset[int]

    def covers(self, plan: ExecutionPlan, worker: int, step: int) -> bool:
        """Whether this holds ``worker``'s layers of ``plan`` after ``step`` steps."""
        return self.step == step and \
            frozenset(plan.layers_by_worker.get(worker, range(0))) <= self.layers


@dataclass(frozen=True)
class Report:
    """One worker's report to the coordinator that took the run over."""

    worker: int
    incarnation: str
    seen_gen: int
    """The newest generation it knows was published (-1: none)."""
    gen: int
    """The newest generation whose directive it read (-1: none)."""
    members: Mapping[int, str]
    """That directive's incarnations: who was alive then."""
    held: Held | None
    pending: Held | None = None
    """What it holds if the step it reduced (and whose verdict it never read) committed."""
    local: bool = False
    """The shell holds its process (its exit is seen at once)."""
    pid: int = 0
    host: str = ""


@dataclass(frozen=True)
class Taking:
    """A run being taken over: the reports read so far and the deadline."""

    until_s: float
    reports: Mapping[int, Mapping[str, Report]] = field(default_factory=dict)
    """Per worker id, per process (incarnation): its newest report."""
