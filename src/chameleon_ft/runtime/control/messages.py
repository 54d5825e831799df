"""What goes into the control plane's step (observations) and what comes out (effects).

Both are small frozen values. The shell turns what it sees (process exits, store
counters, error slots, join requests, signals, the policy's answers) into observations,
calls :func:`chameleon_ft.runtime.control.machine.step`, and performs the effects in
order. Every effect is plain data: a test reads them without any process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.runtime.control.decider import Ask, DecisionLike
from chameleon_ft.runtime.control.detector import Slot

# ---------------------------------------------------------------------- observations


@dataclass(frozen=True)
class Tick:
    """Time passed (deadlines: drains, joins, waits for absent members)."""

    now_s: float


@dataclass(frozen=True)
class Exits:
    """Local processes of current members that exited, with their status."""

    now_s: float
    statuses: Mapping[int, int]


@dataclass(frozen=True)
class Beats:
    """The heartbeat counters of alive workers: worker -> (incarnation, count)."""

    now_s: float
    counts: Mapping[int, tuple[str, int]]


@dataclass(frozen=True)
class Errors:
    """The running generation's error slots from the first unread one, as read."""

    now_s: float
    gen: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class Registered:
    """Members that announced themselves since the last look."""

    now_s: float
    workers: tuple[int, ...]


@dataclass(frozen=True)
class Ready:
    """Every member of generation ``gen`` built its groups and loaded its state."""

    now_s: float
    gen: int


@dataclass(frozen=True)
class Reduced:
    """Every worker of the plan of ``gen`` reduced ``step``."""

    now_s: float
    gen: int
    step: int


@dataclass(frozen=True)
class CheckpointWritten:
    """Every layer file of the checkpoint after ``step`` steps was written by generation
    ``gen`` (its manifest is not written yet: it is not complete)."""

    now_s: float
    step: int
    gen: int


@dataclass(frozen=True)
class CheckpointDone:
    """The manifest of the checkpoint after ``step`` steps from ``gen`` was written: the
    checkpoint is complete."""

    now_s: float
    step: int
    gen: int


@dataclass(frozen=True)
class CheckpointFailed:
    """The checkpoint after ``step`` steps from ``gen`` could not be written (the disk
    refused a layer file or the manifest, or it did not finish in time)."""

    now_s: float
    step: int
    gen: int
    reason: str


@dataclass(frozen=True)
class JoinAsked:
    """A remote worker asked to join; ``refusal`` is set when its proof failed."""

    now_s: float
    refusal: str | None = None


@dataclass(frozen=True)
class StopAsked:
    """SIGINT or SIGTERM: drain (finish or abort the step in flight, checkpoint, stop)."""

    now_s: float
    signal: str


@dataclass(frozen=True)
class Relaunch:
    """A replayed repair: relaunch these local workers if they are dead."""

    now_s: float
    workers: tuple[int, ...]


@dataclass(frozen=True)
class SoftwareFault:
    """A replayed job-level fault: the running plan reloads the last checkpoint."""

    now_s: float


@dataclass(frozen=True)
class TraceEnd:
    """The replayed trace ended: stop at the next step boundary."""

    now_s: float


@dataclass(frozen=True)
class Decision:
    """The policy's answer to a :class:`Decide` effect."""

    now_s: float
    decision: DecisionLike
    decide_s: float = 0.0


@dataclass(frozen=True)
class RejoinDecision:
    """The policy's answer to a :class:`DecideRejoin` effect (None: it cannot re-join)."""

    now_s: float
    decision: DecisionLike | None
    error: str = ""


@dataclass(frozen=True)
class Absent:
    """Answer to :class:`ProbeAbsent`: members of ``gen`` that never joined its groups,
    with the generation whose set-up each last began (None: none)."""

    now_s: float
    gen: int
    setup: Mapping[int, int | None]


@dataclass(frozen=True)
class Launched:
    """Processes now hold these worker ids (answer to :class:`Launch` and to an admitting
    :class:`Reply`): worker -> incarnation."""

    now_s: float
    incarnations: Mapping[int, str]
    local: bool
    replacement: bool


Observation = (Tick | Exits | Beats | Errors | Registered | Ready | Reduced | CheckpointWritten
               | CheckpointDone | CheckpointFailed
               | JoinAsked | StopAsked | Relaunch | SoftwareFault | TraceEnd | Decision
               | RejoinDecision | Absent | Launched)

# ---------------------------------------------------------------------- effects


@dataclass(frozen=True)
class Log:
    """One progress line."""

    text: str


@dataclass(frozen=True)
class Publish:
    """End the previous generation (its abort key) and publish generation ``gen`` of the
    run's state (plan, schedule, migration, load, the members' incarnations)."""

    gen: int


@dataclass(frozen=True)
class Abort:
    """Abort ``step`` (its verdict) and generation ``gen`` (its abort key: workers blocked
    in its collectives are released at once)."""

    gen: int
    step: int


@dataclass(frozen=True)
class Commit:
    """Write the verdict: ``step`` commits (``end``: then leave the generation)."""

    gen: int
    step: int
    end: bool
    start_s: float
    """When the step began: the previous commit, or the generation's readiness."""
    workers: tuple[int, ...]
    """The plan's workers (their losses and timings are collected)."""
    forget_previous: bool
    """The previous step belongs to this generation: its keys can go (every worker read
    its verdict before reducing this step)."""


@dataclass(frozen=True)
class Fence:
    """These workers must never come back into this run: kill local ones, forget their
    heartbeats (directives no longer name their incarnations)."""

    workers: tuple[int, ...]


@dataclass(frozen=True)
class Launch:
    """Start local processes for these worker ids under fresh incarnations (the shell
    answers with :class:`Launched`)."""

    workers: tuple[int, ...]
    replacement: bool


@dataclass(frozen=True)
class Reply:
    """Answer the join request in hand: the worker id given (None: refused; else the
    shell answers with :class:`Launched`)."""

    worker: int | None
    replacement: bool = False
    reason: str = ""


@dataclass(frozen=True)
class StartFrom:
    """Tell a repaired worker the first generation it follows."""

    worker: int
    gen: int


@dataclass(frozen=True)
class Failure:
    """A failure was detected: a new record in the report (before the decision)."""

    workers: tuple[int, ...]
    cause: str
    gen: int
    step: int
    detected_s: float
    idle: bool = False
    strategy: str = ""
    reason: str = ""
    lost_steps: int = 0


@dataclass(frozen=True)
class Resolved:
    """The last failure's recovery was decided."""

    strategy: str
    reason: str
    decision: dict[str, Any] = field(default_factory=dict)
    decide_s: float = 0.0
    lost_steps: int = 0
    plan: ExecutionPlan | None = None
    """The plan decided (logged with the candidates)."""
    candidates: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Decide:
    """Ask the policy (answer with :class:`Decision`)."""

    ask: Ask
    since_checkpoint_s: float | None


@dataclass(frozen=True)
class DecideRejoin:
    """Ask the policy about idle workers (answer with :class:`RejoinDecision`)."""

    plan: ExecutionPlan
    idle: frozenset[int]


@dataclass(frozen=True)
class ProbeAbsent:
    """Find the members of ``gen`` that never joined its groups (answer :class:`Absent`)."""

    gen: int


@dataclass(frozen=True)
class SaveCheckpoint:
    """Write the manifest of the checkpoint after ``step`` steps from generation ``gen``
    (answer :class:`CheckpointDone` or :class:`CheckpointFailed`); ``accepted`` False:
    discard it, it belongs to an abandoned timeline or exists."""

    step: int
    gen: int
    accepted: bool


@dataclass(frozen=True)
class DropCheckpoint:
    """A checkpoint that could not be written: discard what was written of it and list
    it in the report (the previous complete one stays valid)."""

    step: int
    gen: int
    reason: str


@dataclass(frozen=True)
class MarkCorrupt:
    """A complete checkpoint whose files no longer match its manifest: set it aside so
    it is never tried again."""

    step: int
    reason: str


@dataclass(frozen=True)
class DropTimelines:
    """Discard checkpoint assemblies of generations before ``epoch`` (abandoned)."""

    epoch: int


@dataclass(frozen=True)
class Retire:
    """Delete the store keys of these generations (every member moved on):
    ``(gen, first step, last committed step, world)`` each."""

    gens: tuple[tuple[int, int, int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Rejoined:
    """The policy answered about idle workers (a record in the report)."""

    workers: tuple[int, ...]
    step: int
    strategy: str
    reason: str


@dataclass(frozen=True)
class Stop:
    """The run ends: publish the final generation. ``final`` names, per layer, the
    workers whose state is at the final step (they upload it); ``failed`` runs upload
    nothing and the report gives ``reason``."""

    gen: int
    step: int
    final: Mapping[int, tuple[int, ...]]
    reason: str = ""
    failed: bool = False
    interrupted: bool = False
    bad_input: bool = False
    """The job could not start as given (its workers did not join or start)."""


Effect = (Log | Publish | Abort | Commit | Fence | Launch | Reply | StartFrom | Failure
          | Resolved | Decide | DecideRejoin | ProbeAbsent | SaveCheckpoint | DropCheckpoint
          | MarkCorrupt | DropTimelines
          | Retire | Rejoined | Stop)
