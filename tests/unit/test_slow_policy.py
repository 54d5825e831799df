"""The planner's answers to a slow worker: each fixed answer does what it says, Chameleon
takes the best score, the end of a slowdown re-plans, and no answer changes a step's
samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.policy import Planner, Strategy
from chameleon_ft.recovery.slowdown import speed_bounds
from chameleon_ft.spec.config import Config, config_from_mapping, load_config

ROOT = Path(__file__).resolve().parents[2]


def small_config(spare_nodes: int = 0) -> Config:
    return config_from_mapping({
        "cluster": {"num_nodes": 4, "devices_per_node": 2, "spare_nodes": spare_nodes},
        "job": {"pp": 2, "dp": 4, "global_batch": 32},
        "profile": {"kind": "uniform", "num_layers": 8, "fwd_s": 0.01, "bwd_input_s": 0.01,
                    "bwd_weight_s": 0.01, "param_bytes": 1e6, "optimizer_bytes": 2e6,
                    "output_bytes": 1e4},
    })


@pytest.fixture(scope="module")
def paper32() -> Planner:
    return Planner(load_config(ROOT / "examples" / "paper32.toml"))


@pytest.fixture(scope="module")
def spares() -> Planner:
    return Planner(small_config(spare_nodes=1))


def _micro_batches(plan) -> dict[int, int]:  # type: ignore[no-untyped-def]
    return {w: plan.pipelines[p].num_microbatches for w, (p, _) in plan.stage_of_worker.items()}


def test_keep_keeps_the_plan_at_the_slow_speed(paper32: Planner) -> None:
    plan = paper32.initial_plan
    decision = paper32.decide_slow(plan, 5, 2.0, slow_policy="keep")
    assert decision.strategy == "keep" and decision.plan is plan
    assert decision.chosen.step_s == paper32.estimate_slow(plan, {5: 2.0}).step_s
    assert decision.chosen.step_s > 1.5 * paper32.failure_free.step_s
    assert [c.strategy for c in decision.candidates] == [Strategy.KEEP]


def test_rebalance_gives_the_slow_pipeline_fewer_micro_batches(paper32: Planner) -> None:
    plan = paper32.initial_plan
    decision = paper32.decide_slow(plan, 5, 2.0, slow_policy="rebalance")
    new = decision.plan
    assert decision.strategy == "rebalance"
    assert [p.workers for p in new.pipelines] == [p.workers for p in plan.pipelines]
    assert [p.layout for p in new.pipelines] == [p.layout for p in plan.pipelines]
    counts = _micro_batches(new)
    assert counts[5] < min(m for w, m in counts.items() if w not in new.pipelines[
        plan.stage_of_worker[5][0]].workers)
    assert new.global_batch == plan.global_batch  # the same samples every step
    keep = paper32.estimate_slow(plan, {5: 2.0}).step_s
    assert decision.chosen.step_s < keep
    assert decision.transition_s == 0.0  # nothing moves, the communicators stay


def test_dynamic_gives_the_slow_stage_fewer_layers(paper32: Planner) -> None:
    plan = paper32.initial_plan
    decision = paper32.decide_slow(plan, 5, 2.0, slow_policy="dynamic")
    assert decision.strategy == "dynamic"
    p, s = plan.stage_of_worker[5]
    before = plan.pipelines[p].stages[s]
    after = decision.plan.pipelines[p].stages[s]
    assert after.worker == 5 and len(after.layers) < len(before.layers)
    assert decision.plan.global_batch == plan.global_batch
    assert decision.chosen.migration is not None and decision.chosen.migration.moved_bytes > 0


def test_speed_bounds_balances_stage_time_at_each_speed() -> None:
    assert speed_bounds([1.0] * 8, [1.0] * 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    bounds = speed_bounds([1.0] * 8, [1.0, 3.0, 1.0, 1.0])
    assert bounds[1][1] - bounds[1][0] == 1  # the slow stage: one layer
    times = [f * (b - a) for f, (a, b) in zip([1.0, 3.0, 1.0, 1.0], bounds, strict=True)]
    assert max(times) == 3.0


def test_swap_puts_a_spare_in_the_slow_worker_s_place(spares: Planner) -> None:
    plan = spares.initial_plan
    everyone = range(spares.config.total_workers)
    decision = spares.decide_slow(plan, 3, 2.5, alive=everyone, slow_policy="swap")
    assert decision.strategy == "swap"
    assert 3 not in decision.plan.stage_of_worker
    spare = set(decision.plan.workers) - set(plan.workers)
    assert spare and min(spare) >= spares.config.num_workers
    assert decision.plan.stage_of_worker[spare.pop()] == plan.stage_of_worker[3]


def test_a_fixed_answer_that_is_infeasible_keeps(paper32: Planner) -> None:
    decision = paper32.decide_slow(paper32.initial_plan, 5, 2.0, slow_policy="swap")
    assert decision.strategy == "keep"
    assert "infeasible" in decision.reason and "idle worker" in decision.reason


def test_evict_is_the_failure_decision_without_detection(paper32: Planner) -> None:
    plan = paper32.initial_plan
    for policy in ("reroute", "dynamic", "chameleon"):
        decision = paper32.decide_slow(plan, 5, 2.0, policy=policy, slow_policy="evict")
        failure = paper32.decide(plan, [5], policy=policy)
        assert decision.strategy == "evict"
        assert decision.plan == failure.plan
        assert decision.chosen.extra["as"] == failure.strategy
        assert "detect_s" not in decision.chosen.terms
        assert "lost_step_s" not in decision.chosen.terms
        assert decision.chosen.transition_s == pytest.approx(
            failure.transition_s - failure.chosen.terms["detect_s"]
            - failure.chosen.terms.get("lost_step_s", 0.0))


def test_a_fixed_failure_policy_evicts_as_the_common_practice(paper32: Planner) -> None:
    decision = paper32.decide_slow(paper32.initial_plan, 5, 2.0, policy="restart")
    assert decision.strategy == "evict"
    assert {c.strategy for c in decision.candidates} == {Strategy.KEEP, Strategy.EVICT}
    assert decision.chosen.extra["as"] == "restart"


@pytest.mark.parametrize("factor", [1.2, 2.0, 3.0])
def test_chameleon_takes_the_best_score(paper32: Planner, factor: float) -> None:
    plan = paper32.initial_plan
    decision = paper32.decide_slow(plan, 9, factor)
    feasible = [c for c in decision.candidates if c.feasible]
    assert {c.strategy for c in decision.candidates} == set(
        (Strategy.KEEP, Strategy.REBALANCE, Strategy.DYNAMIC, Strategy.SWAP, Strategy.EVICT))
    assert decision.chosen.score == max(c.score for c in feasible)
    assert decision.horizon_expected
    # the window: the expected slowdown cut short by the next failure
    slow_s = paper32.config.recovery.slow_expected_s
    fail_s = paper32.horizon(num_live=32, now_s=0.0)
    assert decision.horizon_s == pytest.approx(1 / (1 / slow_s + 1 / fail_s))
    for c in feasible:
        assert c.plan is None or c.plan.global_batch == plan.global_batch


def test_a_short_window_keeps(paper32: Planner) -> None:
    decision = paper32.decide_slow(paper32.initial_plan, 5, 1.2, horizon_s=1.0)
    assert decision.strategy in ("keep", "rebalance")  # nothing that pays a transition


def test_the_end_of_a_slowdown_re_plans(paper32: Planner) -> None:
    plan = paper32.initial_plan
    rebalanced = paper32.decide_slow(plan, 5, 2.0, slow_policy="rebalance").plan
    back = paper32.decide_slow_end(rebalanced, 5, slow_policy="rebalance")
    assert back.strategy == "rebalance" and back.plan == plan  # the even split again
    assert paper32.decide_slow_end(rebalanced, 5, slow_policy="keep").strategy == "keep"
    # evicted: the worker returns as a re-join does (ReCycle's: its stage back)
    evicted = paper32.decide_slow(plan, 5, 2.0, policy="reroute", slow_policy="evict").plan
    assert 5 not in evicted.stage_of_worker
    rejoin = paper32.decide_slow_end(evicted, 5, alive=range(32), policy="reroute")
    assert rejoin.strategy == "reroute" and 5 in rejoin.plan.stage_of_worker
    chameleon = paper32.decide_slow_end(rebalanced, 5)
    assert chameleon.chosen.score == max(c.score for c in chameleon.candidates if c.feasible)


def test_an_idle_slow_worker_is_kept(spares: Planner) -> None:
    plan = spares.initial_plan
    idle = spares.config.num_workers  # a spare's first worker
    decision = spares.decide_slow(plan, idle, 3.0, alive=range(spares.config.total_workers))
    assert decision.strategy == "keep" and decision.plan is plan


def test_bad_arguments_name_the_field(paper32: Planner) -> None:
    plan = paper32.initial_plan
    with pytest.raises(ValueError, match="worker: worker 5 is not alive"):
        paper32.decide_slow(plan, 5, 2.0, alive=[w for w in range(32) if w != 5])
    with pytest.raises(ValueError, match="slow_policy: unknown answer 'fast'"):
        paper32.decide_slow(plan, 5, 2.0, slow_policy="fast")
    with pytest.raises(ValueError, match="slow: worker 5's factor must be a finite number"):
        paper32.decide_slow(plan, 5, 0.5)
    with pytest.raises(ValueError, match="worker: worker 99 is not in the cluster"):
        paper32.decide_slow(plan, 99, 2.0)


def test_plan_shows_the_slow_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    from chameleon_ft.cli import main

    config = str(ROOT / "examples" / "paper32.toml")
    assert main(["plan", "--config", config, "--slow", "5:2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["slow"] == {"worker": 5, "factor": 2.0}
    assert report["slow_policy"] == "chameleon" and "failed" not in report
    assert [c["strategy"] for c in report["candidates"]] == [
        "keep", "rebalance", "dynamic", "swap", "evict"]
    assert main(["plan", "--config", config, "--slow", "5:2", "--slow-policy", "rebalance"]) == 0
    out = capsys.readouterr().out
    assert "slow worker 5 at 2x; slow policy rebalance" in out
    assert "decision: rebalance: slow policy rebalance: fixed answer" in out
    for bad, message in (("5", "--slow: '5' is not W:F"), ("5:1", "factor must be a number > 1"),
                         ("99:2", "--slow: worker 99")):
        assert main(["plan", "--config", config, "--slow", bad]) == 2
        assert message in capsys.readouterr().err


def test_swap_never_takes_a_worker_a_rerouted_stage_still_names(paper32: Planner) -> None:
    # worker 5 died and its stage is rerouted; back alive and idle, it may not take a slow
    # worker's place while the plan still names it (the swap keeps the reroutes)
    rerouted = paper32.decide(paper32.initial_plan, [5], policy="reroute").plan
    assert 5 in rerouted.dead_workers
    decision = paper32.decide_slow(rerouted, 9, 2.0, alive=range(32), slow_policy="swap")
    assert decision.strategy == "keep" and "no idle worker" in decision.reason


ANSWERS = ("keep", "rebalance", "dynamic", "swap", "evict")


@pytest.mark.parametrize("answer", ANSWERS)
def test_each_fixed_answer_is_honoured_and_undone_when_the_slowdown_ends(
        spares: Planner, answer: str) -> None:
    # With a spare every answer is feasible: the fixed one is taken, priced beside keep
    # only; when the slowdown ends a worker still in the plan is priced back at full speed
    # under the same answer, and one out of it re-joins exactly as a re-join does.
    plan = spares.initial_plan
    everyone = range(spares.config.total_workers)
    decision = spares.decide_slow(plan, 3, 2.5, alive=everyone, slow_policy=answer,
                                  hide_search=True)
    assert decision.strategy == answer
    assert {str(c.strategy) for c in decision.candidates} == {"keep", answer}
    assert "fixed answer" in decision.reason and "infeasible" not in decision.reason
    assert decision.plan.global_batch == plan.global_batch
    assert (3 in decision.plan.stage_of_worker) == (answer in ("keep", "rebalance", "dynamic"))
    end = spares.decide_slow_end(decision.plan, 3, alive=everyone, slow_policy=answer,
                                 hide_search=True)
    if answer == "keep":
        assert end.strategy == "keep" and end.plan is plan
    elif answer in ("rebalance", "dynamic"):
        assert end.strategy == answer and end.plan == plan  # the failure-free split again
    else:
        rejoin = spares.decide_rejoin(decision.plan, [3], alive=everyone, hide_search=True)
        assert (end.strategy, end.plan) == (rejoin.strategy, rejoin.plan)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([0, 3, 4, 7]), st.floats(1.05, 4.0), st.sampled_from([None, 600.0]))
def test_chameleon_s_answer_scores_at_least_every_fixed_answer(
        spares: Planner, worker: int, factor: float, horizon_s: float | None) -> None:
    # Eq. 8 over the same window: Chameleon prices every fixed answer exactly as that
    # answer's own decision does, and takes the best of them.
    plan = spares.initial_plan
    everyone = range(spares.config.total_workers)
    ours = spares.decide_slow(plan, worker, factor, alive=everyone, horizon_s=horizon_s,
                              hide_search=True)
    scores = {str(c.strategy): c.score for c in ours.candidates if c.feasible}
    assert set(scores) == set(ANSWERS)
    for answer in ANSWERS:
        fixed = spares.decide_slow(plan, worker, factor, alive=everyone, horizon_s=horizon_s,
                                   slow_policy=answer, hide_search=True)
        assert fixed.horizon_s == ours.horizon_s
        assert fixed.chosen.score == pytest.approx(scores[answer], rel=1e-12)
        assert ours.chosen.score >= fixed.chosen.score * (1 - 1e-12)
    assert ours.chosen.score == scores[ours.strategy] == max(scores.values())


def test_the_end_of_a_slowdown_under_chameleon_takes_the_best_score(spares: Planner) -> None:
    plan = spares.initial_plan
    everyone = range(spares.config.total_workers)
    rebalanced = spares.decide_slow(plan, 3, 2.5, alive=everyone, slow_policy="rebalance").plan
    end = spares.decide_slow_end(rebalanced, 3, alive=everyone)
    assert {str(c.strategy) for c in end.candidates} == {"keep", "rebalance", "dynamic"}
    assert end.chosen.score == max(c.score for c in end.candidates if c.feasible)
    assert end.chosen.step_s <= spares.estimate_slow(rebalanced, {}).step_s
    # another worker still slow: the end is priced at the remaining speeds
    still = spares.decide_slow_end(rebalanced, 3, alive=everyone, slow={5: 2.0})
    keep = next(c for c in still.candidates if c.strategy == Strategy.KEEP)
    assert keep.step_s == spares.estimate_slow(rebalanced, {5: 2.0}).step_s
