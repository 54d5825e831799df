"""Failure traces generated from failure rates.

A generated trace is a superposition over the live nodes: while ``n`` nodes are up the next
interruption comes after an exponential (or Weibull, same mean) time of mean
``node_mtbf / n``; its kind is drawn from the mix, its target uniformly among what is
alive, and each failed node gets a repair time. Everything is drawn from one
``numpy.random.Generator`` seeded by the caller, so a seed fixes the trace.

The trace format itself (events, CSV, validation) is :mod:`chameleon_ft.failures`.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from chameleon_ft.failures import EventKind, Trace, TraceEvent, validate_trace
from chameleon_ft.spec.scenario import FailureSpec, Interarrival, RepairKind


def generate_trace(failures: FailureSpec, *, num_nodes: int, workers_per_node: int,
                   duration_s: float, seed: int) -> Trace:
    """Draw a failure trace.

    Args:
        failures: rates, mix and repair distribution.
        num_nodes: nodes of the cluster.
        workers_per_node: workers (tensor-parallel groups) per node.
        duration_s: simulated time; no event at or after it.
        seed: the random seed; equal seeds give equal traces.

    Returns:
        The trace, validated.

    Raises:
        ValueError: for a non-positive duration or cluster size.
    """
    if duration_s <= 0 or not math.isfinite(duration_s):
        raise ValueError(f"simulation.days: the duration must be positive, got {duration_s} s")
    if num_nodes < 1 or workers_per_node < 1:
        raise ValueError("cluster: needs at least one node and one worker per node")
    rng = np.random.default_rng(seed)
    mtbf_s = failures.node_mtbf_hours * 3600.0
    kinds = (EventKind.WORKER_FAIL, EventKind.NODE_FAIL, EventKind.GROUP_FAIL, EventKind.SOFTWARE)
    weights = np.array([failures.single_worker, failures.single_node, failures.multi_node,
                        failures.software], dtype=float)
    weights = weights / weights.sum()
    shape = failures.weibull_shape
    # A Weibull of shape k and scale 1 has mean Gamma(1 + 1/k): divide it out to keep the mean.
    weibull_mean = math.gamma(1.0 + 1.0 / shape)

    down: set[int] = set()                 # nodes entirely dead
    dead_workers: set[int] = set()         # dead workers on nodes that are still up
    repairs: list[tuple[float, int, int]] = []  # (time, seq, node)
    events: list[TraceEvent] = []
    seq = 0
    now = 0.0

    def schedule_repair(nodes: tuple[int, ...], at_s: float) -> None:
        nonlocal seq
        repair_s = _repair_s(failures, rng)
        if repair_s is None:
            return
        for node in nodes:
            heapq.heappush(repairs, (at_s + repair_s, seq, node))
            seq += 1

    while True:
        up = [n for n in range(num_nodes) if n not in down]
        if up:
            mean_s = mtbf_s / len(up)
            if failures.interarrival == Interarrival.WEIBULL:
                gap_s = mean_s * float(rng.weibull(shape)) / weibull_mean
            else:
                gap_s = float(rng.exponential(mean_s))
            next_fail = now + gap_s
        else:
            next_fail = math.inf
        # Repairs that land before the next failure happen first; the failure process is
        # memoryless, so redrawing its gap after a repair changes no statistics.
        if repairs and repairs[0][0] < min(next_fail, duration_s):
            at_s, _, node = heapq.heappop(repairs)
            events.append(TraceEvent(at_s, EventKind.REPAIR, (node,)))
            down.discard(node)
            dead_workers -= set(range(node * workers_per_node, (node + 1) * workers_per_node))
            now = at_s
            continue
        if next_fail >= duration_s:
            break
        now = next_fail
        kind = kinds[int(rng.choice(len(kinds), p=weights))]
        if kind == EventKind.SOFTWARE:
            events.append(TraceEvent(now, kind))
            continue
        node = up[int(rng.integers(len(up)))]
        if kind == EventKind.WORKER_FAIL:
            live = [w for w in range(node * workers_per_node, (node + 1) * workers_per_node)
                    if w not in dead_workers]
            worker = live[int(rng.integers(len(live)))]
            if len(live) == 1:
                # The node's last worker: the whole node is now down.
                dead_workers -= set(range(node * workers_per_node, (node + 1) * workers_per_node))
                down.add(node)
            else:
                dead_workers.add(worker)
            events.append(TraceEvent(now, kind, (worker,)))
            if not _has_repair(repairs, node):
                schedule_repair((node,), now)
            continue
        if kind == EventKind.GROUP_FAIL:
            first = node - node % failures.group_nodes
            group = tuple(n for n in range(first, min(first + failures.group_nodes, num_nodes))
                          if n not in down)
        else:
            group = (node,)
        if len(group) == 1:
            kind = EventKind.NODE_FAIL
        events.append(TraceEvent(now, kind, group))
        down.update(group)
        dead_workers -= set(events[-1].workers(workers_per_node))
        # One repair time for the whole group: the switch or cable is fixed once. A node
        # already waiting for a repair (after a worker failure) keeps its earlier repair.
        fresh = tuple(n for n in group if not _has_repair(repairs, n))
        if fresh:
            schedule_repair(fresh, now)
    trace = Trace(events=tuple(events), duration_s=float(duration_s))
    validate_trace(trace, num_nodes=num_nodes, workers_per_node=workers_per_node)
    return trace


def _has_repair(repairs: list[tuple[float, int, int]], node: int) -> bool:
    return any(n == node for _, _, n in repairs)


def _repair_s(failures: FailureSpec, rng: np.random.Generator) -> float | None:
    """One repair duration in seconds, or ``None`` when hardware never comes back."""
    if failures.repair == RepairKind.NONE:
        return None
    if failures.repair == RepairKind.FIXED:
        return failures.repair_hours * 3600.0
    if failures.repair == RepairKind.EXPONENTIAL:
        return float(rng.exponential(failures.repair_hours * 3600.0))
    return float(rng.uniform(failures.repair_min_hours, failures.repair_max_hours)) * 3600.0
