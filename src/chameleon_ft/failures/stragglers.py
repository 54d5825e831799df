"""Per-operation timing traces with stragglers read into fail-slows (``straggler-csv``).

The columns are those of ByteDance's straggler traces (``failures/importers.py`` says where
they are published and how their parquet becomes this CSV); the rule that turns timings into
``slow`` and ``slow-end`` events is there too.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections import defaultdict

from chameleon_ft.failures.csvio import MAX_SLOW_FACTOR, validate_trace
from chameleon_ft.failures.importers import ImportSummary, check_cluster
from chameleon_ft.failures.trace import EventKind, Trace, TraceEvent

REQUIRED_COLUMNS = ("dp_rank", "stage", "step", "optype", "start_ts", "duration")
"""Columns a straggler CSV must have (others, such as ``rank`` and ``mb_id``, are read
when present or ignored)."""
COMPUTE_OPTYPES = frozenset({"forward-compute", "backward-compute"})
"""The operations whose time is a worker's compute."""


def _number(row: dict[str, str], line: int, name: str, integer: bool) -> float:
    """``row[name]`` as a number.

    Raises:
        ValueError: naming the line and the column.
    """
    text = (row.get(name) or "").strip()
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"straggler-csv line {line}: column {name!r} must be a number, got "
                         f"{text!r}") from None
    if not math.isfinite(value) or value < 0 or (integer and value != int(value)):
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"straggler-csv line {line}: column {name!r} must be {kind} >= 0, "
                         f"got {text!r}")
    return value


def _timings(text: str) -> tuple[dict[tuple[int, int, int], float],
                                 dict[int, tuple[float, float]], int]:
    """Per ``(step, dp_rank, stage)`` the compute seconds (the slowest tensor-parallel
    rank's), per step its first start and last end, and the records read.

    Raises:
        ValueError: for a missing column or a bad value, naming the line.
    """
    reader = csv.DictReader(io.StringIO(text))
    try:
        return _read_timings(reader)
    except csv.Error as exc:  # a field over csv's size limit, a stray NUL...
        raise ValueError(f"straggler-csv: not CSV after line {reader.line_num} ({exc})") from None


def _read_timings(reader: csv.DictReader[str]
                  ) -> tuple[dict[tuple[int, int, int], float],
                             dict[int, tuple[float, float]], int]:
    """:func:`_timings` on an open reader.

    Raises:
        ValueError: as :func:`_timings`; ``csv.Error`` for text that is not CSV.
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"straggler-csv: missing column {missing[0]!r} (needs "
                         f"{', '.join(REQUIRED_COLUMNS)})")
    by_rank: dict[tuple[int, int, int, str], float] = defaultdict(float)
    spans: dict[int, tuple[float, float]] = {}
    count = 0
    for line, row in enumerate(reader, start=2):
        count += 1
        step, dp, stage = (int(_number(row, line, c, True)) for c in ("step", "dp_rank", "stage"))
        start = _number(row, line, "start_ts", False)
        duration = _number(row, line, "duration", False)
        if not math.isfinite(start + duration):
            raise ValueError(f"straggler-csv line {line}: columns 'start_ts' + 'duration' "
                             "overflow a float")
        first, last = spans.get(step, (math.inf, -math.inf))
        spans[step] = (min(first, start), max(last, start + duration))
        if (row.get("optype") or "").strip() in COMPUTE_OPTYPES:
            by_rank[(step, dp, stage, (row.get("rank") or "").strip())] += duration
    compute: dict[tuple[int, int, int], float] = {}
    for (step, dp, stage, _), seconds in by_rank.items():
        compute[(step, dp, stage)] = max(compute.get((step, dp, stage), 0.0), seconds)
    return compute, spans, count


def _ratios(compute: dict[tuple[int, int, int], float]
            ) -> dict[tuple[int, int], dict[int, float]]:
    """Per ``(dp_rank, stage)`` worker, per step, its compute over its stage's median."""
    by_stage: dict[tuple[int, int], list[float]] = defaultdict(list)
    for (step, _, stage), seconds in compute.items():
        by_stage[(step, stage)].append(seconds)
    medians = {key: statistics.median(values) for key, values in by_stage.items()}
    out: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for (step, dp, stage), seconds in compute.items():
        median = medians[(step, stage)]
        out[(dp, stage)][step] = seconds / median if median > 0 else 1.0
    return out


def _episodes(ratios: dict[int, float], steps: list[int], threshold: float,
              min_steps: int) -> list[tuple[int, int | None, float]]:
    """A worker's slowdowns: ``(first step, step it ended or None, factor)``."""
    out: list[tuple[int, int | None, float]] = []
    run: list[int] = []
    start: int | None = None
    factors: list[float] = []
    for step in steps:
        slow = ratios.get(step, 1.0) >= threshold
        if start is None:
            run = [*run, step] if slow else []
            if len(run) >= min_steps:
                start, factors, run = run[0], [ratios[s] for s in run], []
        elif slow:
            factors.append(ratios[step])
            run = []
        else:
            run.append(step)
            if len(run) >= min_steps:
                out.append((start, run[0], statistics.median(factors)))
                start, run = None, []
    if start is not None:
        out.append((start, None, statistics.median(factors)))
    return out


def import_straggler_csv(text: str, *, workers_per_node: int = 1, num_nodes: int | None = None,
                         threshold: float = 1.1, min_steps: int = 3
                         ) -> tuple[Trace, ImportSummary]:
    """Read a per-operation timing CSV into fail-slows (``failures/importers.py``).

    Args:
        text: the CSV text.
        workers_per_node: workers per node of the job that replays it.
        num_nodes: the cluster's nodes; default: enough for the trace's workers.
        threshold: the compute ratio to the stage's median that counts as slow (> 1).
        min_steps: steps in a row that start or end a slowdown (>= 1).

    Returns:
        The validated trace (its end: when the last step ends) and what was read.

    Raises:
        ValueError: naming the line and column of malformed input, or a bad setting.
    """
    if not (math.isfinite(threshold) and 1.0 < threshold <= MAX_SLOW_FACTOR):
        raise ValueError(f"--threshold: must be a number > 1, got {threshold}")
    if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 1:
        raise ValueError(f"--min-steps: must be an integer >= 1, got {min_steps!r}")
    check_cluster(workers_per_node, num_nodes)
    compute, spans, count = _timings(text)
    if not spans:
        raise ValueError("straggler-csv: no operation rows")
    steps = sorted(spans)
    starts: dict[int, float] = {}
    elapsed = 0.0
    for step in steps:
        starts[step] = elapsed
        elapsed += spans[step][1] - spans[step][0]
    if not math.isfinite(elapsed):
        raise ValueError("straggler-csv: the steps' spans add up past what a float holds")
    dp_size = 1 + max(dp for _, dp, _ in compute) if compute else 1
    events: list[TraceEvent] = []
    for (dp, stage), ratios in sorted(_ratios(compute).items()):
        worker = stage * dp_size + dp
        for first, end, factor in _episodes(ratios, steps, threshold, min_steps):
            rounded = round(min(factor, MAX_SLOW_FACTOR), 2)
            events.append(TraceEvent(starts[first], EventKind.SLOW, (worker,),
                                     rounded if rounded > 1.0 else factor))
            if end is not None:
                events.append(TraceEvent(starts[end], EventKind.SLOW_END, (worker,)))
    events.sort(key=lambda e: (e.time_s, e.kind == EventKind.SLOW))
    workers = 1 + max((stage * dp_size + dp for _, dp, stage in compute), default=0)
    nodes = num_nodes if num_nodes is not None else -(-workers // workers_per_node)
    trace = Trace(events=tuple(events), duration_s=max(elapsed, 1e-9))
    validate_trace(trace, num_nodes=nodes, workers_per_node=workers_per_node)
    summary = ImportSummary(records=count, nodes=nodes)
    for event in events:
        summary.kinds[event.kind.value] = summary.kinds.get(event.kind.value, 0) + 1
    return trace, summary
