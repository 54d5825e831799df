"""Full-precision results of a bounded run, to compare two commits byte for byte.

    PYTHONPATH=src .venv/bin/python benchmarks/exactness.py > out/64k-300.txt
    PYTHONPATH=src .venv/bin/python benchmarks/exactness.py --scenario llama3-16k --events 100

Replays the first ``--events`` events (300 by default) of the first seed's trace of a
preset (llama3-64k by default) with every policy (``--policies`` picks some) and prints the
``repr`` of each policy's ``RunResult``, one per line, in policy order: every float at full
precision, every decision count, the whole throughput timeline. A refactoring that claims to
change no result must leave this output byte-identical (``cmp``) to the base commit's, as
it must every preset's ``chameleon simulate --json`` report; the JSON rounds nothing away
either, but covers only the whole traces that run in minutes.
"""

from __future__ import annotations

import argparse
import sys

from chameleon_ft.failures import Trace
from chameleon_ft.sim import policies as sim_policies
from chameleon_ft.sim.runner import run_scenario
from chameleon_ft.sim.scenarios import preset_scenario
from chameleon_ft.sim.traces import generate_trace
from chameleon_ft.spec.scenario import POLICY_NAMES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="llama3-64k")
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--policies", default=None, help="comma-separated (default: all ten)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    if args.events < 1:
        parser.error(f"--events: must be at least 1, got {args.events}")
    scenario = preset_scenario(args.scenario)
    policies = (sim_policies.policy_names(args.policies.split(","))
                if args.policies else POLICY_NAMES)
    config, sim = scenario.config, scenario.simulation
    whole = generate_trace(scenario.failures, num_nodes=config.cluster.num_nodes,
                           workers_per_node=config.workers_per_node, duration_s=sim.duration_s,
                           seed=sim.seed, spare_nodes=config.cluster.spare_nodes)
    n = min(args.events, len(whole.events))
    end_s = whole.events[n].time_s if n < len(whole.events) else whole.duration_s
    run = run_scenario(scenario, policies=policies, trace=Trace(whole.events[:n], end_s),
                       jobs=args.jobs)
    for lost in run.lost:
        print(lost.line())
    for result in run.cells[0].runs[0].results:
        print(repr(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
