"""Two shortcuts of the 16k interleaved job, checked against the exact computation.

    .venv/bin/python benchmarks/schedules.py [--failures N] [--seed S]

1. Merge rules: for rerouted components from random failures of
   examples/llama3-405b-16k.toml (one to three workers, or a whole node), the makespan
   under each of the two merge rules. Graphs above ``SECOND_RULE_MAX_OPS`` operations use
   the first rule only; this shows what the second would have found.
2. Template extrapolation: one pipeline of the job's 16-stage template at micro-batch
   counts beyond the exact range, extrapolated from the steady state
   (``Templates.step_s``; memory from the stages' orders) and simulated exactly.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

from chameleon_ft.perf import Topology
from chameleon_ft.perf.estimator import Estimator, _components
from chameleon_ft.perf.schedule import _list_schedule, _stage_costs, build_graph
from chameleon_ft.plan import ExecutionPlan, initial_plan
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.profile import build_profile
from chameleon_ft.recovery import templates as templates_module
from chameleon_ft.recovery.templates import Templates, order_fits
from chameleon_ft.spec import load_config

ROOT = Path(__file__).resolve().parents[1]


def rules(failures: int, seed: int) -> None:
    config = load_config(ROOT / "examples" / "llama3-405b-16k.toml")
    profile = build_profile(config)
    topology = Topology.from_config(config)
    plan = initial_plan(config, profile)
    rng = random.Random(seed)
    gains = []
    start = time.perf_counter()
    for _ in range(failures):
        size = rng.choice([1, 1, 2, 3, 8])
        if size == 8:  # a whole node's workers
            node = rng.randrange(config.cluster.num_nodes)
            per = config.workers_per_node
            failed = list(range(node * per, (node + 1) * per))
        else:
            failed = rng.sample(range(len(plan.workers)), size)
        try:
            rerouted = reroute_plan(plan, failed)
        except ValueError:
            continue  # a stage lost every replica
        costs = _stage_costs(rerouted, profile)
        for group, lone in _components(rerouted):
            if lone:
                continue
            graph = build_graph(rerouted, profile, topology, group, None, costs)
            first = _list_schedule(graph, "rerouted-first", False).makespan_s
            second = _list_schedule(graph, "ready-first", False).makespan_s
            gains.append(first / second - 1)
    better = [g for g in gains if g > 1e-9]
    print(f"merge rules: {len(gains)} rerouted components in {time.perf_counter() - start:.0f} s;"
          f" the second rule faster in {len(better)}, by at most {max(gains) * 100:.2f}%;"
          f" the first faster by {-sum(gains) / len(gains) * 100:.2f}% on average")


def extrapolation() -> None:
    config = load_config(ROOT / "examples" / "llama3-405b-16k.toml")
    profile = build_profile(config)
    topology = Topology.from_config(config)
    estimator = Estimator(profile, topology)

    def price(plan: ExecutionPlan) -> tuple[float, bool]:
        est = estimator.estimate(plan)
        return est.step_s, est.memory_fits

    templates = Templates(profile, capacity_bytes=topology.memory_capacity_bytes,
                          micro_batch=1, schedule=config.job.schedule,
                          num_workers=topology.num_workers,
                          workers_per_node=topology.workers_per_node, pipeline_estimate=price)
    layout = templates.layout(16)
    assert layout is not None
    worst = {False: 0.0, True: 0.0}  # by whether the larger groups fit (else: padded)
    seen = {False: 0, True: 0}
    agree = 0
    counts = [*range(49, 130, 3), 150, 211, 300, 333]
    for m in counts:
        extrapolated = templates.step_s(layout, m)
        exact, fits = price(templates.one_pipeline(layout, m))
        agree += math.isfinite(extrapolated) == fits
        if fits and math.isfinite(extrapolated):
            even = order_fits(profile, layout, m, config.job.schedule,
                              topology.memory_capacity_bytes, padded=False)
            seen[even] += 1
            worst[even] = max(worst[even], abs(extrapolated / exact - 1))
    print(f"template extrapolation: {len(counts)} counts from {counts[0]} to {counts[-1]} "
          f"micro-batches (exact up to {max(48, templates_module.EXACT_MAX_OPS // 256)}): "
          f"memory verdict equal in {agree}; largest relative difference in step "
          f"{worst[True]:.1e} on the {seen[True]} whose groups of at least S fit, "
          f"{worst[False]:.1e} on the {seen[False]} that fit padded groups only")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", type=int, default=75)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    extrapolation()
    rules(args.failures, args.seed)


if __name__ == "__main__":
    main()
