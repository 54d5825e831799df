"""``chameleon trace import``: node-level fault events and per-operation straggler timings
read into our trace, causes mapped to event kinds, malformed files refused in one line."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.cli import main
from chameleon_ft.failures import EventKind, Trace, TraceEvent, trace_from_csv
from chameleon_ft.failures.importers import cause_kind, import_node_json
from chameleon_ft.failures.stragglers import import_straggler_csv
from chameleon_ft.failures.synthetic import (
    INFINITEHBD_COUNTS,
    NUM_SERVERS,
    node_faults_json,
    synthetic_node_faults,
    synthetic_straggler_ops,
)

ROOT = Path(__file__).resolve().parents[2]
DAY = 86400.0


def record(node: str, day: float, start: bool, cls: str = "NIC", desc: str = "NIC Lost",
           level: str = "Hardware Failure") -> dict[str, object]:
    return {"node_id": node, "event_time": day, "event_type": "fault_start" if start
            else "fault_end", "fault_type": {"Level": level, "Class": cls, "Desc": desc}}


@pytest.mark.parametrize(("cause", "degraded", "kind"), [
    (("Hardware Failure", "GPU", "GPU xid Error"), False, "worker-fail"),
    (("Hardware Failure", "GPU", "GPU Temperature High"), False, "node-fail"),
    (("Hardware Failure", "GPU", "GPU Temperature High"), True, "slow"),
    (("Hardware Failure", "NIC", "NIC Link Speed low"), True, "slow"),
    (("Hardware Failure", "Parameter Plane Cable", "Link Down"), True, "node-fail"),
    (("Software Failure", "Operating System", "Kernel Panic"), True, "node-fail"),
    (("Other Failure", "Unknown Error", "Unknown Error"), True, "node-fail"),
])
def test_causes_map_to_event_kinds(cause: tuple[str, str, str], degraded: bool,
                                   kind: str) -> None:
    assert cause_kind(*cause, degraded_slow=degraded) == kind


def test_node_faults_become_failures_repairs_and_fail_slows() -> None:
    gpu = {"cls": "GPU", "desc": "GPU xid Error"}
    hot = {"cls": "GPU", "desc": "GPU Temperature High"}
    records = [record("a", 1.0, True, **gpu), record("b", 1.5, True),
               record("c", 1.5, True), record("a", 2.0, True),  # node fault on a GPU-down node
               record("a", 2.5, False, **gpu), record("b", 3.0, False),
               record("c", 3.0, False), record("a", 4.0, False),
               record("b", 5.0, True, **hot), record("b", 6.0, False, **hot),
               record("c", 7.0, False)]  # an end without a fault: changes nothing
    trace, summary = import_node_json(json.dumps(records), workers_per_node=2,
                                      degraded_factor=1.5)
    assert trace.events == (
        TraceEvent(1.0 * DAY, EventKind.WORKER_FAIL, (0,)),
        TraceEvent(1.5 * DAY, EventKind.GROUP_FAIL, (1, 2)),  # at the same instant
        TraceEvent(2.0 * DAY, EventKind.NODE_FAIL, (0,)),
        TraceEvent(3.0 * DAY, EventKind.REPAIR, (1,)),
        TraceEvent(3.0 * DAY, EventKind.REPAIR, (2,)),
        TraceEvent(4.0 * DAY, EventKind.REPAIR, (0,)),
        TraceEvent(5.0 * DAY, EventKind.SLOW, (2,), 1.5),
        TraceEvent(5.0 * DAY, EventKind.SLOW, (3,), 1.5),
        TraceEvent(6.0 * DAY, EventKind.SLOW_END, (2,)),
        TraceEvent(6.0 * DAY, EventKind.SLOW_END, (3,)))
    assert trace.duration_s == 8 * DAY  # the last record's day, rounded up
    assert summary.nodes == 3 and summary.skipped == 2
    as_failures, _ = import_node_json(json.dumps(records), workers_per_node=2)
    assert not as_failures.has_slow  # without a factor a degradation is a node failure


def test_synthetic_infinitehbd_trace_has_the_published_shape() -> None:
    records = synthetic_node_faults(0)
    starts = [r for r in records if r["event_type"] == "fault_start"]
    assert len(starts) == sum(c[3] for c in INFINITEHBD_COUNTS) == 584
    assert len({r["node_id"] for r in records}) == 231
    trace, summary = import_node_json(node_faults_json(records), num_nodes=NUM_SERVERS)
    assert trace.duration_s == 348 * DAY and summary.nodes == 231
    assert trace.num_failures > 500
    committed = ROOT / "examples" / "traces" / "node-faults-synthetic.json"
    assert committed.read_text(encoding="utf-8") == node_faults_json(records)


@pytest.mark.parametrize(("text", "message"), [
    ("{}", "node-json: the file must hold a JSON list"),
    ("[1", "node-json: not JSON"),
    ('[{"event_time": 1, "event_type": "fault_start", "fault_type": {}}]',
     "node-json record 0: missing field 'node_id'"),
    ('[{"node_id": "a", "event_time": "x", "event_type": "fault_start", "fault_type": {}}]',
     "node-json record 0: field 'event_time' must be a float"),
    ('[{"node_id": "a", "event_time": 1, "event_type": "begin", "fault_type": {}}]',
     "node-json record 0: field 'event_type' must be 'fault_start' or 'fault_end'"),
    ('[{"node_id": "a", "event_time": 1, "event_type": "fault_end", "fault_type": {"Level": 1}}]',
     "node-json record 0: field 'fault_type' needs string 'Level', 'Class' and 'Desc'"),
])
def test_malformed_node_json_is_refused_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        import_node_json(text)
    assert "\n" not in str(info.value)


def test_stragglers_become_a_fail_slow_of_the_slow_worker() -> None:
    text = synthetic_straggler_ops(dp=4, pp=4, slow_worker=(1, 2), slow_steps=range(10, 22),
                                   factor=2.0)
    trace, summary = import_straggler_csv(text)
    (slow, end) = trace.events
    assert slow.kind == EventKind.SLOW and slow.target == (2 * 4 + 1,)
    assert slow.factor == pytest.approx(2.0, abs=0.05)
    assert end.kind == EventKind.SLOW_END and end.target == slow.target
    # a step spans its operations: two micro-batches of 10 + 20 ms and a 5 ms reduce,
    # twice the compute while slow; the slowdown runs from the first slow step's start to
    # the first fast one's
    fast_s, slow_s = 2 * 0.030 + 0.005, 2 * 0.060 + 0.005
    assert slow.time_s == pytest.approx(10 * fast_s, rel=0.03)
    assert end.time_s == pytest.approx(10 * fast_s + 12 * slow_s, rel=0.03)
    assert summary.nodes == 16
    # a blip shorter than min_steps is noise
    blip = synthetic_straggler_ops(slow_steps=range(10, 12))
    assert not import_straggler_csv(blip)[0].events


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace("duration", "dur", 1), "straggler-csv: missing column 'duration'"),
    (lambda t: t.replace("forward-compute,0.000000,", "forward-compute,abc,", 1),
     "straggler-csv line 2: column 'start_ts' must be a number, got 'abc'"),
    (lambda t: t.replace("\n0,0,0,0,", "\n0,0,0,-1,", 1),
     "straggler-csv line 2: column 'step' must be an integer >= 0"),
])
def test_malformed_straggler_csv_is_refused_naming_the_column(
        edit: Callable[[str], str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        import_straggler_csv(edit(synthetic_straggler_ops(steps=3)))


def test_the_cli_writes_a_trace_the_simulator_reads(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "faults.json"
    source.write_text(node_faults_json(synthetic_node_faults(1)), encoding="utf-8")
    out = tmp_path / "trace.csv"
    assert main(["trace", "import", "--format", "node-json", "--input", str(source),
                 "--out", str(out), "--num-nodes", "400", "--degraded-factor", "1.5",
                 "--days", "348"]) == 0
    assert "records on 231 nodes" in capsys.readouterr().err
    trace = trace_from_csv(out.read_text(encoding="utf-8"), num_nodes=400, workers_per_node=1)
    assert trace.has_slow and trace.duration_s == 348 * DAY
    bad = tmp_path / "bad.json"
    bad.write_text('[{"node_id": 3}]', encoding="utf-8")
    assert main(["trace", "import", "--format", "node-json", "--input", str(bad),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("chameleon trace: error: node-json record 0: field 'node_id' must be a "
                   "str, got 3")


# The documented table (docs/design.md section 6), written out for every cause the
# InfiniteHBD trace publishes: (Class, Desc) -> kind without and with --degraded-factor.
GPU_DOWN = {"GPU DBE(Double Bit ECC) > Threshold", "GPU xid Error", "GPU Lost",
            "GPU device unknow error", "nvidia-smi Timeout", "Silent Data Corruption",
            "GPU device not found"}
DEGRADED = {("GPU", "GPU Temperature High"), ("GPU", "GPU PCI link width low"),
            ("GPU", "GPU P2P Bandwidth Low"), ("GPU", "GPU SBE(Single Bit ECC) > Threshold"),
            ("NIC", "NIC Link Speed low"), ("NIC", "NIC PCI link Width low")}


def _documented(level: str, cls: str, desc: str) -> tuple[str, str]:
    if level == "Hardware Failure" and cls == "GPU" and desc in GPU_DOWN:
        return "worker-fail", "worker-fail"
    if (cls, desc) in DEGRADED:
        return "node-fail", "slow"
    return "node-fail", "node-fail"


def test_every_published_cause_maps_as_the_documented_table() -> None:
    seen = {kind: 0 for kind in ("worker-fail", "node-fail", "slow")}
    for level, cls, desc, _ in INFINITEHBD_COUNTS:
        without, with_factor = _documented(level, cls, desc)
        assert cause_kind(level, cls, desc, degraded_slow=False) == without, (cls, desc)
        assert cause_kind(level, cls, desc, degraded_slow=True) == with_factor, (cls, desc)
        seen[with_factor] += 1
    # every row of the table is reached by a published cause
    assert seen == {"worker-fail": len(GPU_DOWN), "node-fail": 40 - 7 - 6, "slow": 6}
    # a software fault on a GPU is a node-level fault, not one device's
    assert cause_kind("Software Failure", "GPU", "GPU xid Error", degraded_slow=True) == (
        "node-fail")


def test_the_synthetic_trace_s_kinds_follow_the_table() -> None:
    # Eight workers per node: a degradation slows all eight; a GPU fault takes one. A node
    # turns slow when a degradation starts on it while it is up, or when its failure ends
    # while a degradation is still open (a repair, then the slowdown again).
    records = synthetic_node_faults(0)
    trace, summary = import_node_json(node_faults_json(records), num_nodes=NUM_SERVERS,
                                      workers_per_node=8, degraded_factor=2.0)
    slow_faults = sum(n for _, cls, desc, n in INFINITEHBD_COUNTS if (cls, desc) in DEGRADED)
    worker_faults = sum(n for level, cls, desc, n in INFINITEHBD_COUNTS
                        if level == "Hardware Failure" and cls == "GPU" and desc in GPU_DOWN)
    slows = summary.kinds.get("slow", 0)
    repairs = summary.kinds.get("repair", 0)
    assert slows % 8 == 0 and 0 < slows <= 8 * (slow_faults + repairs)
    assert summary.kinds.get("slow-end", 0) <= slows
    assert 0 < summary.kinds.get("worker-fail", 0) <= worker_faults
    assert summary.records == len(records)
    assert trace == import_node_json(node_faults_json(records), num_nodes=NUM_SERVERS,
                                     workers_per_node=8, degraded_factor=2.0)[0]


def test_tensor_parallel_ranks_count_as_their_slowest() -> None:
    # two tensor-parallel ranks per worker: one rank of worker (dp 1, stage 0) at 2x for
    # steps 2..5 makes the worker slow by 2x; the other rank's time does not dilute it
    rows = ["dp_rank,stage,rank,step,optype,start_ts,duration"]
    for step in range(9):
        for dp in range(3):
            for rank in range(2):
                times = 2.0 if (dp, rank) == (1, 1) and 2 <= step <= 5 else 1.0
                rows.append(f"{dp},0,{2 * dp + rank},{step},forward-compute,0,{0.01 * times}")
                rows.append(f"{dp},0,{2 * dp + rank},{step},backward-compute,0.01,"
                            f"{0.02 * times}")
    trace, _ = import_straggler_csv("\n".join(rows) + "\n", min_steps=2)
    slow, end = trace.events
    assert (slow.kind, slow.target, slow.factor) == (EventKind.SLOW, (1,), 2.0)
    assert (end.kind, end.target) == (EventKind.SLOW_END, (1,))


NODE = ('[{"node_id": "a", "event_time": 1, "event_type": "fault_start", '
        '"fault_type": {"Level": "Hardware Failure", "Class": "NIC", "Desc": "NIC Lost"}}]')


@pytest.mark.parametrize(("text", "kwargs", "message"), [
    ("[" * 100_000, {}, "node-json: not readable JSON (nested too deeply)"),
    (NODE.replace('"event_time": 1', '"event_time": 1' + "0" * 400), {},
     "node-json record 0: field 'event_time' is too large a number"),
    (NODE.replace('"event_time": 1', '"event_time": 1' + "0" * 5000), {},
     "node-json: not readable JSON"),
    (NODE, {"workers_per_node": 0}, "--workers-per-node: must be an integer >= 1"),
    (NODE, {"num_nodes": 0}, "--num-nodes: must be an integer >= 1"),
    (NODE, {"duration_s": math.inf}, "--days: the trace's end must be a positive number"),
    (NODE, {"degraded_factor": 1.0}, "--degraded-factor: must be a number > 1"),
    (json.dumps([record("a", 1.0, True), record("b", 1.0, True)]), {"num_nodes": 1},
     "--num-nodes: the trace names 2 nodes, more than 1"),
])
def test_bad_node_json_and_settings_are_one_line(text: str, kwargs: dict[str, object],
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        import_node_json(text, **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_a_separator_inside_a_cause_is_just_text() -> None:
    text = NODE.replace('"NIC Lost"', '"NIC\\u001fLost"')
    trace, _ = import_node_json(text)
    assert trace.events == (TraceEvent(DAY, EventKind.NODE_FAIL, (0,)),)


HEAD = "dp_rank,stage,step,optype,start_ts,duration\n"


@pytest.mark.parametrize(("text", "message"), [
    (HEAD + "0,0,0\n", "straggler-csv line 2: column 'start_ts' must be a number, got ''"),
    (HEAD + "0,0,0,forward-compute,0," + "1" * 200_000 + "\n", "straggler-csv: not CSV"),
    (HEAD + "0,0,0,forward-compute,1e308,1e308\n",
     "straggler-csv line 2: columns 'start_ts' + 'duration' overflow a float"),
    (HEAD + "0,0,0.5,forward-compute,0,1\n",
     "straggler-csv line 2: column 'step' must be an integer >= 0, got '0.5'"),
    (HEAD + "0,0,0,forward-compute,0,inf\n",
     "straggler-csv line 2: column 'duration' must be a finite number >= 0"),
    (HEAD, "straggler-csv: no operation rows"),
    ("", "straggler-csv: missing column 'dp_rank'"),
])
def test_bad_straggler_rows_are_one_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        import_straggler_csv(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"threshold": 1.0}, "--threshold: must be a number > 1"),
    ({"min_steps": 0}, "--min-steps: must be an integer >= 1"),
    ({"workers_per_node": 0}, "--workers-per-node: must be an integer >= 1"),
    ({"num_nodes": 1}, "worker 9 is outside the cluster"),
])
def test_bad_straggler_settings_name_the_flag(kwargs: dict[str, object], message: str) -> None:
    text = synthetic_straggler_ops(dp=4, pp=4, slow_worker=(1, 2))
    with pytest.raises(ValueError, match=re.escape(message)):
        import_straggler_csv(text, **kwargs)  # type: ignore[arg-type]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**20) | st.floats(allow_nan=True)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)
CAUSES = [{"Level": c[0], "Class": c[1], "Desc": c[2]} for c in INFINITEHBD_COUNTS]


WRONG = st.sampled_from([None, True, -1, 10**400, 1.5, -0.5, 1e308, math.nan, math.inf, "", "x",
                         [], ["a"], {}, {"Level": "x"}])
"""Values of the wrong type or range for any field."""


def _maybe(valid: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    """Mostly a valid value (a record's first wrong field is the one refused), sometimes a
    wrong one or any JSON value."""
    return st.integers(0, 9).flatmap(lambda i: (WRONG, JSON_VALUES)[i] if i < 2 else valid)


RECORDS = st.fixed_dictionaries({
    "node_id": _maybe(st.sampled_from(["a", "b", "c"])),
    "event_time": _maybe(st.floats(0.0, 5.0) | st.integers(0, 5)),
    "event_type": _maybe(st.sampled_from(["fault_start", "fault_end"])),
    "fault_type": _maybe(st.sampled_from(CAUSES).flatmap(lambda cause: st.fixed_dictionaries(
        {key: _maybe(st.just(value)) for key, value in cause.items()}))),
}).flatmap(lambda r: st.sampled_from([None] * 12 + sorted(r)).map(
    lambda drop: {k: v for k, v in r.items() if k != drop}))


def _one_line_or_trace(read: Callable[[], tuple[Trace, object]]) -> None:
    try:
        trace, _ = read()
    except ValueError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert trace.duration_s > 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 9).flatmap(lambda i: JSON_VALUES if i == 0 else st.lists(
    st.integers(0, 9).flatmap(lambda j: JSON_VALUES if j == 0 else RECORDS), min_size=1,
    max_size=4)),
       st.sampled_from([None, 2.0]), st.integers(1, 3))
def test_any_node_json_reads_or_is_refused_in_one_line(data: object, factor: float | None,
                                                       per_node: int) -> None:
    # Records with a field missing or of any JSON type, any JSON at all: the importer
    # returns a valid trace or raises a one-line ValueError, never another exception.
    text = json.dumps(data)
    _one_line_or_trace(lambda: import_node_json(text, workers_per_node=per_node,
                                                degraded_factor=factor))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_edit_of_a_straggler_file_reads_or_is_refused_in_one_line(
        data: st.DataObject) -> None:
    # Cut, splice and overwrite a valid file anywhere (a row cut short, two rows run
    # together, a stray quote or NUL): a valid trace or a one-line ValueError.
    text = synthetic_straggler_ops(dp=2, pp=2, steps=4, microbatches=1)
    start = data.draw(st.integers(0, len(text)))
    stop = data.draw(st.integers(start, min(len(text), start + 40)))
    patch = data.draw(st.text(alphabet=st.sampled_from(list(',\n"-.0123456789eE\x00x ')),
                              max_size=12))
    edited = text[:start] + patch + text[stop:]
    _one_line_or_trace(lambda: import_straggler_csv(edited))


def _cli(tmp_path: Path, fmt: str, text: str | bytes, *extra: str) -> tuple[int, Path]:
    source = tmp_path / "in"
    if isinstance(text, bytes):
        source.write_bytes(text)
    else:
        source.write_text(text, encoding="utf-8")
    out = tmp_path / "out" / "trace.csv"
    return main(["trace", "import", "--format", fmt, "--input", str(source), "--out",
                 str(out), *extra]), out


@pytest.mark.parametrize(("fmt", "text", "extra", "message"), [
    ("straggler-csv", HEAD + "0,0,0,forward-compute,abc,1\n", (),
     "straggler-csv line 2: column 'start_ts' must be a number, got 'abc'"),
    ("node-json", b"\xff\xfe[]", (), "--input: "),
    ("node-json", "[]", ("--days", "inf"), "--days: must be a positive number"),
    ("node-json", "[]", ("--workers-per-node", "0"), "--workers-per-node: must be >= 1"),
    ("straggler-csv", "x", ("--threshold", "nan"), "--threshold: must be a number > 1"),
])
def test_a_refused_import_writes_nothing_and_keeps_the_old_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str, text: str | bytes,
        extra: tuple[str, ...], message: str) -> None:
    out = tmp_path / "out" / "trace.csv"
    out.parent.mkdir()
    out.write_text("the old trace\n", encoding="utf-8")
    code, _ = _cli(tmp_path, fmt, text, *extra)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"chameleon trace: error: {message}") and err.count("\n") == 1
    assert "Traceback" not in err
    assert out.read_text(encoding="utf-8") == "the old trace\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["trace.csv"]


def test_an_unwritable_output_leaves_no_partial_file(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # the output's name is taken by a folder: the rename fails after the temporary file
    # is written, and the temporary file goes too
    (tmp_path / "out" / "trace.csv").mkdir(parents=True)
    code, out = _cli(tmp_path, "straggler-csv", synthetic_straggler_ops(steps=30))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("chameleon trace: error: --out: cannot write to ")
    assert err.count("\n") == 1
    assert [p.name for p in out.parent.iterdir()] == ["trace.csv"] and out.is_dir()


def test_the_written_straggler_trace_reads_back_as_imported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = synthetic_straggler_ops(dp=4, pp=4, slow_worker=(3, 1), factor=2.5)
    code, out = _cli(tmp_path, "straggler-csv", text, "--workers-per-node", "4")
    assert code == 0 and "1 slow, 1 slow-end" in capsys.readouterr().err
    imported, _ = import_straggler_csv(text, workers_per_node=4)
    assert trace_from_csv(out.read_text(encoding="utf-8"), num_nodes=4,
                          workers_per_node=4) == imported
    assert imported.events[0].target == (1 * 4 + 3,)
