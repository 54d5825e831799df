"""A plan's kept tables and shared objects (plan/plan.py) against their definitions, on
random plans with uneven pipelines, shuffled workers and rerouted stages."""

from __future__ import annotations

import random

import pytest
from plan_shapes import even_pipelines

from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.plan.pipeline import shared_stage
from chameleon_ft.plan.plan import sharing_stages
from chameleon_ft.plan.reroute import reroute_plan


def random_plan(rng: random.Random) -> ExecutionPlan:
    """Pipelines of random lengths (some alike), workers shuffled, some stages rerouted
    when a live replica of theirs remains."""
    num_layers = rng.randint(4, 12)
    lengths = [rng.choice([2, 3, 4]) for _ in range(rng.randint(2, 7))]
    pipes = even_pipelines(num_layers, lengths, rng.randint(1, 4))
    workers = list(range(sum(lengths) + rng.randint(0, 5)))
    rng.shuffle(workers)
    it = iter(workers)
    plan = ExecutionPlan(num_layers=num_layers, pipelines=tuple(
        Pipeline(tuple(Stage(next(it), st.first_layer, st.end_layer) for st in p.stages),
                 p.num_microbatches) for p in pipes))
    plan.validate()
    for _ in range(rng.randint(0, 3)):
        dead = set(plan.dead_workers) | {rng.choice(plan.workers)}
        try:
            plan = reroute_plan(plan, dead)
        except ValueError:
            break  # the stage had no live replica left
    plan.validate()
    return plan


def live_stages(plan: ExecutionPlan) -> list[tuple[int, int, Stage]]:
    dead = {(r.pipeline, r.stage) for r in plan.reroutes}
    return [(p, s, st) for p, s, st in plan.iter_stages() if (p, s) not in dead]


@pytest.mark.parametrize("seed", range(8))
def test_tables_are_their_definitions(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        plan = random_plan(rng)
        live = live_stages(plan)
        holders = tuple(tuple(sorted(st.worker for _, _, st in live if layer in st.layers))
                        for layer in range(plan.num_layers))
        assert plan.holders_by_layer == holders
        # the all-reduce buckets: each distinct holders tuple's layers, in layer order
        buckets: dict[tuple[int, ...], list[int]] = {}
        for layer, h in enumerate(holders):
            buckets.setdefault(h, []).append(layer)
        assert list(plan.layers_by_holders.items()) == list(buckets.items())
        # validation keeps its worker table: the same pairs, in the same order
        fresh = ExecutionPlan(num_layers=plan.num_layers, pipelines=plan.pipelines,
                              reroutes=plan.reroutes)
        assert list(plan.stage_of_worker.items()) == [(st.worker, (p, s)) for p, s, st in live]
        assert list(fresh.stage_of_worker.items()) == list(plan.stage_of_worker.items())
        for per_node in (1, 2, 3):
            nodes_of_layer = [{w // per_node for w in h} for h in holders]
            fatal = {next(iter(n)) for n in nodes_of_layer if len(n) == 1}
            assert plan.fatal_nodes(per_node) == frozenset(fatal)


@pytest.mark.parametrize("seed", range(4))
def test_pipelines_compare_and_hash_by_their_stages(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        a = random_plan(rng).pipelines[0]
        stages = [Stage(st.worker, st.first_layer, st.end_layer) for st in a.stages]
        same = Pipeline(tuple(stages), a.num_microbatches)
        assert same == a and hash(same) == hash(a)
        assert Pipeline(tuple(shared_stage(st.worker, st.first_layer, st.end_layer)
                              for st in a.stages), a.num_microbatches) == a
        assert Pipeline(tuple(stages), a.num_microbatches + 1) != a
        moved = list(stages)
        last = moved[-1]
        moved[-1] = Stage(last.worker + 1000, last.first_layer, last.end_layer)
        assert Pipeline(tuple(moved), a.num_microbatches) != a
        if len(stages) > 1 and stages[0].num_layers > 1:
            first, second = stages[0], stages[1]
            recut = [Stage(first.worker, first.first_layer, first.end_layer - 1),
                     Stage(second.worker, second.first_layer - 1, second.end_layer),
                     *stages[2:]]
            assert Pipeline(tuple(recut), a.num_microbatches) != a
    assert shared_stage(3, 0, 2) is shared_stage(3, 0, 2) == Stage(3, 0, 2)


def test_sharing_stages_takes_the_source_pipelines() -> None:
    source = ExecutionPlan(num_layers=6, pipelines=even_pipelines(6, [3, 3, 2], 2))
    twin = [Pipeline(tuple(Stage(st.worker, st.first_layer, st.end_layer) for st in p.stages),
                     p.num_microbatches) for p in source.pipelines]
    twin[1] = Pipeline(twin[1].stages, 3)  # same stages, other micro-batches
    twin[2] = Pipeline(tuple(Stage(st.worker + 100, st.first_layer, st.end_layer)
                             for st in twin[2].stages), 2)  # other workers
    plan = sharing_stages(ExecutionPlan(num_layers=6, pipelines=tuple(twin)), source)
    assert plan.pipelines[0] is source.pipelines[0]
    assert plan.pipelines[1].stages is source.pipelines[1].stages
    assert plan.pipelines[1].num_microbatches == 3
    assert plan.pipelines[2] is twin[2]
    assert plan == ExecutionPlan(num_layers=6, pipelines=tuple(twin))


@pytest.mark.parametrize("seed", range(4))
def test_plans_sharing_their_pipelines_read_one_kept_table(seed: int) -> None:
    """A plan and its reroutes share their pipelines: each plan's worker tables are the
    kept table of every stage without that plan's own dead workers, equal (items and
    order) to the tables of the same plan built on a copy of the pipelines, whichever
    plan of the family asked first; a plan naming a worker twice is still refused."""
    rng = random.Random(seed)
    for _ in range(10):
        plan = random_plan(rng)
        family = [ExecutionPlan(num_layers=plan.num_layers, pipelines=plan.pipelines,
                                reroutes=plan.reroutes[:k])
                  for k in range(len(plan.reroutes) + 1)]
        rng.shuffle(family)
        for member in family:
            alone = ExecutionPlan(num_layers=member.num_layers,
                                  pipelines=tuple(list(member.pipelines)),
                                  reroutes=member.reroutes)
            assert alone.pipelines is not member.pipelines
            dead = member.dead_workers
            live = [(st.worker, (p, s), st.layers) for p, s, st in member.iter_stages()
                    if st.worker not in dead]
            assert list(member.stage_of_worker.items()) == [(w, at) for w, at, _ in live]
            assert list(member.layers_by_worker.items()) == [(w, r) for w, _, r in live]
            assert list(alone.stage_of_worker.items()) == list(member.stage_of_worker.items())
            assert list(alone.layers_by_worker.items()) == list(member.layers_by_worker.items())
    first = plan.pipelines[0]
    twice = ExecutionPlan(num_layers=plan.num_layers, pipelines=(first, first))
    with pytest.raises(ValueError, match=r"twice|more than once"):
        twice.validate()


def test_pipelines_built_afresh_compare_by_their_stages() -> None:
    """Equality reads the pipelines' tables, built on first use: two pipelines fresh from
    the constructor (no table, no hash yet) are equal exactly when their stages and
    micro-batches are, whichever is compared first."""
    for first, second, equal in (
            (((0, 0, 2), (1, 2, 4)), ((0, 0, 2), (1, 2, 4)), True),
            (((0, 0, 2), (1, 2, 4)), ((0, 0, 2), (2, 2, 4)), False),
            (((0, 0, 2), (1, 2, 4)), ((0, 0, 3), (1, 3, 4)), False)):
        a = Pipeline(tuple(Stage(*st) for st in first), 2)
        b = Pipeline(tuple(Stage(*st) for st in second), 2)
        assert (a == b) is equal and (b == a) is equal
        assert (Pipeline(a.stages, 2) == Pipeline(a.stages, 3)) is False


@pytest.mark.parametrize("seed", range(4))
def test_distinct_holders_make_the_set_of_every_layers_holders(seed: int) -> None:
    """The all-reduce buckets are charged in the order of ``set(holders_by_layer)``; the
    distinct tuples added one by one in first-layer order make that very set, in that very
    order (a repeated insertion changes nothing), so the transition hashes each once."""
    rng = random.Random(seed)
    for _ in range(200):
        plan = random_plan(rng)
        assert list(set(list(plan.layers_by_holders))) == list(set(plan.holders_by_layer))
