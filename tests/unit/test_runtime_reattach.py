"""A coordinator that takes a run over, without processes: the workers' reports in, the
rebuilt run and its first effects out (``runtime/control/reattach.py``).

Each row is a way the previous coordinator can have left its workers: training steadily,
dead between writing a verdict and every worker reading it, in the middle of publishing a
recovery, with a fenced process still around, or with nobody left."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.plan import Pipeline, Stage
from chameleon_ft.runtime.control import machine, reattach
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.control.model import Mode, Settings, initial, mode, wanted
from chameleon_ft.runtime.control.reports import Held, Report

PLAN = ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=4)
"""Stage s of pipeline p on worker s * 2 + p: workers 0 and 1 hold layers 0-1, 2 and 3
hold layers 2-3."""
SETTINGS = Settings(steps=100, num_workers=4, num_local=4, num_layers=4, hang_s=2.0,
                    heartbeat_s=0.1, max_retries=2, rejoin=False, join_timeout_s=10.0,
                    initial_plan=PLAN, reattach_s=4.0)
NAMES = {w: f"inc{w}" for w in range(4)}


def two_stage(*pipelines: tuple[int, int]) -> ExecutionPlan:
    """Pipelines of two stages (layers 0-1 and 2-3) on the given worker pairs."""
    pipes = tuple(Pipeline((Stage(a, 0, 2), Stage(b, 2, 4)), 4 // len(pipelines))
                  for a, b in pipelines)
    return ExecutionPlan(num_layers=4, pipelines=pipes)


def held(worker: int, step: int, gen: int = 7, plan: ExecutionPlan = PLAN,
         extra: tuple[int, ...] = ()) -> Held:
    """What ``worker`` holds of ``plan`` after ``step`` steps (and ``extra`` layers)."""
    layers = frozenset(plan.layers_by_worker.get(worker, range(0))) | frozenset(extra)
    return Held(step=step, gen=gen, plan=plan, layers=layers)


def report(worker: int, step: int | None = 10, *, gen: int = 7, seen: int | None = None,
           plan: ExecutionPlan = PLAN, pending: Held | None = None,
           names: dict[int, str] | None = None, incarnation: str | None = None,
           state: Held | None = None) -> Report:
    return Report(worker=worker, incarnation=incarnation or f"inc{worker}",
                  seen_gen=gen if seen is None else seen, gen=gen,
                  members=NAMES if names is None else names,
                  held=state if state is not None else
                  (None if step is None else held(worker, step, gen, plan)),
                  pending=pending, pid=1000 + worker, host="h")


class Takeover:
    """A coordinator taking a run over, driven through observations."""

    def __init__(self, settings: Settings = SETTINGS, *, checkpoints: tuple[int, ...] = (0,),
                 start_step: int = 0) -> None:
        self.p = settings
        load = st.Load("restore", start_step) if start_step else st.INIT
        start = replace(st.start(PLAN, range(settings.num_workers), step=start_step,
                                 load=load), checkpoints=checkpoints)
        self.c = reattach.start(initial(start, now_s=0.0, settings=settings), 0.0, settings)
        self.effects: list[m.Effect] = []

    def feed(self, obs: m.Observation) -> list[m.Effect]:
        before = mode(self.c)
        self.c, out = machine.step(self.c, obs, self.p)
        edge = machine.transition(before, obs, mode(self.c))
        assert edge is None or edge in machine.TRANSITIONS, edge
        assert not [e for e in out if isinstance(e, m.Log) and "internal" in e.text], out
        self.effects += out
        return out

    def reports(self, *reports: Report, at: float = 0.1) -> list[m.Effect]:
        return self.feed(m.Reports(at, reports))


def of(effects: list[m.Effect], kind: type) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


def test_a_steady_run_trains_on_from_its_committed_step_in_a_new_generation() -> None:
    run = Takeover()
    assert mode(run.c) is Mode.REATTACHING and wanted(run.c).reattach
    assert run.reports(report(0), report(1), report(2)) == []  # worker 3 not yet
    out = run.reports(report(3))
    (publish,) = of(out, m.Publish)
    assert publish.gen == 8 and publish.step == 10 and publish.plan == PLAN
    assert publish.load is None and publish.migration is None and publish.apply is None
    assert dict(publish.incarnations) == NAMES  # the same processes: nobody relaunched
    (record,) = of(out, m.Reattached)
    assert record.step == 10 and [w for w, _, _, _ in record.workers] == [0, 1, 2, 3]
    assert mode(run.c) is Mode.TRAINING and run.c.run.state_plan == PLAN
    assert not of(out, m.Launch) and not of(out, m.Fence)


def test_a_verdict_read_by_some_workers_only_is_applied_by_the_others() -> None:
    """The previous coordinator wrote step 10's commit and died: workers 0 and 2 applied
    it (they hold 11 steps), 1 and 3 reduced it and never read the verdict. The step
    committed, so they apply their kept gradients first; nobody redoes it."""
    run = Takeover()
    out = run.reports(report(0, 11), report(2, 11),
                      report(1, 10, pending=held(1, 11)), report(3, 10, pending=held(3, 11)))
    (publish,) = of(out, m.Publish)
    assert publish.step == 11 and publish.apply == (7, 10)
    assert mode(run.c) is Mode.TRAINING and run.c.apply is None  # carried once


def test_a_step_nobody_applied_is_redone() -> None:
    run = Takeover()
    out = run.reports(*(report(w, 10, pending=held(w, 11)) for w in range(4)))
    (publish,) = of(out, m.Publish)
    assert publish.step == 10 and publish.apply is None


def test_a_recovery_published_but_not_loaded_everywhere_falls_back_to_the_last_commit() -> None:
    """Generation 8 moved worker 2's layers to worker 1 (after worker 3 died): worker 1
    loaded it, worker 0 and 2 had not read it. Every worker still holds its layers of
    generation 7's placement (kept until the next commit), so that is the state; worker 3
    is dead, which the failure path recovers from."""
    moved = two_stage((0, 1), (2, 1))
    names = {0: "inc0", 1: "inc1", 2: "inc2"}
    run = Takeover()
    out = run.reports(report(0, gen=7, names=names, seen=8),
                      report(1, gen=8, names=names, state=held(1, 10, 8, moved, extra=(0, 1))),
                      report(2, gen=7, names=names, seen=8))
    # every member of generation 8 reported (3 was not one): taken over at once
    assert run.c.run.state_plan == PLAN and run.c.run.next_step == 10
    (failure,) = of(out, m.Failure)
    assert failure.workers == (3,)
    (decide,) = of(out, m.Decide)
    assert decide.ask.base == PLAN and decide.ask.failed == {3}
    assert mode(run.c) is Mode.DECIDING


def test_a_recovery_loaded_everywhere_is_the_state() -> None:
    moved = two_stage((0, 1), (2, 1))
    names = {0: "inc0", 1: "inc1", 2: "inc2"}
    run = Takeover()
    reports = [report(w, gen=8, names=names, state=held(w, 10, 8, moved, extra=(0, 1, 2, 3)))
               for w in (0, 1, 2)]
    (publish,) = of(run.reports(*reports), m.Publish)
    assert publish.plan == moved and publish.gen == 9 and mode(run.c) is Mode.TRAINING


def test_members_that_do_not_report_in_time_are_dead() -> None:
    run = Takeover()
    assert run.reports(report(0), report(1), report(2)) == []
    assert run.feed(m.Tick(3.9)) == []  # not yet
    out = run.feed(m.Tick(4.1))
    assert of(out, m.Fence)[0].workers == (3,)
    (failure,) = of(out, m.Failure)
    assert failure.workers == (3,) and "did not report" in failure.cause
    assert of(out, m.Decide)[0].ask.failed == {3}
    assert of(out, m.Reattached)[0].workers == ((0, "inc0", 1000, "h"), (1, "inc1", 1001, "h"),
                                                (2, "inc2", 1002, "h"))


def test_a_fenced_process_is_not_taken_for_its_replacement() -> None:
    """Worker 3 was replaced (``new3``); its fenced process reports too: the newest
    directive names the replacement, whose report counts."""
    names = {**NAMES, 3: "new3"}
    run = Takeover()
    stale = report(3, 10, gen=5, names=NAMES)
    assert run.reports(*(report(w, names=names) for w in range(3)), stale) == []
    out = run.reports(report(3, names=names, incarnation="new3"))
    (publish,) = of(out, m.Publish)
    assert publish.incarnations[3] == "new3"


def test_a_stale_worker_is_recovered_through_the_policy() -> None:
    run = Takeover()
    out = run.reports(report(0, 10), report(1, 10), report(2, 10), report(3, 9))
    (failure,) = of(out, m.Failure)
    assert failure.workers == (3,) and "state lost" in failure.cause
    (decide,) = of(out, m.Decide)
    assert decide.ask.failed == {3} and decide.ask.usable == {0, 1, 2}
    assert run.c.run.stateless == {3}


def test_nobody_reporting_resumes_from_the_checkpoint_or_fails_without_one() -> None:
    run = Takeover(checkpoints=(0, 20), start_step=20)
    assert run.feed(m.Tick(4.5)) != []
    (launch,) = of(run.effects, m.Launch)
    assert launch.workers == (0, 1, 2, 3) and not launch.replacement
    assert mode(run.c) is Mode.JOINING and run.c.run.next_step == 20
    bare = Takeover(replace(SETTINGS, resume_fallback=False))
    (stop,) = of(bare.feed(m.Tick(4.5)), m.Stop)
    assert stop.failed and stop.bad_input and "no complete checkpoint" in stop.reason


def test_a_run_taken_over_after_its_last_step_writes_the_final_state() -> None:
    run = Takeover(replace(SETTINGS, steps=11))
    out = run.reports(report(0, 11), report(1, 10, pending=held(1, 11)), report(2, 11),
                      report(3, 11))
    (stop,) = of(out, m.Stop)
    assert not stop.failed and stop.write and stop.step == 11 and stop.apply == (7, 10)
    assert mode(run.c) is Mode.FINISHED


def test_a_signal_or_a_crash_while_reattaching_stops_past_every_generation_seen() -> None:
    for obs in (m.StopAsked(0.2, "SIGTERM"), m.ShellFailed(0.2, "OSError: disk")):
        run = Takeover()
        run.reports(report(0, seen=12))
        (stop,) = of(run.feed(obs), m.Stop)
        assert stop.failed and stop.gen == 13  # the workers wait in generation 12 or later
        assert mode(run.c) is Mode.FAILED


def test_nothing_else_is_acted_on_while_reattaching() -> None:
    run = Takeover()
    for obs in (m.Exits(0.1, {0: 9}), m.Reduced(0.1, 0, 0, 4), m.Registered(0.1, (0, 1)),
                m.JoinSlots(0.1, 3), m.Beats(0.1, {0: ("inc0", 3)})):
        assert run.feed(obs) == []
    assert mode(run.c) is Mode.REATTACHING


def test_no_state_anywhere_loads_the_checkpoint_on_the_initial_plan() -> None:
    """The previous coordinator died before its first generation loaded anything."""
    run = Takeover(checkpoints=(0, 20), start_step=20)
    out = run.reports(*(report(w, None, gen=0) for w in range(4)))
    (publish,) = of(out, m.Publish)
    assert publish.load == st.Load("restore", 20) and publish.step == 20 and publish.gen == 1
