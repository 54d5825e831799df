"""The transition model: what each recovery redoes (recovery/transition.py), and ReCycle's
rerouting with deferred weight gradients."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.policy import Planner
from chameleon_ft.profile import uniform_profile
from chameleon_ft.recovery import reroute
from chameleon_ft.recovery.transition import build_s, comm_s, pipeline_groups, plan_groups
from chameleon_ft.sim.scenarios import preset_scenario
from chameleon_ft.spec.config import load_config
from chameleon_ft.spec.recovery import RecoverySpec

ROOT = Path(__file__).resolve().parents[2]
SPEC = RecoverySpec(comm_init_s=1.0, comm_per_rank_s=0.01)


def uniform(dp: int = 4, pp: int = 4) -> ExecutionPlan:
    return ExecutionPlan.uniform(dp=dp, pp=pp, num_layers=8, num_microbatches=4 * dp)


def test_groups_are_pipelines_and_buckets() -> None:
    plan = uniform()  # stage-major: stage s of pipeline p is worker 4 s + p
    groups = plan_groups(plan)
    pipelines = {frozenset({p, 4 + p, 8 + p, 12 + p}) for p in range(4)}
    buckets = {frozenset(range(4 * s, 4 * s + 4)) for s in range(4)}
    assert groups == pipelines | buckets


def test_reroute_creates_only_the_damaged_groups() -> None:
    plan = uniform()
    rerouted = reroute_plan(plan, {5})  # stage 1 of pipeline 1
    new = plan_groups(rerouted) - plan_groups(plan)
    # the damaged stage's bucket without 5, and pipeline 1's group with its hosts
    assert new == {frozenset({4, 6, 7}), frozenset({1, 4, 6, 7, 9, 13})}
    # the busiest worker (a host) creates both: 2 inits and 3 + 6 ranks
    assert comm_s(plan, rerouted, SPEC, tp=1) == pytest.approx(2 * 1.0 + 0.01 * 9)
    # a stop-the-world rebuild creates everything plus a world group over 15 workers: a
    # host is in the world, its own pipeline's group, pipeline 1's and its bucket
    everything = comm_s(plan, rerouted, SPEC, tp=1, everything=True)
    assert everything == pytest.approx(4 * 1.0 + 0.01 * (15 + 4 + 6 + 3))
    # nothing changes, nothing is created
    assert comm_s(plan, plan, SPEC, tp=1) == 0.0


def test_tensor_parallel_ranks_count_in_the_world_group_only() -> None:
    plan = uniform()
    world = comm_s(None, plan, SPEC, tp=8, everything=True) - comm_s(None, plan, SPEC, tp=8)
    assert world == pytest.approx(1.0 + 0.01 * 16 * 8)


def test_the_runtime_forms_bucket_groups_without_a_first_exchange() -> None:
    spec = RecoverySpec(comm_init_s=0.002, comm_per_rank_s=0.01, rebuild_all_groups=True)
    plan = uniform(dp=2, pp=2)
    rerouted = reroute_plan(plan, {3})
    # world group of the 3 live workers, then worker 0's bucket {0, 1}, formed only
    assert comm_s(plan, rerouted, spec, tp=1) == pytest.approx(0.002 + 0.03 + 0.002)


def uneven() -> ExecutionPlan:
    """Pipelines of 4, 3, 3, 2 and 1 stages over 8 layers, with several layouts."""
    layouts = [((0, 2), (2, 4), (4, 6), (6, 8)), ((0, 3), (3, 6), (6, 8)),
               ((0, 2), (2, 5), (5, 8)), ((0, 4), (4, 8)), ((0, 8),)]
    pipelines, worker = [], 0
    for m, layout in enumerate(layouts, start=1):
        stages = []
        for lo, hi in layout:
            stages.append(Stage(worker, lo, hi))
            worker += 1
        pipelines.append(Pipeline(tuple(stages), m))
    plan = ExecutionPlan(num_layers=8, pipelines=tuple(pipelines))
    plan.validate()
    return plan


def charged_one_by_one(plan: ExecutionPlan, spec: RecoverySpec, tp: int, world: bool) -> float:
    """comm_s of creating every group of ``plan`` (one per layer), worker by worker."""
    busy: dict[int, float] = defaultdict(float)
    groups = []
    if world and len(plan.workers) * tp > 1:
        groups.append((plan.workers, len(plan.workers) * tp))
    groups += [(pipe.workers, len(pipe.workers)) for pipe in plan.pipelines
               if len(pipe.workers) > 1]
    groups += [(h, len(h)) for h in plan.holders_by_layer if len(h) > 1]
    for members, ranks in groups:
        for w in members:
            busy[w] += spec.comm_init_s + spec.comm_per_rank_s * ranks
    return max(busy.values(), default=0.0)


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("world", [False, True])
def test_a_fresh_set_of_groups_costs_the_same_summed_per_class(tp: int, world: bool) -> None:
    spec = RecoverySpec(comm_init_s=0.3, comm_per_rank_s=0.017)
    for plan in (uneven(), uniform(), uniform(dp=1, pp=1)):
        old = None if not world else uniform()
        expected = charged_one_by_one(plan, spec, tp, world)
        assert comm_s(old, plan, spec, tp=tp, everything=world, per_layer=True) == expected


def charged_changed(old: ExecutionPlan | None, new: ExecutionPlan,
                    spec: RecoverySpec) -> float:
    """comm_s of creating the groups of ``new`` that ``old`` lacks, worker by worker: the
    pipelines' groups in pipeline order, then the buckets in the order of the set of
    ``new``'s holder tuples (the order the sums are added in)."""
    kept = plan_groups(old) if old is not None else frozenset()
    busy: dict[int, float] = {}
    groups = [*pipeline_groups(new),
              *(frozenset(h) for h in set(new.holders_by_layer) if len(h) > 1)]
    for group in groups:
        if group not in kept:
            cost = spec.comm_init_s + spec.comm_per_rank_s * len(group)
            for w in group:
                busy[w] = busy.get(w, 0.0) + cost
    return max(busy.values(), default=0.0)


@pytest.mark.parametrize("seed", range(6))
def test_changed_groups_cost_the_same_summed_per_range(seed: int) -> None:
    """Only the groups a plan lacks are created; the busiest worker's sum, added up per
    layer range for the buckets, is exactly the sum charged worker by worker, for plans of
    mixed layouts, shuffled workers and rerouted stages, from another plan or from none."""
    import random

    from plan_shapes import even_pipelines

    spec = RecoverySpec(comm_init_s=0.37, comm_per_rank_s=0.013)
    rng = random.Random(seed)
    for _ in range(15):
        lengths = [rng.choice([2, 3, 4]) for _ in range(rng.randint(2, 7))]
        pipes = even_pipelines(12, lengths, 2)
        workers = list(range(sum(lengths) + 3))
        rng.shuffle(workers)
        it = iter(workers)
        plan = ExecutionPlan(num_layers=12, pipelines=tuple(
            Pipeline(tuple(Stage(next(it), st.first_layer, st.end_layer) for st in p.stages),
                     p.num_microbatches) for p in pipes))
        family = [plan]
        for _ in range(3):
            try:
                family.append(reroute_plan(family[-1], set(family[-1].dead_workers)
                                           | {rng.choice(family[-1].workers)}))
            except ValueError:
                break
        for new in family:
            for old in (None, *family):
                expected = charged_changed(old, new, spec)
                assert comm_s(old, new, spec, tp=1) == expected


def test_a_full_rebuild_costs_the_costliest_range() -> None:
    plan = uneven()
    profile = uniform_profile(8, fwd_s=0.01, param_bytes=3e8, optimizer_bytes=9e8)
    spec = RecoverySpec(layer_build_s=0.7, layer_build_gb_per_s=3.0)
    nobody = {-1: range(0)}  # held by no worker of the plan: worker by worker
    assert build_s(plan, {}, profile, spec) == build_s(plan, nobody, profile, spec) > 0


@pytest.fixture(scope="module")
def paper32() -> Planner:
    return Planner(load_config(ROOT / "examples" / "paper32.toml"))


def test_dynamic_rebuilds_more_than_reroute(paper32: Planner) -> None:
    decision = paper32.decide(paper32.initial_plan, [5], horizon_s=3600.0)
    by = {str(c.strategy): c for c in decision.candidates}
    rerouting, dyn = by["recycle"], by["dynamic"]
    assert rerouting.terms["build_s"] == 0.0 and rerouting.terms["warmup_s"] == 0.0
    assert dyn.terms["build_s"] > 0 and dyn.terms["warmup_s"] == pytest.approx(dyn.step_s)
    assert dyn.terms["comm_s"] > rerouting.terms["comm_s"] > 0
    assert rerouting.terms["lost_step_s"] == dyn.terms["lost_step_s"] == pytest.approx(
        paper32.failure_free.step_s / 2)
    # the flat shorthand replaces the three rebuild terms
    flat = Planner(replace(paper32.config, recovery=replace(paper32.config.recovery,
                                                            rebuild_s=5.0)),
                   profile=paper32.profile)
    c = next(c for c in flat.decide(flat.initial_plan, [5]).candidates
             if c.strategy == "dynamic")
    assert c.terms["rebuild_s"] == 5.0 and "comm_s" not in c.terms


def test_recycle_defers_weight_gradients_when_memory_allows() -> None:
    config = preset_scenario("sweep").config  # 1.3B on 80 GB: room for deferred W's
    planner = Planner(config)
    plan = planner.initial_plan
    state = planner.recovery_state(plan, set(plan.workers) - {5})
    (fused,) = reroute.candidates(state, frozenset({5}))
    (recycle,) = reroute.candidates(state, frozenset({5}), decoupled=True)
    assert recycle.feasible and recycle.plan is not None and recycle.plan.defer_weight_grad
    assert fused.plan is not None and not fused.plan.defer_weight_grad
    assert recycle.step_s < fused.step_s
    assert recycle.terms == fused.terms  # the same groups change: same transition
    # without the capability, recycle is not an option
    off = replace(config, recovery=replace(config.recovery, decoupled_backward=False))
    state_off = replace(state, config=off)
    (none,) = reroute.candidates(state_off, frozenset({5}), decoupled=True)
    assert not none.feasible and "decoupled_backward" in none.reason


def test_recycle_runs_fused_backwards_when_deferral_does_not_fit(paper32: Planner) -> None:
    # a device whose memory holds the fused rerouted plan but not the deferred one (every
    # deferred weight gradient keeps its activations until it runs)
    plan = paper32.initial_plan
    fused_plan = reroute_plan(plan, {5})
    deferred = replace(fused_plan, defer_weight_grad=True)
    fused_peak = paper32.estimate(fused_plan).max_memory_bytes
    deferred_peak = paper32.estimate(deferred).max_memory_bytes
    assert deferred_peak > fused_peak
    config = paper32.config
    assert config.cluster.device is not None
    device = replace(config.cluster.device, memory_bytes=(fused_peak + deferred_peak) / 2)
    tight = replace(config, cluster=replace(config.cluster, device=device))
    planner = Planner(tight)
    state = planner.recovery_state(plan, set(plan.workers) - {5})
    assert not planner.estimate(deferred).memory_fits
    (recycle,) = reroute.candidates(state, frozenset({5}), decoupled=True)
    assert recycle.feasible and recycle.plan is not None
    assert not recycle.plan.defer_weight_grad


def test_fixed_policies_get_their_own_strategy_when_comparing(paper32: Planner) -> None:
    for name in ("reroute", "recycle", "dynamic", "shrink"):
        decision = paper32.decide(paper32.initial_plan, [5], policy=name, horizon_s=3600.0)
        assert decision.strategy == name


def test_cached_canonical_answers_keep_the_deferred_schedule() -> None:
    planner = Planner(preset_scenario("sweep").config)
    plan = planner.initial_plan
    first = planner.decide(plan, [5], policy="recycle", horizon_s=3600.0)
    again = planner.decide(plan, [6], policy="recycle", horizon_s=3600.0)  # same class
    assert again.cache_hit
    for decision in (first, again):
        assert decision.plan.defer_weight_grad
        assert planner.estimate(decision.plan).step_s == pytest.approx(decision.chosen.step_s)
