"""Scenario presets, their example files, Bamboo's rules and the report writer."""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.sim.bamboo import BAMBOO_FALLBACK_SLOWDOWN, BambooPolicy
from chameleon_ft.sim.policies import EventContext, policy_names
from chameleon_ft.sim.report import (
    effective_training_table,
    policy_summary,
    report_json,
    report_markdown,
    write_files,
)
from chameleon_ft.sim.runner import run_scenario
from chameleon_ft.sim.scenarios import PRESETS, preset_scenario
from chameleon_ft.spec import load_config
from chameleon_ft.spec.recovery import RecoverySpec

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_example_file_equals_preset(name):
    path = ROOT / "examples" / "scenarios" / f"{name}.toml"
    assert tomllib.loads(path.read_text()) == tomllib.loads(PRESETS[name])
    scenario = preset_scenario(name)
    assert load_config(path).extra == scenario.config.extra


def test_paper32_preset_uses_the_paper32_job():
    paper = load_config(ROOT / "examples" / "paper32.toml")
    scenario = preset_scenario("paper32").config
    assert (scenario.model, scenario.cluster, scenario.job, scenario.recovery) == (
        paper.model, paper.cluster, paper.job, paper.recovery)


def test_llama3_preset_uses_the_16k_job_and_rate():
    job = load_config(ROOT / "examples" / "llama3-405b-16k.toml")
    scenario = preset_scenario("llama3-16k")
    assert (scenario.config.model, scenario.config.cluster, scenario.config.job,
            scenario.config.profile) == (job.model, job.cluster, job.job, job.profile)
    # Llama 3: 419 interruptions in 54 days on 2,048 nodes.
    expected = 2048 * 54 * 24 / scenario.failures.node_mtbf_hours
    assert expected == pytest.approx(419, rel=1e-6)
    assert scenario.simulation.days == 54


def test_sweep_grid_spans_an_hour_to_a_month_and_never():
    sim = preset_scenario("sweep").simulation
    assert min(sim.sweep_node_mtbf_hours) == 1.0 and max(sim.sweep_node_mtbf_hours) == 720.0
    assert min(sim.sweep_repair_hours) == pytest.approx(1 / 6, rel=1e-3)
    assert sim.sweep_repair_hours[-1] == float("inf")


def test_unknown_scenario_and_policy_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown scenario 'nope'; choose one of paper32"):
        preset_scenario("nope")
    with pytest.raises(ValueError, match="unknown policy 'magic'"):
        policy_names(["chameleon", "magic"])
    with pytest.raises(ValueError, match="listed twice"):
        policy_names(["oracle", "oracle"])


# ------------------------------------------------------------------------- Bamboo
# 3 pipelines x 4 stages, stage-major: worker s*3+p; 12 micro-batches.
PLAN = ExecutionPlan.uniform(dp=3, pp=4, num_layers=8, num_microbatches=12)
REC = RecoverySpec(detect_s=10.0, restart_s=100.0, checkpoint_load_s=50.0)
STEP_S = 1.2


def bamboo() -> BambooPolicy:
    return BambooPolicy(PLAN, STEP_S, lambda plan: STEP_S * 3 / plan.num_pipelines, REC, tax=0.25)


def ctx(alive: set[int]) -> EventContext:
    return EventContext(alive=frozenset(alive), now_s=100.0, next_event_in_s=50.0,
                        since_checkpoint_s=0.0)


def test_bamboo_taxes_steady_throughput():
    start = bamboo().start()
    assert start.throughput_samples_s == pytest.approx(12 / STEP_S * 0.75)


def test_bamboo_small_job_reconfigures_at_once():
    policy = bamboo()
    everyone = set(range(12))
    # Stage 1 of pipeline 0 (worker 3) dies; 2 * 1 covered / 11 active > 5 %, so Bamboo
    # rebalances right away into floor(11 / 4) = 2 pipelines.
    first = policy.on_failure(policy.start(), frozenset({3}), ctx(everyone - {3}))
    assert first.strategy == "reconfigure"  # 2 * 1 / 11 > 5 %: Bamboo rebalances at once
    assert dict(first.terms) == {"detect_s": 10.0, "rendezvous_s": 30.0, "load_s": 50.0}
    assert first.plan is not None and first.plan.num_pipelines == 2
    assert not first.rollback


def test_bamboo_takeover_and_fatal_rules_on_a_wide_job():
    # 40 pipelines x 2 stages: one failure is 2/79 < 5 %, so the predecessor takes over.
    plan = ExecutionPlan.uniform(dp=40, pp=2, num_layers=4, num_microbatches=40)
    policy = BambooPolicy(plan, 1.0, lambda p: 40.0 / p.num_pipelines, REC, tax=0.2)
    alive = set(range(80))
    takeover = policy.on_failure(policy.start(), frozenset({45}), ctx(alive - {45}))
    assert takeover.strategy == "takeover"
    assert takeover.stall_s == pytest.approx(REC.detect_s)
    assert takeover.step_s == pytest.approx(BAMBOO_FALLBACK_SLOWDOWN)
    assert takeover.throughput_samples_s == pytest.approx(40 / 1.5 * 0.8)
    # Worker 5 holds stage 0 of pipeline 5: its predecessor (stage 1, worker 45) is dead.
    fatal = policy.on_failure(takeover, frozenset({5}), ctx(alive - {45, 5}))
    assert fatal.strategy == "restart" and fatal.rollback
    assert dict(fatal.terms) == {"detect_s": 10.0, "restart_s": 100.0, "load_s": 50.0}
    # A whole pipeline at once (adjacent stages) is fatal too.
    both = policy.on_failure(policy.start(), frozenset({7, 47}), ctx(alive - {7, 47}))
    assert both.strategy == "restart"
    # A repaired node ends the overload with a reconfiguration.
    back = policy.on_rejoin(takeover, frozenset({45}), ctx(alive))
    assert back.strategy == "reconfigure" and back.plan is not None
    assert back.plan.num_pipelines == 40


# ------------------------------------------------------------------------- reports
def test_write_files_replaces_atomically(tmp_path):
    out = tmp_path / "out"
    write_files(out, {"a.txt": b"one"})
    write_files(out, {"a.txt": b"two", "b.txt": b"x"})
    assert (out / "a.txt").read_bytes() == b"two"
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "b.txt"]


def test_binned_throughput_integrates_the_timeline():
    from chameleon_ft.sim.report import binned_throughput

    edges, rates = binned_throughput([(0.0, 4.0), (5.0, 0.0), (7.5, 2.0)], 10.0, num_bins=2)
    assert edges == [0.0, 5.0, 10.0]
    assert rates == pytest.approx([4.0, (2.5 * 2.0) / 5.0])


def _half_day(policies: tuple[str, ...], **recovery: float) -> Any:
    scenario = preset_scenario("paper32")
    config = replace(scenario.config, recovery=replace(scenario.config.recovery, **recovery))
    scenario = replace(scenario, config=config,
                       simulation=replace(scenario.simulation, days=0.5, seeds=2))
    return run_scenario(scenario, policies=policies, jobs=1)


def test_reports_give_effective_training_time_next_to_throughput():
    run = _half_day(("chameleon", "reroute", "restart"))
    doc = json.loads(report_json(run))
    for policy in doc["policies"]:
        # committed work at the failure-free speed over wall time...
        assert policy["effective_training_time"] == pytest.approx(
            policy["avg_throughput_samples_s"] / doc["failure_free_samples_s"])
        # ...and the time spent training kept work, which a slower plan still counts
        assert policy["effective_training_time"] <= policy["training_time_share"] + 1e-9
        assert 0 < policy["training_time_share"] <= 1
        for seed in policy["per_seed"]:
            assert 0 < seed["effective_training_time"] <= seed["training_time_share"] + 1e-9
    reroute = next(p for p in doc["policies"] if p["name"] == "reroute")
    assert reroute["training_time_share"] > reroute["effective_training_time"] + 0.01
    text = report_markdown(run)
    assert "| effective training time | time training |" in text
    chameleon = next(p for p in doc["policies"] if p["name"] == "chameleon")
    assert f"| {chameleon['effective_training_time']:.4f} |" in text


def test_effective_training_table_has_a_column_pair_per_variant():
    policies = ("chameleon", "restart")
    slow = _half_day(policies)
    fast = _half_day(policies, restart_s=60.0, checkpoint_load_s=10.0)
    table = effective_training_table([("as configured", slow), ("fast restarts", fast)])
    lines = table.splitlines()
    assert lines[0].count("effective training time") == 2
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:4]}
    assert set(rows) == set(policies)
    restart = [policy_summary(r.cells[0], "restart")["effective_training_time"]
               for r in (slow, fast)]
    assert restart[1] > restart[0]
    assert f"{restart[0]:.1%} |" in rows["restart"] and f"{restart[1]:.1%} |" in rows["restart"]
    assert "Llama 3" in table and "above 90%" in table
    with pytest.raises(ValueError, match="other policies"):
        effective_training_table([("a", slow), ("b", _half_day(("chameleon",)))])
