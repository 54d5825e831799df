"""Fail-slows in the simulator: speeds that change at step boundaries, the job noticing them
``slow_detect_steps`` later, answers applied, evicted workers re-joining, and the planner's
policies with and without fail-slow handling."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest

from chameleon_ft.failures import EventKind, Trace, TraceEvent
from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.sim.engine import RunResult, simulate
from chameleon_ft.sim.policies import KEEP, Choice, EventContext, slowed
from chameleon_ft.sim.runner import run_scenario
from chameleon_ft.sim.scenarios import preset_scenario
from chameleon_ft.spec.recovery import RecoverySpec

NUM_WORKERS, PER_NODE = 4, 2
FF_STEP_S, BATCH = 2.0, 8
FF = BATCH / FF_STEP_S
RECOVERY = RecoverySpec(detect_s=1.0, rebuild_s=2.0, restart_s=50.0, checkpoint_load_s=10.0,
                        checkpoint_interval_s=1000.0)
FULL = ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=8)


def one_pipeline(workers: list[int]) -> ExecutionPlan:
    return ExecutionPlan(num_layers=4, pipelines=(
        Pipeline((Stage(workers[0], 0, 2), Stage(workers[1], 2, 4)), 8),))


class SlowFake:
    """A plan runs as slow as its slowest worker; ``evict`` answers a slow worker with one
    pipeline on two other workers (1 s), a re-join with the full plan (3 s)."""

    def __init__(self, evict: bool) -> None:
        self.name = "fake"
        self.evict = evict
        self.calls: list[tuple[str, float, int]] = []

    def start(self) -> Choice:
        return Choice(strategy="initial", plan=FULL, step_s=FF_STEP_S, throughput_samples_s=FF)

    def on_failure(self, base: Choice, failed: frozenset[int], ctx: EventContext) -> Choice:
        alive = sorted(ctx.alive)
        return Choice(strategy="shrink", plan=one_pipeline(alive), step_s=4.0,
                      throughput_samples_s=2.0, stall_s=3.0, terms=(("detect_s", 3.0),))

    def on_rejoin(self, base: Choice, returned: frozenset[int], ctx: EventContext) -> Choice:
        self.calls.append(("rejoin", ctx.now_s, min(returned)))
        return Choice(strategy="dynamic", plan=FULL, step_s=FF_STEP_S, throughput_samples_s=FF,
                      stall_s=3.0, terms=(("rebuild_s", 3.0),))

    def priced(self, choice: Choice, slow: Mapping[int, float]) -> Choice:
        def step_s(plan: ExecutionPlan, factors: Mapping[int, float]) -> float:
            return max((factors.get(w, 1.0) for w in plan.workers), default=1.0)
        return slowed(choice, slow, step_s)

    def on_slow(self, base: Choice, worker: int, factor: float, slow: Mapping[int, float],
                ctx: EventContext) -> Choice:
        self.calls.append(("slow", ctx.now_s, worker))
        if not self.evict:
            return Choice(strategy=KEEP, plan=None)
        others = sorted(ctx.alive - {worker})
        return Choice(strategy="evict", plan=one_pipeline(others), step_s=4.0,
                      throughput_samples_s=2.0, stall_s=1.0, terms=(("comm_s", 1.0),))

    def on_slow_end(self, base: Choice, worker: int, slow: Mapping[int, float],
                    ctx: EventContext) -> Choice:
        self.calls.append(("end", ctx.now_s, worker))
        return Choice(strategy=KEEP, plan=None)


def run(events: list[TraceEvent], duration_s: float, policy: SlowFake,
        recovery: RecoverySpec = RECOVERY) -> RunResult:
    return simulate(Trace(tuple(events), duration_s), policy, failure_free_samples_s=FF,
                    recovery=recovery, num_workers=NUM_WORKERS, workers_per_node=PER_NODE)


SLOW_100_500 = [TraceEvent(100.0, EventKind.SLOW, (0,), 2.0),
                TraceEvent(500.0, EventKind.SLOW_END, (0,))]


def test_kept_slow_worker_halves_the_speed_between_step_boundaries() -> None:
    policy = SlowFake(evict=False)
    result = run(SLOW_100_500, 1000.0, policy)
    assert result.samples == pytest.approx(FF * 100 + FF / 2 * 400 + FF * 500)
    lost = dict(result.time_lost_s)
    assert lost == {"slow_s": pytest.approx(200.0)}
    assert sum(lost.values()) == pytest.approx(1000.0 - result.samples / FF)
    # noticed five (slowed, 4 s) steps after the slowdown, five steps after its end
    assert policy.calls == [("slow", 120.0, 0), ("end", 510.0, 0)]
    assert dict(result.decisions) == {"slow-keep": 2}
    assert result.training_s == pytest.approx(1000.0)


def test_evicted_worker_re_joins_when_its_slowdown_ends() -> None:
    policy = SlowFake(evict=True)
    result = run(SLOW_100_500, 1000.0, policy)
    # 0-100 at full speed; 100-120 slowed (5 steps of 4 s); 1 s to evict; one pipeline
    # (step 4 s from 121) until the end is noticed at 521; 3 s to re-join; full speed.
    assert policy.calls == [("slow", 120.0, 0), ("rejoin", 521.0, 0)]
    assert result.samples == pytest.approx(400 + 40 + 400 * 2.0 + 476 * FF)
    assert dict(result.decisions) == {"dynamic": 1, "slow-evict": 1}
    lost = dict(result.time_lost_s)
    assert lost["slow_s"] == pytest.approx(10.0)
    assert sum(lost.values()) == pytest.approx(1000.0 - result.samples / FF)


def test_a_slow_worker_that_dies_is_no_longer_noticed() -> None:
    policy = SlowFake(evict=True)
    events = [TraceEvent(100.0, EventKind.SLOW, (0,), 2.0),
              TraceEvent(105.0, EventKind.NODE_FAIL, (0,))]
    run(events, 1000.0, policy)
    assert [c[0] for c in policy.calls] == []  # the failure came before the check


def test_a_check_during_a_transition_waits_for_its_end() -> None:
    policy = SlowFake(evict=True)
    events = [TraceEvent(50.0, EventKind.WORKER_FAIL, (3,)),
              TraceEvent(51.0, EventKind.SLOW, (0,), 2.0)]
    run(events, 1000.0, policy)
    # the failure's plan (workers 0 and 1) commits at 53: it runs the slow worker, so the
    # job answers at once
    assert policy.calls == [("slow", 53.0, 0)]


def test_a_trace_without_fail_slows_never_asks_about_them() -> None:
    for evict in (False, True):
        policy = SlowFake(evict=evict)
        result = run([TraceEvent(100.0, EventKind.WORKER_FAIL, (3,))], 1000.0, policy)
        assert policy.calls == [] and "slow_s" not in dict(result.time_lost_s)


@pytest.fixture(scope="module")
def paper32_slow() -> tuple[Trace, object]:
    scenario = preset_scenario("paper32")
    events = (TraceEvent(3600.0, EventKind.SLOW, (5,), 2.0),
              TraceEvent(5 * 3600.0, EventKind.WORKER_FAIL, (20,)),
              TraceEvent(9 * 3600.0, EventKind.SLOW_END, (5,)),
              TraceEvent(10 * 3600.0, EventKind.SLOW, (9,), 3.0),
              TraceEvent(12 * 3600.0, EventKind.REPAIR, (2,)))
    return Trace(events, 86400.0), scenario


def _run(scenario: object, trace: Trace, slow_policy: str,
         policies: tuple[str, ...]) -> dict[str, RunResult]:
    config = scenario.config  # type: ignore[attr-defined]
    changed = replace(scenario, config=replace(  # type: ignore[type-var]
        config, recovery=replace(config.recovery, slow_policy=slow_policy)))
    run = run_scenario(changed, policies=policies, trace=trace, jobs=1)
    return {r.name: r for r in run.cells[0].runs[0].results}


def test_planner_policies_with_and_without_fail_slow_handling(paper32_slow) -> None:
    trace, scenario = paper32_slow
    policies = ("chameleon", "reroute", "bamboo", "oobleck")
    handled = _run(scenario, trace, "chameleon", policies)
    kept = _run(scenario, trace, "keep", policies)
    assert handled["chameleon"].samples > kept["chameleon"].samples
    slow = dict(kept["chameleon"].time_lost_s)["slow_s"]
    assert slow > 3600.0  # hours at half and a third of the speed
    assert dict(handled["chameleon"].time_lost_s).get("slow_s", 0.0) < 0.1 * slow
    assert any(k.startswith("slow-") and k != "slow-keep"
               for k in dict(handled["chameleon"].decisions))
    assert all(k == "slow-keep" for k in dict(kept["reroute"].decisions) if k.startswith("slow"))
    for name in policies:  # every policy's lost time adds up
        for result in (handled[name], kept[name]):
            total = sum(v for _, v in result.time_lost_s)
            assert total == pytest.approx(86400.0 - result.samples / result.failure_free_samples_s,
                                          rel=1e-9)


def test_fail_slows_change_nothing_without_them(paper32_slow) -> None:
    trace, scenario = paper32_slow
    failures_only = Trace(tuple(e for e in trace.events if e.kind not in (
        EventKind.SLOW, EventKind.SLOW_END)), trace.duration_s)
    answers = {p: _run(scenario, failures_only, p, ("chameleon", "bamboo"))
               for p in ("chameleon", "keep", "evict")}
    assert answers["chameleon"] == answers["keep"] == answers["evict"]


def test_the_oracle_s_horizon_skips_other_workers_speed_changes() -> None:
    from chameleon_ft.sim.slowrun import Horizons

    trace = Trace((TraceEvent(10.0, EventKind.SLOW, (0,), 2.0),
                   TraceEvent(20.0, EventKind.SLOW, (1,), 2.0),
                   TraceEvent(30.0, EventKind.WORKER_FAIL, (3,)),
                   TraceEvent(40.0, EventKind.SLOW_END, (0,))), 100.0)
    horizons = Horizons(trace)
    assert [horizons.next_change_s(i) for i in range(5)] == [30.0, 30.0, 30.0, 100.0, 100.0]
    assert horizons.next_speed_s(0, 10.0) == 40.0
    assert horizons.next_speed_s(1, 25.0) == 100.0
