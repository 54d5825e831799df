"""``chameleon trace import``: node-level fault events and per-operation straggler timings
read into our trace, causes mapped to event kinds, malformed files refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chameleon_ft.cli import main
from chameleon_ft.failures import EventKind, TraceEvent, trace_from_csv
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
def test_malformed_straggler_csv_is_refused_naming_the_column(edit, message: str) -> None:
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
