"""The estimator's per-worker slowdown factors: a factor of 1 is the old estimate exactly,
and a slow worker's compute lengthens the step as the list scheduler says."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.perf import Topology, estimate, speeds_from_factors
from chameleon_ft.perf.closed_form import step_1f1b
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.profile import Profile, uniform_profile
from chameleon_ft.spec import ClusterSpec


def topology(num_workers: int, per_node: int = 4) -> Topology:
    cluster = ClusterSpec(num_nodes=-(-num_workers // per_node), devices_per_node=per_node,
                          inter_node_gb_per_s=1.0, intra_node_gb_per_s=10.0,
                          inter_node_latency_us=50.0, intra_node_latency_us=5.0)
    return Topology(cluster, per_node)


PROFILE = uniform_profile(8, fwd_s=0.4, bwd_input_s=0.5, bwd_weight_s=0.3, param_bytes=4e6,
                          optimizer_bytes=8e6, output_bytes=2e6, optimizer_step_s=0.2)


def test_a_factor_of_one_is_the_unit_speed_estimate_exactly() -> None:
    plan = ExecutionPlan.uniform(dp=3, pp=4, num_layers=8, num_microbatches=12)
    topo = topology(12)
    rerouted = reroute_plan(plan, {5})
    for p in (plan, rerouted):
        base = estimate(p, PROFILE, topo, brute_force=True)
        assert estimate(p, PROFILE, topo, slow={w: 1.0 for w in p.workers},
                        brute_force=True) == base
        assert estimate(p, PROFILE, topo, slow={}) == estimate(p, PROFILE, topo)
    assert speeds_from_factors({3: 1.0, 1: 2.0, 7: 4.0}, {1, 3}) == {1: 0.5}


def _scaled(profile: Profile, layers: range, factor: float) -> Profile:
    """``profile`` with the compute of ``layers`` taking ``factor`` times as long."""
    return dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, fwd_s=layer.fwd_s * factor,
                            bwd_input_s=layer.bwd_input_s * factor,
                            bwd_weight_s=layer.bwd_weight_s * factor)
        if i in layers else layer for i, layer in enumerate(profile.layers)))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 8), st.sampled_from(["1f1b", "gpipe"]),
       st.sampled_from([2.0, 4.0, 8.0]), st.data())
def test_a_slow_worker_is_its_stage_computing_that_many_times_longer(
        stages: int, m: int, schedule: str, factor: float, data: st.DataObject) -> None:
    # One pipeline, no optimizer step: the slow worker's operations are exactly those of a
    # profile whose layers on its stage cost ``factor`` times as much (powers of two: no
    # rounding apart), and the list scheduler times both graphs alike.
    profile = dataclasses.replace(PROFILE, optimizer_step_s=0.0)
    plan = ExecutionPlan.uniform(dp=1, pp=stages, num_layers=8, num_microbatches=m,
                                 schedule=schedule)
    slow_stage = data.draw(st.integers(0, stages - 1))
    stage = plan.pipelines[0].stages[slow_stage]
    topo = topology(stages)
    slowed = estimate(plan, profile, topo, slow={stage.worker: factor}, brute_force=True)
    oracle = estimate(plan, _scaled(profile, stage.layers, factor), topo, brute_force=True)
    assert slowed.step_s == oracle.step_s
    assert slowed.step_s >= estimate(plan, profile, topo, brute_force=True).step_s


def test_one_slow_stage_without_links_is_the_closed_form() -> None:
    # Free links: a pipeline of S stages whose slowest stage takes F (t_f + t_b) per
    # micro-batch runs (S - 1)(t_f + t_b) + m F (t_f + t_b) when the slow stage is the last;
    # at F = 1 it is Eq. 9.
    profile = uniform_profile(4, fwd_s=1.0, bwd_input_s=2.0)
    plan = ExecutionPlan.uniform(dp=1, pp=4, num_layers=4, num_microbatches=6)
    cluster = ClusterSpec(num_nodes=1, devices_per_node=4, ideal_network=True)
    topo = Topology(cluster, 4)
    last = plan.pipelines[0].stages[-1].worker
    for factor in (1.0, 2.0, 3.0):
        est = estimate(plan, profile, topo, slow={last: factor})
        assert est.step_s == pytest.approx(3 * 3.0 + 6 * factor * 3.0, rel=1e-12)
    assert estimate(plan, profile, topo).step_s == pytest.approx(step_1f1b(4, 6, 1.0, 2.0))


def test_communication_is_not_slowed() -> None:
    # Two pipelines: the gradient all-reduce after the compute takes as long whatever the
    # slow worker's factor; only the compute phase and its optimizer step lengthen.
    plan = ExecutionPlan.uniform(dp=2, pp=2, num_layers=8, num_microbatches=4)
    topo = topology(4)
    base = estimate(plan, PROFILE, topo)
    slow = estimate(plan, PROFILE, topo, slow={0: 2.0})
    assert slow.breakdown.allreduce_s == pytest.approx(base.breakdown.allreduce_s, rel=1e-9)
    assert slow.breakdown.compute_s > base.breakdown.compute_s
    assert slow.breakdown.optimizer_s == pytest.approx(2 * base.breakdown.optimizer_s)


@pytest.mark.parametrize("factor", [0.5, float("nan"), float("inf"), True])
def test_bad_factors_are_refused(factor: float) -> None:
    plan = ExecutionPlan.uniform(dp=1, pp=2, num_layers=8, num_microbatches=2)
    with pytest.raises(ValueError, match="slow: worker 0's factor must be a finite number >= 1"):
        estimate(plan, PROFILE, topology(2), slow={0: factor})
    with pytest.raises(ValueError, match="give speeds or slow factors, not both"):
        estimate(plan, PROFILE, topology(2), slow={0: 2.0}, speeds={0: 0.5})


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", "zero-bubble"])
def test_factors_of_one_change_no_schedule_s_estimate(schedule: str) -> None:
    # every schedule the estimator prices, on the failure-free plan, a rerouted one and one
    # with uneven micro-batches: factors of 1 (alone or beside a slow worker) are the
    # estimate without them, field for field, with and without the estimator's shortcuts
    from chameleon_ft.perf import estimate as estimate_plan
    from chameleon_ft.policy import Planner
    from chameleon_ft.spec.config import config_from_mapping

    job: dict[str, object] = {"pp": 2, "dp": 4, "global_batch": 32, "schedule": schedule}
    if schedule == "interleaved":
        job["virtual_stages"] = 2
    planner = Planner(config_from_mapping({
        "cluster": {"num_nodes": 4, "devices_per_node": 2},
        "job": job,
        "profile": {"kind": "uniform", "num_layers": 8, "fwd_s": 0.01, "bwd_input_s": 0.012,
                    "bwd_weight_s": 0.008, "param_bytes": 1e6, "optimizer_bytes": 2e6,
                    "output_bytes": 1e4},
    }))
    plan = planner.initial_plan
    plans = [plan, planner.decide(plan, [3], policy="reroute").plan,
             planner.decide_slow(plan, 3, 2.0, slow_policy="rebalance").plan]
    assert len({tuple(p.num_microbatches for p in q.pipelines) for q in plans}) > 1
    for p in plans:
        ones = {w: 1.0 for w in range(planner.config.num_workers)}
        for brute in (False, True):
            base = estimate_plan(p, planner.profile, planner.topology, brute_force=brute)
            assert estimate_plan(p, planner.profile, planner.topology, slow=ones,
                                 brute_force=brute) == base
            slow = estimate_plan(p, planner.profile, planner.topology, slow={2: 1.5},
                                 brute_force=brute)
            assert estimate_plan(p, planner.profile, planner.topology,
                                 slow={**ones, 2: 1.5}, brute_force=brute) == slow
        assert planner.estimate_slow(p, ones) == planner.estimate_slow(p, {})


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 3), st.integers(2, 4), st.integers(1, 4), st.data())
def test_slow_estimates_with_shared_timelines_are_brute_force_s(
        dp: int, pp: int, m: int, data: st.DataObject) -> None:
    # An estimator that has already timed the plan at unit speed reuses those timelines
    # for every pipeline and rerouted component without a slow worker: the estimate at the
    # slow speeds is the brute-force one (each pipeline simulated afresh), exactly.
    from chameleon_ft.perf import Estimator

    plan = ExecutionPlan.uniform(dp=dp, pp=pp, num_layers=8, num_microbatches=m * dp)
    if data.draw(st.booleans()):
        plan = reroute_plan(plan, {data.draw(st.sampled_from(list(plan.workers)))})
    live = sorted(plan.stage_of_worker)
    slow = {w: data.draw(st.sampled_from([1.5, 2.0, 3.0]))
            for w in data.draw(st.sets(st.sampled_from(live), min_size=1, max_size=2))}
    topo = topology(dp * pp, per_node=data.draw(st.sampled_from([1, 2])))
    shared = Estimator(PROFILE, topo)
    shared.estimate(plan)  # every unit-speed timeline kept
    fast = shared.estimate(plan, speeds_from_factors(slow, plan.stage_of_worker))
    brute = estimate(plan, PROFILE, topo, slow=slow, brute_force=True)
    assert fast.step_s == brute.step_s
    assert fast.breakdown == brute.breakdown
    assert dict(fast.peak_memory_bytes) == dict(brute.peak_memory_bytes)
