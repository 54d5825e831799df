"""Failure traces: generated from failure rates, validated, and read from / written to CSV.

A generated trace is a superposition over the live nodes: while ``n`` nodes are up the next
interruption comes after an exponential (or Weibull, same mean) time of mean
``node_mtbf / n``; its kind is drawn from the mix, its target uniformly among what is
alive, and each failed node gets a repair time. Everything is drawn from one
``numpy.random.Generator`` seeded by the caller, so a seed fixes the trace.

CSV form, one event per row, times in seconds written with ``repr`` so a round trip is
exact::

    time_s,event,target
    5021.3,worker-fail,17
    9000.0,group-fail,4 5 6 7
    12000.5,software,
    23421.3,repair,2
    604800.0,end,
"""

from __future__ import annotations

import csv
import heapq
import io
import math

import numpy as np

from chameleon_ft.sim.events import EventKind, Trace, TraceEvent
from chameleon_ft.spec.scenario import FailureSpec, Interarrival, RepairKind

CSV_HEADER = ("time_s", "event", "target")


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


def validate_trace(trace: Trace, *, num_nodes: int, workers_per_node: int) -> None:
    """Check that a trace fits the cluster and is consistent in time.

    Args:
        trace: the trace.
        num_nodes: nodes of the cluster.
        workers_per_node: workers per node.

    Raises:
        ValueError: naming the row (1-based, after the header) that is wrong: a node or
            worker outside the cluster, a time out of order or past the end, a failure of
            hardware that is already dead, a repair of a node that is not broken.
    """
    num_workers = num_nodes * workers_per_node
    dead_workers: set[int] = set()
    previous = 0.0
    for row, event in enumerate(trace.events, start=1):
        where = f"trace row {row} ({event.kind.value} at {event.time_s} s)"
        if not math.isfinite(event.time_s) or event.time_s < 0:
            raise ValueError(f"{where}: time must be a finite number >= 0")
        if event.time_s < previous:
            raise ValueError(f"{where}: out of time order, the previous event is at {previous} s")
        if event.time_s >= trace.duration_s:
            raise ValueError(f"{where}: at or after the end of the trace ({trace.duration_s} s)")
        previous = event.time_s
        if event.kind == EventKind.SOFTWARE:
            if event.target:
                raise ValueError(f"{where}: a software fault names no target")
            continue
        if event.kind == EventKind.END:
            raise ValueError(f"{where}: 'end' must be the last row")
        if not event.target:
            raise ValueError(f"{where}: needs a target")
        if event.kind == EventKind.WORKER_FAIL:
            if len(event.target) != 1:
                raise ValueError(f"{where}: names exactly one worker")
            worker = event.target[0]
            if not 0 <= worker < num_workers:
                raise ValueError(f"{where}: worker {worker} is outside the cluster "
                                 f"(workers 0..{num_workers - 1})")
            if worker in dead_workers:
                raise ValueError(f"{where}: worker {worker} is already dead")
            dead_workers.add(worker)
            continue
        if event.kind == EventKind.NODE_FAIL and len(event.target) != 1:
            raise ValueError(f"{where}: names exactly one node; use group-fail for several")
        if len(set(event.target)) != len(event.target):
            raise ValueError(f"{where}: names a node twice")
        for node in event.target:
            if not 0 <= node < num_nodes:
                raise ValueError(f"{where}: node {node} is outside the cluster "
                                 f"(nodes 0..{num_nodes - 1})")
            workers = set(range(node * workers_per_node, (node + 1) * workers_per_node))
            if event.kind == EventKind.REPAIR:
                if not workers & dead_workers:
                    raise ValueError(f"{where}: node {node} is not broken")
                dead_workers -= workers
            else:
                if workers <= dead_workers:
                    raise ValueError(f"{where}: node {node} is already dead")
                dead_workers |= workers


def trace_to_csv(trace: Trace) -> str:
    """The CSV text of a trace (with the header and a final ``end`` row)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for event in trace.events:
        writer.writerow((repr(float(event.time_s)), event.kind.value,
                         " ".join(str(t) for t in event.target)))
    writer.writerow((repr(float(trace.duration_s)), EventKind.END.value, ""))
    return out.getvalue()


def trace_from_csv(text: str, *, num_nodes: int, workers_per_node: int,
                   duration_s: float | None = None) -> Trace:
    """Parse and validate a CSV trace.

    Args:
        text: the CSV text (header ``time_s,event,target``).
        num_nodes: nodes of the cluster it must fit.
        workers_per_node: workers per node.
        duration_s: the end of the trace when it has no ``end`` row.

    Returns:
        The trace.

    Raises:
        ValueError: naming the row for a bad header, time, kind or target, or any error of
            :func:`validate_trace`.
    """
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != CSV_HEADER:
        raise ValueError(f"trace: the first line must be the header {','.join(CSV_HEADER)}, "
                         f"got {','.join(header or [])!r}")
    kinds = {k.value: k for k in EventKind}
    events: list[TraceEvent] = []
    end_s: float | None = None
    for row, fields in enumerate(reader, start=1):
        if not fields or all(not f.strip() for f in fields):
            continue
        if end_s is not None:
            raise ValueError(f"trace row {row}: rows after 'end'")
        if len(fields) not in (2, 3):
            raise ValueError(f"trace row {row}: expected 3 columns time_s,event,target, got "
                             f"{len(fields)}")
        time_text, kind_text = fields[0].strip(), fields[1].strip()
        target_text = fields[2].strip() if len(fields) == 3 else ""
        try:
            time_s = float(time_text)
        except ValueError:
            raise ValueError(f"trace row {row}: time_s {time_text!r} is not a number") from None
        if kind_text not in kinds:
            raise ValueError(f"trace row {row}: unknown event {kind_text!r}; choose one of "
                             f"{', '.join(kinds)}")
        kind = kinds[kind_text]
        try:
            target = tuple(int(t) for t in target_text.split())
        except ValueError:
            raise ValueError(f"trace row {row}: target {target_text!r} must be integers "
                             "separated by spaces") from None
        if kind == EventKind.END:
            if target:
                raise ValueError(f"trace row {row}: 'end' names no target")
            end_s = time_s
            continue
        events.append(TraceEvent(time_s, kind, target))
    if end_s is None:
        if duration_s is None:
            raise ValueError("trace: no 'end' row gives the trace's duration; add one, e.g. "
                             "'604800,end,'")
        end_s = duration_s
    if not math.isfinite(end_s) or end_s <= 0:
        raise ValueError(f"trace: the end time must be a positive number, got {end_s}")
    trace = Trace(events=tuple(events), duration_s=end_s)
    validate_trace(trace, num_nodes=num_nodes, workers_per_node=workers_per_node)
    return trace
