"""The simulator driven by the real planner on a tiny uniform job (2 nodes x 4 workers)."""

from __future__ import annotations

import math

import pytest

from chameleon_ft.failures import EventKind, Trace, TraceEvent, trace_from_csv, trace_to_csv
from chameleon_ft.policy import Planner
from chameleon_ft.recovery.oobleck import instantiate
from chameleon_ft.sim.engine import simulate
from chameleon_ft.sim.report import report_json
from chameleon_ft.sim.runner import make_policy, run_scenario
from chameleon_ft.sim.scenarios import scenario_from_config
from chameleon_ft.spec import config_from_mapping
from chameleon_ft.spec.scenario import POLICY_NAMES

TABLES = {
    "cluster": {"num_nodes": 2, "devices_per_node": 4},
    "job": {"pp": 2, "dp": 4, "global_batch": 16},
    "profile": {"kind": "uniform", "num_layers": 8, "fwd_s": 0.01, "bwd_input_s": 0.01,
                "bwd_weight_s": 0.01, "param_bytes": 1e8, "optimizer_bytes": 6e8,
                "activation_bytes": 1e7, "output_bytes": 1e6},
    # A narrow dynamic search keeps each decision at milliseconds on this tiny job.
    "recovery": {"detect_s": 10.0, "rebuild_s": 5.0, "restart_s": 100.0,
                 "checkpoint_load_s": 50.0, "checkpoint_interval_s": 600.0,
                 "search_exhaustive_workers": 1, "search_extra_stages": 0},
    "policy": {"node_mtbf_hours": 2.0, "repair_hours": 1.0},
}
CONFIG = config_from_mapping(TABLES)
FIXED = ("reroute", "dynamic", "restart", "shrink")


@pytest.fixture(scope="module")
def planner() -> Planner:
    return Planner(CONFIG)


def run_one(name: str, trace: Trace, planner: Planner):
    policy = make_policy(name, Planner(CONFIG, profile=planner.profile), CONFIG, bamboo_tax=0.24)
    return simulate(trace, policy, failure_free_samples_s=planner.failure_free.throughput_samples_s,
                    recovery=CONFIG.recovery, num_workers=CONFIG.num_workers,
                    workers_per_node=CONFIG.workers_per_node)


def test_no_failures_every_policy_runs_at_failure_free_speed(planner):
    trace = Trace((), 3600.0)
    ff = planner.failure_free.throughput_samples_s
    # Oobleck runs the job's pipelines on consecutive workers (its rank assignment)
    oobleck = planner.estimate(instantiate(planner.initial_plan)).throughput_samples_s
    for name in POLICY_NAMES:
        result = run_one(name, trace, planner)
        expected = {"bamboo": ff * (1 - 0.24), "oobleck": oobleck}.get(name, ff)
        assert result.avg_throughput_samples_s == pytest.approx(expected, rel=1e-12), name
        assert result.num_decisions == 0


@pytest.mark.parametrize("name", [*FIXED, "chameleon", "oracle"])
def test_single_failure_no_repair_matches_hand_computation(name, planner):
    t_fail, end = 1000.3, 3000.0
    trace = Trace((TraceEvent(t_fail, EventKind.WORKER_FAIL, (1,)),), end)
    result = run_one(name, trace, planner)
    (strategy, count), = result.decisions
    assert count == 1
    # Price the same failure with a fresh planner; take the candidate the run chose.
    ff = planner.failure_free
    step0, batch = ff.step_s, CONFIG.job.global_batch
    done_steps = math.floor(t_fail / step0)
    checkpoint_steps = math.floor(600.0 / step0)  # checkpoints at 600, 1200, ...; last at 600
    since = t_fail - checkpoint_steps * step0 - (t_fail - done_steps * step0)
    fresh = Planner(CONFIG, profile=planner.profile)
    decision = fresh.decide(fresh.initial_plan, [1], alive=[0, 2, 3, 4, 5, 6, 7], now_s=t_fail,
                            horizon_s=end - t_fail if name == "oracle" else None,
                            policy="chameleon" if name == "oracle" else name,
                            since_checkpoint_s=since)
    cand = next(c for c in decision.candidates if c.feasible and str(c.strategy) == strategy)
    # search is hidden; the step in flight is charged exactly by the engine (done_steps)
    terms = {k: v for k, v in cand.terms.items() if k not in ("search_s", "lost_step_s")}
    if strategy == "restart":
        stall = sum(v for k, v in terms.items() if k != "lost_s")
        expected = checkpoint_steps * batch + cand.throughput_samples_s * (end - t_fail - stall)
    elif strategy == "reroute-then-dynamic":
        stall = sum(terms.values())
        interim = math.ceil(cand.interim_s / cand.interim_step_s) * cand.interim_step_s
        expected = (done_steps * batch + batch / cand.interim_step_s * interim
                    + cand.throughput_samples_s * (end - t_fail - stall - interim - cand.switch_s))
    else:
        stall = sum(terms.values())
        expected = done_steps * batch + cand.throughput_samples_s * (end - t_fail - stall)
    if name in FIXED:
        assert strategy == name
    assert result.samples == pytest.approx(expected, rel=1e-9)


def repaired_trace(seed: int) -> Trace:
    """Failures each repaired before the next one (any kind, any target)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    events, t = [], 0.0
    for _ in range(4):
        t += float(rng.uniform(300.0, 1500.0))
        if rng.random() < 0.5:
            events.append(TraceEvent(t, EventKind.WORKER_FAIL, (int(rng.integers(8)),)))
            node = events[-1].target[0] // 4
        else:
            node = int(rng.integers(2))
            events.append(TraceEvent(t, EventKind.NODE_FAIL, (node,)))
        t += float(rng.uniform(100.0, 1200.0))
        events.append(TraceEvent(t, EventKind.REPAIR, (node,)))
    return Trace(tuple(events), t + float(rng.uniform(300.0, 1500.0)))


@pytest.mark.parametrize("seed", range(12))
def test_oracle_not_below_fixed_strategies_when_each_failure_is_repaired_first(seed, planner):
    trace = repaired_trace(seed)
    oracle = run_one("oracle", trace, planner).samples
    # Eq. 8 is fluid; the engine counts whole steps (the step in flight at an event is lost,
    # a two-phase switch waits for a step boundary), so allow one step's samples per event.
    slack = len(trace.events) * CONFIG.job.global_batch
    # Shrink is left out: it re-admits replicas in the layout it already runs, and that
    # layout can survive the next failure better than the one the oracle's per-window
    # choice left (seed 1: both run at the same speed after a repair, then a node failure
    # costs the oracle's plan more). Greedy per window is no bound across such states; the
    # benchmarks report shrink against the oracle instead.
    for name in ("reroute", "dynamic", "restart", "chameleon"):
        other = run_one(name, trace, planner).samples
        assert oracle >= other - slack, (name, oracle, other)


def scenario(days: float = 0.25):
    tables = dict(TABLES)
    tables["simulation"] = {"days": days, "seeds": 2, "seed": 7}
    tables["failures"] = {"node_mtbf_hours": 3.0, "repair": "fixed", "repair_hours": 0.5}
    return scenario_from_config("tiny", config_from_mapping(tables))


def test_same_seed_same_report_byte_for_byte():
    first = report_json(run_scenario(scenario(), policies=("chameleon", "reroute", "bamboo")))
    second = report_json(run_scenario(scenario(), policies=("chameleon", "reroute", "bamboo")))
    assert first == second
    assert '"avg_throughput_samples_s"' in first


def test_csv_round_trip_replays_identically():
    sc = scenario()
    run = run_scenario(sc, policies=("chameleon", "dynamic"), seeds=1)
    trace = run.cells[0].runs[0].trace
    assert trace.events, "the test needs failures"
    back = trace_from_csv(trace_to_csv(trace), num_nodes=2, workers_per_node=4)
    replay = run_scenario(sc, policies=("chameleon", "dynamic"), trace=back, seed=run.cells[0]
                          .runs[0].seed)
    assert report_json(replay) == report_json(run)


def test_time_lost_adds_up_for_every_policy():
    run = run_scenario(scenario(0.5), seeds=1)
    for result in run.cells[0].runs[0].results:
        lost = sum(v for _, v in result.time_lost_s)
        assert lost == pytest.approx(result.duration_s - result.samples
                                     / result.failure_free_samples_s, rel=1e-9, abs=1e-6)


def spare_scenario(spare_nodes: int, days: float = 0.5):
    tables = {k: dict(v) for k, v in TABLES.items()}
    tables["cluster"]["spare_nodes"] = spare_nodes
    tables["simulation"] = {"days": days, "seeds": 1, "seed": 3}
    tables["failures"] = {"node_mtbf_hours": 3.0, "repair": "fixed", "repair_hours": 1.0}
    return scenario_from_config("tiny-spares", config_from_mapping(tables))


def test_spare_nodes_are_part_of_the_fleet_and_swap_joins_the_defaults():
    run = run_scenario(spare_scenario(1))
    assert "swap" in run.policies and set(run.policies) == set(POLICY_NAMES)
    assert "swap" not in run_scenario(spare_scenario(0), policies=None, seeds=1,
                                      seed=3).policies
    trace = run.cells[0].runs[0].trace
    # failures strike the spare node (node 2, workers 8..11) too
    assert any(set(event.workers(4)) & {8, 9, 10, 11} for event in trace.events
               if event.kind != EventKind.REPAIR)
    for result in run.cells[0].runs[0].results:
        lost = sum(v for _, v in result.time_lost_s)
        assert lost == pytest.approx(result.duration_s - result.samples
                                     / result.failure_free_samples_s, rel=1e-9, abs=1e-6)
    swap = run.cells[0].runs[0].result("swap")
    assert swap is not None and dict(swap.decisions).get("swap", 0) > 0


def test_swap_policy_swaps_with_a_spare_and_restarts_without_one(planner):
    config = spare_scenario(1).config
    spared = Planner(config, profile=planner.profile)
    trace = Trace((TraceEvent(100.0, EventKind.WORKER_FAIL, (1,)),), 3600.0)
    policy = make_policy("swap", spared, config, bamboo_tax=0.24)
    result = simulate(trace, policy, failure_free_samples_s=planner.failure_free
                      .throughput_samples_s, recovery=config.recovery,
                      num_workers=config.total_workers, workers_per_node=config.workers_per_node)
    assert dict(result.decisions) == {"swap": 1}
    # the plan keeps its layout; a stage's all-reduce now crosses to the spare node
    ff = planner.failure_free.throughput_samples_s
    assert 0.9 * ff < result.timeline[-1][1] <= ff
    alone = run_one("swap", trace, planner)  # no spare node: a restart
    assert dict(alone.decisions) == {"restart": 1}
    assert alone.samples < result.samples
