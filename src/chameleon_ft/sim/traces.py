"""Failure traces generated from failure rates.

A generated trace is a superposition over the live nodes: while ``n`` nodes are up the next
interruption comes after an exponential (or Weibull, same mean) time of mean
``node_mtbf / n``; its kind is drawn from the mix, its target uniformly among what is
alive, and each failed node gets a repair time. Warm spare nodes are part of the fleet and
fail like the others, but a job-level software fault comes from the job's nodes only: with
more nodes up than the job has, the software faults keep the rate of ``job_nodes`` nodes
(``n (1 - s) + job_nodes s`` nodes' worth of interruptions, ``s`` the software share). Everything is drawn from one
``numpy.random.Generator`` seeded by the caller, so a seed fixes the trace.

The trace format itself (events, CSV, validation) is :mod:`chameleon_ft.failures`.
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np
import numpy.typing as npt

from chameleon_ft.failures import EventKind, Trace, TraceEvent, validate_trace
from chameleon_ft.spec.scenario import FailureSpec, Interarrival, RepairKind

_KINDS = (EventKind.WORKER_FAIL, EventKind.NODE_FAIL, EventKind.GROUP_FAIL, EventKind.SOFTWARE)
"""The failure kinds in the order of the mix's weights (the draws depend on it)."""


def generate_trace(failures: FailureSpec, *, num_nodes: int, workers_per_node: int,
                   duration_s: float, seed: int, job_nodes: int | None = None) -> Trace:
    """Draw a failure trace.

    Args:
        failures: rates, mix and repair distribution.
        num_nodes: nodes of the cluster, spare nodes included.
        workers_per_node: workers (tensor-parallel groups) per node.
        duration_s: simulated time; no event at or after it.
        seed: the random seed; equal seeds give equal traces.
        job_nodes: the nodes the job's layout fills (default ``num_nodes``: no spares);
            software faults come at their rate.

    Returns:
        The trace, validated.

    Raises:
        ValueError: for a non-positive duration or cluster size.
    """
    if duration_s <= 0 or not math.isfinite(duration_s):
        raise ValueError(f"simulation.days: the duration must be positive, got {duration_s} s")
    if num_nodes < 1 or workers_per_node < 1:
        raise ValueError("cluster: needs at least one node and one worker per node")
    fleet = _Fleet(failures, num_nodes, workers_per_node, np.random.default_rng(seed),
                   num_nodes if job_nodes is None else job_nodes)
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
    trace = Trace(events=tuple(fleet.events), duration_s=float(duration_s))
    validate_trace(trace, num_nodes=num_nodes, workers_per_node=workers_per_node)
    return trace


class _Fleet:
    """What is alive while a trace is drawn, and the events so far; private to
    :func:`generate_trace`. The order of the draws is part of a seed's trace."""

    def __init__(self, failures: FailureSpec, num_nodes: int, workers_per_node: int,
                 rng: np.random.Generator, job_nodes: int) -> None:
        self.failures = failures
        self.num_nodes = num_nodes
        self.job_nodes = job_nodes
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
        mean_s = self.mtbf_s / self._nodes_worth()
        if self.failures.interarrival == Interarrival.WEIBULL:
            return mean_s * float(self.rng.weibull(self.failures.weibull_shape)) \
                / self.weibull_mean
        return float(self.rng.exponential(mean_s))

    def _nodes_worth(self) -> float:
        """Up nodes, counting the software faults of the job's nodes only."""
        up = len(self.up)
        if up <= self.job_nodes:
            return up
        software = float(self.weights[3])
        return up * (1.0 - software) + self.job_nodes * software

    def _mix(self) -> npt.NDArray[np.float64]:
        """The kinds' probabilities now: the mix, with the software faults scaled to the
        job's nodes when spares are up too."""
        up = len(self.up)
        weights: npt.NDArray[np.float64] = self.weights
        if up <= self.job_nodes:
            return weights
        scaled: npt.NDArray[np.float64] = weights * up
        scaled[3] = weights[3] * self.job_nodes
        out: npt.NDArray[np.float64] = scaled / scaled.sum()
        return out

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
        kind = _KINDS[int(self.rng.choice(len(_KINDS), p=self._mix()))]
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
