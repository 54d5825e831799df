"""The trace driver's event handling, without processes: a fake run records what the driver
asks of it (the coordinator's side is tested in tests/dist/test_trace_replay.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from chameleon_ft.failures import EventKind, Trace, TraceEvent, trace_to_csv
from chameleon_ft.runtime.replay import ActionKind, TraceDriver, actions_of, load_trace
from chameleon_ft.sim.traces import generate_trace
from chameleon_ft.spec.scenario import FailureSpec

NODES, PER_NODE = 4, 2

CSV = """time_s,event,target
1.0,worker-fail,3
2.0,software,
3.0,repair,1
4.0,node-fail,0
5.0,group-fail,2 3
9.0,end,
"""


class FakeRun:
    """Records the driver's requests; deaths are processed when the test says so."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.ready_s: float | None = None
        self.running = set(range(NODES * PER_NODE))
        self.unprocessed: set[int] = set()
        """Killed, but the run has not seen the exit yet: no relaunch possible."""
        self.calls: list[tuple[str, tuple[int, ...], float]] = []
        self.software_ok = True
        self.stopped: str | None = None
        self.alive = set(self.running)
        """The run's view: relaunched workers are alive once they registered."""
        self.starting: set[int] = set()
        self.plan_workers = set(self.running)
        """Workers of the placement the state has (the last plan that committed)."""

    @property
    def state(self) -> SimpleNamespace:
        return SimpleNamespace(alive=frozenset(self.alive), stateless=frozenset(),
                               state_plan=SimpleNamespace(workers=frozenset(self.plan_workers)))

    def register(self) -> None:
        self.alive |= self.starting
        self.starting.clear()

    def now(self) -> float:
        return self.clock

    def kill_workers(self, workers: Sequence[int]) -> list[int]:
        hit = [w for w in workers if w in self.running]
        self.running -= set(hit)
        self.unprocessed |= set(hit)
        self.calls.append(("kill", tuple(hit), self.clock))
        return hit

    def relaunch_workers(self, workers: Sequence[int]) -> list[int]:
        dead = [w for w in workers if w not in self.running and w not in self.unprocessed]
        self.running |= set(dead)
        self.starting |= set(dead)
        self.calls.append(("relaunch", tuple(dead), self.clock))
        return dead

    def software_fault(self) -> bool:
        self.calls.append(("software", (), self.clock))
        return self.software_ok

    def stop_at_boundary(self, reason: str) -> None:
        self.stopped = reason
        self.calls.append(("end", (), self.clock))

    def process_deaths(self) -> None:
        self.alive -= self.unprocessed
        self.plan_workers -= self.unprocessed
        self.unprocessed.clear()


def _trace(text: str = CSV) -> Trace:
    from chameleon_ft.failures import trace_from_csv

    return trace_from_csv(text, num_nodes=NODES, workers_per_node=PER_NODE)


def _run_at(driver: TraceDriver, run: FakeRun, *times: float) -> None:
    for t in times:
        run.clock = t
        driver.poll(run)


def test_rows_become_actions_on_workers() -> None:
    actions = actions_of(_trace(), PER_NODE)
    assert [(a.kind, a.workers) for a in actions] == [
        (ActionKind.KILL, (3,)), (ActionKind.SOFTWARE, ()), (ActionKind.RELAUNCH, (2, 3)),
        (ActionKind.KILL, (0, 1)), (ActionKind.KILL, (4, 5, 6, 7)), (ActionKind.END, ())]
    assert [a.row for a in actions] == [1, 2, 3, 4, 5, 6]
    assert actions[-1].at_s == 9.0 and actions[2].event == "repair"


def test_nothing_happens_before_the_first_step_then_the_clock_starts_there() -> None:
    run, driver = FakeRun(), TraceDriver(_trace(), PER_NODE)
    _run_at(driver, run, 0.5, 3.0)  # workers not ready yet: no trace time
    assert run.calls == [] and driver.now_s(run) is None
    run.ready_s = 3.5
    _run_at(driver, run, 4.0, 4.4)
    assert run.calls == [] and driver.origin_s == 3.5
    _run_at(driver, run, 4.5)  # trace time 1.0: the worker-fail row
    assert run.calls == [("kill", (3,), 4.5)]
    run.ready_s = 20.0  # later generations do not move the origin
    _run_at(driver, run, 4.6)
    assert driver.origin_s == 3.5


def test_every_row_in_order_and_the_end_stops_the_run() -> None:
    run, driver = FakeRun(), TraceDriver(_trace(), PER_NODE)
    run.ready_s = 0.0
    _run_at(driver, run, 1.0)
    run.process_deaths()
    _run_at(driver, run, 2.5, 3.0)
    run.process_deaths()
    _run_at(driver, run, 100.0)  # a late poll applies every remaining row, in order
    kinds = [c[0] for c in run.calls]
    assert kinds == ["kill", "software", "relaunch", "kill", "kill", "end"]
    assert run.calls[2] == ("relaunch", (3,), 3.0)  # only the dead worker of node 1
    assert run.calls[4][1] == (4, 5, 6, 7)
    assert run.stopped == "end of trace" and driver.ended and driver.ended_at_s == 100.0
    _run_at(driver, run, 200.0)
    assert len(run.calls) == 6  # nothing after the end
    done = [d["row"] for d in driver.report([], 4)["trace"]["actions"]]
    assert done == [1, 2, 3, 4, 5, 6]


def test_a_repair_before_the_death_is_processed_relaunches_later() -> None:
    trace = _trace("time_s,event,target\n1.0,worker-fail,3\n1.001,repair,1\n9,end,\n")
    run, driver = FakeRun(), TraceDriver(trace, PER_NODE)
    run.ready_s = 0.0
    _run_at(driver, run, 1.0, 1.001)
    assert run.calls[-1] == ("relaunch", (), 1.001) and driver.waiting == {3}
    _run_at(driver, run, 1.002)  # still not processed: asked again, nothing yet
    assert driver.waiting == {3}
    run.process_deaths()
    _run_at(driver, run, 1.01)
    assert run.calls[-1] == ("relaunch", (3,), 1.01) and not driver.waiting
    assert 3 in run.running and not driver.killed
    notes = [d["note"] for d in driver.report([], 4)["trace"]["actions"]]
    assert "after the death is processed: 3" in notes[1] and "once its death" in notes[2]


def test_repairs_are_timed_until_up_and_until_trained_on() -> None:
    trace = _trace("time_s,event,target\n1.0,worker-fail,3\n2.0,repair,1\n"
                   "4.0,worker-fail,3\n5.0,repair,1\n9,end,\n")
    run, driver = FakeRun(), TraceDriver(trace, PER_NODE)
    run.ready_s = 0.0
    _run_at(driver, run, 1.0)
    run.process_deaths()
    _run_at(driver, run, 2.0, 2.5)
    assert driver.repairs[0]["up_at_s"] is None  # started, not registered yet
    run.register()
    _run_at(driver, run, 2.7)
    run.plan_workers.add(3)  # a plan with it committed
    _run_at(driver, run, 3.1)
    first = driver.repairs[0]
    assert (first["relaunched_at_s"], first["up_at_s"], first["in_plan_at_s"]) == \
        (2.0, 2.7, 3.1)
    # killed again, repaired again, up, but never trained on: the second record stays open
    _run_at(driver, run, 4.0)
    run.process_deaths()
    _run_at(driver, run, 5.0)
    run.register()
    _run_at(driver, run, 5.5, 6.0)
    second = driver.report([], 4)["trace"]["repairs"][1]
    assert second == {"worker": 3, "relaunched_at_s": 5.0, "up_at_s": 5.5,
                      "in_plan_at_s": None}
    assert driver.repairs[0]["in_plan_at_s"] == 3.1


def test_a_failure_overtakes_a_waiting_repair() -> None:
    trace = _trace("time_s,event,target\n1.0,worker-fail,3\n1.001,repair,1\n"
                   "1.002,node-fail,1\n9,end,\n")
    run, driver = FakeRun(), TraceDriver(trace, PER_NODE)
    run.ready_s = 0.0
    _run_at(driver, run, 1.0, 1.001, 1.002)
    assert not driver.waiting and driver.killed == {2, 3}
    run.process_deaths()
    _run_at(driver, run, 2.0)
    assert [c for c in run.calls if c[0] == "relaunch" and c[1]] == []


def test_a_software_fault_the_run_cannot_apply_is_noted() -> None:
    run, driver = FakeRun(), TraceDriver(_trace(), PER_NODE)
    run.ready_s, run.software_ok = 0.0, False
    _run_at(driver, run, 2.0)
    note = driver.report([], 4)["trace"]["actions"][1]["note"]
    assert "not applied" in note


def test_throughput_counts_commits_by_the_end_over_the_trace() -> None:
    run, driver = FakeRun(), TraceDriver(_trace("time_s,event,target\n10,end,\n"), PER_NODE)
    run.ready_s = 2.0
    _run_at(driver, run, 12.0)
    # commits on the run clock: three by the end (t <= 12), one after it
    report = driver.report([3.0, 7.5, 12.0, 12.3], global_batch=16)
    assert report["throughput_samples_s"] == pytest.approx(3 * 16 / 10.0)
    assert report["trace"]["committed_steps"] == 3 and report["trace"]["end_reached"]


def test_throughput_when_the_steps_ran_out_before_the_end() -> None:
    run, driver = FakeRun(), TraceDriver(_trace(), PER_NODE)
    run.ready_s = 1.0
    _run_at(driver, run, 1.5)
    report = driver.report([2.0, 3.0, 5.0], global_batch=8)
    assert not report["trace"]["end_reached"]
    assert report["throughput_samples_s"] == pytest.approx(3 * 8 / 4.0)
    assert TraceDriver(_trace(), PER_NODE).report([], 8)["throughput_samples_s"] == 0.0


@pytest.mark.parametrize(("text", "message"), [
    ("time,event\n1,worker-fail,3\n", "first line must be the header"),
    ("time_s,event,target\nsoon,worker-fail,3\n9,end,\n", "not a number"),
    ("time_s,event,target\n1,worker-fail,8\n9,end,\n", "worker 8 is outside the cluster"),
    ("time_s,event,target\n1,node-fail,4\n9,end,\n", "node 4 is outside the cluster"),
    ("time_s,event,target\n1,worker-fail,3\n", "no 'end' row"),
    ("time_s,event,target\n1,explode,3\n9,end,\n", "unknown event"),
    ("time_s,event,target,factor\n1,worker-fail,3,\n2,slow,2,2.5\n9,end,,\n",
     "row 2 is a fail-slow; the runtime does not replay"),
])
def test_bad_traces_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_trace(path, num_nodes=NODES, workers_per_node=PER_NODE)
    assert str(info.value).startswith("--trace: ") and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="cannot read"):
        load_trace(tmp_path / "missing.csv", num_nodes=NODES, workers_per_node=PER_NODE)


def test_replays_the_run_cannot_carry_out_are_refused() -> None:
    driver = TraceDriver(_trace(), PER_NODE)
    ok = {"num_nodes": NODES, "workers_per_node": PER_NODE, "num_workers": 8, "num_local": 8,
          "resume": False}
    driver.check_job(**ok)
    for change, message in (({"num_local": 6}, "launch every worker here"),
                            ({"resume": True}, "--resume"),
                            ({"num_nodes": 3, "num_workers": 6, "num_local": 6},
                             "outside the cluster"),
                            ({"workers_per_node": 4}, "workers per node")):
        with pytest.raises(ValueError, match=message):
            driver.check_job(**{**ok, **change})


@settings(max_examples=40, deadline=None)
@given(seed=hst.integers(0, 10_000),
       polls=hst.lists(hst.floats(0.0, 40.0, allow_nan=False), min_size=1, max_size=30))
def test_each_row_applies_once_in_order_never_early(seed: int, polls: list[float]) -> None:
    failures = FailureSpec(node_mtbf_hours=8 / 3600.0, repair="fixed", repair_hours=3 / 3600.0)
    trace = generate_trace(failures, num_nodes=NODES, workers_per_node=PER_NODE,
                           duration_s=30.0, seed=seed)
    run, driver = FakeRun(), TraceDriver(trace, PER_NODE)
    run.ready_s = 0.0
    for t in sorted(polls):
        run.clock = t
        driver.poll(run)
        run.process_deaths()
    done = driver.done
    rows = [d.action.row for d in done if d.action.row]
    assert rows == sorted(rows) and len(rows) == len(set(rows))
    assert all(d.done_at_s >= d.action.at_s for d in done)
    expected = [a.row for a in driver.actions if a.at_s <= max(polls)]
    assert rows == expected
    # every worker the trace killed was signalled while running or was already dead
    for d in done:
        if d.action.kind is ActionKind.KILL:
            assert set(d.workers) <= set(d.action.workers)
    assert driver.ended == (max(polls) >= trace.duration_s)


def test_a_csv_round_trip_gives_the_same_actions(tmp_path: Path) -> None:
    trace = Trace(events=(TraceEvent(0.5, EventKind.WORKER_FAIL, (1,)),
                          TraceEvent(2.0, EventKind.REPAIR, (0,))), duration_s=5.0)
    path = tmp_path / "t.csv"
    path.write_text(trace_to_csv(trace))
    loaded = load_trace(path, num_nodes=NODES, workers_per_node=PER_NODE)
    assert actions_of(loaded, PER_NODE) == actions_of(trace, PER_NODE)
