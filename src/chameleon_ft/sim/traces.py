"""Failure traces generated from failure rates.

A generated trace is a superposition over the live nodes: while ``n`` nodes are up the next
interruption comes after an exponential (or Weibull, same mean) time of mean
``node_mtbf / n``; its kind is drawn from the mix, its target uniformly among what is
alive, and each failed node gets a repair time. Everything is drawn from one
``numpy.random.Generator`` seeded by the caller, so a seed fixes the trace.

Warm spare nodes (``[cluster] spare_nodes``) are part of the fleet and fail like the job's
nodes: their failures are a second, independent stream over nodes ``num_nodes ..`` (their
own generator, seeded from the same seed), merged by time. The job's nodes keep exactly the
trace they have without spares, so a job with spares and one without meet the same
failures on the same nodes (a paired comparison), and job-level software faults come from
the job's stream only (an idle spare raises none).

With ``[failures] slow_node_mtbf_hours`` set, fail-slows are drawn as streams of their own
(the job's nodes, then the spares') and merged in (``slowtraces.py``): the failures stay
those of the same seed without them.

The trace format itself (events, CSV, validation) is :mod:`chameleon_ft.failures`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import replace

import numpy as np

from chameleon_ft.failures import EventKind, Trace, TraceEvent, validate_trace
from chameleon_ft.sim.slowtraces import draw_fail_slows, with_fail_slows
from chameleon_ft.spec.scenario import FailureSpec, Interarrival, RepairKind

_KINDS = (EventKind.WORKER_FAIL, EventKind.NODE_FAIL, EventKind.GROUP_FAIL, EventKind.SOFTWARE)
"""The failure kinds in the order of the mix's weights (the draws depend on it)."""


def generate_trace(failures: FailureSpec, *, num_nodes: int, workers_per_node: int,
                   duration_s: float, seed: int, spare_nodes: int = 0) -> Trace:
    """Draw a failure trace.

    Args:
        failures: rates, mix and repair distribution.
        num_nodes: nodes of the job's layout.
        workers_per_node: workers (tensor-parallel groups) per node.
        duration_s: simulated time; no event at or after it.
        seed: the random seed; equal seeds give equal traces.
        spare_nodes: warm spare nodes after the job's (module docstring).

    Returns:
        The trace over ``num_nodes + spare_nodes`` nodes, validated.

    Raises:
        ValueError: for a non-positive duration or cluster size.
    """
    if duration_s <= 0 or not math.isfinite(duration_s):
        raise ValueError(f"simulation.days: the duration must be positive, got {duration_s} s")
    if num_nodes < 1 or workers_per_node < 1:
        raise ValueError("cluster: needs at least one node and one worker per node")
    events = _draw(failures, num_nodes, workers_per_node, duration_s,
                   np.random.default_rng(seed))
    hardware = _hardware_only(failures)
    if spare_nodes and hardware is not None:
        spares = _draw(hardware, spare_nodes, workers_per_node, duration_s,
                       np.random.default_rng((seed, 1)))
        shift = num_nodes * workers_per_node
        moved = [TraceEvent(e.time_s, e.kind,
                            tuple(t + (shift if e.kind == EventKind.WORKER_FAIL else num_nodes)
                                  for t in e.target))
                 for e in spares]
        # a stable merge: at equal times the job's event comes first
        events = sorted(events + moved, key=lambda e: e.time_s)
    trace = Trace(events=tuple(events), duration_s=float(duration_s))
    if failures.slow_node_mtbf_hours is not None:
        episodes = draw_fail_slows(failures, num_nodes=num_nodes,
                                   workers_per_node=workers_per_node, duration_s=duration_s,
                                   rng=np.random.default_rng((seed, 2)))
        if spare_nodes:
            episodes += draw_fail_slows(failures, num_nodes=spare_nodes,
                                        workers_per_node=workers_per_node,
                                        duration_s=duration_s,
                                        rng=np.random.default_rng((seed, 3)),
                                        first_node=num_nodes)
        trace = with_fail_slows(trace, sorted(episodes), workers_per_node=workers_per_node)
    validate_trace(trace, num_nodes=num_nodes + spare_nodes, workers_per_node=workers_per_node)
    return trace


def _hardware_only(failures: FailureSpec) -> FailureSpec | None:
    """``failures`` without job-level software faults: each node's hardware failures at
    their rate (the MTBF over the hardware share), the hardware mix rescaled; ``None``
    when every failure is a software fault."""
    hardware = failures.single_worker + failures.single_node + failures.multi_node
    if hardware <= 0:
        return None
    return replace(failures, node_mtbf_hours=failures.node_mtbf_hours / hardware,
                   single_worker=failures.single_worker / hardware,
                   single_node=failures.single_node / hardware,
                   multi_node=1.0 - (failures.single_worker + failures.single_node) / hardware,
                   software=0.0)


def _draw(failures: FailureSpec, num_nodes: int, workers_per_node: int, duration_s: float,
          rng: np.random.Generator) -> list[TraceEvent]:
    """The events of one fleet of ``num_nodes`` nodes, in time order."""
    fleet = _Fleet(failures, num_nodes, workers_per_node, rng)
    now = 0.0
    while True:
        next_fail = now + fleet.gap_s()
        # Repairs that land before the next failure happen first; the failure process is
        # memoryless, so redrawing its gap after a repair changes no statistics.
        if fleet.repairs and fleet.repairs[0][0] < min(next_fail, duration_s):
            now = fleet.repair_next()
            continue
        if next_fail >= duration_s:
            break
        now = next_fail
        fleet.fail(now)
    return fleet.events


class _Fleet:
    """What is alive while a trace is drawn, and the events so far; private to
    :func:`generate_trace`. The order of the draws is part of a seed's trace."""

    def __init__(self, failures: FailureSpec, num_nodes: int, workers_per_node: int,
                 rng: np.random.Generator) -> None:
        self.failures = failures
        self.num_nodes = num_nodes
        self.per_node = workers_per_node
        self.rng = rng
        self.mtbf_s = failures.node_mtbf_hours * 3600.0
        weights = np.array([failures.single_worker, failures.single_node, failures.multi_node,
                            failures.software], dtype=float)
        self.weights = weights / weights.sum()
        # A Weibull of shape k and scale 1 has mean Gamma(1 + 1/k): divide it out to keep
        # the mean.
        self.weibull_mean = math.gamma(1.0 + 1.0 / failures.weibull_shape)
        self.up = list(range(num_nodes))      # nodes not entirely dead, ascending
        self.down: set[int] = set()           # nodes entirely dead
        self.dead_workers: set[int] = set()   # dead workers on nodes that are still up
        self.repairs: list[tuple[float, int, int]] = []  # (time, seq, node)
        self.repairing: set[int] = set()      # nodes in ``repairs``
        self.seq = 0
        self.events: list[TraceEvent] = []

    def gap_s(self) -> float:
        """Seconds to the next failure while the live nodes stay up (inf: none is up)."""
        if not self.up:
            return math.inf
        mean_s = self.mtbf_s / len(self.up)
        if self.failures.interarrival == Interarrival.WEIBULL:
            return mean_s * float(self.rng.weibull(self.failures.weibull_shape)) \
                / self.weibull_mean
        return float(self.rng.exponential(mean_s))

    def repair_next(self) -> float:
        """Bring the node of the earliest repair back; returns the repair's time."""
        at_s, _, node = heapq.heappop(self.repairs)
        self.repairing.discard(node)
        self.events.append(TraceEvent(at_s, EventKind.REPAIR, (node,)))
        self._set_up(node)
        self.dead_workers -= set(self._workers_of(node))
        return at_s

    def fail(self, now: float) -> None:
        """One interruption at ``now``: its kind from the mix, its target among the live."""
        kind = _KINDS[int(self.rng.choice(len(_KINDS), p=self.weights))]
        if kind == EventKind.SOFTWARE:
            self.events.append(TraceEvent(now, kind))
            return
        node = self.up[int(self.rng.integers(len(self.up)))]
        if kind == EventKind.WORKER_FAIL:
            self._fail_worker(now, node)
        else:
            self._fail_nodes(now, kind, node)

    def _fail_worker(self, now: float, node: int) -> None:
        live = [w for w in self._workers_of(node) if w not in self.dead_workers]
        worker = live[int(self.rng.integers(len(live)))]
        if len(live) == 1:
            # The node's last worker: the whole node is now down.
            self.dead_workers -= set(self._workers_of(node))
            self._set_down(node)
        else:
            self.dead_workers.add(worker)
        self.events.append(TraceEvent(now, EventKind.WORKER_FAIL, (worker,)))
        if node not in self.repairing:
            self._schedule_repair((node,), now)

    def _fail_nodes(self, now: float, kind: EventKind, node: int) -> None:
        """A host fault takes ``node``; a switch or cable fault its whole aligned group."""
        if kind == EventKind.GROUP_FAIL:
            size = self.failures.group_nodes
            first = node - node % size
            group = tuple(n for n in range(first, min(first + size, self.num_nodes))
                          if n not in self.down)
        else:
            group = (node,)
        if len(group) == 1:
            kind = EventKind.NODE_FAIL
        self.events.append(TraceEvent(now, kind, group))
        for n in group:
            self._set_down(n)
        self.dead_workers -= set(self.events[-1].workers(self.per_node))
        # One repair time for the whole group: the switch or cable is fixed once. A node
        # already waiting for a repair (after a worker failure) keeps its earlier repair.
        fresh = tuple(n for n in group if n not in self.repairing)
        if fresh:
            self._schedule_repair(fresh, now)

    def _schedule_repair(self, nodes: tuple[int, ...], at_s: float) -> None:
        repair_s = _repair_s(self.failures, self.rng)
        if repair_s is None:
            return
        for node in nodes:
            heapq.heappush(self.repairs, (at_s + repair_s, self.seq, node))
            self.repairing.add(node)
            self.seq += 1

    def _workers_of(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def _set_down(self, node: int) -> None:
        if node not in self.down:
            self.down.add(node)
            del self.up[bisect.bisect_left(self.up, node)]

    def _set_up(self, node: int) -> None:
        if node in self.down:
            self.down.discard(node)
            bisect.insort(self.up, node)


def _repair_s(failures: FailureSpec, rng: np.random.Generator) -> float | None:
    """One repair duration in seconds, or ``None`` when hardware never comes back."""
    if failures.repair == RepairKind.NONE:
        return None
    if failures.repair == RepairKind.FIXED:
        return failures.repair_hours * 3600.0
    if failures.repair == RepairKind.EXPONENTIAL:
        return float(rng.exponential(failures.repair_hours * 3600.0))
    return float(rng.uniform(failures.repair_min_hours, failures.repair_max_hours)) * 3600.0
