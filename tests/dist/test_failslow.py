"""Real processes: a worker that keeps running, several times slower, is found from the
workers' own step timings, answered by the policy, and found again at full speed; the
update stays the failure-free one (float64, < 1e-9).

The job is the testbed's smaller variant (``examples/testbed8.toml`` at 4 workers, pp 2 x
dp 2, ``benchmarks/policies_runtime.testbed_doc``): its layers take a fixed device time,
so a 2-core host under load still measures the plan, not the scheduler.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from dist_harness import alive, max_abs_diff

from chameleon_ft.runtime.coordinator.shell import Coordinator
from chameleon_ft.spec.config import config_from_mapping
from chameleon_ft.spec.train import parse_fault

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "examples", ROOT / "benchmarks"):  # the testbed's model and layout
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

STEPS = 28
SLOW_FROM, SLOW_STEPS = 8, 10
FAULT = f"rank=1,step={SLOW_FROM},kind=slow,factor=3,steps={SLOW_STEPS}"


def _run(out: Path, faults: tuple[str, ...] = (), **recovery: Any) -> tuple[dict[str, Any],
                                                                          Coordinator]:
    import policies_runtime as bench

    doc = bench.testbed_doc(4)
    # a loaded 2-core host can hold a heartbeat back for seconds: a longer hang deadline
    # keeps this test about slowness
    doc["train"].update(steps=STEPS, dtype="float64", checkpoint_every=0, hang_timeout_s=6.0)
    doc["recovery"].update(recovery)
    lines: list[str] = []
    coord = Coordinator(config_from_mapping(doc), out_dir=out, log=lines.append,
                        faults=[parse_fault(f) for f in faults])
    try:
        report = coord.run()
    except BaseException:
        print("\n".join(lines[-40:]))
        raise
    report["log"] = lines
    leftover = [pid for pid in coord.launched_pids if alive(pid)]
    assert not leftover, f"worker processes left behind: {leftover}"
    return report, coord


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    report, coord = _run(tmp_path_factory.mktemp("failslow-reference"))
    assert not report["events"], report["events"]  # no slow alarm in a clean run
    return coord.params


def _slow_events(report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    events = report["events"]
    assert [(e["cause"], e["workers"]) for e in events] == [("slow", [1]), ("slow-end", [1])], \
        events
    return events[0], events[1]


def test_a_slow_worker_is_found_within_five_steps_and_the_update_stays_exact(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    report, coord = _run(tmp_path / "run", (FAULT,))
    slow, end = _slow_events(report)
    # the event's step is the one in flight: the slow steps measured before it
    assert 1 <= slow["step"] - SLOW_FROM <= 5, slow
    assert 2.0 <= slow["factor"] <= 4.0, slow
    assert slow["strategy"] in ("keep", "rebalance", "dynamic", "swap", "evict"), slow
    assert slow["detected_after_s"] is not None and slow["detected_after_s"] > 0
    (fault,) = report["faults"]
    assert fault["fired_step"] == SLOW_FROM and fault["ended_step"] >= SLOW_FROM + SLOW_STEPS
    assert 0 <= end["step"] - fault["ended_step"] <= 6, (end, fault)
    assert end["measured"] < 1.1
    assert [s["step"] for s in report["steps"]] == list(range(STEPS))
    assert max_abs_diff(coord.params, reference) < 1e-9


@pytest.mark.parametrize("answer", ["rebalance", "evict"])
def test_a_fixed_slow_policy_is_honoured(tmp_path: Path, reference: dict[str, Any],
                                         answer: str) -> None:
    report, coord = _run(tmp_path / "run", (FAULT,), slow_policy=answer)
    slow, end = _slow_events(report)
    assert slow["strategy"] == answer, slow
    assert slow["decision"]["reason"].startswith(f"slow policy {answer}: fixed answer"), slow
    if answer == "evict":  # out of the plan while slow, found at full speed by its probes
        plans = {s["gen"]: s["plan_workers"] for s in _metrics(coord)}
        assert 3 in plans.values(), plans
        assert end["strategy"] not in ("", "keep"), end  # folded back in
    assert report["final_plan"] == report["initial_plan"] or answer == "evict"
    assert max_abs_diff(coord.params, reference) < 1e-9


def _metrics(coord: Coordinator) -> list[dict[str, Any]]:
    import json

    path = coord.job.out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
