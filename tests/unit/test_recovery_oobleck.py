"""Oobleck's re-instantiation rules and reconfiguration (recovery/oobleck.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.failures import EventKind, Trace, TraceEvent
from chameleon_ft.policy import Planner
from chameleon_ft.recovery.oobleck import (
    BORROW,
    MERGE,
    SIMPLE,
    instantiate,
    oobleck_spec,
    reconfigure,
    reinstantiate,
)
from chameleon_ft.sim.engine import simulate
from chameleon_ft.sim.peers import OobleckPolicy, oobleck_planner
from chameleon_ft.spec.config import config_from_mapping, load_config

ROOT = Path(__file__).resolve().parents[2]
INITIAL = [[0, 1], [2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13]]
"""The pipelines of Oobleck's published reconfiguration test (templates of 2..5 nodes)."""


@pytest.mark.parametrize(("lost", "expected", "rule"), [
    ([2], [[0, 1], [3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13]], SIMPLE),
    ([1, 3, 4], [[0, 13], [2, 12], [9, 10, 11], [5, 6, 7, 8]], BORROW),
    ([2, 4, 6, 7, 8], [[0, 1], [3, 13], [5, 12], [9, 10, 11]], BORROW),
    ([1, 2, 3, 5, 6, 7, 9, 10, 11], [[0, 4], [8, 12, 13]], MERGE),
])
def test_the_four_published_cases(lost, expected, rule) -> None:
    result = reinstantiate(INITIAL, lost, min_ranks=2)
    assert [list(r) for r in result.ranks] == expected
    assert result.rule == rule


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6),
       min_ranks=st.integers(1, 3), data=st.data())
def test_every_survivor_is_placed_once_in_a_long_enough_pipeline(sizes, min_ranks, data) -> None:
    pipelines, start = [], 0
    for n in sizes:
        pipelines.append(list(range(start, start + n)))
        start += n
    lost = data.draw(st.sets(st.integers(0, start - 1)))
    survivors = sorted(set(range(start)) - lost)
    try:
        result = reinstantiate(pipelines, lost, min_ranks)
    except ValueError:
        assert len(survivors) < min_ranks  # only when no pipeline can be formed at all
        return
    placed = sorted(w for ranks in result.ranks for w in ranks)
    assert placed == survivors
    assert all(len(r) >= min_ranks and list(r) == sorted(r) for r in result.ranks)
    assert list(result.ranks) == sorted(result.ranks, key=lambda r: (len(r), r[0]))
    if not lost and min(sizes) >= min_ranks:  # nothing to do: the pipelines stay
        assert [list(r) for r in result.ranks] == sorted(pipelines, key=lambda r: (len(r), r[0]))
        assert result.rule == SIMPLE


@pytest.fixture(scope="module")
def paper32() -> Planner:
    return Planner(load_config(ROOT / "examples" / "paper32.toml"))


def test_a_worker_failure_shortens_its_pipeline_stop_the_world(paper32: Planner) -> None:
    plan = paper32.initial_plan
    spec = oobleck_spec(paper32.templates, num_workers=32, job_length=4, fault_threshold=3)
    assert spec.min_length == 2  # a 7B model needs two 80 GB devices
    assert spec.max_length == 32 - 3 * 2
    state = paper32.recovery_state(plan, set(plan.workers) - {5})
    c = reconfigure(state, {5}, spec)
    assert c.feasible and c.plan is not None and c.extra["rule"] == SIMPLE
    lengths = sorted(p.num_stages for p in c.plan.pipelines)
    assert lengths == [3] + [4] * 7
    # stop-the-world: every layer rebuilt, every group (one per layer) and a world group
    assert {"detect_s", "comm_s", "build_s", "warmup_s", "migrate_s", "lost_step_s"} <= set(c.terms)
    per_layer = 9 * (1.0 + 0.01 * 8)  # a 4-stage worker holds up to 9 layers, 8 holders each
    assert c.terms["comm_s"] > per_layer
    assert c.terms["warmup_s"] == pytest.approx(c.step_s)
    # parameters only, from the first replica of each layer
    assert c.migration is not None
    assert all(t.num_parts == 1 for t in c.migration.transfers)
    profile = paper32.profile
    assert c.migration.moved_bytes == pytest.approx(
        sum(profile.layers[t.layer].param_bytes for t in c.migration.transfers))
    ours = paper32.decide(plan, [5], policy="dynamic", compare=False)
    assert c.transition_s > ours.chosen.transition_s


def test_a_wiped_stage_or_too_few_pipelines_is_not_an_oobleck_recovery(paper32: Planner) -> None:
    plan = paper32.initial_plan
    spec = oobleck_spec(paper32.templates, num_workers=32, job_length=4, fault_threshold=3)
    node = set(range(8, 16))  # stage-major: node 1 holds every replica of stage 1
    c = reconfigure(paper32.recovery_state(plan, set(plan.workers) - node), node, spec)
    assert not c.feasible and "no live replica" in c.reason
    strict = oobleck_spec(paper32.templates, num_workers=32, job_length=4, fault_threshold=8)
    c = reconfigure(paper32.recovery_state(plan, set(plan.workers) - {5}), {5}, strict)
    assert not c.feasible and "f + 1" in c.reason


def test_returned_workers_join_at_the_next_reconfiguration(paper32: Planner) -> None:
    spec = oobleck_spec(paper32.templates, num_workers=32, job_length=4, fault_threshold=3)
    plan = paper32.initial_plan
    first = reconfigure(paper32.recovery_state(plan, set(plan.workers) - {5}), {5}, spec)
    assert first.plan is not None
    # worker 5 comes back and waits (idle); worker 6 fails next
    state = paper32.recovery_state(first.plan, set(range(32)) - {6})
    second = reconfigure(state, {6}, spec)
    assert second.plan is not None and second.extra["joined_workers"] == 1
    assert set(second.plan.workers) == set(range(32)) - {6}


def test_pipelines_that_outlive_a_reconfiguration_are_kept_as_they_are(
        paper32: Planner) -> None:
    spec = oobleck_spec(paper32.templates, num_workers=32, job_length=4, fault_threshold=3)
    plan = paper32.initial_plan
    first = reconfigure(paper32.recovery_state(plan, set(plan.workers) - {5}), {5}, spec)
    assert first.plan is not None
    # nothing lost, nobody waiting: the same instances on the same workers, the same
    # objects (the estimator's per-pipeline memo and the plan's tables come with them)
    again = reconfigure(paper32.recovery_state(first.plan, first.plan.workers), set(), spec)
    assert again.plan == first.plan
    assert all(new is old for new, old in zip(again.plan.pipelines, first.plan.pipelines,
                                              strict=True))
    assert again.step_s == first.step_s


def test_oobleck_starts_on_consecutive_workers(paper32: Planner) -> None:
    plan = instantiate(paper32.initial_plan)
    assert [[st.worker for st in p.stages] for p in plan.pipelines] == [
        list(range(4 * p, 4 * p + 4)) for p in range(8)]
    assert [p.layout for p in plan.pipelines] == [p.layout for p in
                                                  paper32.initial_plan.pipelines]
    # a whole node (two pipelines here) is lost: the others keep their workers
    state = paper32.recovery_state(plan, set(range(8, 32)))
    spec = oobleck_spec(paper32.templates, num_workers=32, job_length=4, fault_threshold=3)
    c = reconfigure(state, set(range(8)), spec)
    assert c.feasible and c.plan is not None and c.extra["rule"] == SIMPLE
    assert sorted(p.num_stages for p in c.plan.pipelines) == [4] * 6


def test_the_simulated_oobleck_keeps_returned_workers_idle_until_the_next_failure() -> None:
    config = config_from_mapping({
        "cluster": {"num_nodes": 4, "devices_per_node": 2},
        "job": {"pp": 2, "dp": 4, "global_batch": 16},
        "profile": {"kind": "uniform", "num_layers": 8, "fwd_s": 0.01, "bwd_input_s": 0.01,
                    "bwd_weight_s": 0.01, "param_bytes": 1e8, "optimizer_bytes": 6e8,
                    "activation_bytes": 1e7, "output_bytes": 1e6},
        "recovery": {"checkpoint_interval_s": 600.0}})
    planner = Planner(config)
    policy = OobleckPolicy(planner, config.recovery, fault_threshold=1)
    plan = policy.start().plan
    assert plan is not None and [p.stages[0].worker for p in plan.pipelines] == [0, 2, 4, 6]
    events = (TraceEvent(100.0, EventKind.NODE_FAIL, (1,)),   # workers 2, 3: pipeline 1
              TraceEvent(200.0, EventKind.REPAIR, (1,)),
              TraceEvent(300.0, EventKind.WORKER_FAIL, (5,)))  # pipeline 2 loses a stage
    seen: list[tuple[str, int]] = []
    original_failure, original_rejoin = policy.on_failure, policy.on_rejoin

    def on_failure(base, failed, ctx):
        choice = original_failure(base, failed, ctx)
        seen.append((choice.strategy, len(choice.plan.workers) if choice.plan else 0))
        return choice

    def on_rejoin(base, returned, ctx):
        choice = original_rejoin(base, returned, ctx)
        seen.append((choice.strategy, 0))
        return choice

    policy.on_failure, policy.on_rejoin = on_failure, on_rejoin
    result = simulate(Trace(events, 400.0), policy,
                      failure_free_samples_s=planner.failure_free.throughput_samples_s,
                      recovery=config.recovery, num_workers=8, workers_per_node=2)
    # the node's pipeline is gone (simple: 3 pipelines of 2 stay); the repair waits; the
    # next failure re-instantiates with the returned workers as a new pipeline of the
    # job's length (7 workers busy: the 1-stage template holds the model here)
    assert seen == [("simple", 6), ("keep", 0), ("simple", 7)]
    assert dict(result.decisions)["keep"] == 1


def test_an_interleaved_job_runs_under_oobleck_as_the_same_job_on_1f1b() -> None:
    # Oobleck has no interleaving: its pipelines run 1F1B over the model's own layers, with
    # a template for every length (the interleaved job plans 4 columns of 2 chunks)
    config = config_from_mapping({
        "cluster": {"num_nodes": 4, "devices_per_node": 2},
        "job": {"pp": 4, "dp": 2, "global_batch": 16, "schedule": "interleaved",
                "virtual_stages": 2},
        "profile": {"kind": "uniform", "num_layers": 8, "fwd_s": 0.01, "bwd_input_s": 0.01,
                    "bwd_weight_s": 0.01, "param_bytes": 1e8, "optimizer_bytes": 6e8,
                    "activation_bytes": 1e7, "output_bytes": 1e6},
        "recovery": {"checkpoint_interval_s": 600.0}})
    planner = Planner(config)
    assert planner.profile.num_layers == 4
    own = oobleck_planner(planner)
    assert own.config.job.schedule == "1f1b" and own.profile.num_layers == 8
    assert [layer.fwd_s for layer in own.profile.layers] == [0.01] * 8
    assert all(own.templates.layout(n) is not None for n in range(1, 9))
    # interleaving hides part of the bubble: the same job is slower on 1F1B
    assert own.failure_free.step_s > planner.failure_free.step_s
    policy = OobleckPolicy(planner, config.recovery, fault_threshold=1)
    start = policy.start()
    assert start.plan is not None and start.plan.schedule == "1f1b"
    assert start.plan.num_layers == 8 and start.step_s > planner.failure_free.step_s
    # a 1F1B planner is its own Oobleck planner
    assert oobleck_planner(own) is own
