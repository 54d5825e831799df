"""Simulator speed and memory: one scenario, every policy, on the same traces.

    .venv/bin/python benchmarks/simulate.py                       # llama3-16k, 1 seed
    .venv/bin/python benchmarks/simulate.py --scenario paper32 --seeds 5
    .venv/bin/python benchmarks/simulate.py --gpus 2048           # llama3-16k's job at 2k GPUs
    .venv/bin/python benchmarks/simulate.py --scenario llama3-64k --events 400
    .venv/bin/python benchmarks/simulate.py --variants configured     # the speed target

Prints the wall time, the CPU time of this process and of its children, the peak resident
memory of every process that ran policies (each unit of policies runs in a forked process
of its own; with ``--jobs 1`` in this one), the trace size, and each policy's mean average
throughput and effective training time; for a single-cell scenario the effective-training
table of RESULTS.md. ``--gpus`` runs the Llama 3 job (llama3-16k) at another scale: dp =
GPUs / 128 with 16 micro-batches per pipeline, as many 8-GPU nodes, the same per-node
failure rate (so 2,048 GPUs: 256 nodes, dp 16). Each variant of :data:`VARIANTS` (the
scenario as configured, with warm spare nodes, with checkpoints in memory, with both) is
one run and one column pair of the table; ``--variants`` picks some. The issue's targets
(19): ``llama3-16k``,
every policy, one seed, under 20 s on 2 cores; ``llama3-64k`` under 60 s; every simulation
process under 2 GB at 65k GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from chameleon_ft.failures import Trace
from chameleon_ft.sim import policies as sim_policies
from chameleon_ft.sim.report import ProgressBar, effective_training_table, policy_summary
from chameleon_ft.sim.runner import ScenarioRun, default_jobs, run_scenario
from chameleon_ft.sim.scenarios import Scenario, preset_scenario
from chameleon_ft.sim.traces import generate_trace
from chameleon_ft.spec.scenario import POLICY_NAMES


def default_spare_nodes(scenario: Scenario) -> int:
    """Spare nodes of the ``spares`` variants: one per 256 of the job's nodes (8 for the
    16,384-GPU job, 0.4% of its nodes; its ~0.3 nodes down on average and 4-node switch
    failures fit), at least one."""
    return max(1, scenario.config.cluster.num_nodes // 256)


def with_spares(scenario: Scenario, spare_nodes: int | None = None) -> Scenario:
    """``scenario`` with warm spare nodes (``[cluster] spare_nodes``)."""
    k = default_spare_nodes(scenario) if spare_nodes is None else spare_nodes
    config = scenario.config
    return replace(scenario, config=replace(config, cluster=replace(config.cluster,
                                                                    spare_nodes=k)))


def with_memory_checkpoints(scenario: Scenario) -> Scenario:
    """``scenario`` with checkpoints in memory (``[recovery] memory_checkpoint``)."""
    config = scenario.config
    return replace(scenario, config=replace(config, recovery=replace(
        config.recovery, memory_checkpoint=True)))


VARIANTS: tuple[tuple[str, str, Callable[[Scenario], Scenario]], ...] = (
    ("configured", "as configured", lambda scenario: scenario),
    ("spares", "spare nodes", with_spares),
    ("memory", "checkpoints in memory", with_memory_checkpoints),
    ("both", "spare nodes and checkpoints in memory",
     lambda scenario: with_memory_checkpoints(with_spares(scenario))),
)
"""The columns of the effective-training table: ``(name, label, scenario -> variant)``, the
scenario as configured, then one entry per means of recovery (warm spare nodes,
checkpoints in memory, both)."""


def at_scale(scenario: Scenario, gpus: int) -> Scenario:
    """The Llama 3 job of ``scenario`` (tp 8 x pp 16, 8 GPUs per node) at ``gpus`` GPUs:
    dp = gpus / 128 pipelines of 16 micro-batches each, gpus / 8 nodes."""
    config = scenario.config
    per_pipeline = config.job.tp * config.job.pp
    if gpus % per_pipeline or gpus % config.cluster.devices_per_node:
        raise ValueError(f"--gpus: {gpus} is not a whole number of {per_pipeline}-GPU "
                         "pipelines")
    dp = gpus // per_pipeline
    micro = config.job.global_batch // config.job.dp
    job = replace(config.job, dp=dp, global_batch=dp * micro)
    cluster = replace(config.cluster, num_nodes=gpus // config.cluster.devices_per_node)
    return replace(scenario, name=f"{scenario.name}@{gpus}",
                   config=replace(config, job=job, cluster=cluster))


def bounded_trace(scenario: Scenario, events: int, seed: int | None) -> tuple[Trace, int]:
    """The first ``events`` events of the first seed's trace (over every node of the fleet,
    spares included), and how many it has."""
    config, sim = scenario.config, scenario.simulation
    whole = generate_trace(scenario.failures, num_nodes=config.cluster.num_nodes,
                           workers_per_node=config.workers_per_node, duration_s=sim.duration_s,
                           seed=seed if seed is not None else sim.seed,
                           spare_nodes=config.cluster.spare_nodes)
    n = min(events, len(whole.events))
    end_s = whole.events[n].time_s if n < len(whole.events) else whole.duration_s
    return Trace(whole.events[:n], end_s), len(whole.events)


def _print_run(run: ScenarioRun) -> None:
    for name in run.policies:
        s = policy_summary(run.cells[0], name)
        if s["avg_throughput_samples_s"] is None:
            print(f"  {name:10s} died")
            continue
        print(f"  {name:10s} {s['avg_throughput_samples_s']:10.4g} samples/s  "
              f"relative {s['relative_to_failure_free']:.4f} (+-{s['relative_std']:.4f})  "
              f"effective training time {s['effective_training_time']:.1%}, "
              f"time training {s['training_time_share']:.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="llama3-16k")
    parser.add_argument("--gpus", type=int, default=None,
                        help="run the (Llama 3) scenario's job at this many GPUs")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--policies", default=None, help="comma-separated (default: all)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes (default: every core, as `chameleon simulate`)")
    parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS),
                        help="comma-separated variants to run: "
                             + ", ".join(f"{name} ({label})" for name, label, _ in VARIANTS))
    parser.add_argument("--spare-nodes", type=int, default=None,
                        help="spare nodes of the spares variants (default: one per 256 "
                             "of the job's nodes, at least one)")
    parser.add_argument("--events", type=int, default=None,
                        help="replay only the first N events of the first seed's trace (a "
                             "bounded measurement) and extrapolate to the whole trace")
    args = parser.parse_args()
    scenario = preset_scenario(args.scenario)
    if args.gpus is not None:
        scenario = at_scale(scenario, args.gpus)
    # every variant runs every policy (swap too), so that the table's rows line up
    policies = (sim_policies.policy_names(args.policies.split(","))
                if args.policies else POLICY_NAMES)
    known = {name: (label, make) for name, label, make in VARIANTS}
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in chosen:
        if name not in known:
            parser.error(f"--variants: unknown variant {name!r}; choose from "
                         f"{', '.join(known)}")
    jobs = args.jobs or default_jobs()
    runs = []
    for name in chosen:
        label, make = known[name]
        variant = make(scenario)
        if name in ("spares", "both") and args.spare_nodes is not None:
            variant = with_spares(variant, args.spare_nodes)
        spares = variant.config.cluster.spare_nodes
        if spares:
            label = f"{spares} {label}" if name == "spares" else label.replace(
                "spare nodes", f"{spares} spare nodes")
        trace, full_events = (bounded_trace(variant, args.events, args.seed)
                              if args.events is not None else (None, 0))
        bar = ProgressBar(f"benchmark {scenario.name} ({label})")
        start, cpu = time.perf_counter(), os.times()
        run = run_scenario(variant, policies=policies, seeds=args.seeds,
                           seed=args.seed, trace=trace, progress=bar, jobs=jobs)
        wall_s, after = time.perf_counter() - start, os.times()
        bar.close()
        runs.append((label, run))
        num_events = sum(len(r.trace.events) for cell in run.cells for r in cell.runs)
        num_failures = sum(r.trace.num_failures for cell in run.cells for r in cell.runs)
        print(f"scenario {scenario.name} ({label}): {len(run.policies)} policies x "
              f"{args.seeds} seed(s), {len(run.cells)} cell(s), {num_events} trace events "
              f"({num_failures} failures), {scenario.config.num_workers} workers, "
              f"{jobs} process(es)")
        own = (after.user - cpu.user) + (after.system - cpu.system)
        children = (after.children_user - cpu.children_user) + (
            after.children_system - cpu.children_system)
        peaks = ", ".join(f"{b / 2**20:.0f}" for b in run.process_peak_rss_bytes)
        print(f"wall {wall_s:.1f} s, CPU {own + children:.1f} s ({own:.1f} s here, "
              f"{children:.1f} s in worker processes); peak RSS per process: {peaks} MiB")
        if trace is not None and trace.events:
            print(f"bounded run: {len(trace.events)} of {full_events} events; extrapolated "
                  f"linearly to the whole trace: {wall_s * full_events / len(trace.events):.0f} s")
        for lost in run.lost:
            print(lost.line())
        if len(run.cells) == 1:
            _print_run(run)
    if all(len(run.cells) == 1 for _, run in runs):
        print()
        print(effective_training_table(runs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
