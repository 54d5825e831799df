"""A failure trace replayed on real worker processes (``--trace``): a node failure, a
software fault, the node's repair and the end, checked against the report and a
failure-free run."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import TINY, alive, max_abs_diff, run_job

from chameleon_ft.runtime.replay import TraceDriver, load_trace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PER_NODE = TINY["cluster"]["devices_per_node"]
TRACE = """time_s,event,target
1.0,node-fail,1
2.0,software,
2.5,repair,1
8.0,end,
"""


def test_node_failure_software_repair_and_end(tmp_path: Path, reference) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    driver = TraceDriver(load_trace(path, num_nodes=TINY["cluster"]["num_nodes"],
                                    workers_per_node=PER_NODE), PER_NODE, path=str(path))
    report, params, pids = run_job(tmp_path / "run", policy="dynamic", steps=100_000,
                                   coordinator={"trace": driver})
    trace = report["trace"]
    # every row applied once, in order, soon after its time (a kill waits up to 1 s for
    # the processes to exit; a loaded 2-core host adds a poll or two)
    actions = trace["actions"]
    assert [a["event"] for a in actions if a["row"]] == ["node-fail", "software", "repair",
                                                         "end"]
    assert all(0 <= a["done_at_s"] - a["at_s"] < 1.5 for a in actions)
    assert actions[0]["workers"] == [2, 3]
    relaunched = [w for a in actions if a["kind"] == "relaunch" for w in a["workers"]]
    assert relaunched == [2, 3]
    # the node's two workers die as one failure with its fault time (stage-major: they
    # held stage 1 of both pipelines, so only a restart recovers); the software fault is
    # a restart in place
    node, software = [e for e in report["events"] if not e["idle"]][:2]
    assert node["workers"] == [2, 3] and "exit" in node["cause"]
    assert node["strategy"] == "restart"
    assert node["fault_at_s"] is not None and 0 <= node["detected_after_s"] < 1.0
    assert software["workers"] == [] and software["strategy"] == "restart"
    assert software["cause"].startswith("software fault")
    repairs = trace["repairs"]
    assert [r["worker"] for r in repairs] == [2, 3]
    # a relaunched process takes seconds to start on a loaded host: once up, it is timed
    assert all(r["up_at_s"] is None or r["relaunched_at_s"] < r["up_at_s"] for r in repairs)
    # the run ended at the trace's end, not by its steps nor as an interruption
    assert trace["end_reached"] and report["interrupted"] is None
    steps = [s["step"] for s in report["steps"]]
    assert steps == list(range(len(steps))) and report["committed_steps"] == len(steps)
    # throughput: the steps committed by the end; after it, the drain commits the step in
    # flight, and a commit may land between the end and the loop's next look at the clock
    assert len(steps) - 2 <= trace["committed_steps"] <= len(steps)
    assert trace["committed_samples"] == trace["committed_steps"] * TINY["job"]["global_batch"]
    assert report["throughput_samples_s"] == pytest.approx(trace["committed_samples"] / 8.0)
    assert report["throughput_samples_s"] > 0
    # recovery is invisible: the parameters of a failure-free run of as many steps
    _, expected = reference("float64", len(steps))
    assert max_abs_diff(params, expected) < 1e-9
    assert not any(alive(p) for p in pids)
