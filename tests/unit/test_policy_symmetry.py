"""Failures that differ only by which identical pipeline they hit share one cached answer."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from chameleon_ft.perf import Bucket, Topology
from chameleon_ft.perf.estimator import Breakdown, Estimate, Estimator
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.policy import Planner
from chameleon_ft.policy.renaming import _Inverse, _rename_estimate, _rename_migration, rename_plan
from chameleon_ft.policy.symmetry import canonical_renaming
from chameleon_ft.recovery.reroute import rerouted_plan
from chameleon_ft.recovery.types import Migration, Strategy, Transfer
from chameleon_ft.spec import ClusterSpec, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_equivalent_failures_are_one_cache_entry_renamed_back() -> None:
    planner = Planner(load_config(ROOT / "examples/paper32.toml"))
    plan = planner.initial_plan
    first = planner.decide(plan, [5])  # stage 0 of pipeline 5
    second = planner.decide(plan, [6])  # stage 0 of pipeline 6: the same problem renamed
    assert not first.cache_hit and second.cache_hit
    for a, b in zip(first.candidates, second.candidates, strict=True):
        assert (a.strategy, a.feasible) == (b.strategy, b.feasible)
        assert a.step_s == pytest.approx(b.step_s)
        # the only difference: the second decision's search was already done (hidden)
        assert {k: v for k, v in a.terms.items() if k != "search_s"} == pytest.approx(
            {k: v for k, v in b.terms.items() if k != "search_s"})
    for c in second.candidates:
        if c.plan is None:
            continue
        c.plan.validate(num_microbatches=plan.num_microbatches)
        assert 6 not in c.plan.workers
        if c.migration is not None:
            assert all(6 not in (t.src, t.dst) for t in c.migration.transfers)
        if c.estimate is not None:
            assert set(c.estimate.peak_memory_bytes) == set(c.plan.workers)
    assert second.strategy == first.strategy
    # the renamed plan estimates the same as a direct computation would
    direct = Planner(load_config(ROOT / "examples/paper32.toml")).decide(plan, [6])
    assert direct.chosen.step_s == pytest.approx(second.chosen.step_s)


def test_renaming_only_where_the_node_structure_allows() -> None:
    plan = ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=4,
                                 placement="pipeline-major")
    # pipeline-major on nodes of 2 workers: each node holds one whole pipeline
    topo = Topology(ClusterSpec(num_nodes=2, devices_per_node=2), 2)
    renaming = canonical_renaming(plan, frozenset({3}), frozenset({0, 1, 2}), topo)
    assert renaming == {2: 0, 3: 1, 0: 2, 1: 3}
    assert rename_plan(plan, renaming).workers == plan.workers
    # stage-major dp 3 x pp 2 on nodes of 2 workers: nodes {0,1} {2,3} {4,5} mix pipelines,
    # and moving pipeline 2 first would split node {0,1}: refused
    mixed = ExecutionPlan.uniform(dp=3, pp=2, num_layers=4, num_microbatches=6)
    nodes_of_two = Topology(ClusterSpec(num_nodes=3, devices_per_node=2), 2)
    assert canonical_renaming(mixed, frozenset({5}), frozenset({0, 1, 2, 3, 4}),
                              nodes_of_two) is None
    # one worker per node: any pipeline order keeps the node structure
    one_each = Topology(ClusterSpec(num_nodes=6, devices_per_node=1), 1)
    renaming = canonical_renaming(mixed, frozenset({5}), frozenset({0, 1, 2, 3, 4}), one_each)
    # pipeline 2 (workers 2, 5) trades places with pipeline 0 (workers 0, 3)
    assert renaming == {2: 0, 5: 3, 0: 2, 3: 5}
    # idle workers or reroutes: no renaming
    assert canonical_renaming(plan, frozenset({3}), frozenset({0, 1}), topo) is None
    # pipeline-major dp 4 x pp 2 on nodes of 4 workers: pipelines (0, 1) and (2, 3) share
    # node 0. Moving pipeline 2 (workers 4, 5) first would put workers 0, 1 on node 1 and
    # leave 2, 3 on node 0: the nodes map one to one, but node 0 is split, so it is refused
    halves = ExecutionPlan.uniform(dp=4, pp=2, num_layers=4, num_microbatches=8,
                                   placement="pipeline-major")
    nodes_of_four = Topology(ClusterSpec(num_nodes=2, devices_per_node=4), 4)
    assert canonical_renaming(halves, frozenset({5}), frozenset(range(8)) - {5},
                              nodes_of_four) is None


def test_an_answer_to_a_pipeline_sharing_a_node_is_the_direct_one() -> None:
    """Pipelines that share nodes with others (pipeline-major, two per node): a failure of
    a pipeline that is not first is answered as a direct computation answers it (the
    rerouted micro-batches go to the peer on the failed worker's node, not to the one on
    the node of the pipeline it would have been renamed to), priced as its own plan."""
    config = load_config(ROOT / "examples/paper32.toml")
    planner = Planner(config)
    first = planner.initial_plan
    plan = ExecutionPlan.uniform(dp=config.job.dp, pp=config.job.pp,
                                 num_layers=first.num_layers,
                                 num_microbatches=first.num_microbatches,
                                 placement="pipeline-major")
    decision = planner.decide(plan, [9])  # stage 1 of pipeline 2, on node 1 with pipeline 3
    rerouted = next(c for c in decision.candidates if c.strategy == Strategy.RECYCLE)
    state = planner.recovery_state(plan, frozenset(plan.workers) - {9})
    direct = rerouted_plan(state, defer=True)
    assert not isinstance(direct, str) and rerouted.plan is not None
    assert rerouted.plan.reroutes == direct[0].reroutes
    assert rerouted.step_s == Estimator(planner.profile, planner.topology).estimate(
        rerouted.plan).step_s


def test_a_renamed_answer_names_the_tied_sum_s_workers_as_a_direct_one() -> None:
    """A tied head: each cached estimate's all-reduce group of the copies is renamed with
    its plan, so it never names the failed worker and matches a direct computation."""
    base = load_config(ROOT / "examples/paper32.toml")
    assert base.model is not None
    config = dataclasses.replace(base, model=dataclasses.replace(base.model,
                                                                 tied_embeddings=True))
    planner = Planner(config)
    plan = planner.initial_plan
    planner.decide(plan, [5])
    second = planner.decide(plan, [6])
    direct = Planner(config).decide(plan, [6])
    assert second.cache_hit and not direct.cache_hit
    tied = [(a.estimate, b.estimate) for a, b in zip(second.candidates, direct.candidates,
                                                     strict=True)
            if a.estimate is not None and b.estimate is not None]
    assert tied and all(a.tie_workers for a, _ in tied)
    for renamed, computed in tied:
        assert 6 not in renamed.tie_workers
        assert renamed.tie_workers == computed.tie_workers
        assert renamed.step_s == pytest.approx(computed.step_s)


def test_a_lazily_renamed_estimate_and_migration_read_as_eager_copies() -> None:
    """Renaming back is deferred to the first read of a per-worker field: every field,
    read first or after pickling or ``replace``, is the renamed value, and the copy
    compares equal to an eagerly built one."""
    bucket = Bucket((0, 1), (0,))
    est = Estimate(1.0, 2.0, 3.0, 0.1, {0: 1.0, 1: 2.0}, 2.0, 10.0, True,
                   Breakdown(1.0, 0.0, 0.0, 0.0, 0.0), ((bucket,),), (0, 1))
    migration = Migration(((0, 0, 0), (1, 0, 1)), 5.0, (Transfer(0, 0, 1, 0, 1, 5.0),),
                          ((0,),), 1.0)
    renaming = {0: 7}
    eager_est = dataclasses.replace(est, peak_memory_bytes={7: 1.0, 1: 2.0},
                                    sync_rounds=((Bucket((1, 7), (0,)),),), tie_workers=(1, 7))
    eager_migration = dataclasses.replace(migration, slots=((7, 0, 0), (1, 0, 1)),
                                          transfers=(Transfer(0, 7, 1, 0, 1, 5.0),))
    # a field with a class default read first is renamed, not the default
    assert _rename_estimate(est, renaming).tie_workers == (1, 7)
    assert _rename_migration(migration, renaming).transfers == eager_migration.transfers
    for lazy, eager in ((_rename_estimate(est, renaming), eager_est),
                        (_rename_migration(migration, renaming), eager_migration)):
        assert lazy == eager and eager == lazy
        assert pickle.loads(pickle.dumps(lazy)) == eager
        assert dataclasses.replace(lazy, time_s=1.0) == eager if isinstance(
            eager, Migration) else dataclasses.replace(lazy, step_s=1.0) == eager
    assert _rename_estimate(est, renaming) != est
    assert hash(_rename_migration(migration, {})) == hash(migration)


def test_a_renaming_back_read_by_index_reads_as_its_dict() -> None:
    back = (3, 0, 2, 1)
    inverse = _Inverse(back)
    as_dict = dict(enumerate(back))
    assert dict(inverse) == as_dict and len(inverse) == 4
    for k in (-1, 0, 3, 4, 7):
        assert inverse.get(k, k) == as_dict.get(k, k)
        assert (k in inverse) == (k in as_dict)
    with pytest.raises(KeyError):
        inverse[4]
    assert rename_plan(ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=4),
                       inverse).worker_rows() == [(3, 2), (0, 1)]
