"""The fast paths that make 2,048-worker simulations affordable give the same answers.

- the canonical form of a whole state (one worker per node): equivalent states share it;
  answers renamed back price the same as a direct computation;
- rerouted components simulated once per shape, bucket conflicts from layer ranges;
- ``decide(compare=False, detail=False)``: the same choice as the full decision;
- the simulator's parallel units: the same report with one process or two;
- shrink's re-join re-admits whole replicas;
- passes skipped at 65k GPUs (missing layers by a count, the canonical order sorting only
  the pipelines that differ, builds looked for in changed pipelines only) agree with the
  passes over every worker.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable

import pytest

from chameleon_ft.perf import Topology
from chameleon_ft.perf.coloring import conflict_edges
from chameleon_ft.perf.estimator import Estimate, Estimator
from chameleon_ft.perf.sync import _bucket_conflicts, sync_buckets
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.policy import Planner
from chameleon_ft.policy.renaming import carried_estimate, rename_plan
from chameleon_ft.policy.symmetry import (
    _canonical_order,
    _pipeline_keys,
    _Shapes,
    interchangeable_form,
)
from chameleon_ft.recovery.restorer import _workers_by_holding
from chameleon_ft.recovery.transition import build_s
from chameleon_ft.recovery.types import Strategy
from chameleon_ft.sim.report import report_json
from chameleon_ft.sim.runner import run_scenario
from chameleon_ft.sim.scenarios import scenario_from_config
from chameleon_ft.spec import config_from_mapping

# One worker per node (tp fills a node): every worker is interchangeable.
TABLES = {
    "cluster": {"num_nodes": 24, "devices_per_node": 1},
    "job": {"pp": 4, "dp": 6, "global_batch": 24},
    "profile": {"kind": "uniform", "num_layers": 8, "fwd_s": 0.01, "bwd_input_s": 0.01,
                "bwd_weight_s": 0.01, "param_bytes": 1e8, "optimizer_bytes": 6e8,
                "activation_bytes": 1e7, "output_bytes": 1e6},
    "recovery": {"search_exhaustive_workers": 8, "search_extra_stages": 1},
}
CONFIG = config_from_mapping(TABLES)


@pytest.fixture(scope="module")
def planner() -> Planner:
    return Planner(CONFIG)


def test_equivalent_states_share_one_canonical_form(planner: Planner) -> None:
    plan = planner.initial_plan
    topo = planner.topology
    everyone = frozenset(range(topo.num_workers))
    # the same stage of two different pipelines, with the pipelines listed in another order
    a = plan.pipelines[1].stages[2].worker
    b = plan.pipelines[4].stages[2].worker
    form_a = interchangeable_form(plan, everyone - {a}, (frozenset({a}),), topo)
    shuffled = type(plan)(num_layers=plan.num_layers, pipelines=plan.pipelines[::-1],
                          micro_batch=plan.micro_batch, schedule=plan.schedule)
    form_b = interchangeable_form(shuffled, everyone - {b}, (frozenset({b}),), topo)
    assert form_a is not None and form_b is not None
    assert form_a.plan == form_b.plan
    assert form_a.rename(frozenset({a})) == form_b.rename(frozenset({b}))
    assert sorted(form_a.renaming.values()) == list(range(topo.num_workers))
    # a different stage is a different problem
    c = plan.pipelines[1].stages[1].worker
    form_c = interchangeable_form(plan, everyone - {c}, (frozenset({c}),), topo)
    assert form_c is not None
    assert (form_c.plan, form_c.rename(frozenset({c}))) != (form_a.plan,
                                                            form_a.rename(frozenset({a})))


def test_an_estimate_carried_into_canonical_names_is_the_direct_one(planner: Planner) -> None:
    """A rerouted plan's estimate carried to its canonical form (the same plan renamed,
    pipelines reordered) has the canonical plan's own step time, memory and breakdown; its
    per-worker tables are computed for the canonical plan at their first read, and it
    pickles as a plain estimate. A decision keeps its chosen plan's estimate, so the next
    event's form starts from it."""
    topo = planner.topology
    everyone = frozenset(range(topo.num_workers))
    rng = random.Random(5)
    fresh = Estimator(planner.profile, topo)
    for _ in range(4):
        dead = frozenset(rng.sample(planner.initial_plan.workers, 2))
        plan = reroute_plan(planner.initial_plan, dead)
        failed = frozenset(rng.sample(plan.workers, 1))
        form = interchangeable_form(plan, everyone - dead - failed, (failed,), topo)
        assert form is not None
        direct = Estimator(planner.profile, topo).estimate(form.plan)
        computed: list[Estimate] = []

        def compute(canonical: ExecutionPlan = form.plan,
                    log: list[Estimate] = computed) -> Estimate:
            log.append(fresh.uncached(canonical))
            return log[-1]

        carried = carried_estimate(fresh.estimate(plan), compute)
        assert (carried.step_s, carried.max_memory_bytes, carried.memory_fits) == (
            direct.step_s, direct.max_memory_bytes, direct.memory_fits)
        assert carried.bubble_fraction == pytest.approx(direct.bubble_fraction, rel=1e-12)
        assert not computed
        assert carried.peak_memory_bytes == direct.peak_memory_bytes and len(computed) == 1
        assert (carried.sync_rounds, carried.tie_workers) == (direct.sync_rounds,
                                                              direct.tie_workers)
        again = pickle.loads(pickle.dumps(carried))
        assert type(again) is Estimate and again == carried
    own = Planner(CONFIG, profile=planner.profile)  # the module's planner's cache untouched
    plan = own.initial_plan
    decision = own.decide(plan, [plan.pipelines[2].stages[1].worker], detail=False)
    kept = own._estimator.known(decision.plan)
    assert kept is not None and kept.step_s == decision.chosen.step_s
    assert kept.step_s == fresh.estimate(decision.plan).step_s


def test_a_canonical_form_renames_the_whole_state_consistently(planner: Planner) -> None:
    """On rerouted plans with dead, failed and idle workers: the forward lookups, the
    inverse and the canonical plan are one renaming, and a shuffled equivalent state has
    the same canonical plan and marks."""
    topo = planner.topology
    everyone = frozenset(range(topo.num_workers))
    rng = random.Random(11)
    for trial in range(8):
        plan = planner.initial_plan
        dead = frozenset(rng.sample(plan.workers, rng.choice([1, 2])))
        plan = reroute_plan(plan, dead)
        idle = frozenset(rng.sample(sorted(dead), 1)) if trial % 2 else frozenset()
        alive = everyone - dead | idle
        failed = frozenset(rng.sample(plan.workers, 1))
        form = interchangeable_form(plan, alive - failed, (failed,), topo)
        assert form is not None
        renaming = form.renaming
        assert sorted(form.back) == list(range(topo.num_workers))
        assert all(renaming[w] == k for k, w in enumerate(form.back))
        assert form.rename(failed | dead) == frozenset(renaming[w] for w in failed | dead)
        canon_alive, canon_dead = form.rename_alive(alive - failed)
        assert canon_alive == frozenset(renaming[w] for w in alive - failed)
        assert canon_dead == frozenset(renaming[w] for w in everyone - (alive - failed))
        # the canonical plan is the plan renamed, pipelines in canonical order
        for k, p in enumerate(form.order):
            assert form.plan.pipelines[k].workers == tuple(
                renaming[w] for w in plan.pipelines[p].workers)
            assert form.plan.pipelines[k].layout == plan.pipelines[p].layout
        assert sorted((r.pipeline, r.stage, r.shares) for r in form.plan.reroutes) == sorted(
            (form.order.index(r.pipeline), r.stage, tuple((renaming[w], n) for w, n in r.shares))
            for r in plan.reroutes)
        # the same state with the workers of two look-alike healthy pipelines swapped
        healthy = [p for p, pipe in enumerate(plan.pipelines)
                   if not set(pipe.workers) & (dead | failed)
                   and p not in {r.pipeline for r in plan.reroutes}]
        a, b = healthy[0], healthy[-1]
        swap = dict(zip(plan.pipelines[a].workers, plan.pipelines[b].workers, strict=True))
        swap.update({v: k for k, v in swap.items()})
        other = interchangeable_form(rename_plan(plan, swap), frozenset(
            swap.get(w, w) for w in alive - failed), (frozenset(swap.get(w, w) for w in failed),),
            topo)
        assert other is not None and other.plan == form.plan
        assert other.rename(frozenset(swap.get(w, w) for w in failed)) == form.rename(failed)


def test_canonical_answers_price_like_a_direct_computation(planner: Planner) -> None:
    plan = planner.initial_plan
    first = planner.decide(plan, [plan.pipelines[0].stages[1].worker])
    failed = plan.pipelines[3].stages[1].worker
    hit = planner.decide(plan, [failed])
    assert hit.cache_hit and not first.cache_hit
    fresh = Planner(CONFIG, profile=planner.profile).decide(plan, [failed])
    for a, b in zip(hit.candidates, fresh.candidates, strict=True):
        assert a.strategy == b.strategy and a.feasible == b.feasible
        assert a.step_s == pytest.approx(b.step_s, rel=1e-12)
        if a.plan is not None:
            a.plan.validate(num_microbatches=plan.num_microbatches)
            assert failed not in a.plan.workers
            assert a.estimate is not None
            assert set(a.estimate.peak_memory_bytes) == set(a.plan.workers)
    assert hit.strategy == fresh.strategy


def test_lean_decisions_choose_as_the_full_ones(planner: Planner) -> None:
    plan = planner.initial_plan
    failed = [plan.pipelines[2].stages[3].worker]
    planner.decide(plan, failed)  # both below hit the cache: the search counts as hidden
    for policy in ("chameleon", "reroute", "dynamic", "restart", "shrink"):
        full = planner.decide(plan, failed, policy=policy, horizon_s=3600.0)
        lean = planner.decide(plan, failed, policy=policy, horizon_s=3600.0, compare=False,
                              detail=False)
        assert lean.strategy == full.strategy
        assert lean.plan == full.plan
        assert lean.chosen.step_s == pytest.approx(full.chosen.step_s, rel=1e-12)
        if policy != "chameleon":
            assert {c.strategy for c in lean.candidates} == {Strategy(policy)}
        # only the winner carries a plan
        assert [c for c in lean.candidates if c.plan is not None] == [lean.chosen]


def test_lean_decisions_stop_beaten_re_plans_and_choose_as_the_full_ones(
        planner: Planner) -> None:
    """A lean Chameleon decision (``detail=False``) stops a dynamic search whose fastest
    plan cannot beat the first candidate (a failure's rerouting, a rejoin's keep); over
    random failures and rejoins it chooses exactly what a full decision chooses, and some
    searches of each kind were stopped."""
    rng = random.Random(1)
    stopped = {"fail": 0, "rejoin": 0}

    def both(kind: str, plan: ExecutionPlan, workers: list[int], alive: set[int]
             ) -> ExecutionPlan:
        decisions = []
        for detail in (False, True):
            fresh = Planner(CONFIG, profile=planner.profile)
            decide = fresh.decide if kind == "fail" else fresh.decide_rejoin
            decisions.append(decide(plan, workers, alive=alive, detail=detail, now_s=100.0,
                                    hide_search=True))
        lean, full = decisions
        assert (lean.strategy, lean.plan, lean.chosen.step_s, lean.transition_s) == (
            full.strategy, full.plan, full.chosen.step_s, full.transition_s)
        dyn = next(c for c in lean.candidates if c.strategy == Strategy.DYNAMIC)
        stopped[kind] += not dyn.feasible and "too slow" in dyn.reason
        return lean.plan

    for _ in range(12):
        plan, alive, dead = planner.initial_plan, set(range(24)), []
        for _ in range(rng.choice([1, 2, 3])):
            worker = rng.choice(sorted(set(plan.workers) & alive))
            alive.discard(worker)
            dead.append(worker)
            plan = both("fail", plan, [worker], alive)
        returned = rng.choice(dead)
        alive.add(returned)
        both("rejoin", plan, [returned], alive)
    assert stopped["fail"] > 0 and stopped["rejoin"] > 0, stopped


def test_shared_component_timelines_equal_direct_simulation(planner: Planner) -> None:
    plan = planner.initial_plan
    cached = Estimator(planner.profile, planner.topology)
    rng = random.Random(5)
    for _ in range(12):
        dead = frozenset(rng.sample(plan.workers, rng.choice([1, 2, 3])))
        try:
            rerouted = reroute_plan(plan, dead)
        except ValueError:
            continue
        got = cached.estimate(rerouted)
        want = cached.estimate(rerouted, brute_force=True)
        assert got.step_s == want.step_s
        assert got.peak_memory_bytes == want.peak_memory_bytes
        assert got.bubble_fraction == pytest.approx(want.bubble_fraction, rel=1e-12)


def test_bucket_conflicts_equal_the_worker_by_worker_graph(planner: Planner) -> None:
    rng = random.Random(2)
    plan = planner.initial_plan
    everyone = frozenset(range(planner.topology.num_workers))
    for _ in range(8):
        failed = frozenset(rng.sample(plan.workers, rng.choice([1, 2, 4])))
        decision = planner.decide(plan, failed, alive=everyone - failed)
        for candidate in decision.candidates:
            if candidate.plan is None:
                continue
            buckets = [(b, n) for b, n in sync_buckets(candidate.plan, planner.profile)
                       if len(b.workers) > 1]
            assert _bucket_conflicts(candidate.plan, buckets) == conflict_edges(
                [b.workers for b, _ in buckets])


def _scenario(days: float):
    tables = dict(TABLES)
    tables["simulation"] = {"days": days, "seeds": 2, "seed": 3}
    tables["failures"] = {"node_mtbf_hours": 10.0, "repair": "fixed", "repair_hours": 1.0}
    return scenario_from_config("grid", config_from_mapping(tables))


@pytest.mark.slow
def test_parallel_units_give_the_same_report() -> None:
    names = ("chameleon", "reroute", "shrink", "oracle")
    one = report_json(run_scenario(_scenario(0.3), policies=names, jobs=1))
    two = report_json(run_scenario(_scenario(0.3), policies=names, jobs=2))
    assert one == two
    assert '"shrink"' in one


def test_shrink_readmits_healed_replicas(planner: Planner) -> None:
    plan = planner.initial_plan
    failed = plan.pipelines[2].stages[0].worker
    everyone = frozenset(range(planner.topology.num_workers))
    shrunk = planner.decide(plan, [failed], policy="shrink", horizon_s=3600.0).plan
    assert shrunk.num_pipelines == plan.num_pipelines - 1
    back = planner.decide_rejoin(shrunk, [failed], alive=everyone, policy="shrink",
                                 horizon_s=3600.0)
    assert back.strategy == "shrink"
    grown = back.plan
    grown.validate(num_microbatches=plan.num_microbatches)
    assert grown.num_pipelines == plan.num_pipelines
    assert failed in grown.workers
    chosen = back.chosen
    # the healed replica loads in the background while the shrunk plan trains on
    assert chosen.interim_plan == shrunk and chosen.transition_s == 0.0
    assert chosen.interim_s > 0 and chosen.migration is not None
    assert {t.dst for t in chosen.migration.transfers} <= set(grown.workers) - set(
        shrunk.workers)
    # nothing to re-admit when the idle workers make no whole pipeline
    keep = planner.decide_rejoin(plan, [], alive=everyone, policy="shrink", horizon_s=60.0)
    assert keep.strategy == "keep"


def test_readmitted_replicas_keep_a_dead_stage_rerouted(planner: Planner) -> None:
    """Regression: re-admitting replicas into a rerouted plan dropped its reroutes, so the
    grown plan ran a stage on a worker that was still dead (and priced it as live)."""
    plan = planner.initial_plan
    dead = plan.pipelines[2].stages[0].worker
    shrunk_away = plan.pipelines[5].stages[0].worker
    everyone = frozenset(range(planner.topology.num_workers))
    # a pipeline is dropped, then a stage of another is rerouted; the dropped pipeline's
    # worker returns while ``dead`` stays dead
    shrunk = planner.decide(plan, [shrunk_away], policy="shrink", horizon_s=3600.0).plan
    rerouted = planner.decide(shrunk, [dead], policy="reroute", horizon_s=3600.0).plan
    assert dead in rerouted.dead_workers
    alive = everyone - {dead}
    back = planner.decide_rejoin(rerouted, [shrunk_away], alive=alive, policy="shrink",
                                 horizon_s=3600.0)
    grown = back.plan
    assert back.strategy == "shrink"
    grown.validate(num_microbatches=plan.num_microbatches)
    assert set(grown.workers) <= alive
    assert dead in grown.dead_workers
    assert grown.num_pipelines == rerouted.num_pipelines + 1
    # the returned worker of the rerouted stage takes it back
    both = planner.decide_rejoin(rerouted, [shrunk_away, dead], alive=everyone,
                                 policy="shrink", horizon_s=3600.0).plan
    assert dead in both.workers and not both.reroutes


def test_topology_of_the_grid_is_one_worker_per_node() -> None:
    assert Topology.from_config(CONFIG).workers_per_node == 1


def test_fragile_plans_are_priced_by_the_restart_they_risk() -> None:
    from chameleon_ft.plan import ExecutionPlan
    from chameleon_ft.recovery.restorer import fatal_nodes
    from chameleon_ft.spec import ClusterSpec

    # nodes of 4 workers; stage-major: node 0 holds every replica of stage 0 (layers 0-3)
    topo = Topology(ClusterSpec(num_nodes=2, devices_per_node=4), 4)
    stage_major = ExecutionPlan.uniform(dp=4, pp=2, num_layers=8, num_microbatches=8)
    assert fatal_nodes(stage_major, topo) == frozenset({0, 1})
    # pipeline-major: a node holds two whole pipelines, every layer lives on both nodes
    pipeline_major = ExecutionPlan.uniform(dp=4, pp=2, num_layers=8, num_microbatches=8,
                                           placement="pipeline-major")
    assert fatal_nodes(pipeline_major, topo) == frozenset()

    tables = {
        "cluster": {"num_nodes": 2, "devices_per_node": 4},
        "job": {"pp": 2, "dp": 4, "global_batch": 16},
        "profile": TABLES["profile"],
        "policy": {"node_mtbf_hours": 2.0, "repair_hours": 1.0, "node_failure_share": 1.0},
    }
    config = config_from_mapping(tables)
    planner = Planner(config)
    fragile = planner.decide(planner.initial_plan, [0])
    # the same decision with no node-level failures expected: nothing is discounted
    calm = Planner(config_from_mapping(
        {**tables, "policy": {**tables["policy"], "node_failure_share": 0.0}}),
        profile=planner.profile).decide(planner.initial_plan, [0])
    by_strategy = {c.strategy: c for c in calm.candidates}
    discounted = 0
    for c in fragile.candidates:
        if not c.feasible:
            continue
        other = by_strategy[c.strategy]
        assert c.score <= other.score + 1e-9
        if c.plan is not None and fatal_nodes(c.plan, planner.topology):
            assert c.score < other.score
            discounted += 1
        elif c.plan is not None:
            assert c.score == pytest.approx(other.score)
    assert discounted >= 1
    with pytest.raises(ValueError, match="node_failure_share"):
        config_from_mapping({**tables, "policy": {"node_failure_share": 1.5}})


def _states(planner: Planner, seed: int, count: int
            ) -> list[tuple[ExecutionPlan, frozenset[int], frozenset[int]]]:
    """Random ``(plan, alive, failed)``: rerouted and re-planned plans (pipelines of
    several lengths), dead and idle workers, whole stages lost."""
    rng = random.Random(seed)
    everyone = frozenset(range(planner.topology.num_workers))
    out = []
    for trial in range(count):
        plan = planner.initial_plan
        dead = frozenset(rng.sample(plan.workers, rng.choice([1, 2, 3])))
        if trial % 3 == 1:
            plan = reroute_plan(plan, dead)
        elif trial % 3 == 2:
            plan = planner.decide(plan, dead, policy="dynamic", horizon_s=1e6).plan
        failed = frozenset(rng.sample(plan.workers, rng.choice([1, 2])))
        if trial % 4 == 3:  # every replica of a stage
            stage = rng.randrange(len(plan.pipelines[0].stages))
            failed = frozenset(pipe.stages[stage].worker for pipe in plan.pipelines
                               if stage < len(pipe.stages))
        out.append((plan, everyone - dead - failed, failed))
    return out


def test_missing_layers_counted_or_looked_up_agree(planner: Planner) -> None:
    """With fewer dead workers than pipelines no layer is missing (a count); otherwise the
    layers are looked up: both agree with the layers no live worker holds."""
    for plan, alive, _ in _states(planner, 3, 24):
        state = planner._state(plan, alive, None)
        held = {layer for w in alive for layer in plan.layers_by_worker.get(w, ())}
        expected = [layer for layer in range(plan.num_layers) if layer not in held]
        assert state.missing_layers() == expected
    plan = planner.initial_plan
    whole = frozenset(pipe.stages[1].worker for pipe in plan.pipelines)
    state = planner._state(plan, frozenset(range(planner.topology.num_workers)) - whole, None)
    assert state.missing_layers() == list(plan.pipelines[0].stages[1].layers)


def _order_by_whole_keys(plan: ExecutionPlan, rows: list[tuple[int, ...]], ranks: list[int],
                         named: tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]],
                         special: set[int], status: Callable[[int], tuple[bool, ...]]
                         ) -> list[int]:
    """The canonical order as first written: every pipeline sorted by its whole key (the
    reference the faster order is checked against)."""
    lite, hosted, _ = _pipeline_keys(plan, rows, ranks, named, special, status)
    keys = [(lite[p], hosted.get(p, []), p) for p in range(plan.num_pipelines)]
    return sorted(range(plan.num_pipelines), key=keys.__getitem__)


def test_canonical_order_sorts_as_the_whole_keys(planner: Planner) -> None:
    for plan, alive, failed in _states(planner, 7, 30):
        rows = plan.worker_rows()
        ranks = _Shapes(plan).ranks
        named = (dict(plan.stage_of_worker),
                 {plan.pipelines[r.pipeline].stages[r.stage].worker: (r.pipeline, r.stage)
                  for r in plan.reroutes})
        special = set(failed) | (set(plan.workers) | plan.dead_workers) - alive

        def status(w: int, alive: frozenset[int] = alive,
                   failed: frozenset[int] = failed) -> tuple[bool, ...]:
            return (w in alive, w in failed)

        assert _canonical_order(plan, rows, ranks, named, special, status) == (
            _order_by_whole_keys(plan, rows, ranks, named, special, status))


def test_builds_looked_for_in_changed_pipelines_only_are_all_of_them(planner: Planner) -> None:
    """``build_s`` skipping the pipelines a plan keeps whole from the old one gives the
    build time of looking at every worker: on re-plans, reroutes, shrinks, re-joins that
    hand a rerouted stage back and re-joins that re-admit replicas."""
    spec, profile = planner.config.recovery, planner.profile
    everyone = frozenset(range(planner.topology.num_workers))
    pairs = []
    for plan, alive, failed in _states(planner, 9, 18):
        decision = planner.decide(plan, failed, alive=alive, horizon_s=1e6)
        pairs.extend((plan, alive, c.plan) for c in decision.candidates if c.plan is not None)
        back = planner.decide_rejoin(decision.plan, failed, alive=alive | failed,
                                     horizon_s=1e6)
        pairs.extend((decision.plan, alive | failed, c.plan) for c in back.candidates
                     if c.plan is not None)
    rerouted = reroute_plan(planner.initial_plan, {3})
    pairs.append((rerouted, everyone, reroute_plan(rerouted, set())))  # stage 3 handed back
    assert any(build_s(new, planner._state(old, alive, None).held_layers(), profile, spec) > 0
               for old, alive, new in pairs)
    for old, alive, new in pairs:
        held = planner._state(old, alive, None).held_layers()
        assert build_s(new, held, profile, spec, old) == build_s(new, held, profile, spec)


def test_holdings_grouped_by_object_are_grouped_by_value(planner: Planner) -> None:
    """The workers of each holding, grouped by range object first, are those of each
    distinct holding by value, holdings in order of first appearance; equal ranges that
    are distinct objects fall in one group, and a dict with equal contents but other
    values is grouped anew, not read from the last answer."""
    for plan, alive, _ in _states(planner, 13, 12):
        held = planner._state(plan, alive, None).held_layers()
        expected: dict[object, set[int]] = {}
        for w, layers in held.items():
            expected.setdefault(layers, set()).add(w)
        grouped = _workers_by_holding(held)
        assert grouped is not None
        assert list(grouped) == list(expected)
        assert {k: set(v) for k, v in grouped.items()} == expected
        assert _workers_by_holding(held) is grouped  # the same read-only holdings
    copies = {0: range(0, 2), 1: range(0, 2), 2: range(2, 4)}  # equal ranges, two objects
    assert _workers_by_holding(copies) == {range(0, 2): [0, 1], range(2, 4): [2]}
    copies[1] = range(2, 4)
    assert _workers_by_holding(copies) == {range(0, 2): [0], range(2, 4): [1, 2]}
    assert _workers_by_holding({0: [1, 2]}) is None  # an unhashable holding


def test_own_plans_skip_the_cluster_check_with_the_same_form(planner: Planner) -> None:
    """A plan the planner handed out is known as its own (its workers are not checked to
    be the cluster's again) and gets the form a checked plan gets; a plan naming a worker
    outside the cluster gets none unless called its own."""
    topo = planner.topology
    everyone = frozenset(range(topo.num_workers))
    own = Planner(CONFIG, profile=planner.profile)
    plan = own.initial_plan
    decision = own.decide(plan, [plan.pipelines[1].stages[0].worker], detail=False)
    issued = decision.plan
    assert own._issued.get(id(issued)) is issued and own._issued.get(id(plan)) is plan
    failed = frozenset({issued.pipelines[0].stages[1].worker})
    alive = everyone - failed - {plan.pipelines[1].stages[0].worker}
    checked = interchangeable_form(issued, alive, (failed,), topo)
    trusted = interchangeable_form(issued, alive, (failed,), topo, own=True)
    assert checked is not None and trusted is not None
    assert (checked.plan, checked.back) == (trusted.plan, trusted.back)
    outside = rename_plan(issued, {issued.pipelines[2].stages[0].worker: topo.num_workers})
    assert interchangeable_form(outside, alive, (failed,), topo) is None
