"""Two shortcuts of the 16k interleaved job, checked against the exact computation.

    .venv/bin/python benchmarks/schedules.py [--failures N] [--seed S]

1. Merge rules: for rerouted components from random failures of
   examples/llama3-405b-16k.toml (one to three workers, or a whole node), the makespan
   under each of the two merge rules. Graphs above ``SECOND_RULE_MAX_OPS`` operations use
   the first rule only; this shows what the second would have found.
2. Template extrapolation: one pipeline of the job's 16-stage template at micro-batch
   counts beyond the exact range, extrapolated from the steady state
   (``Templates.step_s``; memory from the stages' orders) and simulated exactly.
3. The compiled scheduler against its Python reference (``--speed``): on the same
   rerouted components, the milliseconds per run of each (median, one rule, graph built
   once), their ratio, and that the two timelines are equal.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

from chameleon_ft.perf import Topology
from chameleon_ft.perf.components import _components
from chameleon_ft.perf.estimator import Estimator
from chameleon_ft.perf.graph import _stage_costs, build_graph
from chameleon_ft.perf.kernel import COMPILED
from chameleon_ft.perf.list_scheduler import _list_schedule
from chameleon_ft.plan import ExecutionPlan, initial_plan
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.profile import LayerCost, Profile, build_profile
from chameleon_ft.recovery import templates as templates_module
from chameleon_ft.recovery.templates import Templates, order_fits
from chameleon_ft.spec import load_config

StageCosts = dict[tuple[int, int], tuple[LayerCost, ...]]

ROOT = Path(__file__).resolve().parents[1]


def rerouted_components(failures: int, seed: int
                        ) -> tuple[Profile, Topology, list[tuple[ExecutionPlan, list[int],
                                                                 StageCosts]]]:
    """The rerouted components of ``failures`` random failures of the 16k job (one to
    three workers, or a whole node; failures that lose a stage's every replica skipped)."""
    config = load_config(ROOT / "examples" / "llama3-405b-16k.toml")
    profile = build_profile(config)
    topology = Topology.from_config(config)
    plan = initial_plan(config, profile)
    rng = random.Random(seed)
    out = []
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
        out.extend((rerouted, group, costs) for group, lone in _components(rerouted)
                   if not lone)
    return profile, topology, out


def rules(failures: int, seed: int) -> None:
    profile, topology, components = rerouted_components(failures, seed)
    gains = []
    start = time.perf_counter()
    for rerouted, group, costs in components:
        graph = build_graph(rerouted, profile, topology, group, None, costs)
        first = _list_schedule(graph, "rerouted-first", False).makespan_s
        second = _list_schedule(graph, "ready-first", False).makespan_s
        gains.append(first / second - 1)
    better = [g for g in gains if g > 1e-9]
    print(f"merge rules: {len(gains)} rerouted components in {time.perf_counter() - start:.0f} s;"
          f" the second rule faster in {len(better)}, by at most {max(gains) * 100:.2f}%;"
          f" the first faster by {-sum(gains) / len(gains) * 100:.2f}% on average")


def speed(failures: int, seed: int) -> None:
    if not COMPILED:
        print("compiled scheduler: not built (or CHAMELEON_SCHEDULER=python); nothing to compare")
        return
    profile, topology, components = rerouted_components(failures, seed)
    python_ms, kernel_ms, ratios, ops = [], [], [], []
    for rerouted, group, costs in components:
        graph = build_graph(rerouted, profile, topology, group, None, costs)
        ops.append(len(graph.op_kind))
        t0 = time.process_time()
        slow = _list_schedule(graph, "rerouted-first", False, compiled=False)
        t1 = time.process_time()
        fast = _list_schedule(graph, "rerouted-first", False, compiled=True)
        t2 = time.process_time()
        assert fast == slow, "the compiled timeline differs from the reference"
        python_ms.append((t1 - t0) * 1e3)
        kernel_ms.append((t2 - t1) * 1e3)
        ratios.append((t1 - t0) / max(t2 - t1, 1e-9))
    print(f"compiled scheduler: {len(components)} rerouted components of "
          f"{min(ops):,} to {max(ops):,} operations, every timeline equal; CPU ms per run "
          f"(median): Python {statistics.median(python_ms):.0f}, compiled "
          f"{statistics.median(kernel_ms):.1f}; ratio median {statistics.median(ratios):.0f}x "
          f"(min {min(ratios):.0f}x)")


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
    parser.add_argument("--speed", action="store_true",
                        help="only compare the compiled scheduler with its Python reference")
    args = parser.parse_args()
    if args.speed:
        speed(args.failures, args.seed)
        return
    extrapolation()
    rules(args.failures, args.seed)


if __name__ == "__main__":
    main()
