"""Decisions never wait for the background preparation (policy/prepared.py), with threads
and no processes: a preparation held mid-search by an event shows what a decision waits
for."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.policy import Decision, Planner
from chameleon_ft.policy.prepared import PreparedPlanner
from chameleon_ft.recovery import dynamic
from chameleon_ft.recovery.types import RecoveryState
from chameleon_ft.spec.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
PREPARING = "chameleon-prepare"
"""The preparation thread's name."""


@pytest.fixture(scope="module")
def config() -> Config:
    return load_config(ROOT / "examples" / "paper32.toml")


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """``(started, release)``: the preparation's first dynamic search sets ``started`` and
    waits for ``release``; decisions on other threads search as usual."""
    started, release = threading.Event(), threading.Event()
    search = dynamic.search

    def held_search(state: RecoveryState, beaten: dynamic.Beaten | None = None
                    ) -> dynamic.SearchResult | str | None:
        if threading.current_thread().name == PREPARING and not release.is_set():
            started.set()
            release.wait(30)
        return search(state, beaten)

    monkeypatch.setattr(dynamic, "search", held_search)
    yield started, release
    release.set()


def _answer(decide: Callable[..., Decision], plan: ExecutionPlan,
            failed: list[int]) -> tuple[object, ...]:
    """What a decision chose and how it priced every candidate (search time hidden, so
    prepared and cold answers compare)."""
    decision = decide(plan, failed, hide_search=True)
    return (decision.strategy, decision.plan,
            tuple((c.strategy, c.feasible, c.step_s, c.transition_s, c.score)
                  for c in decision.candidates))


def test_a_failure_during_preparation_is_decided_without_waiting_for_it(
        config: Config, held: tuple[threading.Event, threading.Event]) -> None:
    started, release = held
    prepared = PreparedPlanner(Planner(config))
    plan = prepared.planner.initial_plan
    try:
        prepared.prepare(plan)
        assert started.wait(30), "the preparation never reached its first search"
        # The preparation is held inside its first failure set's search: a decision that
        # waited for it (or for a lock it holds) would never return.
        decision = prepared.decide(plan, [5])
        assert not release.is_set()
        assert prepared.status().state == "preparing"
        assert not decision.cache_hit  # decided cold, by itself
        cold = Planner(config).decide(plan, [5])
        assert (decision.strategy, decision.plan) == (cold.strategy, cold.plan)
        release.set()
        assert prepared.wait(30)
        status = prepared.status()
        assert status.state == "cancelled"  # the decision stopped it
        assert status.num_done < status.num_sets == len(plan.workers) + 4
    finally:
        prepared.close()


def test_prepared_failures_are_cache_hits_answered_as_a_cold_planner_would(
        config: Config) -> None:
    prepared = PreparedPlanner(Planner(config))
    plan = prepared.planner.initial_plan
    try:
        prepared.prepare(plan)
        assert prepared.wait(60)
        status = prepared.status()
        assert (status.state, status.num_done, status.num_sets) == (
            "done", len(plan.workers) + 4, len(plan.workers) + 4)
        cold = Planner(config)
        for failed in ([5], [0], [31], list(range(8, 16))):
            warm = prepared.decide(plan, failed)
            assert warm.cache_hit
            assert _answer(prepared.decide, plan, failed) == _answer(cold.decide, plan, failed)
    finally:
        prepared.close()


def test_decisions_next_to_a_running_preparation_are_the_cold_ones(config: Config) -> None:
    """Decisions and the preparation share the decision cache from two threads; every
    answer is the one a planner alone gives."""
    prepared = PreparedPlanner(Planner(config))
    plan = prepared.planner.initial_plan
    cold = Planner(config)
    try:
        for failed in ([3], [12], [20, 21], [30]):
            prepared.prepare(plan)
            assert _answer(prepared.decide, plan, failed) == _answer(cold.decide, plan, failed)
    finally:
        prepared.close()


def test_the_budget_stops_the_preparation(config: Config) -> None:
    prepared = PreparedPlanner(Planner(config), budget_s=0.0)
    try:
        prepared.prepare(prepared.planner.initial_plan)
        assert prepared.wait(30)
        status = prepared.status()
        assert (status.state, status.num_done) == ("budget", 0)
        assert not prepared.decide(prepared.planner.initial_plan, [5]).cache_hit
    finally:
        prepared.close()


def test_a_newer_plan_replaces_the_preparation(
        config: Config, held: tuple[threading.Event, threading.Event]) -> None:
    started, release = held
    prepared = PreparedPlanner(Planner(config))
    first = prepared.planner.initial_plan
    second = prepared.decide(first, [5]).plan
    try:
        prepared.prepare(first)
        assert started.wait(30)
        prepared.prepare(second, failures=[[w] for w in second.workers[:3]])
        assert (prepared.status().plan, prepared.status().state) == (second, "preparing")
        release.set()
        assert prepared.wait(60)
        status = prepared.status()
        assert (status.plan, status.state, status.num_done) == (second, "done", 3)
    finally:
        prepared.close()


def test_a_failing_preparation_is_reported_not_raised(config: Config) -> None:
    prepared = PreparedPlanner(Planner(config))
    try:
        prepared.prepare(prepared.planner.initial_plan, failures=[[999]])
        assert prepared.wait(30)
        status = prepared.status()
        assert status.state == "failed" and "failures: worker 999" in status.error
    finally:
        prepared.close()


def test_close_stops_the_thread_and_refuses_more_work(config: Config) -> None:
    prepared = PreparedPlanner(Planner(config))
    prepared.prepare(prepared.planner.initial_plan)
    prepared.close()
    assert not any(t.name == PREPARING and t.is_alive() for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        prepared.prepare(prepared.planner.initial_plan)


def test_a_negative_budget_is_refused(config: Config) -> None:
    with pytest.raises(ValueError, match="budget_s"):
        PreparedPlanner(Planner(config), budget_s=-1.0)


def test_likely_failures_meet_every_stage_first(config: Config) -> None:
    """Pipeline by pipeline: a budget that runs out after ``pp`` failure sets has met every
    stage (and failures of one stage of identical pipelines share their answer)."""
    planner = Planner(config)
    plan = planner.initial_plan
    sets = planner.likely_failures(plan)
    assert len(sets) == len(set(sets)) == len(plan.workers) + config.cluster.num_nodes
    first = [plan.stage_of_worker[w] for ws in sets[:config.job.pp] for w in ws]
    assert sorted(s for _, s in first) == list(range(config.job.pp))


def test_spares_are_prepared_alive(config: Config) -> None:
    spared = replace(config, cluster=replace(config.cluster, spare_nodes=1))
    prepared = PreparedPlanner(Planner(spared))
    plan = prepared.planner.initial_plan
    spares = range(32, 40)
    try:
        prepared.prepare(plan, failures=[[5], list(range(8, 16))], idle=spares)
        assert prepared.wait(60)
        for failed in ([5], list(range(8, 16))):
            alive = sorted((set(plan.workers) | set(spares)) - set(failed))
            decision = prepared.decide(plan, failed, alive=alive)
            assert decision.cache_hit
            assert any(c.strategy == "swap" and c.feasible for c in decision.candidates)
    finally:
        prepared.close()
