"""Warm spares and checkpoints in memory: the ``swap`` strategy, the reload's source and
price, and how the planner chooses with idle workers (recovery/swap.py,
recovery/transition.py, policy/planner.py)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.policy import Planner
from chameleon_ft.recovery import Strategy, swap
from chameleon_ft.recovery.transition import (
    layers_lost_from_memory,
    memory_load_s,
    restart_terms,
)
from chameleon_ft.recovery.types import CheckpointSource, RecoveryState
from chameleon_ft.spec.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
JOB = 32  # paper32: 4 nodes x 8 workers, stage-major (node s holds stage s of every pipeline)


def paper32(spare_nodes: int = 0, **recovery: object) -> Config:
    config = load_config(ROOT / "examples" / "paper32.toml")
    return replace(config, cluster=replace(config.cluster, spare_nodes=spare_nodes),
                   recovery=replace(config.recovery, **recovery))


@pytest.fixture(scope="module")
def spares() -> Planner:
    """paper32 with one spare node (workers 32..39)."""
    return Planner(paper32(1))


@pytest.fixture(scope="module")
def in_memory() -> Planner:
    """paper32 with one spare node and checkpoints in memory."""
    return Planner(paper32(1, memory_checkpoint=True))


def state_after(planner: Planner, failed: set[int], *, idle: set[int] | None = None
                ) -> RecoveryState:
    """The failure-free plan after ``failed`` died, the spare nodes' workers idle (or
    ``idle``)."""
    plan = planner.initial_plan
    if idle is None:
        idle = set(range(JOB, planner.config.total_workers))
    return planner._state(plan, frozenset((set(plan.workers) | idle) - failed), None)


def test_a_spare_takes_the_failed_slot_of_the_same_plan(spares: Planner) -> None:
    state = state_after(spares, {5})
    (c,) = swap.candidates(state, frozenset({5}))
    assert c.feasible and c.strategy == Strategy.SWAP and c.rollback is None
    old, new = state.plan, c.plan
    assert new is not None and c.migration is not None
    p, s = old.stage_of_worker[5]
    spare = new.pipelines[p].stages[s].worker
    assert spare >= JOB  # a spare node's worker
    for q, pipe in enumerate(new.pipelines):
        assert pipe.layout == old.pipelines[q].layout
        assert pipe.num_microbatches == old.pipelines[q].num_microbatches
        if q != p:
            assert pipe is old.pipelines[q]  # untouched pipelines are the very objects
    assert {st.worker for _, _, st in new.iter_stages()} == set(old.workers) - {5} | {spare}
    # the spare copies exactly its slot's layers, each from a live same-stage replica
    layers = old.layers_by_worker[5]
    assert {t.layer for t in c.migration.transfers} == set(layers)
    for t in c.migration.transfers:
        assert t.dst == spare and t.src in state.alive and t.layer in old.layers_by_worker[t.src]
    assert c.migration.moved_bytes == pytest.approx(
        sum(state.profile.layers[i].state_bytes for i in layers))
    assert (spare, p, s) in c.migration.slots
    assert {"detect_s", "comm_s", "build_s", "warmup_s", "lost_step_s",
            "migrate_s"} <= set(c.terms)
    assert c.terms["build_s"] > 0 and c.terms["warmup_s"] == pytest.approx(c.step_s)


def test_a_node_failure_lands_on_the_idlest_spare_node(spares: Planner) -> None:
    plan = spares.initial_plan
    topology = spares.topology
    node1 = list(topology.workers_of_node(1))
    slots = swap.dead_slots(plan, set(range(JOB + 16)) - set(node1))
    # node 4 has only two idle workers left, node 5 all eight: the node's slots go there
    idle = [38, 39, *range(40, 48)]
    assignment = swap.assign_spares(plan, slots, idle, replace(topology, cluster=replace(
        topology.cluster, spare_nodes=2)))
    assert assignment is not None and len(assignment) == 8
    assert sorted(assignment.values()) == list(range(40, 48))
    # too few idle workers: no swap
    assert swap.assign_spares(plan, slots, idle[:7], topology) is None


def test_a_returned_worker_takes_its_own_stage_back(spares: Planner) -> None:
    rerouted = reroute_plan(spares.initial_plan, {5})
    # worker 5 came back (idle), then 6 died: 5 takes back its stage, a spare takes 6's
    alive = (set(rerouted.workers) | {5, *range(JOB, 40)}) - {6}
    state = spares._state(rerouted, frozenset(alive), None)
    (c,) = swap.candidates(state, frozenset({6}))
    assert c.feasible and c.plan is not None and not c.plan.reroutes
    where = rerouted.pipelines
    p5, s5 = next((p, s) for p, s, st in rerouted.iter_stages() if st.worker == 5)
    p6, s6 = rerouted.stage_of_worker[6]
    assert c.plan.pipelines[p5].stages[s5].worker == 5
    assert c.plan.pipelines[p6].stages[s6].worker >= JOB
    assert len(where) == c.plan.num_pipelines


def test_no_idle_worker_no_swap() -> None:
    planner = Planner(paper32())
    (c,) = swap.candidates(state_after(planner, {5}, idle=set()), frozenset({5}))
    assert not c.feasible and c.reason == "1 stage(s) lost their worker, 0 worker(s) idle"
    # a fixed swap policy then restarts, as every fixed policy falls back
    decision = planner.decide(planner.initial_plan, [5], policy="swap", compare=False)
    assert decision.strategy == "restart"
    assert "falling back to restart" in decision.reason


def test_a_wiped_stage_swaps_from_the_checkpoint_without_a_job_restart(spares: Planner) -> None:
    node1 = set(range(8, 16))  # every replica of stage 1
    state = state_after(spares, node1)
    assert state.missing_layers()
    (c,) = swap.candidates(state, frozenset(node1))
    assert c.feasible and c.rollback == CheckpointSource.STORAGE and c.migration is None
    spec = spares.config.recovery
    assert "restart_s" not in c.terms and "migrate_s" not in c.terms
    assert c.terms["load_s"] == spec.checkpoint_load_s
    assert c.terms["lost_s"] == spec.checkpoint_interval_s / 2
    restart = restart_terms(spec, None)
    assert c.transition_s < sum(restart.values())
    # the whole failed node's slots went to the spare node, the rest kept their workers
    assert c.plan is not None and set(c.plan.workers) == (set(range(JOB)) - node1
                                                          | set(range(JOB, 40)))
    # chameleon prefers it to restarting every process
    decision = spares.decide(spares.initial_plan, sorted(node1),
                             alive=sorted(state.alive))
    assert decision.strategy == "swap" and decision.rollback == CheckpointSource.STORAGE


def test_a_swap_from_the_checkpoint_needs_spare_nodes(spares: Planner) -> None:
    # two pipelines run, the other workers are idle (left over by an earlier recovery);
    # then both replicas of stage 1 (workers 8 and 9) die
    for planner, feasible in ((Planner(paper32()), False), (spares, True)):
        full = planner.initial_plan
        plan = replace(full, pipelines=full.pipelines[:2])
        alive = frozenset(range(planner.config.total_workers)) - {8, 9}
        (c,) = swap.candidates(planner._state(plan, alive, None), frozenset({8, 9}))
        assert c.feasible == feasible, c.reason
        if not feasible:
            assert "cluster.spare_nodes" in c.reason


def test_memory_copies_reload_in_seconds(in_memory: Planner) -> None:
    node1 = set(range(8, 16))
    state = state_after(in_memory, node1)
    # stage 1's copies sit on node 1 (dead) and node 2 (up): nothing is lost from memory
    assert layers_lost_from_memory(state) == []
    (c,) = swap.candidates(state, frozenset(node1))
    assert c.rollback == CheckpointSource.MEMORY and c.plan is not None
    expected = memory_load_s(c.plan, in_memory.profile, in_memory.topology,
                             in_memory.config.recovery)
    assert c.terms["load_s"] == pytest.approx(expected)
    assert 0 < expected < in_memory.config.recovery.checkpoint_load_s
    # half a step of the failed plan is lost on average (a copy at every step)
    assert c.terms["lost_s"] == pytest.approx(0.5 * in_memory.failure_free.step_s)
    restart = in_memory.decide(in_memory.initial_plan, sorted(node1), policy="restart",
                               compare=False)
    assert restart.rollback == CheckpointSource.MEMORY
    assert restart.chosen.terms["restart_s"] == in_memory.config.recovery.restart_s


def test_memory_load_is_the_largest_stage_over_an_inter_node_link(in_memory: Planner) -> None:
    plan = in_memory.initial_plan
    spec = in_memory.config.recovery
    stage = max(sum(in_memory.profile.layers[i].state_bytes for i in r)
                for r in plan.layers_by_worker.values())
    latency_s, bandwidth = in_memory.config.cluster.link(False)
    assert memory_load_s(plan, in_memory.profile, in_memory.topology, spec) == pytest.approx(
        latency_s + stage / (bandwidth * spec.migration_efficiency))


def test_copies_lost_with_both_hosts_read_storage(in_memory: Planner) -> None:
    # nodes 1 and 2 die: stage 1's workers kept their copies on nodes 1 and 2
    dead = set(range(8, 24))
    state = state_after(in_memory, dead)
    lost = layers_lost_from_memory(state)
    assert lost and set(lost) == set(state.plan.layers_by_worker[8])
    restart = in_memory.decide(in_memory.initial_plan, sorted(dead), policy="restart",
                               compare=False, alive=sorted(state.alive))
    assert restart.rollback == CheckpointSource.STORAGE
    assert restart.chosen.terms["load_s"] == in_memory.config.recovery.checkpoint_load_s


def test_the_exact_checkpoint_age_prices_the_reload_it_reads(in_memory: Planner) -> None:
    node1 = sorted(range(8, 16))
    alive = sorted(set(range(40)) - set(node1))
    decision = in_memory.decide(in_memory.initial_plan, node1, alive=alive,
                                since_checkpoint_s=1234.0, since_memory_checkpoint_s=3.0)
    chosen = decision.chosen
    assert chosen.rollback == CheckpointSource.MEMORY and chosen.terms["lost_s"] == 3.0
    assert chosen.transition_s == pytest.approx(sum(chosen.terms.values()))
    with pytest.raises(ValueError, match="since_memory_checkpoint_s"):
        in_memory.decide(in_memory.initial_plan, node1, since_memory_checkpoint_s=-1.0)


def test_spares_never_add_pipelines(spares: Planner) -> None:
    decision = spares.decide(spares.initial_plan, [5], alive=sorted(set(range(40)) - {5}))
    for c in decision.candidates:
        if c.feasible and c.plan is not None:
            assert len(c.plan.workers) <= JOB, c.strategy
    by_strategy = {c.strategy: c for c in decision.candidates}
    assert by_strategy[Strategy.SWAP].feasible
    # every candidate is priced with the same horizon: the spares' failures change nothing
    assert math.isfinite(decision.horizon_s)


def test_prepared_swaps_are_cache_hits(spares: Planner) -> None:
    planner = Planner(spares.config, profile=spares.profile)
    idle = range(JOB, 40)
    planner.precompute(planner.initial_plan, failures=[[5]], idle=idle)
    decision = planner.decide(planner.initial_plan, [5], alive=sorted(set(range(40)) - {5}))
    assert decision.cache_hit
    assert any(c.strategy == Strategy.SWAP and c.feasible for c in decision.candidates)
