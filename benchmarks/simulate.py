"""Simulator speed and memory: one scenario, every policy, on the same traces.

    .venv/bin/python benchmarks/simulate.py                       # llama3-16k, 1 seed
    .venv/bin/python benchmarks/simulate.py --scenario paper32 --seeds 5

Prints wall time, peak memory (``resource.getrusage`` max RSS), the trace size, how the
time splits between the planner (decisions) and the simulator loop, and each policy's
mean average throughput. The issue's target: ``llama3-16k``, all policies, one seed,
under 60 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from chameleon_ft.sim import policies as sim_policies
from chameleon_ft.sim.events import Trace
from chameleon_ft.sim.report import ProgressBar, policy_summary
from chameleon_ft.sim.runner import run_scenario
from chameleon_ft.sim.scenarios import preset_scenario
from chameleon_ft.sim.traces import generate_trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="llama3-16k")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--policies", default=None, help="comma-separated (default: all)")
    parser.add_argument("--events", type=int, default=None,
                        help="replay only the first N events of the first seed's trace (a "
                             "bounded measurement) and extrapolate to the whole trace")
    args = parser.parse_args()
    scenario = preset_scenario(args.scenario)
    policies = (sim_policies.policy_names(args.policies.split(","))
                if args.policies else None)

    # Time spent inside planner calls, measured by wrapping the adapter's two entry points.
    planner_s = [0.0]
    calls = [0]
    for method in ("on_failure", "on_rejoin"):
        original = getattr(sim_policies.PlannerPolicy, method)

        def timed(self, *a, _original=original, **kw):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return _original(self, *a, **kw)
            finally:
                planner_s[0] += time.perf_counter() - start
                calls[0] += 1

        setattr(sim_policies.PlannerPolicy, method, timed)

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
    run = run_scenario(scenario, policies=policies, seeds=args.seeds, seed=args.seed,
                       trace=trace, progress=bar)
    wall_s = time.perf_counter() - start
    bar.close()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    num_events = sum(len(r.trace.events) for cell in run.cells for r in cell.runs)
    num_failures = sum(r.trace.num_failures for cell in run.cells for r in cell.runs)
    print(f"scenario {args.scenario}: {len(run.policies)} policies x {args.seeds} seed(s), "
          f"{len(run.cells)} cell(s), {num_events} trace events ({num_failures} failures)")
    print(f"wall {wall_s:.1f} s (planner calls {calls[0]}: {planner_s[0]:.1f} s; the rest, "
          f"{wall_s - planner_s[0]:.1f} s, is the planner set-up, Bamboo's estimates and the "
          f"event loop), peak RSS {peak_mib:.0f} MiB")
    if trace is not None and trace.events:
        setup_s = wall_s - planner_s[0]
        per_event_s = planner_s[0] / len(trace.events)
        print(f"bounded run: {len(trace.events)} of {full_events} events; planner "
              f"{per_event_s:.2f} s per event for all policies; extrapolated whole trace: "
              f"{setup_s + per_event_s * full_events:.0f} s")
    if len(run.cells) == 1:
        for name in run.policies:
            s = policy_summary(run.cells[0], name)
            print(f"  {name:10s} {s['avg_throughput_samples_s']:10.4g} samples/s  "
                  f"relative {s['relative_to_failure_free']:.4f} "
                  f"(+-{s['relative_std']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
