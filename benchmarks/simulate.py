"""Simulator speed and memory: one scenario, every policy, on the same traces.

    .venv/bin/python benchmarks/simulate.py                       # llama3-16k, 1 seed
    .venv/bin/python benchmarks/simulate.py --scenario paper32 --seeds 5

Prints wall time, peak memory (``resource.getrusage`` max RSS of this process and of the
largest worker process), the trace size and each policy's mean average throughput. The issue's target: ``llama3-16k``, all policies, one seed,
under 60 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from chameleon_ft.failures import Trace
from chameleon_ft.sim import policies as sim_policies
from chameleon_ft.sim.report import ProgressBar, policy_summary
from chameleon_ft.sim.runner import default_jobs, run_scenario
from chameleon_ft.sim.scenarios import preset_scenario
from chameleon_ft.sim.traces import generate_trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="llama3-16k")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--policies", default=None, help="comma-separated (default: all)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes (default: every core, as `chameleon simulate`)")
    parser.add_argument("--events", type=int, default=None,
                        help="replay only the first N events of the first seed's trace (a "
                             "bounded measurement) and extrapolate to the whole trace")
    args = parser.parse_args()
    scenario = preset_scenario(args.scenario)
    policies = (sim_policies.policy_names(args.policies.split(","))
                if args.policies else None)

    trace = None
    full_events = 0
    if args.events is not None:
        config = scenario.config
        sim = scenario.simulation
        whole = generate_trace(scenario.failures, num_nodes=config.cluster.num_nodes,
                               workers_per_node=config.workers_per_node,
                               duration_s=sim.duration_s,
                               seed=args.seed if args.seed is not None else sim.seed)
        full_events = len(whole.events)
        n = min(args.events, full_events)
        end_s = whole.events[n].time_s if n < full_events else whole.duration_s
        trace = Trace(whole.events[:n], end_s)
    bar = ProgressBar(f"benchmark {args.scenario}")
    start = time.perf_counter()
    jobs = args.jobs or default_jobs()
    run = run_scenario(scenario, policies=policies, seeds=args.seeds, seed=args.seed,
                       trace=trace, progress=bar, jobs=jobs)
    wall_s = time.perf_counter() - start
    bar.close()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    num_events = sum(len(r.trace.events) for cell in run.cells for r in cell.runs)
    num_failures = sum(r.trace.num_failures for cell in run.cells for r in cell.runs)
    print(f"scenario {args.scenario}: {len(run.policies)} policies x {args.seeds} seed(s), "
          f"{len(run.cells)} cell(s), {num_events} trace events ({num_failures} failures), "
          f"{jobs} process(es)")
    print(f"wall {wall_s:.1f} s, peak RSS {peak_mib:.0f} MiB (this process), "
          f"{child_mib:.0f} MiB (largest worker process)")
    if trace is not None and trace.events:
        print(f"bounded run: {len(trace.events)} of {full_events} events; extrapolated "
              f"linearly to the whole trace: {wall_s * full_events / len(trace.events):.0f} s")
    if len(run.cells) == 1:
        for name in run.policies:
            s = policy_summary(run.cells[0], name)
            print(f"  {name:10s} {s['avg_throughput_samples_s']:10.4g} samples/s  "
                  f"relative {s['relative_to_failure_free']:.4f} "
                  f"(+-{s['relative_std']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
