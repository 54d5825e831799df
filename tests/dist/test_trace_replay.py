"""A failure trace replayed on real worker processes (``--trace``): a kill, a software
fault, a repair and the end, checked against the report and a failure-free run."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import TINY, alive, max_abs_diff, run_job

from chameleon_ft.runtime.trace import TraceDriver, load_trace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PER_NODE = TINY["cluster"]["devices_per_node"]
TRACE = """time_s,event,target
1.0,worker-fail,3
2.0,software,
2.5,repair,1
6.0,end,
"""


def test_kill_software_repair_and_end(tmp_path: Path, reference) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    driver = TraceDriver(load_trace(path, num_nodes=TINY["cluster"]["num_nodes"],
                                    workers_per_node=PER_NODE), PER_NODE, path=str(path))
    report, params, pids = run_job(tmp_path / "run", policy="dynamic", steps=100_000,
                                   coordinator={"trace": driver})
    trace = report["trace"]
    # every row applied once, in order, within a poll or two of its time
    actions = trace["actions"]
    assert [a["event"] for a in actions if a["row"]] == ["worker-fail", "software", "repair",
                                                         "end"]
    assert all(0 <= a["done_at_s"] - a["at_s"] < 0.5 for a in actions)
    assert actions[0]["workers"] == [3]
    relaunched = [w for a in actions if a["kind"] == "relaunch" for w in a["workers"]]
    assert relaunched == [3]
    # the kill is a failure with its fault time; the software fault a restart in place
    kill, software = [e for e in report["events"] if not e["idle"]][:2]
    assert kill["workers"] == [3] and "exit" in kill["cause"]
    assert kill["fault_at_s"] is not None and 0 <= kill["detected_after_s"] < 1.0
    assert software["workers"] == [] and software["strategy"] == "restart"
    assert software["cause"].startswith("software fault")
    assert any("worker 3 (repaired) is up" in line for line in report["log"])
    # the run ended at the trace's end, not by its steps nor as an interruption
    assert trace["end_reached"] and report["interrupted"] is None
    steps = [s["step"] for s in report["steps"]]
    assert steps == list(range(len(steps))) and report["committed_steps"] == len(steps)
    # throughput: the steps committed by the end (the one in flight then is not counted)
    assert len(steps) - 1 <= trace["committed_steps"] <= len(steps)
    assert trace["committed_samples"] == trace["committed_steps"] * TINY["job"]["global_batch"]
    assert report["throughput_samples_s"] == pytest.approx(trace["committed_samples"] / 6.0)
    assert report["throughput_samples_s"] > 0
    # recovery is invisible: the parameters of a failure-free run of as many steps
    _, expected = reference("float64", len(steps))
    assert max_abs_diff(params, expected) < 1e-9
    assert not any(alive(p) for p in pids)
