"""The warm-up opens only the pairs that carry traffic (``traffic.peers_of``): a pipeline
connects each worker with a few others, while every pair of a large world would be
quadratically many NCCL communicators to create at every generation."""

from __future__ import annotations

from p2p_plans import generated, planner_decisions, schedule_actions

from chameleon_ft.runtime.nccl_model import check_warm_up
from chameleon_ft.runtime.traffic import peers_of


def _peers(case: object, world: list[int]) -> dict[int, frozenset[int]]:
    plan = case.plan  # type: ignore[attr-defined]
    actions = schedule_actions(plan, case.profile)  # type: ignore[attr-defined]
    migration = case.migration  # type: ignore[attr-defined]
    transfers = [] if migration is None else [
        [t.layer, t.src, t.dst, t.part, t.num_parts] for t in migration.transfers]
    return {w: peers_of(plan, actions, transfers, w) for w in world}


def _cases() -> list[object]:
    return [generated(seed) for seed in range(300)] + list(planner_decisions(40))


def test_peers_are_symmetric_and_their_warm_up_cannot_deadlock() -> None:
    for case in _cases():
        plan = case.plan  # type: ignore[attr-defined]
        movers = set()
        if case.migration is not None:  # type: ignore[attr-defined]
            movers = {t.src for t in case.migration.transfers} | \
                {t.dst for t in case.migration.transfers}  # type: ignore[attr-defined]
        world = sorted(set(plan.workers) | movers)
        peers = _peers(case, world)
        for w, mine in peers.items():
            assert w not in mine
            assert all(w in peers[p] for p in mine), (case.name, w)  # type: ignore[attr-defined]
        assert check_warm_up(world, peers) == [], case.name  # type: ignore[attr-defined]


def test_a_pipeline_worker_opens_a_few_pairs_not_every_one() -> None:
    """dp 8 x pp 8 on 64 workers: a worker talks to its stage neighbours, and a rerouted
    one to the dead stage's peers too; far fewer than its 63 possible pairs."""
    big = [c for c in (generated(seed) for seed in range(400))
           if len(c.plan.workers) >= 16]
    assert big
    for case in big:
        world = sorted(set(case.plan.workers))
        peers = _peers(case, world)
        assert max(len(p) for p in peers.values()) < len(world) - 1, case.name


def test_a_peer_left_out_on_one_side_is_caught() -> None:
    world = [0, 1, 2]
    peers = {0: {1, 2}, 1: {0}, 2: {0, 1}}  # worker 1 forgot worker 2
    assert check_warm_up(world, peers)
