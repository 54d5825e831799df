"""Fail-slows in the simulator: effective training time per policy with and without
fail-slow handling, Chameleon against every fixed answer to a slow worker, and a
production-shaped fault trace replayed on a job the size of its cluster (docs/design.md
sections 3.4 and 6).

    PYTHONPATH=src .venv/bin/python benchmarks/failslow.py             # 3 seeds, both parts
    PYTHONPATH=src .venv/bin/python benchmarks/failslow.py --quick     # a smoke run
    PYTHONPATH=src .venv/bin/python benchmarks/failslow.py --part trace

The whole measurement is long: every fail-slow is a decision for each of the seven
planner-backed policies (about 820 of them in the 54 days of a seed), each pricing plans at
the slow speeds. ``--quick`` runs one seed over the first 14 days of the scenario and the
first 60 days of the trace, in minutes on two cores: a check that everything runs, whose
must-hold verdict is only indicative.

Part ``scenario`` (``llama3-16k-slow``: llama3-16k's failures with fail-slows at the
published durations, 1.3x to 3x, at the rate that delays the job 1.34x left alone): every
policy runs the same traces with its own answer to slow workers (``--slow-policy
chameleon``: Chameleon's choice, the fixed strategies' eviction, Oobleck's and Bamboo's
failure path) and with none (``--slow-policy keep``); then Chameleon's failure policy with
each fixed answer (``rebalance``, ``dynamic``, ``swap``, ``evict``; ``keep`` is the run
without handling). Figures are medians over the seeds of the effective training time
(committed work at the failure-free speed over wall time) and of the time lost to slow
workers (``slow_s``). The must-hold (issue 34): Chameleon with handling at least every
fixed policy (the better of its two runs) and every fixed answer within 0.5%, and above
itself without handling; the oracle (it knows the future) is shown, not compared.

Part ``trace``: ``examples/traces/node-faults-synthetic.json`` (the InfiniteHBD trace's
published shape: 400 servers, 348 days, its 584 faults with their causes) read as
``chameleon trace import --format node-json --num-nodes 400`` does, replayed on
``examples/traces/infinitehbd-400.toml`` (Llama 3 405B on those 400 servers: 3,200 H100s,
one tp-8 worker a server) by every policy: degradations read as the operators recorded
them (node failures), and as fail-slows of ``--degraded-factor`` (2x) with and without
fail-slow handling.

Prints Markdown tables, the seconds each part took, and whether the must-hold holds
(exit status 1 when it fails).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from chameleon_ft.failures import Trace
from chameleon_ft.failures.importers import import_node_json
from chameleon_ft.sim.runner import run_scenario
from chameleon_ft.sim.scenarios import Scenario, preset_scenario, scenario_from_config
from chameleon_ft.spec.config import load_config
from chameleon_ft.spec.scenario import default_policies

ROOT = Path(__file__).resolve().parents[1]
ANSWERS = ("rebalance", "dynamic", "swap", "evict")
"""Chameleon's fixed answers run on their own (``keep`` is the run without handling)."""
TOLERANCE = 0.005
TRACE_JSON = ROOT / "examples" / "traces" / "node-faults-synthetic.json"
TRACE_JOB = ROOT / "examples" / "traces" / "infinitehbd-400.toml"


@dataclass
class Runs:
    """Per policy, one figure per seed."""

    ett: dict[str, list[float]]
    """Effective training time."""
    slow_h: dict[str, list[float]]
    """Hours lost to slow workers."""
    seconds: float
    """Wall seconds the runs took."""

    def median(self, name: str) -> float:
        """``name``'s median effective training time."""
        return statistics.median(self.ett[name])

    def slow_median_h(self, name: str) -> float:
        """``name``'s median hours lost to slow workers."""
        return statistics.median(self.slow_h[name])


def run(scenario: Scenario, slow_policy: str, policies: tuple[str, ...], *, seeds: int,
        jobs: int, trace: Trace | None = None) -> Runs:
    """Every policy of ``policies`` under ``slow_policy`` on the scenario's traces (or
    ``trace``).

    Raises:
        RuntimeError: when a simulation process died.
    """
    config = scenario.config
    changed = replace(scenario, config=replace(
        config, recovery=replace(config.recovery, slow_policy=slow_policy)))
    start = time.perf_counter()
    result = run_scenario(changed, policies=policies, seeds=seeds, trace=trace, jobs=jobs)
    seconds = time.perf_counter() - start
    ett: dict[str, list[float]] = {n: [] for n in policies}
    slow: dict[str, list[float]] = {n: [] for n in policies}
    for seed_run in result.cells[0].runs:
        if seed_run.lost:
            raise RuntimeError(f"seed {seed_run.seed}: the simulation of "
                               f"{', '.join(r.policy for r in seed_run.lost)} died")
        for r in seed_run.results:
            ett[r.name].append(r.effective_training_time)
            slow[r.name].append(dict(r.time_lost_s).get("slow_s", 0.0) / 3600.0)
    return Runs(ett=ett, slow_h=slow, seconds=seconds)


def scenario_part(name: str, seeds: int, jobs: int, days: float | None) -> bool:
    """Print the scenario's two tables (over its first ``days``, default all); returns
    whether the must-hold holds."""
    scenario = preset_scenario(name)
    if days is not None:
        scenario = replace(scenario, simulation=replace(scenario.simulation, days=days))
    policies = default_policies(scenario.config.cluster.spare_nodes)
    with_ = run(scenario, "chameleon", policies, seeds=seeds, jobs=jobs)
    without = run(scenario, "keep", policies, seeds=seeds, jobs=jobs)
    answers = {"chameleon": with_, "keep": without}
    for answer in ANSWERS:
        answers[answer] = run(scenario, answer, ("chameleon",), seeds=seeds, jobs=jobs)
    seconds = with_.seconds + without.seconds + sum(answers[a].seconds for a in ANSWERS)
    first = scenario.simulation.seed
    print(f"## {name}: {scenario.simulation.days:g} days, seeds {first}..{first + seeds - 1}, "
          f"medians ({seconds:.0f} s)\n")
    print("| policy | effective training time, with fail-slow handling | without | "
          "with - without | slow time lost, with (h) | without (h) |")
    print("|---|---|---|---|---|---|")
    for policy in policies:
        w, wo = with_.median(policy), without.median(policy)
        print(f"| {policy} | {w:.2%} | {wo:.2%} | {(w - wo) * 100:+.2f} pt "
              f"| {with_.slow_median_h(policy):.1f} | {without.slow_median_h(policy):.1f} |")
    ours = with_.median("chameleon")
    print("\n| Chameleon's answer to a slow worker | effective training time "
          "| vs chameleon | slow time lost (h) |")
    print("|---|---|---|---|")
    for answer, runs in answers.items():
        value = runs.median("chameleon")
        print(f"| {answer} | {value:.2%} | {value / ours - 1:+.2%} "
              f"| {runs.slow_median_h('chameleon'):.1f} |")
    rivals = {f"policy {p}": max(with_.median(p), without.median(p)) for p in policies
              if p not in ("chameleon", "oracle")}
    rivals.update({f"answer {a}": r.median("chameleon") for a, r in answers.items()
                   if a != "chameleon"})
    best = max(rivals, key=lambda k: rivals[k])
    at_least = all(ours >= v * (1 - TOLERANCE) for v in rivals.values())
    gains = without.median("chameleon") < ours
    print(f"\nchameleon {ours:.4%} against the best fixed ({best}) {rivals[best]:.4%}: "
          f"{'holds' if at_least else 'FAILS'} within {TOLERANCE:.1%}; with handling "
          f"{ours:.4%} against without {without.median('chameleon'):.4%}: "
          f"{'above' if gains else 'NOT above'}")
    per_seed = [min(with_.ett['chameleon'][k] / max(v.ett[p][k] for v in (with_, without))
                    for p in policies if p not in ("chameleon", "oracle"))
                for k in range(seeds)]
    print("per seed, chameleon over the best fixed policy: "
          + ", ".join(f"{r - 1:+.2%}" for r in per_seed))
    return at_least and gains


def _first(trace: Trace, days: float | None) -> Trace:
    """The events of ``trace``'s first ``days`` (all: ``None``)."""
    if days is None or days * 86400.0 >= trace.duration_s:
        return trace
    end_s = days * 86400.0
    return Trace(events=tuple(e for e in trace.events if e.time_s < end_s), duration_s=end_s)


def trace_part(jobs: int, factor: float, days: float | None) -> None:
    """Print every policy on the imported production-shaped trace (its first ``days``)."""
    scenario = scenario_from_config(TRACE_JOB.stem, load_config(TRACE_JOB))
    text = TRACE_JSON.read_text(encoding="utf-8")
    nodes = scenario.config.cluster.num_nodes
    per_node = scenario.config.workers_per_node
    as_failures, summary = import_node_json(text, workers_per_node=per_node, num_nodes=nodes)
    as_slows, slow_summary = import_node_json(text, workers_per_node=per_node,
                                              num_nodes=nodes, degraded_factor=factor)
    whole_days = as_failures.duration_s / 86400.0
    as_failures, as_slows = _first(as_failures, days), _first(as_slows, days)
    days = as_failures.duration_s / 86400.0
    scenario = replace(scenario, simulation=replace(scenario.simulation, days=days))
    policies = default_policies(scenario.config.cluster.spare_nodes)
    failures = run(scenario, "chameleon", policies, seeds=1, jobs=jobs, trace=as_failures)
    with_ = run(scenario, "chameleon", policies, seeds=1, jobs=jobs, trace=as_slows)
    without = run(scenario, "keep", policies, seeds=1, jobs=jobs, trace=as_slows)
    seconds = failures.seconds + with_.seconds + without.seconds
    print(f"\n## {TRACE_JSON.name} on {TRACE_JOB.name} ({nodes} nodes, {days:.0f} days; "
          f"{seconds:.0f} s)\n")
    print(f"degradations as node failures: {summary.line()}")
    print(f"degradations as {factor:g}x fail-slows: {slow_summary.line()}")
    if days < whole_days:
        counts = collections.Counter(e.kind.value for e in as_slows.events)
        print(f"replayed: the first {days:g} days, "
              + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
              + " (degradations as fail-slows)")
    print()
    print("| policy | effective training time, degradations as failures "
          f"| as {factor:g}x fail-slows, with handling | without | slow time lost, with (h) "
          "| without (h) |")
    print("|---|---|---|---|---|---|")
    for policy in policies:
        print(f"| {policy} | {failures.median(policy):.2%} | {with_.median(policy):.2%} "
              f"| {without.median(policy):.2%} | {with_.slow_median_h(policy):.1f} "
              f"| {without.slow_median_h(policy):.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--part", choices=("both", "scenario", "trace"), default="both")
    parser.add_argument("--scenario", default="llama3-16k-slow")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="one seed, the scenario's first 14 days, the trace's first 60")
    parser.add_argument("--jobs", type=int, default=2, help="simulation processes")
    parser.add_argument("--degraded-factor", type=float, default=2.0,
                        help="the trace part's reading of degradations as fail-slows")
    args = parser.parse_args()
    seeds = 1 if args.quick else args.seeds
    holds = True
    if args.part in ("both", "scenario"):
        holds = scenario_part(args.scenario, seeds, args.jobs, 14.0 if args.quick else None)
    if args.part in ("both", "trace"):
        trace_part(args.jobs, args.degraded_factor, 60.0 if args.quick else None)
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
