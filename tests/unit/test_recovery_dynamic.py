"""The dynamic search against brute force on small jobs (<= 8 workers, <= 8 layers)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from chameleon_ft.perf import estimate
from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.policy import Planner
from chameleon_ft.profile import LayerCost, Profile
from chameleon_ft.recovery import dynamic
from chameleon_ft.recovery.restorer import fatal_nodes
from chameleon_ft.spec.config import Config, config_from_mapping, load_config

GIB = 2**30


def make_config(*, num_nodes: int, per_node: int, pp: int, dp: int, global_batch: int,
                num_layers: int, memory_bytes: float | None = None,
                ideal: bool = True) -> Config:
    cluster: dict[str, object] = {"num_nodes": num_nodes, "devices_per_node": per_node,
                                  "ideal_network": ideal}
    if memory_bytes is not None:
        cluster["device"] = {"name": "test", "peak_flops": 1e12, "mfu": 0.5,
                             "memory_bytes": int(memory_bytes), "memory_gb_per_s": 100.0}
    return config_from_mapping({
        "cluster": cluster,
        "job": {"pp": pp, "dp": dp, "global_batch": global_batch},
        "profile": {"kind": "uniform", "num_layers": num_layers, "fwd_s": 1.0,
                    "bwd_input_s": 1.0, "bwd_weight_s": 1.0},
    })


def varied_profile(num_layers: int, *, param_gib: float = 1.0) -> Profile:
    """Layers of unequal cost (so the layer split matters) with memory figures."""
    layers = []
    for i in range(num_layers):
        scale = 1.0 + 0.5 * ((i * 7) % 3)  # 1.0, 2.0, 1.5, 1.0, ...
        layers.append(LayerCost(name=f"l{i}", fwd_s=0.1 * scale, bwd_input_s=0.1 * scale,
                                bwd_weight_s=0.1 * scale, param_bytes=param_gib * GIB,
                                optimizer_bytes=2 * param_gib * GIB,
                                activation_bytes=0.25 * GIB, output_bytes=1e6))
    return Profile(layers=tuple(layers), optimizer_step_s=0.05)


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered split of ``total`` into ``parts`` positive integers."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def layouts(num_layers: int, num_stages: int) -> Iterator[tuple[tuple[int, int], ...]]:
    for sizes in compositions(num_layers, num_stages):
        out, lo = [], 0
        for size in sizes:
            out.append((lo, lo + size))
            lo += size
        yield tuple(out)


def partitions(total: int, largest: int) -> Iterator[tuple[int, ...]]:
    """Every multiset of positive parts <= ``largest`` summing to at most ``total``."""
    def rec(left: int, cap: int, acc: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if acc:
            yield acc
        for part in range(min(left, cap), 0, -1):
            yield from rec(left - part, part, (*acc, part))
    yield from rec(total, largest, ())


def build(num_layers: int, pipes: list[tuple[tuple[tuple[int, int], ...], int]]) -> ExecutionPlan:
    worker = 0
    pipelines = []
    for layout, m in pipes:
        stages = []
        for lo, hi in layout:
            stages.append(Stage(worker, lo, hi))
            worker += 1
        pipelines.append(Pipeline(tuple(stages), m))
    return ExecutionPlan(num_layers=num_layers, pipelines=tuple(pipelines))


def step_or_inf(planner: Planner, plan: ExecutionPlan) -> float:
    est = estimate(plan, planner.profile, planner.topology, brute_force=True)
    return est.step_s if est.memory_fits else math.inf


def dynamic_step(planner: Planner, failed: list[int]) -> float:
    decision = planner.decide(planner.initial_plan, failed, horizon_s=1e9)
    cand = next(c for c in decision.candidates if c.strategy == "dynamic")
    assert cand.feasible, cand.reason
    assert cand.plan is not None
    assert set(cand.plan.workers) <= set(planner.initial_plan.workers) - set(failed)
    return cand.step_s


def test_full_brute_force_whole_plans() -> None:
    """6 workers, 4 layers, 6 micro-batches: every whole plan priced by the estimator."""
    config = make_config(num_nodes=1, per_node=6, pp=2, dp=3, global_batch=6, num_layers=4,
                         memory_bytes=12 * GIB)
    planner = Planner(config, profile=varied_profile(4))
    survivors = 5
    num_mb = 6
    best = math.inf
    count = 0
    for lengths in partitions(survivors, 4):
        if len(lengths) > num_mb:
            continue
        layout_choices = [list(layouts(4, n)) for n in lengths]
        for split in compositions(num_mb, len(lengths)):
            for chosen in itertools.product(*layout_choices):
                plan = build(4, list(zip(chosen, split, strict=True)))
                best = min(best, step_or_inf(planner, plan))
                count += 1
    assert count == 343  # the enumeration really ran (every partition x split x layout)
    assert math.isfinite(best)
    assert dynamic_step(planner, [3]) == pytest.approx(best, rel=1e-9)


def test_whole_plan_is_at_least_its_slowest_pipeline() -> None:
    """With an ideal network a plan's step is at least its slowest pipeline's (the gradient
    all-reduce is a barrier between replicas, so it can only add): the premise of the
    per-pipeline brute force below, whose optimum is thus a lower bound on every plan."""
    config = make_config(num_nodes=1, per_node=8, pp=2, dp=4, global_batch=8, num_layers=8)
    planner = Planner(config, profile=varied_profile(8))
    for pipes in ([(((0, 3), (3, 8)), 3), (((0, 8),), 2), (((0, 2), (2, 5), (5, 8)), 3)],
                  [(((0, 4), (4, 8)), 5), (((0, 1), (1, 8)), 3)]):
        whole = step_or_inf(planner, build(8, pipes))
        parts = [step_or_inf(planner, build(8, [p])) for p in pipes]
        assert whole >= max(parts) - 1e-12


@pytest.mark.parametrize(("failed", "memory_gib"), [([0, 7], None), ([2], 9.0)])
def test_per_pipeline_brute_force(failed: list[int], memory_gib: float | None) -> None:
    """8 workers, 8 layers, 8 micro-batches: every partition of the survivors into pipeline
    lengths, every layer split and every batch split.

    Per pipeline the best layer split is taken independently; the resulting optimum is a
    lower bound on every whole plan (see the test above), so a dynamic plan whose whole-plan
    estimate reaches it is optimal."""
    config = make_config(num_nodes=2, per_node=4, pp=2, dp=4, global_batch=8, num_layers=8,
                         memory_bytes=None if memory_gib is None else memory_gib * GIB)
    planner = Planner(config, profile=varied_profile(8))
    num_layers = num_mb = 8
    survivors = 8 - len(failed)
    best_single: dict[tuple[int, int], float] = {}
    for length in range(1, min(survivors, num_layers) + 1):
        for m in range(1, num_mb + 1):
            best_single[(length, m)] = min(step_or_inf(planner, build(num_layers, [(lay, m)]))
                                           for lay in layouts(num_layers, length))
    best = math.inf
    for lengths in partitions(survivors, num_layers):
        if len(lengths) > num_mb:
            continue
        for split in compositions(num_mb, len(lengths)):
            best = min(best, max(best_single[(n, m)] for n, m in zip(lengths, split, strict=True)))
    assert math.isfinite(best)
    assert dynamic_step(planner, failed) == pytest.approx(best, rel=1e-9)


def test_partitions_restricted_above_threshold() -> None:
    """The large-job restriction: at most two distinct lengths, few idle survivors."""
    groups = dynamic.partitions_two_lengths(31, [3, 4, 5, 6])
    assert groups
    for g in groups:
        assert len(g) <= 2
        used = sum(n * c for n, c in g)
        assert used <= 31
        assert 31 - used < g[0][0] or 31 - used < g[-1][0]
    assert ((4, 7), (3, 1)) in groups
    assert ((3, 10),) in groups


def test_all_partitions_enumerates_every_multiset() -> None:
    got = set(dynamic.partitions_all(5, [1, 2, 3]))
    expected = {p for p in partitions(5, 3)}
    assert got == expected


@pytest.mark.parametrize("seed", range(8))
def test_random_small_jobs_match_whole_plan_brute_force(seed: int) -> None:
    """Random layer costs, optimizer step, memory, batch and failures; every whole plan
    (partition x layer splits x batch split) priced by the estimator. Few micro-batches and
    a long optimizer step are included: there the balanced split is not always best and
    the gradient all-reduce barrier couples the pipelines' layer splits."""
    rng = random.Random(seed)
    num_layers = rng.randint(3, 5)
    per_node = rng.choice([2, 3])
    workers = 2 * per_node
    pp = rng.choice([p for p in (1, 2, 3) if workers % p == 0 and p <= num_layers])
    dp = workers // pp
    num_mb = dp * rng.choice([1, 2])
    layers = tuple(LayerCost(name=f"l{i}", fwd_s=rng.uniform(0.05, 0.3),
                             bwd_input_s=rng.uniform(0.05, 0.3),
                             bwd_weight_s=rng.uniform(0.05, 0.3),
                             param_bytes=rng.uniform(0.2, 1.0) * GIB, optimizer_bytes=GIB,
                             activation_bytes=rng.uniform(0.1, 0.5) * GIB, output_bytes=1e6)
                   for i in range(num_layers))
    profile = Profile(layers=layers, optimizer_step_s=rng.choice([0.0, 0.05, 0.2]))
    memory = rng.choice([None, 12.0])
    config = make_config(num_nodes=2, per_node=per_node, pp=pp, dp=dp, global_batch=num_mb,
                         num_layers=num_layers,
                         memory_bytes=None if memory is None else memory * GIB)
    planner = Planner(config, profile=profile)
    assert planner.failure_free.memory_fits
    # fail workers while every layer keeps a replica
    plan = planner.initial_plan
    failed: list[int] = []
    for w in rng.sample(list(plan.workers), len(plan.workers)):
        alive = set(plan.workers) - {*failed, w}
        if {x for v in alive for x in plan.layers_by_worker[v]} == set(range(num_layers)):
            failed.append(w)
        if len(failed) >= max(1, workers // 3):
            break
    survivors = workers - len(failed)
    best = math.inf
    for lengths in partitions(survivors, num_layers):
        if len(lengths) > num_mb:
            continue
        choices = [list(layouts(num_layers, n)) for n in lengths]
        for split in compositions(num_mb, len(lengths)):
            for chosen in itertools.product(*choices):
                best = min(best, step_or_inf(planner, build(num_layers,
                                                            list(zip(chosen, split,
                                                                     strict=True)))))
    assert math.isfinite(best)
    assert dynamic_step(planner, failed) == pytest.approx(best, rel=1e-9)


def test_dynamic_is_not_slower_than_restarts_uniform_layout() -> None:
    """Regression: on the sweep job (GPT-3 1.3B, pp 4 x dp 4) one-pipeline templates ranked
    a 3x2+9x1 split first, though the all-reduce over its many splits makes it slower than
    the 5x3 layout restart picks; uniform partitions are now priced as whole plans too."""
    from pathlib import Path

    from chameleon_ft.policy import Planner
    from chameleon_ft.spec import load_config

    root = Path(__file__).resolve().parents[2]
    planner = Planner(load_config(root / "examples/scenarios/sweep.toml"))
    decision = planner.decide(planner.initial_plan, [3])
    by = {c.strategy: c for c in decision.candidates if c.feasible}
    assert by["dynamic"].step_s <= by["restart"].step_s * (1 + 1e-9)


def test_a_returned_worker_gets_a_placement_as_fast_as_the_jobs_own() -> None:
    # The sweep's job: 2 nodes x 8, pp 4 x dp 4 stage-major (each stage's 4 replicas on
    # one node, so its all-reduce stays inside it). Re-planning over all 16 after a
    # failure and the repair used to place by the fewest bytes moved, scattering stages
    # over both nodes: 1.5% slower at every step for the rest of the run.
    config = load_config(Path(__file__).parents[2] / "examples" / "scenarios" / "sweep.toml")
    planner = Planner(config)
    initial = planner.initial_plan
    week = 7 * 86400.0
    degraded = planner.decide(initial, [5], policy="dynamic", horizon_s=week).plan
    assert degraded is not None and 5 not in degraded.workers
    back = planner.decide_rejoin(degraded, [5], policy="dynamic", horizon_s=week).plan
    assert back is not None and 5 in back.workers
    job = planner.estimate(initial).throughput_samples_s
    assert planner.estimate(back).throughput_samples_s >= job * (1 - 1e-9)
    topology = planner.recovery_state(back, back.workers).topology
    assert len(fatal_nodes(back, topology)) <= len(fatal_nodes(initial, topology))


@pytest.mark.parametrize("example", ["paper32", "scenarios/sweep"])
def test_search_splits_micro_batches_as_the_moves_do(
        example: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search's exact splits (found from the optimum with the step times the
    templates already priced) give the plans the moves alone gave, failure by failure."""
    from chameleon_ft.recovery import allocation

    config = load_config(Path(__file__).parents[2] / "examples" / f"{example}.toml")
    plan = Planner(config).initial_plan
    node_of_five = [w for w in plan.workers if w // config.workers_per_node
                    == 5 // config.workers_per_node]
    failures = [[5], [0], [5, 6], [3, 30 % len(plan.workers)], node_of_five]

    def results() -> list[tuple[object, ...]]:
        planner = Planner(config)  # fresh templates: nothing remembered between runs
        out = []
        for failed in failures:
            state = planner.recovery_state(plan, set(plan.workers) - set(failed))
            if state.missing_layers():
                continue  # a node holding a whole stage: only a restart
            found = dynamic.search(state)
            assert found is not None
            out.append((found.plan, found.estimate.step_s, found.lengths,
                        found.migration.moved_bytes))
        return out

    fast = results()
    assert len(fast) >= 4
    monkeypatch.setattr(dynamic, "allocate",
                        lambda layouts, total, step_s, known=None:
                        allocation.allocate_by_moves(layouts, total, step_s))
    assert results() == fast


def test_intact_pipelines_are_counted_by_length_in_order_of_first_intact_one() -> None:
    """Pipelines that lost nothing (no rerouted stage, every stage worker alive), counted
    by length in the order their lengths first appear among them: as a walk over every
    pipeline counts them, on mixed lengths, reroutes and dead workers."""
    planner = Planner(load_config(Path(__file__).parents[2] / "examples" / "paper32.toml"))
    layers = planner.initial_plan.num_layers
    rng = random.Random(3)
    for _ in range(20):
        lengths = [rng.choice([2, 4]) for _ in range(6)]
        pipelines, worker = [], 0
        for n in lengths:
            bounds = [round(layers * k / n) for k in range(n + 1)]
            pipelines.append(Pipeline(tuple(Stage(worker + s, bounds[s], bounds[s + 1])
                                            for s in range(n)), 4))
            worker += n
        plan = ExecutionPlan(num_layers=layers, pipelines=tuple(pipelines))
        rerouted = frozenset(rng.sample(plan.workers, rng.choice([0, 1])))
        if rerouted and lengths.count(len(plan.pipelines[plan.stage_of_worker[
                next(iter(rerouted))][0]].stages)) > 1:  # a peer of its layout exists
            plan = reroute_plan(plan, rerouted)
        else:
            rerouted = frozenset()
        dead = rerouted | frozenset(rng.sample(plan.workers, rng.choice([0, 1, 2])))
        alive = frozenset(range(worker)) - dead
        state = planner.recovery_state(plan, alive)
        expected: dict[int, int] = {}
        for p, pipe in enumerate(plan.pipelines):
            hit = any((p, s) in plan.reroute_map for s in range(pipe.num_stages))
            if not hit and all(w in alive for w in pipe.workers):
                expected[pipe.num_stages] = expected.get(pipe.num_stages, 0) + 1
        found = dynamic._intact_lengths(state)
        assert found == expected and list(found) == list(expected)
