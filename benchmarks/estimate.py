"""Benchmark: how long the estimator takes on the example jobs, and the process's memory.

    .venv/bin/python benchmarks/estimate.py [--repeats N]

Each timing builds a fresh ``Estimator`` (no cached pipelines or plans), so it is the cost
of a cold estimate. Reports the median over the repeats and the peak resident memory of
the process. Goals: paper32 under 20 ms, llama3-405b-16k under 1 s.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time
from pathlib import Path

from chameleon_ft.perf import Estimator, Topology
from chameleon_ft.plan import initial_plan
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.profile import build_profile
from chameleon_ft.spec import load_config

ROOT = Path(__file__).resolve().parents[1]
CASES = (("paper32", "examples/paper32.toml", [5], 0.020),
         ("llama3-405b-16k", "examples/llama3-405b-16k.toml", [300], 1.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {platform.python_implementation()} "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print(f"{'job':18} {'plan':12} {'median':>10} {'min':>10} {'goal':>8}  step_s")
    for name, path, failed, goal_s in CASES:
        config = load_config(ROOT / path)
        profile = build_profile(config)
        topology = Topology.from_config(config)
        plan = initial_plan(config, profile)
        rerouted = reroute_plan(plan, failed)
        for label, target in (("failure-free", plan), (f"fail {failed[0]}", rerouted)):
            times = []
            step_s = 0.0
            for _ in range(args.repeats):
                estimator = Estimator(profile, topology)
                t0 = time.perf_counter()
                step_s = estimator.estimate(target).step_s
                times.append(time.perf_counter() - t0)
            median = statistics.median(times)
            flag = "ok" if median < goal_s else "SLOW"
            print(f"{name:18} {label:12} {median * 1e3:8.2f}ms {min(times) * 1e3:8.2f}ms "
                  f"{goal_s * 1e3:6.0f}ms  {step_s:.3f} {flag}")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory of the process: {peak_mib:.0f} MiB")


if __name__ == "__main__":
    main()
