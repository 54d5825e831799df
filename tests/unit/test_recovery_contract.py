"""One contract over every strategy: what any candidate promises, in several situations."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from chameleon_ft.policy import Planner
from chameleon_ft.recovery import Candidate, Strategy, dynamic, reroute, restart, shrink, swap
from chameleon_ft.recovery.reroute_then_dynamic import combine
from chameleon_ft.recovery.types import CheckpointSource
from chameleon_ft.spec.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MODULES = {Strategy.REROUTE: reroute, Strategy.DYNAMIC: dynamic, Strategy.RESTART: restart,
           Strategy.SHRINK: shrink, Strategy.SWAP: swap}


@pytest.fixture(scope="module", params=[0, 1], ids=["no spares", "one spare node"])
def planner(request: pytest.FixtureRequest) -> Planner:
    """paper32, and paper32 with a spare node whose 8 workers are alive and idle (with
    checkpoints in memory: the reloads' other source)."""
    config = load_config(ROOT / "examples" / "paper32.toml")
    if request.param:
        config = replace(config, cluster=replace(config.cluster, spare_nodes=request.param),
                         recovery=replace(config.recovery, memory_checkpoint=True))
    return Planner(config)


def check(c: Candidate, strategy: Strategy, failed: frozenset[int], capacity: float) -> None:
    assert c.strategy == strategy
    assert c.reason
    if not c.feasible:
        assert c.score == 0.0
        return
    assert c.plan is not None and c.estimate is not None
    c.plan.validate()
    assert not failed & set(c.plan.workers)
    assert c.step_s == c.estimate.step_s and c.step_s > 0
    assert c.peak_memory_bytes <= capacity
    assert c.transition_s == pytest.approx(sum(c.terms.values()))
    assert all(v >= 0 and math.isfinite(v) for v in c.terms.values())
    assert "detect_s" in c.terms
    # a plan never uses more workers than the job's layout (spares replace, never add)
    assert len(c.plan.workers) <= 32
    if c.rollback is not None:
        # every worker reloads the checkpoint: nothing migrates, the work since it is lost
        assert {"load_s", "lost_s"} <= set(c.terms) and c.migration is None
    if strategy == Strategy.RESTART:
        assert {"restart_s", "load_s", "lost_s"} <= set(c.terms)
        assert c.rollback is not None
    if strategy == Strategy.DYNAMIC:
        assert c.migration is not None and {"migrate_s", "search_s"} <= set(c.terms)
        assert not c.plan.reroutes
    if strategy in (Strategy.REROUTE, Strategy.SHRINK):
        assert c.migration is None
    if strategy == Strategy.SWAP:
        assert not c.plan.reroutes
        assert "restart_s" not in c.terms  # the survivors and the spares keep running
        if c.rollback is None:
            assert c.migration is not None and "migrate_s" in c.terms
    if strategy != Strategy.RESTART and strategy != Strategy.SWAP:
        assert c.rollback is None


@pytest.mark.parametrize("failed", [[5], [0, 1], list(range(8, 16)), [0, 8, 16, 24]])
def test_every_strategy_keeps_the_contract(planner: Planner, failed: list[int]) -> None:
    plan = planner.initial_plan
    dead = frozenset(failed)
    spares = frozenset(range(32, planner.config.total_workers))
    state = planner._state(plan, (frozenset(plan.workers) | spares) - dead, None)
    capacity = planner.topology.memory_capacity_bytes
    made = {}
    for strategy, module in MODULES.items():
        out = module.candidates(state, dead)
        assert len(out) == 1
        check(out[0], strategy, dead, capacity)
        made[strategy] = out[0]
    two = combine(state, made[Strategy.REROUTE], made[Strategy.DYNAMIC])
    assert two.strategy == Strategy.REROUTE_THEN_DYNAMIC
    if two.feasible:
        assert two.transition_s == made[Strategy.REROUTE].transition_s
        assert two.interim_step_s == made[Strategy.REROUTE].step_s
        assert two.plan == made[Strategy.DYNAMIC].plan
        assert two.interim_plan == made[Strategy.REROUTE].plan
    # a wiped stage leaves only the reloads: restart, and a swap when spares are idle
    wiped = bool(state.missing_layers())
    assert made[Strategy.RESTART].feasible
    for strategy in (Strategy.REROUTE, Strategy.DYNAMIC, Strategy.SHRINK):
        if wiped:
            assert not made[strategy].feasible
    assert made[Strategy.SWAP].feasible == (len(spares) >= len(dead))
    if wiped and spares:
        assert made[Strategy.SWAP].rollback == CheckpointSource.MEMORY
