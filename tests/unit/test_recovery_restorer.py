"""The restorer: Hungarian matching against brute force, and the migration schedule."""

from __future__ import annotations

import itertools
import pickle
from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.perf import Topology
from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.plan.pipeline import pipeline_on, placeholder_pipeline
from chameleon_ft.plan.tables import indices_by_object
from chameleon_ft.profile import uniform_profile
from chameleon_ft.recovery import match_workers, schedule_migration
from chameleon_ft.recovery.restorer import _by_rows, assign_workers
from chameleon_ft.recovery.types import Migration
from chameleon_ft.spec.cluster import ClusterSpec


def brute_force_moved(held: list[set[int]], wanted: list[set[int]],
                      layer_bytes: list[int]) -> float:
    best = float("inf")
    for rows in itertools.permutations(range(len(held)), len(wanted)):
        cost = sum(layer_bytes[x] for j, i in enumerate(rows) for x in wanted[j] - held[i])
        best = min(best, cost)
    return best


layer_sets = st.sets(st.integers(0, 5), max_size=4)


@settings(max_examples=100, deadline=None)
@given(held=st.lists(layer_sets, min_size=1, max_size=6),
       wanted_count=st.integers(1, 6),
       wanted_pool=st.lists(st.sets(st.integers(0, 5), min_size=1, max_size=4), min_size=6,
                            max_size=6),
       layer_bytes=st.lists(st.integers(1, 100), min_size=6, max_size=6))
def test_matching_equals_brute_force(held: list[set[int]], wanted_count: int,
                                     wanted_pool: list[set[int]], layer_bytes: list[int]) -> None:
    wanted = wanted_pool[:min(wanted_count, len(held))]
    result = match_workers(held, wanted, layer_bytes)
    assert result.moved_bytes == brute_force_moved(held, wanted, layer_bytes)
    # a proper assignment: every slot once, every survivor at most once
    assert sorted(result.assignment.values()) == list(range(len(wanted)))
    assert len(set(result.assignment)) == len(result.assignment)
    recomputed = sum(layer_bytes[x] for i, j in result.assignment.items()
                     for x in wanted[j] - held[i])
    assert recomputed == result.moved_bytes


def test_matching_prefers_exact_holders() -> None:
    held = [{0, 1}, {2, 3}, {4, 5}, set()]
    wanted = [{2, 3}, {0, 1, 2}, {4, 5}]
    result = match_workers(held, wanted, [10] * 6)
    assert result.assignment[1] == 0 and result.assignment[2] == 2
    assert result.moved_bytes == 10  # survivor 0 adds layer 2


def test_matching_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="wanted"):
        match_workers([{0}], [{0}, {1}], [1, 1])
    with pytest.raises(ValueError, match=r"held\[0\]"):
        match_workers([{7}], [{0}], [1, 1])


def _topology() -> Topology:
    cluster = ClusterSpec(num_nodes=2, devices_per_node=4, intra_node_gb_per_s=100.0,
                          inter_node_gb_per_s=10.0)
    return Topology(cluster=cluster, workers_per_node=4)


def test_migration_schedule_is_conflict_free_and_complete() -> None:
    profile = uniform_profile(8, param_bytes=1e9, optimizer_bytes=2e9)
    topo = _topology()
    # before: two pipelines of 4 stages (2 layers each); worker 3 died
    held = {0: range(0, 2), 1: range(2, 4), 2: range(4, 6),
            4: range(0, 2), 5: range(2, 4), 6: range(4, 6), 7: range(6, 8)}
    # after: one 4-stage pipeline kept, and a 3-stage pipeline re-formed from 0, 1, 2
    plan = ExecutionPlan(num_layers=8, pipelines=(
        Pipeline((Stage(4, 0, 2), Stage(5, 2, 4), Stage(6, 4, 6), Stage(7, 6, 8)), 4),
        Pipeline((Stage(0, 0, 3), Stage(1, 3, 6), Stage(2, 6, 8)), 2)))
    plan.validate()
    mig = schedule_migration(plan, held, profile, topo, max_parts=2)
    # every missing layer arrives in full
    got: dict[tuple[int, int], float] = defaultdict(float)
    for t in mig.transfers:
        got[(t.dst, t.layer)] += t.num_bytes
        assert t.layer in held[t.src]
        assert 1 <= t.num_parts <= 2 and 0 <= t.part < t.num_parts
    expected = {(0, 2), (1, 4), (1, 5), (2, 6), (2, 7)}
    assert set(got) == expected
    for value in got.values():
        assert value == pytest.approx(3e9)
    assert mig.moved_bytes == pytest.approx(5 * 3e9)
    # rounds cover each transfer once and no worker sends or receives twice in a round
    flat = sorted(i for r in mig.rounds for i in r)
    assert flat == list(range(len(mig.transfers)))
    for r in mig.rounds:
        senders = [mig.transfers[i].src for i in r]
        receivers = [mig.transfers[i].dst for i in r]
        assert len(set(senders)) == len(senders)
        assert len(set(receivers)) == len(receivers)
    # time = sum over rounds of the slowest transfer
    expected_s = sum(max(topo.p2p_s(mig.transfers[i].src, mig.transfers[i].dst,
                                    mig.transfers[i].num_bytes) for i in r) for r in mig.rounds)
    assert mig.time_s == pytest.approx(expected_s)
    assert {s[0] for s in mig.slots} == {0, 1, 2, 4, 5, 6, 7}


def test_migration_fails_without_replica() -> None:
    profile = uniform_profile(2, param_bytes=1.0)
    plan = ExecutionPlan(num_layers=2, pipelines=(Pipeline((Stage(0, 0, 2),), 1),))
    with pytest.raises(ValueError, match="layer 1 has no live replica"):
        schedule_migration(plan, {0: range(0, 1)}, profile, _topology())


@settings(max_examples=60, deadline=None)
@given(held=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=7),
       wanted=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3)), min_size=1,
                       max_size=7))
def test_matching_reads_ranges_as_the_sets_they_hold(held: list[tuple[int, int]],
                                                    wanted: list[tuple[int, int]]) -> None:
    # survivors (and slots) given as range objects, some of them shared, match exactly as
    # the same layers given as sets
    wanted = wanted[:len(held)]
    ranges = {b: range(b[0], min(6, b[0] + b[1])) for b in set(held) | set(wanted)}
    as_ranges = match_workers([ranges[b] for b in held], [ranges[b] for b in wanted],
                              [1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    as_sets = match_workers([set(ranges[b]) for b in held], [set(ranges[b]) for b in wanted],
                            [1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    assert as_ranges == as_sets


@pytest.mark.parametrize("dead", [0, 5, 11, 14])
def test_assigned_pipelines_are_the_source_plans_where_equal(dead: int) -> None:
    # Five pipelines of three stages; one worker dies and four pipelines are re-formed from
    # the survivors: with the source plan given, every new pipeline equal to one of its
    # pipelines is that very object, and the plan and bytes moved are those without it.
    layout = ((0, 2), (2, 4), (4, 6))
    source = ExecutionPlan(num_layers=6, pipelines=tuple(
        pipeline_on(layout, 4, range(3 * p, 3 * p + 3)) for p in range(5)))
    skeleton = ExecutionPlan(num_layers=6, pipelines=tuple(
        placeholder_pipeline(layout, 5, p * 3) for p in range(4)))
    held = {w: layers for w, layers in source.layers_by_worker.items() if w != dead}
    skeleton_4mb = replace(skeleton, pipelines=tuple(
        placeholder_pipeline(layout, 4, p * 3) for p in range(4)))
    for shape in (skeleton, skeleton_4mb):
        plain, moved = assign_workers(shape, held, [1.0] * 6)
        reused, moved_reused = assign_workers(shape, held, [1.0] * 6, source)
        assert reused == plain and moved_reused == moved
        equal = [pipe for pipe in plain.pipelines if pipe in source.pipelines]
        kept = [pipe for pipe in reused.pipelines
                if any(pipe is old for old in source.pipelines)]
        assert len(kept) == len(equal)
        # five micro-batches match no pipeline; four do wherever the matching kept one
        # (the survivors of a pipeline before the dead one's keep their stages)
        if shape is skeleton:
            assert not kept
        else:
            assert len(kept) == {0: 0, 5: 1, 11: 3, 14: 4}[dead]


def test_a_migrations_slots_are_listed_when_read() -> None:
    """A scheduled migration lists its plan's live slots only when first read: the same
    slots as listed eagerly, and it compares, hashes, pickles and serialises as the eager
    :class:`Migration` with the same fields."""
    profile = uniform_profile(8, param_bytes=1e9, optimizer_bytes=2e9)
    held = {0: range(0, 2), 1: range(2, 4), 2: range(4, 6),
            4: range(0, 2), 5: range(2, 4), 6: range(4, 6), 7: range(6, 8)}
    plan = ExecutionPlan(num_layers=8, pipelines=(
        Pipeline((Stage(4, 0, 2), Stage(5, 2, 4), Stage(6, 4, 6), Stage(7, 6, 8)), 4),
        Pipeline((Stage(0, 0, 3), Stage(1, 3, 6), Stage(2, 6, 8)), 2)))
    lazy = schedule_migration(plan, held, profile, _topology())
    assert "slots" not in vars(lazy)
    expected = ((4, 0, 0), (5, 0, 1), (6, 0, 2), (7, 0, 3), (0, 1, 0), (1, 1, 1), (2, 1, 2))
    eager = Migration(slots=expected, moved_bytes=lazy.moved_bytes,
                      transfers=lazy.transfers, rounds=lazy.rounds, time_s=lazy.time_s)
    assert lazy.slots == expected and lazy.slots is lazy.slots
    assert lazy == eager and eager == lazy and hash(lazy) == hash(eager)
    assert lazy != replace(eager, time_s=eager.time_s + 1.0)
    assert pickle.loads(pickle.dumps(lazy)) == eager
    assert lazy.to_dict() == eager.to_dict()


def _one_by_one(sets: list[range]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, obj in enumerate(sets):
        out.setdefault(id(obj), []).append(i)
    return out


@settings(max_examples=80, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30)), min_size=0,
                     max_size=12),
       rows=st.lists(st.tuples(st.sampled_from([(0, 1, 2), (2, 1, 0), (3, 1), (0, 0, 1)]),
                               st.integers(1, 4)), min_size=0, max_size=8))
def test_objects_are_indexed_in_runs_as_one_by_one(runs: list[tuple[int, int]],
                                                   rows: list[tuple[tuple[int, ...], int]]
                                                   ) -> None:
    # long runs of one object (survivors in id order) and short ones alike, and pipelines'
    # range rows in runs of one row object (a row naming an object twice included): the
    # indices of each object, in order of first appearance, are the one-by-one ones
    objects = [range(k, k + 2) for k in range(4)]
    sets = [objects[k] for k, n in runs for _ in range(n)]
    by_object = indices_by_object(sets)
    assert list(by_object.items()) == list(_one_by_one(sets).items())
    row_objects = {shape: tuple(objects[k] for k in shape) for shape, _ in rows}
    chained_rows = [row_objects[shape] for shape, n in rows for _ in range(n)]
    chained = list(itertools.chain.from_iterable(chained_rows))
    assert list(_by_rows(chained_rows).items()) == list(_one_by_one(chained).items())


@pytest.mark.parametrize("per_node", [1, 2, 8])
def test_sources_are_ranked_as_sorting_them_all(per_node: int) -> None:
    """A migration's sources of a layer are the first of all its live replicas by (on
    another node than the receiver, bytes sent so far, worker id), as a full sort ranks
    them, whatever the replicas, the receiver and the bytes already sent (zero included)."""
    import random

    from chameleon_ft.recovery.restorer import _first_sources

    rng = random.Random(per_node)
    cluster = ClusterSpec(num_nodes=64 // per_node, devices_per_node=per_node,
                          intra_node_gb_per_s=100.0, inter_node_gb_per_s=10.0)
    topology = Topology(cluster=cluster, workers_per_node=per_node)
    for _ in range(300):
        sources = sorted(rng.sample(range(64), rng.randint(1, 40)))
        dst = rng.randrange(64)
        sent = {w: rng.choice([0.0, 1.0, 2.5, 7.0]) for w in rng.sample(range(64), 12)}
        parts = rng.randint(1, min(4, len(sources)))
        ranked = sorted(sources, key=lambda w: (w // per_node != dst // per_node,
                                                sent.get(w, 0.0), w))[:parts]
        assert _first_sources(sources, parts, dst // per_node, sent, topology) == ranked
