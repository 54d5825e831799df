"""Public fault-trace formats read into our trace (``chameleon trace import``).

Two shapes of published trace (docs/design.md section 6 has the table of causes):

- ``node-json``: node-level fault start/end events with a hierarchical cause, as the
  InfiniteHBD trace (Shou et al., SIGCOMM'25, arXiv:2502.03885; github.com/stepfun-ai/
  InfiniteHBD-Trace) publishes them: a JSON list of ``{"node_id", "event_time" (days since
  the first event), "event_type" ("fault_start" | "fault_end"), "fault_type": {"Level",
  "Class", "Desc"}}``. Node ids (anonymised strings) are numbered in order of first
  appearance. Each cause maps to an event kind (:func:`cause_kind`): a GPU fault kills one
  worker of its node, any other fault the whole node, and a degradation (a throttled GPU,
  a link at low width or speed) is a fail-slow of the node's workers when a factor is
  given, else a node failure as the operators treated it (the trace records every fault
  as the node leaving service). A node is down while any of its failures is open and slow
  while only degradations are; the last end brings it back (``repair``, ``slow-end``).
  Failures that start at the same instant on several nodes are one ``group-fail``.
- ``straggler-csv``: per-operation timings of one training job with stragglers, the columns
  of ByteDance's straggler traces (Lin et al., OSDI'25, arXiv:2505.05713; github.com/
  ByteDance-Seed/StragglerAnalysis, published as parquet: ``pandas.read_parquet(f)
  .to_csv(g, index=False)`` gives this CSV): ``dp_rank, stage, step, optype, start_ts,
  duration`` (seconds) at least. Per step, each worker's compute (its ``forward-compute``
  and ``backward-compute`` operations, the slowest of its tensor-parallel ranks) is
  compared with the median of its stage's workers; a worker at least ``threshold`` times
  slower for ``min_steps`` steps in a row is slow from the first of them, at the median of
  its ratios, until it runs ``min_steps`` steps below the threshold. Worker ``s * dp + d``
  runs stage ``s`` of pipeline ``d`` (our failure-free plan's numbering); step ``k`` starts
  when the steps before it have taken their spans (first start to last end).

Nothing is downloaded: the importers read the text they are given. Bad input is a
``ValueError`` naming the record and the field.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.failures.csvio import MAX_SLOW_FACTOR, validate_trace
from chameleon_ft.failures.trace import EventKind, Trace, TraceEvent

DAY_S = 86400.0

DEGRADED_CAUSES = frozenset({
    ("GPU", "GPU Temperature High"), ("GPU", "GPU PCI link width low"),
    ("GPU", "GPU P2P Bandwidth Low"), ("GPU", "GPU SBE(Single Bit ECC) > Threshold"),
    ("NIC", "NIC Link Speed low"), ("NIC", "NIC PCI link Width low")})
"""``(Class, Desc)`` of the node-json causes that degrade a node rather than stop it."""

_FAIL_WORKER, _FAIL_NODE, _SLOW = "worker-fail", "node-fail", "slow"


def cause_kind(level: str, cls: str, desc: str, *, degraded_slow: bool) -> str:
    """The event kind a node-json fault maps to (docs/design.md section 6).

    Args:
        level: ``fault_type.Level`` (``Hardware Failure``, ``Software Failure``,
            ``Other Failure``).
        cls: ``fault_type.Class`` (``GPU``, ``NIC``, ``Power Supply``...).
        desc: ``fault_type.Desc``.
        degraded_slow: whether a degradation (:data:`DEGRADED_CAUSES`) is a fail-slow.

    Returns:
        ``slow`` for a degradation read as a fail-slow; ``worker-fail`` for any other
        hardware fault of a GPU (one device, so one worker); ``node-fail`` for the rest:
        network cards and cables, power, fans, boards, node-level software and unknown
        causes take the whole node out of service.
    """
    if (cls, desc) in DEGRADED_CAUSES and degraded_slow:
        return _SLOW
    if level == "Hardware Failure" and cls == "GPU" and (cls, desc) not in DEGRADED_CAUSES:
        return _FAIL_WORKER
    return _FAIL_NODE


@dataclass
class ImportSummary:
    """What an import read and made of it (one line for the user)."""

    records: int = 0
    nodes: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    """Trace events written, by kind."""
    skipped: int = 0
    """Records that changed nothing (an end without an open fault, a fault on a node
    already out of service)."""

    def line(self) -> str:
        """The summary as one line."""
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items())) or "no events"
        return (f"read {self.records} records on {self.nodes} nodes: {kinds}; "
                f"{self.skipped} records changed nothing")


def _record_field(record: Mapping[str, Any], index: int, name: str, kind: type) -> Any:
    """``record[name]``, of ``kind``.

    Raises:
        ValueError: naming the record (0-based, as in the JSON list) and the field.
    """
    if name not in record:
        raise ValueError(f"node-json record {index}: missing field {name!r}")
    value = record[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise ValueError(f"node-json record {index}: field {name!r} is too large a "
                             "number") from None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"node-json record {index}: field {name!r} must be a "
                         f"{kind.__name__}, got {value!r}")
    return value


def _node_records(text: str) -> list[tuple[str, float, bool, tuple[str, str, str]]]:
    """``(node id, time s, start, (Level, Class, Desc))`` per record, checked.

    Raises:
        ValueError: for text that is not a JSON list of records with the fields above.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"node-json: not JSON ({exc.msg} at line {exc.lineno})") from None
    except (ValueError, RecursionError) as exc:  # an integer of 4,300+ digits, deep nesting
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ValueError(f"node-json: not readable JSON ({reason})".splitlines()[0]) from None
    if not isinstance(data, list):
        raise ValueError("node-json: the file must hold a JSON list of fault records")
    out = []
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise ValueError(f"node-json record {i}: must be an object, got {record!r}")
        node = _record_field(record, i, "node_id", str)
        days = _record_field(record, i, "event_time", float)
        if not (math.isfinite(days) and days >= 0):
            raise ValueError(f"node-json record {i}: field 'event_time' must be a number of "
                             f"days >= 0, got {days!r}")
        kind = _record_field(record, i, "event_type", str)
        if kind not in ("fault_start", "fault_end"):
            raise ValueError(f"node-json record {i}: field 'event_type' must be 'fault_start' "
                             f"or 'fault_end', got {kind!r}")
        cause = _record_field(record, i, "fault_type", dict)
        level, cls, desc = (cause.get(k) for k in ("Level", "Class", "Desc"))
        if not (isinstance(level, str) and isinstance(cls, str) and isinstance(desc, str)):
            raise ValueError(f"node-json record {i}: field 'fault_type' needs string "
                             "'Level', 'Class' and 'Desc'")
        out.append((node, days * DAY_S, kind == "fault_start", (level, cls, desc)))
    return out


class _NodeStates:
    """Open faults per node and the trace events their changes make; private to
    :func:`import_node_json`."""

    def __init__(self, workers_per_node: int, degraded_factor: float | None) -> None:
        self.per_node = workers_per_node
        self.factor = degraded_factor
        self.open: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.state: dict[int, str] = {}
        """``down``, ``slow`` or absent (up)."""
        self.down_kind: dict[int, str] = {}
        """A down node's failure: its first worker's (a GPU) or the whole node's."""
        self.events: list[TraceEvent] = []

    def change(self, node: int, at_s: float, start: bool, kind: str) -> bool:
        """One record: returns whether the node's state changed."""
        counts = self.open[node]
        if start:
            counts[kind] += 1
        elif counts[kind] > 0:
            counts[kind] -= 1
        else:
            return False
        failing = _FAIL_NODE if counts[_FAIL_NODE] > 0 else (
            _FAIL_WORKER if counts[_FAIL_WORKER] > 0 else None)
        new = "down" if failing else ("slow" if counts[_SLOW] > 0 else "up")
        old = self.state.get(node, "up")
        if new == old and not (new == "down" and failing != self.down_kind.get(node)):
            return False
        workers = tuple(range(node * self.per_node, (node + 1) * self.per_node))
        if old == "slow" and new == "up":
            self.events += [TraceEvent(at_s, EventKind.SLOW_END, (w,)) for w in workers]
        elif old == "down" and new != "down":
            self.events.append(TraceEvent(at_s, EventKind.REPAIR, (node,)))
        if new == "down":
            if failing == _FAIL_NODE or self.per_node == 1:
                if self.down_kind.get(node) != _FAIL_NODE:
                    self.events.append(TraceEvent(at_s, EventKind.NODE_FAIL, (node,)))
                self.down_kind[node] = _FAIL_NODE
            elif old != "down":  # one GPU: the node's first worker
                self.events.append(TraceEvent(at_s, EventKind.WORKER_FAIL, (workers[0],)))
                self.down_kind[node] = _FAIL_WORKER
            else:
                return False  # a second GPU fault on a node already short of one
        else:
            self.down_kind.pop(node, None)
            if new == "slow":
                self.events += [TraceEvent(at_s, EventKind.SLOW, (w,), self.factor)
                                for w in workers]
        self.state[node] = new
        return True


def import_node_json(text: str, *, workers_per_node: int = 1, num_nodes: int | None = None,
                     duration_s: float | None = None, degraded_factor: float | None = None
                     ) -> tuple[Trace, ImportSummary]:
    """Read a node-json fault trace (module docstring) into our trace.

    Args:
        text: the JSON text.
        workers_per_node: workers per node of the job that replays it.
        num_nodes: the cluster's nodes (at least the trace's); default: the trace's.
        duration_s: the trace's end; default: the last record's day, rounded up.
        degraded_factor: read degradations as fail-slows of this factor; ``None``: as
            node failures.

    Returns:
        The validated trace and what was read.

    Raises:
        ValueError: naming the record and field of malformed input, or a cluster too
            small for the trace.
    """
    if degraded_factor is not None and not (math.isfinite(degraded_factor)
                                            and 1.0 < degraded_factor <= MAX_SLOW_FACTOR):
        raise ValueError(f"--degraded-factor: must be a number > 1 and <= "
                         f"{MAX_SLOW_FACTOR:g}, got {degraded_factor}")
    check_cluster(workers_per_node, num_nodes)
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"--days: the trace's end must be a positive number, got "
                         f"{duration_s / DAY_S} days")
    records = _node_records(text)
    ids: dict[str, int] = {}
    states = _NodeStates(workers_per_node, degraded_factor)
    summary = ImportSummary(records=len(records))
    last_s = 0.0
    for node_id, at_s, start, cause in sorted(records, key=lambda r: r[1]):
        node = ids.setdefault(node_id, len(ids))
        kind = cause_kind(*cause, degraded_slow=degraded_factor is not None)
        if not states.change(node, at_s, start, kind):
            summary.skipped += 1
        last_s = max(last_s, at_s)
    summary.nodes = len(ids)
    if num_nodes is None:
        num_nodes = len(ids)
    if num_nodes < len(ids):
        raise ValueError(f"--num-nodes: the trace names {len(ids)} nodes, more than "
                         f"{num_nodes}")
    end_s = duration_s if duration_s is not None else math.floor(last_s / DAY_S + 1) * DAY_S
    events = _grouped(states.events)
    trace = Trace(events=tuple(events), duration_s=float(end_s))
    validate_trace(trace, num_nodes=max(1, num_nodes), workers_per_node=workers_per_node)
    for event in events:
        summary.kinds[event.kind.value] = summary.kinds.get(event.kind.value, 0) + 1
    return trace, summary


def check_cluster(workers_per_node: int, num_nodes: int | None) -> None:
    """The replaying job's shape, as the importers take it.

    Raises:
        ValueError: naming the flag of a count below 1.
    """
    if (isinstance(workers_per_node, bool) or not isinstance(workers_per_node, int)
            or workers_per_node < 1):
        raise ValueError(f"--workers-per-node: must be an integer >= 1, got {workers_per_node!r}")
    if num_nodes is not None and (isinstance(num_nodes, bool) or not isinstance(num_nodes, int)
                                  or num_nodes < 1):
        raise ValueError(f"--num-nodes: must be an integer >= 1, got {num_nodes!r}")


def _grouped(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    """Node failures at the same instant as one ``group-fail`` (the other events kept)."""
    out: list[TraceEvent] = []
    for event in events:
        last = out[-1] if out else None
        if (event.kind == EventKind.NODE_FAIL and last is not None
                and last.time_s == event.time_s
                and last.kind in (EventKind.NODE_FAIL, EventKind.GROUP_FAIL)):
            out[-1] = TraceEvent(event.time_s, EventKind.GROUP_FAIL,
                                 (*last.target, *event.target))
        else:
            out.append(event)
    return out
