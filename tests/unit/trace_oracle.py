"""The failure-trace generator as it was before ``generate_trace`` was split into named
steps, kept verbatim as the oracle of ``test_sim_traces.py``: the split must draw the
same trace for every seed."""

from __future__ import annotations

import heapq
import math

import numpy as np

from chameleon_ft.failures import EventKind, Trace, TraceEvent
from chameleon_ft.spec.scenario import FailureSpec, Interarrival, RepairKind


def reference_trace(failures: FailureSpec, *, num_nodes: int, workers_per_node: int,
                    duration_s: float, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    mtbf_s = failures.node_mtbf_hours * 3600.0
    kinds = (EventKind.WORKER_FAIL, EventKind.NODE_FAIL, EventKind.GROUP_FAIL, EventKind.SOFTWARE)
    weights = np.array([failures.single_worker, failures.single_node, failures.multi_node,
                        failures.software], dtype=float)
    weights = weights / weights.sum()
    shape = failures.weibull_shape
    weibull_mean = math.gamma(1.0 + 1.0 / shape)

    down: set[int] = set()
    dead_workers: set[int] = set()
    repairs: list[tuple[float, int, int]] = []
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
                dead_workers -= set(range(node * workers_per_node, (node + 1) * workers_per_node))
                down.add(node)
            else:
                dead_workers.add(worker)
            events.append(TraceEvent(now, kind, (worker,)))
            if not any(n == node for _, _, n in repairs):
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
        fresh = tuple(n for n in group if not any(m == n for _, _, m in repairs))
        if fresh:
            schedule_repair(fresh, now)
    return Trace(events=tuple(events), duration_s=float(duration_s))


def _repair_s(failures: FailureSpec, rng: np.random.Generator) -> float | None:
    if failures.repair == RepairKind.NONE:
        return None
    if failures.repair == RepairKind.FIXED:
        return failures.repair_hours * 3600.0
    if failures.repair == RepairKind.EXPONENTIAL:
        return float(rng.exponential(failures.repair_hours * 3600.0))
    return float(rng.uniform(failures.repair_min_hours, failures.repair_max_hours)) * 3600.0
