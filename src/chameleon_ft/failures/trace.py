"""A failure trace: what happens to the cluster, and when.

The one format the simulator replays and the runtime replays (``chameleon train
--trace``): a time-ordered tuple of :class:`TraceEvent`. Targets are integers whose meaning
depends on the kind: a worker id for ``worker-fail``, ``slow`` and ``slow-end``, node ids
for ``node-fail``, ``group-fail`` and ``repair``, nothing for ``software`` and ``end``. A
``slow`` event also carries its factor: the worker's compute runs that many times slower
until its ``slow-end`` (a fail-slow, docs/design.md section 6).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class EventKind(StrEnum):
    """What happens at an instant of a trace."""

    WORKER_FAIL = "worker-fail"
    """One worker (tensor-parallel group) dies, e.g. a GPU or its HBM; its node stays up."""
    NODE_FAIL = "node-fail"
    """One host dies with every worker on it."""
    GROUP_FAIL = "group-fail"
    """Several hosts behind one switch or cable die at once."""
    SOFTWARE = "software"
    """A job-level fault (software bug, NCCL watchdog): every process restarts, no hardware lost."""
    REPAIR = "repair"
    """Failed hosts come back (a replaced node, or a node whose dead worker was fixed)."""
    SLOW = "slow"
    """One live worker's compute runs ``factor`` times slower (a fail-slow: a throttled or
    degraded GPU, a contended host); a ``slow`` of a worker already slow sets its new
    factor."""
    SLOW_END = "slow-end"
    """A slow worker runs at full speed again."""
    END = "end"
    """The end of the trace: the simulated duration."""


FAILURE_KINDS = frozenset({EventKind.WORKER_FAIL, EventKind.NODE_FAIL, EventKind.GROUP_FAIL})
"""Kinds that take hardware away."""

SLOW_KINDS = frozenset({EventKind.SLOW, EventKind.SLOW_END})
"""Kinds that change a live worker's speed (no hardware is lost)."""


_WORKER_KINDS = frozenset({EventKind.WORKER_FAIL, EventKind.SLOW, EventKind.SLOW_END})
"""Kinds whose target is one worker id rather than node ids."""


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One row of a failure trace."""

    time_s: float
    """Seconds since the start of training."""
    kind: EventKind
    target: tuple[int, ...] = ()
    """Worker id (``worker-fail``, ``slow``, ``slow-end``) or node ids (``node-fail``,
    ``group-fail``, ``repair``)."""
    factor: float | None = None
    """A ``slow`` event's slowdown: its worker's compute takes ``factor`` (> 1) times as
    long; ``None`` for every other kind."""

    def workers(self, workers_per_node: int) -> tuple[int, ...]:
        """The workers the event names: a ``worker-fail``'s, ``slow``'s or ``slow-end``'s
        worker, every worker of the other events' nodes (node ``n`` holds workers
        ``n * W .. (n + 1) * W - 1``), none for ``software``."""
        if self.kind in _WORKER_KINDS:
            return self.target
        return tuple(w for n in self.target
                     for w in range(n * workers_per_node, (n + 1) * workers_per_node))


@dataclass(frozen=True, slots=True)
class Trace:
    """A whole failure trace: its events in time order, ending at ``duration_s``."""

    events: tuple[TraceEvent, ...]
    """Failures, software faults and repairs, in non-decreasing time order (no ``end``)."""
    duration_s: float
    """Simulated time; every event happens strictly before it."""

    @property
    def num_failures(self) -> int:
        """Hardware failures plus software faults (fail-slows are not failures)."""
        return sum(1 for e in self.events
                   if e.kind != EventKind.REPAIR and e.kind not in SLOW_KINDS)

    @property
    def has_slow(self) -> bool:
        """Whether some event is a fail-slow (``slow`` or ``slow-end``)."""
        return any(e.kind in SLOW_KINDS for e in self.events)

    def count(self, kinds: Iterable[EventKind]) -> int:
        """Events of the given kinds."""
        wanted = set(kinds)
        return sum(1 for e in self.events if e.kind in wanted)
