"""The simulator's caches are bounded in workers, and evicting never changes a result."""

from __future__ import annotations

from dataclasses import replace

import pytest

from chameleon_ft.perf import estimator
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.sim import runner
from chameleon_ft.sim.report import report_json
from chameleon_ft.sim.scenarios import preset_scenario


def test_cache_bounds_shrink_with_the_cluster():
    assert runner.planner_cache_size(32) == runner.planner_cache_size(2048) == 512
    assert runner.planner_cache_size(8192) == 128
    assert estimator.default_cache_size(32) == 4096
    assert estimator.default_cache_size(2048) == 1024
    assert estimator.default_cache_size(8192) == 256
    # the kept plans stay about the same number of workers at any scale
    for workers in (2048, 8192, 32768):
        assert runner.planner_cache_size(workers) * workers <= 2 ** 20
        assert estimator.default_cache_size(workers) * workers <= 2 ** 21


def test_tiny_caches_give_the_same_results(monkeypatch: pytest.MonkeyPatch):
    scenario = preset_scenario("paper32")
    scenario = replace(scenario, simulation=replace(scenario.simulation, days=1.0, seeds=2))
    names = ("chameleon", "oracle", "dynamic", "recycle", "shrink", "oobleck")
    default = report_json(runner.run_scenario(scenario, policies=names, jobs=1))
    # every decision and nearly every estimate evicted as soon as the next one comes
    monkeypatch.setattr(runner, "planner_cache_size", lambda workers: 1)
    monkeypatch.setattr(estimator, "default_cache_size", lambda workers: 1)
    monkeypatch.setattr(estimator, "_ESTIMATORS", type(estimator._ESTIMATORS)())
    assert report_json(runner.run_scenario(scenario, policies=names, jobs=1)) == default


def test_a_plans_tables_share_their_values():
    plan = ExecutionPlan.uniform(dp=8, pp=4, num_layers=8, num_microbatches=16)
    ranges = {id(r) for r in plan.layers_by_worker.values()}
    assert len(ranges) == 4  # one range object per stage layout
    assert plan.layers_by_worker[0] == range(0, 2) and plan.layers_by_worker[31] == range(6, 8)
    other = ExecutionPlan.uniform(dp=8, pp=4, num_layers=8, num_microbatches=16)
    assert plan.stage_of_worker == other.stage_of_worker
    assert all(plan.stage_of_worker[w] is other.stage_of_worker[w] for w in plan.workers)
    assert plan.stage_of_worker[9] == (1, 1)  # stage-major: worker s * dp + p
