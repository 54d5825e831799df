"""The control value: everything the coordinator decides from, in one frozen value.

:class:`Control` holds the run's
state (:class:`~chameleon_ft.runtime.control.state.RunState`), the members (processes
holding worker ids), what failure detection remembers, the generations not yet retired and
a few flags (a drain asked, a re-join question asked, a decision awaited).
:mod:`~chameleon_ft.runtime.control.machine` moves it; the run's :class:`Mode` is derived
from it (:func:`mode`): the run's state says training, draining, finished or failed, and
the control value's flags refine training into joining, relaunching, deciding and
recovering.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.runtime.control import checkpoints as ck
from chameleon_ft.runtime.control import decider, detector
from chameleon_ft.runtime.control import members as mb
from chameleon_ft.runtime.control import slots as sl
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.control.state import Mode as Mode  # derived here (mode())

PUBLISHED = frozenset({Mode.TRAINING, Mode.DECIDING, Mode.RECOVERING, Mode.DRAINING})
"""The modes in which a generation is published: its reports, heartbeats, readiness and
votes are observed (and read) only then."""
RUNNING = frozenset({Mode.TRAINING, Mode.RECOVERING, Mode.DRAINING})
"""The modes in which the published generation runs unbroken (no decision awaited)."""


@dataclass(frozen=True)
class Settings:
    """What the step needs to know of the job (fixed for the run)."""

    steps: int
    num_workers: int
    num_local: int
    num_layers: int
    hang_s: float
    heartbeat_s: float
    max_retries: int
    rejoin: bool
    join_timeout_s: float
    initial_plan: ExecutionPlan
    replay: bool = False
    """A failure trace drives repairs (the automatic relaunch is off)."""
    drain_grace_s: float = 2.0
    """How long a drain waits for the step in flight before aborting it."""
    join_hint: str = ""
    """Appended to the join-deadline error (how to start the missing workers)."""
    keep_checkpoints: int | None = None
    """Complete checkpoints kept on disk (older ones are forgotten)."""
    checkpoint_every: int = 0
    """A checkpoint after every this many committed steps (0: none but the final one)."""
    checkpoint_deadline_s: float = 10.0
    """How long writing one checkpoint may take (its bytes over the storage's bandwidth,
    plus a latency)."""
    deadline_of: Callable[[ExecutionPlan, Any], tuple[float, str | None]] = \
        lambda _plan, _migration: (3.0, None)
    """A generation's collective deadline, and a log line when it was raised."""


@dataclass(frozen=True)
class GenInfo:
    """A generation not yet retired."""

    published_s: float
    collective_s: float
    world: tuple[int, ...]
    first_step: int
    last_step: int
    silent: bool = False
    """A member went silent (not an exit or an error): its peers' set-up may retry for
    five deadlines, so nobody stuck in it is waited for."""


@dataclass(frozen=True)
class Control:
    """Everything the coordinator decides from. Replaced as a whole by each step."""

    run: st.RunState
    members: mb.Members
    watch: detector.Watch
    beats: Mapping[tuple[int, str], detector.Beat] = field(default_factory=dict)
    gens: Mapping[int, GenInfo] = field(default_factory=dict)
    joining_until_s: float | None = None
    """Set while the first workers join: the join deadline."""
    relaunching_until_s: float | None = None
    """Set while every worker is being relaunched: their deadline."""
    ready_s: float | None = None
    """When the running generation's members were all ready."""
    last_commit_s: float | None = None
    """When the running generation last committed."""
    recovering: bool = False
    """A failure's recovery has not committed a step yet (no repairs meanwhile)."""
    ask: decider.Ask | None = None
    """The policy is being asked this (between :class:`~messages.Decide` and its answer)."""
    rejoin_asked: tuple[ExecutionPlan, frozenset[int]] | None = None
    """The last re-join question (the same question gets the same answer)."""
    drain_since_s: float | None = None
    trace_ended: bool = False
    checkpoint_times: Mapping[int, float] = field(default_factory=dict)
    """When each complete checkpoint the run remembers completed."""
    expected: Mapping[tuple[int, int], ck.Expected] = field(default_factory=dict)
    """Checkpoints being written, by ``(step, gen)``."""
    final: ck.Final | None = None
    """The final checkpoint being written (after the run finished)."""
    closed: bool = False
    """The run is over and nothing more is waited for: the shell ends."""
    joins: sl.Window = field(default_factory=sl.Window)
    """The join slots read so far, and those waited for."""


def initial(run: st.RunState, *, now_s: float, settings: Settings) -> Control:
    """The control value of a run whose workers are about to be launched."""
    return Control(run=run, members=mb.empty(), watch=detector.Watch(gen=run.gen),
                   joining_until_s=now_s + settings.join_timeout_s,
                   checkpoint_times={run.latest_checkpoint(): now_s})


def mode(c: Control) -> Mode:
    """The mode of a control value."""
    if c.run.mode in (Mode.FAILED, Mode.FINISHED):
        return c.run.mode
    if c.joining_until_s is not None:
        return Mode.JOINING
    if c.relaunching_until_s is not None:
        return Mode.RELAUNCHING
    if c.ask is not None:
        return Mode.DECIDING
    if c.run.mode is Mode.DRAINING:
        return Mode.DRAINING
    return Mode.RECOVERING if c.recovering else Mode.TRAINING


@dataclass(frozen=True)
class Wanted:
    """What the shell reads for the next observations (each poll, and again after each
    step: a step may change it)."""

    gen: int | None
    """The published generation whose reports, readiness and votes are read (None: no
    generation runs)."""
    errors_from: int = 0
    """The index of its first unread error report."""
    ready: bool = False
    """Its readiness is still to be counted."""
    votes_step: int | None = None
    """The step whose votes are counted (None: none)."""
    voters: tuple[int, ...] = ()
    """The workers whose votes count (the running plan's)."""
    beats: Mapping[int, str] = field(default_factory=dict)
    """The processes whose heartbeats are read, by worker."""
    unregistered: Mapping[int, str] = field(default_factory=dict)
    """Processes that have not announced themselves yet, by worker."""
    joins: bool = False
    """Join requests are answered: the reserved join slots are read."""
    joins_recheck_at_s: float | None = None
    """When join slots reserved but not yet written are looked at again (None: none
    is)."""


def wanted(c: Control) -> Wanted:
    """What the shell reads next, from the control value alone."""
    k = mode(c)
    if k in (Mode.FINISHED, Mode.FAILED):
        return Wanted(None)
    by = c.members.by_worker
    unregistered = {w: x.incarnation for w, x in sorted(by.items())
                    if not x.registered and not x.gone}
    recheck = c.joins.recheck_at_s if c.joins.pending else None
    if k not in PUBLISHED:
        return Wanted(None, unregistered=unregistered, joins=True, joins_recheck_at_s=recheck)
    run = c.run
    voting = k in RUNNING
    return Wanted(run.gen, errors_from=c.watch.errors_read, ready=c.ready_s is None,
                  votes_step=run.next_step if voting else None,
                  voters=tuple(sorted(run.plan.workers)) if voting else (),
                  beats=incarnations(c, run.alive), unregistered=unregistered, joins=True,
                  joins_recheck_at_s=recheck)


def incarnations(c: Control, workers: Iterable[int]) -> dict[int, str]:
    """The process of each of ``workers`` that has one."""
    by = c.members.by_worker
    return {w: by[w].incarnation for w in sorted(workers) if w in by}


def final_holders(run: st.RunState, num_layers: int) -> dict[int, tuple[int, ...]]:
    """Per layer, the workers whose state is at the run's committed step: the holders of
    the placement the state has that still hold it (a worker dropped by a plan keeps the
    state of the placement it left, which is older once a later plan committed)."""
    return {i: tuple(dict.fromkeys(w for w in run.state_plan.holders(i) if w in run.holding))
            for i in range(num_layers)}
