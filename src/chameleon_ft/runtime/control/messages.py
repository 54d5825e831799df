"""What goes into the control plane's step (observations) and what comes out (effects).

Both are small frozen values. The shell turns what it sees (process exits, store
counters, error reports, join requests, signals, the policy's answers) into observations,
calls :func:`chameleon_ft.runtime.control.machine.step`, and performs the effects in
order. Every effect is plain data: a test reads them without any process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.recovery.types import Migration
from chameleon_ft.runtime.control.decider import Ask, DecisionLike
from chameleon_ft.runtime.control.detector import Report
from chameleon_ft.runtime.control.state import Load

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
    """The running generation's error reports from the first unread one, as read."""

    now_s: float
    gen: int
    reports: tuple[Report, ...]


@dataclass(frozen=True)
class Registered:
    """Members that announced themselves since the last look."""

    now_s: float
    workers: tuple[int, ...]


@dataclass(frozen=True)
class Ready:
    """``count`` members of generation ``gen`` built their groups and loaded their state
    (the generation is ready when every member is)."""

    now_s: float
    gen: int
    count: int


@dataclass(frozen=True)
class Reduced:
    """``count`` workers of the plan of ``gen`` reduced ``step`` (it commits when every
    worker of the plan did)."""

    now_s: float
    gen: int
    step: int
    count: int


@dataclass(frozen=True)
class CheckpointLayers:
    """The layer files of the checkpoint after ``step`` steps by generation ``gen``
    reported written so far (its manifest is written once every layer is)."""

    now_s: float
    step: int
    gen: int
    layers: frozenset[int]


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
class Joiner:
    """One join request as the shell read it (the proof checked: ``refusal`` says why it
    fails), with the incarnation its process gets if it is admitted."""

    request: Any
    """What the shell answers to (opaque here)."""
    incarnation: str
    refusal: str | None = None


@dataclass(frozen=True)
class JoinSlots:
    """The join slots reserved so far, as the counter says (a hint anyone can raise)."""

    now_s: float
    reserved: int


@dataclass(frozen=True)
class JoinRequests:
    """Answer to :class:`ReadJoins`: what each slot read held, ``(slot, held)``: a
    :class:`Joiner`, ``MISSING`` (reserved, not written yet), ``MALFORMED`` or
    ``REPLAYED`` (a proof used before: refused, counted, never answered)."""

    now_s: float
    found: tuple[tuple[int, Joiner | str], ...]


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
    """Processes now hold these worker ids (answer to :class:`Launch`): worker ->
    incarnation."""

    now_s: float
    incarnations: Mapping[int, str]
    local: bool
    replacement: bool


@dataclass(frozen=True)
class LaunchFailed:
    """A :class:`Launch` could not start its processes (answer instead of
    :class:`Launched`)."""

    now_s: float
    workers: tuple[int, ...]
    reason: str
    replacement: bool


@dataclass(frozen=True)
class ShellFailed:
    """The shell cannot go on: an exception while it observed or performed (a full disk
    under the run folder, a policy that raised, a bug). Training stops through the failure
    path: the workers are told to stop and the report gives ``reason``."""

    now_s: float
    reason: str
    bad_input: bool = False
    """The job could not start as given (the reason names what to change)."""


Observation = (Tick | Exits | Beats | Errors | Registered | Ready | Reduced | CheckpointLayers
               | CheckpointDone | CheckpointFailed | JoinSlots | JoinRequests | StopAsked
               | Relaunch | SoftwareFault | TraceEnd | Decision | RejoinDecision | Absent
               | Launched | LaunchFailed | ShellFailed)

# ---------------------------------------------------------------------- effects


@dataclass(frozen=True)
class Log:
    """One progress line."""

    text: str


@dataclass(frozen=True)
class Publish:
    """End the previous generation (its abort key) and publish generation ``gen``: its
    plan (the shell builds the schedule), migration, load, first step, members and their
    incarnations, and its collective deadline."""

    gen: int
    plan: ExecutionPlan
    migration: Migration | None
    load: Load | None
    step: int
    world: tuple[int, ...]
    incarnations: Mapping[int, str]
    """Every alive worker's process (a worker whose process is not named is fenced)."""
    collective_s: float
    idle: frozenset[int] = frozenset()


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
    recovered: bool = False
    """The first commit since a failure: its recovery ends here."""


@dataclass(frozen=True)
class ExpectCheckpoint:
    """Follow the checkpoint after ``step`` steps that generation ``gen`` writes: each
    layer by its writer (``writers``), by ``deadline_s``. ``fallback``: the final state,
    uploaded over the bulk channel into the run folder (the checkpoint folder refused it).
    Performed before the commit that makes it due, so no upload can race it."""

    step: int
    gen: int
    deadline_s: float
    writers: Mapping[int, int]
    committed_s: float
    fallback: bool = False


@dataclass(frozen=True)
class Fence:
    """These processes must never come back into this run: kill local ones, delete their
    keys (heartbeat, registration, set-up, start; directives no longer name them)."""

    workers: tuple[int, ...]
    incarnations: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Launch:
    """Start local processes for these worker ids under fresh incarnations (the shell
    answers with :class:`Launched`)."""

    workers: tuple[int, ...]
    replacement: bool


@dataclass(frozen=True)
class Reply:
    """Answer a join request: the worker id given with its incarnation (None: refused, or
    ``request`` None: a malformed request, nobody to answer)."""

    worker: int | None
    replacement: bool = False
    reason: str = ""
    request: Any = None
    incarnation: str = ""
    alive: frozenset[int] = frozenset()
    """Alive workers (the shell gives the joiner a device no live worker of its host
    holds)."""


@dataclass(frozen=True)
class ReadJoins:
    """Read these join slots (each read is deleted) and check their proofs (answer
    :class:`JoinRequests`)."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class Refused:
    """Count a refused value of key ``key`` (``kind``: its message kind in the report)."""

    key: str
    why: str
    kind: str


@dataclass(frozen=True)
class StartFrom:
    """Tell a repaired worker (the process ``incarnation``) the first generation it
    follows."""

    worker: int
    incarnation: str
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
    alive: frozenset[int] = frozenset()


@dataclass(frozen=True)
class ProbeAbsent:
    """Find the members of ``gen`` (these processes) that never joined its groups (answer
    :class:`Absent`)."""

    gen: int
    incarnations: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SaveCheckpoint:
    """Write the manifest of the checkpoint after ``step`` steps from generation ``gen``
    (answer :class:`CheckpointDone` or :class:`CheckpointFailed`); ``accepted`` False:
    discard it, it belongs to an abandoned timeline or exists. ``plan``: the placement its
    state has (for the record)."""

    step: int
    gen: int
    accepted: bool
    plan: ExecutionPlan | None = None
    fallback: bool = False
    """The final state uploaded into the run folder (not a checkpoint a restart loads)."""


@dataclass(frozen=True)
class DropCheckpoint:
    """A checkpoint that could not be written: discard what was written of it and its
    keys, and list it in the report (the previous complete one stays valid); ``quiet``:
    an abandoned timeline's, not listed."""

    step: int
    gen: int
    reason: str
    quiet: bool = False


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
    workers whose state is at the final step; with ``write`` each layer's first holder
    writes it into the final checkpoint (none of that step is complete or being written).
    ``failed`` runs write nothing and the report gives ``reason``. Workers wait at most
    ``final_timeout_s`` for the final checkpoint to complete."""

    gen: int
    step: int
    final: Mapping[int, tuple[int, ...]]
    reason: str = ""
    failed: bool = False
    interrupted: bool = False
    bad_input: bool = False
    """The job could not start as given (its workers did not join or start)."""
    write: bool = False
    final_timeout_s: float = 0.0


@dataclass(frozen=True)
class AskFinal:
    """Ask ``worker`` to write these layers of the final checkpoint (every layer asked of
    it in this attempt: a worker that reads only the latest ask still writes them all);
    ``upload``: over the bulk channel, into the run folder."""

    gen: int
    worker: int
    layers: tuple[int, ...]
    attempt: int
    upload: bool = False


@dataclass(frozen=True)
class FinalDone:
    """The final checkpoint is over: the workers leave. ``folder``: where the final state
    is complete (``checkpoints``, or ``fallback``: the run folder's copy), None when it
    could not be written anywhere (``reason`` says why)."""

    gen: int
    step: int
    folder: str | None
    reason: str = ""


Effect = (Log | Publish | Abort | Commit | ExpectCheckpoint | Fence | Launch | Reply
          | ReadJoins | Refused | StartFrom | Failure | Resolved | Decide | DecideRejoin
          | ProbeAbsent | SaveCheckpoint | DropCheckpoint | MarkCorrupt | DropTimelines
          | Retire | Rejoined | Stop | AskFinal | FinalDone)
