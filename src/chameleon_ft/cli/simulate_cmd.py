"""``chameleon simulate``: replay failure traces against every policy, side by side.

Three ways to say what to simulate::

    chameleon simulate --scenario paper32 [--seeds 5] [--out out/paper32]
    chameleon simulate --config examples/scenarios/spot.toml --policies chameleon,reroute
    chameleon simulate --job examples/paper32.toml --days 7 --node-mtbf-hours 12 \\
        --repair-hours 3 [--trace trace.csv]

``--spare-nodes K`` adds K warm spare nodes to the fleet (the ``swap`` policy joins the
default policies) and ``--memory-checkpoint`` keeps checkpoints in host memory too.
``--slow-policy`` sets the answer to slow workers (a trace's fail-slows): ``keep`` leaves
them be (no fail-slow handling), a fixed answer for every policy that plans with Chameleon's
planner, ``chameleon`` (the default) Chameleon's choice.

With ``--out`` the JSON and Markdown reports and the PNG plots are written there, only
once every run has finished (a simulation process that died is one line on stderr and in
the reports; the other results are kept). ``--save-trace`` writes the (first) generated
trace as CSV.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

from chameleon_ft.failures import Trace, trace_from_csv, trace_to_csv
from chameleon_ft.sim.policies import policy_names
from chameleon_ft.sim.report import ProgressBar, render, report_json, report_markdown, write_files
from chameleon_ft.sim.runner import default_jobs, run_scenario
from chameleon_ft.sim.scenarios import PRESETS, Scenario, preset_scenario, scenario_from_config
from chameleon_ft.spec.config import load_config
from chameleon_ft.spec.recovery import SLOW_POLICY_NAMES
from chameleon_ft.spec.scenario import POLICY_NAMES, RepairKind


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chameleon simulate``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", metavar="NAME",
                        help=f"a preset scenario: {', '.join(PRESETS)}")
    source.add_argument("--config", metavar="FILE.toml",
                        help="a scenario file: job tables plus [simulation] and [failures]")
    source.add_argument("--job", metavar="JOB.toml",
                        help="any job file of `chameleon estimate`; failures from the flags below")
    parser.add_argument("--policies", metavar="A,B,...",
                        help="policies to compare (default: all): " + ", ".join(POLICY_NAMES))
    parser.add_argument("--seeds", type=int, metavar="N", help="independent traces (mean, spread)")
    parser.add_argument("--seed", type=int, metavar="S", help="first seed")
    parser.add_argument("--out", metavar="DIR", help="write report.json, report.md and PNG plots")
    parser.add_argument("--json", action="store_true", help="print the JSON report")
    parser.add_argument("--days", type=float, metavar="N", help="simulated days")
    parser.add_argument("--node-mtbf-hours", type=float, metavar="H",
                        help="mean time between failures of one node, hours")
    repair = parser.add_mutually_exclusive_group()
    repair.add_argument("--repair-hours", type=float, metavar="R",
                        help="failed nodes come back after R hours (fixed)")
    repair.add_argument("--no-repair", action="store_true", help="failed nodes never come back")
    parser.add_argument("--trace", metavar="FILE.csv",
                        help="replay this trace (time_s,event,target) instead of generating one")
    parser.add_argument("--save-trace", metavar="FILE.csv",
                        help="also write the first generated trace as CSV")
    parser.add_argument("--spare-nodes", type=int, metavar="K",
                        help="warm spares: K more nodes whose workers start idle ([cluster] "
                             "spare_nodes); they are part of the fleet and fail too")
    parser.add_argument("--memory-checkpoint", action="store_true",
                        help="keep checkpoints in other hosts' memory too ([recovery] "
                             "memory_checkpoint)")
    parser.add_argument("--slow-policy", choices=SLOW_POLICY_NAMES,
                        help="the answer to slow workers ([recovery] slow_policy): chameleon "
                             "(default), or keep (no fail-slow handling), rebalance, dynamic, "
                             "swap, evict")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="processes running policies and seeds at once (default: every "
                             "core); the results do not depend on it")


def _positive(flag: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag}: must be a positive number, got {value}")


def _scenario(args: argparse.Namespace) -> Scenario:
    """The scenario the flags describe, with their overrides applied."""
    if args.scenario is not None:
        scenario = preset_scenario(args.scenario)
    elif args.config is not None:
        config = load_config(args.config)
        scenario = scenario_from_config(Path(args.config).stem, config)
    else:
        config = load_config(args.job)
        # A job file may not carry the simulator's tables: start from their defaults.
        scenario = scenario_from_config(Path(args.job).stem, config)
        if args.days is None and args.trace is None:
            raise ValueError("--days: give the simulated duration (or a --trace with an end row)")
    for flag, value in (("--days", args.days), ("--node-mtbf-hours", args.node_mtbf_hours),
                        ("--repair-hours", args.repair_hours)):
        _positive(flag, value)
    if args.seeds is not None and args.seeds < 1:
        raise ValueError(f"--seeds: must be >= 1, got {args.seeds}")
    if args.seed is not None and args.seed < 0:
        raise ValueError(f"--seed: must be >= 0, got {args.seed}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs: must be >= 1, got {args.jobs}")
    if args.spare_nodes is not None and args.spare_nodes < 0:
        raise ValueError(f"--spare-nodes: must be >= 0, got {args.spare_nodes}")
    simulation, failures = scenario.simulation, scenario.failures
    policy = scenario.config.policy
    if args.days is not None:
        simulation = replace(simulation, days=args.days)
    if args.node_mtbf_hours is not None:
        failures = replace(failures, node_mtbf_hours=args.node_mtbf_hours)
        policy = replace(policy, node_mtbf_hours=args.node_mtbf_hours)
    if args.repair_hours is not None:
        failures = replace(failures, repair=RepairKind.FIXED.value, repair_hours=args.repair_hours)
        policy = replace(policy, repair_hours=args.repair_hours)
    if args.no_repair:
        failures = replace(failures, repair=RepairKind.NONE.value)
        policy = replace(policy, repair_hours=None)
    if args.policies is not None:
        simulation = replace(simulation, policies=policy_names(args.policies.split(",")))
    config = replace(scenario.config, policy=policy)
    if args.spare_nodes is not None:
        config = replace(config, cluster=replace(config.cluster, spare_nodes=args.spare_nodes))
    if args.memory_checkpoint:
        config = replace(config, recovery=replace(config.recovery, memory_checkpoint=True))
    if args.slow_policy is not None:
        config = replace(config, recovery=replace(config.recovery, slow_policy=args.slow_policy))
    if simulation.is_sweep and (args.node_mtbf_hours is not None or args.repair_hours is not None
                                or args.no_repair or args.trace is not None):
        raise ValueError("--scenario: a sweep sets the failure rate and repair time itself; "
                         "drop --node-mtbf-hours, --repair-hours, --no-repair and --trace")
    return replace(scenario, config=config, simulation=simulation, failures=failures)


def _trace(args: argparse.Namespace, scenario: Scenario) -> Trace | None:
    path = args.trace if args.trace is not None else scenario.simulation.trace or None
    if path is None:
        return None
    p = Path(path) if args.trace is not None else scenario.config.resolve(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--trace: cannot read {str(p)!r}: {exc.strerror}") from None
    duration = scenario.simulation.duration_s if args.days is not None else None
    config = scenario.config
    return trace_from_csv(text, num_nodes=config.cluster.total_nodes,
                          workers_per_node=config.workers_per_node, duration_s=duration)


def run(args: argparse.Namespace) -> int:
    """Run ``chameleon simulate``.

    Returns:
        0 on success; 1 when a simulation process died (one line each on stderr; the
        report holds the other results).

    Raises:
        ValueError: for bad flags, an unknown scenario or policy, or a bad trace; nothing
            is written then.
    """
    scenario = _scenario(args)
    trace = _trace(args, scenario)
    if trace is not None:
        scenario = replace(scenario, simulation=replace(
            scenario.simulation, days=trace.duration_s / 86400.0))
    bar = ProgressBar(f"simulate {scenario.name}")
    try:
        result = run_scenario(scenario, seeds=args.seeds, seed=args.seed, trace=trace,
                              progress=bar, jobs=args.jobs or default_jobs())
    finally:
        bar.close()
    # Everything is rendered before anything is written (dataclass replace() re-validates
    # every override above, so bad flags fail before the run).
    files = render(result) if args.out is not None else {}
    if args.save_trace is not None:
        target = Path(args.save_trace)
        write_files(target.parent, {target.name: trace_to_csv(result.cells[0].runs[0].trace)
                                    .encode()})
    if args.out is not None:
        paths = write_files(args.out, files)
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    print(report_json(result) if args.json else report_markdown(result), end="")
    for lost in result.lost:
        print(lost.line(), file=sys.stderr)
    return 1 if result.lost else 0
