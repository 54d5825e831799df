"""Failure traces checked against a cluster and read from / written to CSV.

CSV form, one event per row, times in seconds written with ``repr`` so a round trip is
exact::

    time_s,event,target
    5021.3,worker-fail,17
    9000.0,group-fail,4 5 6 7
    12000.5,software,
    23421.3,repair,2
    604800.0,end,

A trace with fail-slows has a fourth column, ``factor``, set on its ``slow`` rows only (the
worker's compute takes that many times as long until its ``slow-end``); a trace without
them is written with three columns, and both headers are read::

    time_s,event,target,factor
    700.0,slow,3,2.5
    4300.0,slow-end,3,
    604800.0,end,,
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterator

from chameleon_ft.failures.trace import SLOW_KINDS, EventKind, Trace, TraceEvent

CSV_HEADER = ("time_s", "event", "target")
SLOW_CSV_HEADER = (*CSV_HEADER, "factor")
"""The header of a trace with fail-slows: ``factor`` is set on ``slow`` rows only."""
MAX_SLOW_FACTOR = 1000.0
"""The largest slowdown a trace may give: a worker a thousand times slower is as good as
dead (a typo such as ``25`` for ``2.5`` stays within it; ``250000`` does not)."""


def validate_trace(trace: Trace, *, num_nodes: int, workers_per_node: int) -> None:
    """Check that a trace fits the cluster and is consistent in time.

    Args:
        trace: the trace.
        num_nodes: nodes of the cluster.
        workers_per_node: workers per node.

    Raises:
        ValueError: naming the row (1-based, after the header) that is wrong: a node or
            worker outside the cluster, a time out of order or past the end, a failure of
            hardware that is already dead, a repair of a node that is not broken, a
            fail-slow of a dead worker or without a factor > 1, the end of a slowdown that
            is not under way.
    """
    num_workers = num_nodes * workers_per_node
    dead_workers: set[int] = set()
    slow: set[int] = set()
    previous = 0.0
    for row, event in enumerate(trace.events, start=1):
        where = f"trace row {row} ({event.kind.value} at {event.time_s} s)"
        _check_time(where, event.time_s, previous, trace.duration_s)
        previous = event.time_s
        if event.factor is not None and event.kind != EventKind.SLOW:
            raise ValueError(f"{where}: only a slow event has a factor")
        if event.kind in SLOW_KINDS:
            _change_speed(where, event, num_workers, dead_workers, slow)
            continue
        if event.kind == EventKind.SOFTWARE:
            if event.target:
                raise ValueError(f"{where}: a software fault names no target")
            continue
        if event.kind == EventKind.END:
            raise ValueError(f"{where}: 'end' must be the last row")
        if not event.target:
            raise ValueError(f"{where}: needs a target")
        if event.kind == EventKind.WORKER_FAIL:
            _fail_worker(where, event.target, num_workers, dead_workers)
        else:
            _change_nodes(where, event, num_nodes, workers_per_node, dead_workers)
        slow -= dead_workers  # a dead worker is no longer slow; repaired, it is not either


def _change_speed(where: str, event: TraceEvent, num_workers: int, dead_workers: set[int],
                  slow: set[int]) -> None:
    """A fail-slow of one live worker (a factor > 1; again: its new factor), or its end.

    Raises:
        ValueError: naming the row (``where``).
    """
    if len(event.target) != 1:
        raise ValueError(f"{where}: names exactly one worker")
    worker = event.target[0]
    if not 0 <= worker < num_workers:
        raise ValueError(f"{where}: worker {worker} is outside the cluster "
                         f"(workers 0..{num_workers - 1})")
    if worker in dead_workers:
        raise ValueError(f"{where}: worker {worker} is dead")
    if event.kind == EventKind.SLOW_END:
        if worker not in slow:
            raise ValueError(f"{where}: worker {worker} is not slow")
        slow.discard(worker)
        return
    factor = event.factor
    if factor is None or not (math.isfinite(factor) and 1.0 < factor <= MAX_SLOW_FACTOR):
        raise ValueError(f"{where}: factor must be a number > 1 and <= {MAX_SLOW_FACTOR:g} "
                         f"(the worker runs that many times slower), got {factor}")
    slow.add(worker)


def _check_time(where: str, time_s: float, previous: float, duration_s: float) -> None:
    """An event's time: finite, >= 0, in order and before the trace's end.

    Raises:
        ValueError: naming the row (``where``).
    """
    if not math.isfinite(time_s) or time_s < 0:
        raise ValueError(f"{where}: time must be a finite number >= 0")
    if time_s < previous:
        raise ValueError(f"{where}: out of time order, the previous event is at {previous} s")
    if time_s >= duration_s:
        raise ValueError(f"{where}: at or after the end of the trace ({duration_s} s)")


def _fail_worker(where: str, target: tuple[int, ...], num_workers: int,
                 dead_workers: set[int]) -> None:
    """A worker failure: one live worker of the cluster, now dead.

    Raises:
        ValueError: naming the row (``where``).
    """
    if len(target) != 1:
        raise ValueError(f"{where}: names exactly one worker")
    worker = target[0]
    if not 0 <= worker < num_workers:
        raise ValueError(f"{where}: worker {worker} is outside the cluster "
                         f"(workers 0..{num_workers - 1})")
    if worker in dead_workers:
        raise ValueError(f"{where}: worker {worker} is already dead")
    dead_workers.add(worker)


def _change_nodes(where: str, event: TraceEvent, num_nodes: int, workers_per_node: int,
                  dead_workers: set[int]) -> None:
    """A node (or group) failure of nodes not yet dead, or a repair of broken ones: their
    workers dead, or alive again.

    Raises:
        ValueError: naming the row (``where``).
    """
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
    """The CSV text of a trace (with the header and a final ``end`` row): three columns,
    or four (``factor``) when the trace has fail-slows."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if not trace.has_slow:
        writer.writerow(CSV_HEADER)
        for event in trace.events:
            writer.writerow((repr(float(event.time_s)), event.kind.value,
                             " ".join(str(t) for t in event.target)))
        writer.writerow((repr(float(trace.duration_s)), EventKind.END.value, ""))
        return out.getvalue()
    writer.writerow(SLOW_CSV_HEADER)
    for event in trace.events:
        writer.writerow((repr(float(event.time_s)), event.kind.value,
                         " ".join(str(t) for t in event.target),
                         "" if event.factor is None else repr(float(event.factor))))
    writer.writerow((repr(float(trace.duration_s)), EventKind.END.value, "", ""))
    return out.getvalue()


def trace_from_csv(text: str, *, num_nodes: int, workers_per_node: int,
                   duration_s: float | None = None) -> Trace:
    """Parse and validate a CSV trace.

    Args:
        text: the CSV text (header ``time_s,event,target``, or ``time_s,event,target,factor``
            for a trace with fail-slows).
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
    try:
        return _read_trace(reader, num_nodes, workers_per_node, duration_s)
    except csv.Error as exc:  # a field over csv's size limit, a stray NUL...
        raise ValueError(f"trace: not CSV after line {reader.line_num} ({exc})") from None


def _read_trace(reader: Iterator[list[str]], num_nodes: int, workers_per_node: int,
                duration_s: float | None) -> Trace:
    """:func:`trace_from_csv` on an open reader.

    Raises:
        ValueError: as :func:`trace_from_csv`; ``csv.Error`` for text that is not CSV.
    """
    header = next(reader, None)
    columns = tuple(h.strip() for h in header or [])
    if columns not in (CSV_HEADER, SLOW_CSV_HEADER):
        raise ValueError(f"trace: the first line must be the header {','.join(CSV_HEADER)} "
                         f"(or {','.join(SLOW_CSV_HEADER)} with fail-slows), got "
                         f"{','.join(header or [])!r}")
    events: list[TraceEvent] = []
    end_s: float | None = None
    for row, fields in enumerate(reader, start=1):
        if not fields or all(not f.strip() for f in fields):
            continue
        if end_s is not None:
            raise ValueError(f"trace row {row}: rows after 'end'")
        event = _parsed_row(row, fields, len(columns))
        if event.kind == EventKind.END:
            if event.target:
                raise ValueError(f"trace row {row}: 'end' names no target")
            end_s = event.time_s
            continue
        events.append(event)
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


_KINDS = {k.value: k for k in EventKind}


def _parsed_row(row: int, fields: list[str], num_columns: int) -> TraceEvent:
    """One CSV row (``time_s,event,target[,factor]``) as an event, ``end`` included.

    Raises:
        ValueError: naming the row for a bad column count, time, kind, target or factor.
    """
    if not 2 <= len(fields) <= num_columns:
        names = ",".join(SLOW_CSV_HEADER[:num_columns])
        raise ValueError(f"trace row {row}: expected {num_columns} columns {names}, got "
                         f"{len(fields)}")
    time_text, kind_text = fields[0].strip(), fields[1].strip()
    target_text = fields[2].strip() if len(fields) >= 3 else ""
    factor_text = fields[3].strip() if len(fields) == 4 else ""
    try:
        time_s = float(time_text)
    except ValueError:
        raise ValueError(f"trace row {row}: time_s {time_text!r} is not a number") from None
    if kind_text not in _KINDS:
        raise ValueError(f"trace row {row}: unknown event {kind_text!r}; choose one of "
                         f"{', '.join(_KINDS)}")
    try:
        target = tuple(int(t) for t in target_text.split())
    except ValueError:
        raise ValueError(f"trace row {row}: target {target_text!r} must be integers "
                         "separated by spaces") from None
    kind = _KINDS[kind_text]
    if kind == EventKind.SLOW and not factor_text:
        raise ValueError(f"trace row {row}: a slow event needs its factor (the header "
                         f"{','.join(SLOW_CSV_HEADER)}, e.g. '700,slow,3,2.5')")
    if factor_text and kind != EventKind.SLOW:
        raise ValueError(f"trace row {row}: factor {factor_text!r} is given for a "
                         f"{kind_text} event; only slow events have one")
    factor = None
    if factor_text:
        try:
            factor = float(factor_text)
        except ValueError:
            raise ValueError(f"trace row {row}: factor {factor_text!r} is not a "
                             "number") from None
    return TraceEvent(time_s, kind, target, factor)
