"""Decision latency of the planner, cold and warm cache, and the quality of its choice.

Run: ``.venv/bin/python benchmarks/decision.py`` (``--quick`` for fewer repetitions).

- setup: building the Planner (profile, failure-free estimate, pipeline templates timed
  at the micro-batch counts single failures ask for); once per job.
- cold: ``decide`` for a single-worker failure with the decision cache cleared (each
  repetition a different worker), templates warm.
- warm: ``decide`` for a failure prepared by ``precompute`` (cache hit: re-scoring only).
- precompute (paper32): filling the cache for every single-worker and single-node failure.
- quality (paper32): the chosen plan's estimated throughput against failure-free after one
  failure and after two failures in the same stage.

Goals (issue 3): paper32 cold < 100 ms, warm < 5 ms; llama3-405b-16k cold < 2 s,
warm < 20 ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from chameleon_ft.policy import Planner
from chameleon_ft.spec.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def bench(name: str, cold_workers: list[int], warm_repeats: int) -> dict[str, float]:
    config = load_config(ROOT / "examples" / f"{name}.toml")
    start = time.perf_counter()
    planner = Planner(config)
    setup_s = time.perf_counter() - start
    plan = planner.initial_plan
    cold = []
    strategies = []
    for worker in cold_workers:
        # Equivalent failures share a cache entry (symmetry), so clear it for a cold one.
        planner.clear_cache()
        start = time.perf_counter()
        decision = planner.decide(plan, [worker])
        cold.append(time.perf_counter() - start)
        assert not decision.cache_hit
        strategies.append(decision.strategy)
    warm_worker = cold_workers[0] + 1
    precompute_s = planner.precompute(plan, failures=[[warm_worker]])
    warm = []
    for _ in range(warm_repeats):
        start = time.perf_counter()
        decision = planner.decide(plan, [warm_worker])
        warm.append(time.perf_counter() - start)
        assert decision.cache_hit
    return {"setup_s": setup_s, "cold_median_s": statistics.median(cold),
            "cold_max_s": max(cold), "warm_median_s": statistics.median(warm),
            "precompute_one_s": precompute_s, "num_cold": len(cold),
            "strategies": ",".join(sorted(set(strategies)))}  # type: ignore[dict-item]


def quality() -> list[tuple[str, str, float]]:
    planner = Planner(load_config(ROOT / "examples" / "paper32.toml"))
    plan = planner.initial_plan
    base = planner.failure_free.throughput_samples_s
    stage = {st.worker: s for _, s, st in plan.iter_stages()}
    same_stage = [w for w in plan.workers if stage[w] == stage[5]][:2]
    out = []
    for label, failed in (("one failure (worker 5)", [5]),
                          (f"two in one stage (workers {same_stage})", same_stage)):
        decision = planner.decide(plan, failed)
        out.append((label, decision.strategy, decision.chosen.throughput_samples_s / base))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    small = [5, 13, 22, 30, 7, 17, 26] if not args.quick else [5, 13, 22]
    large = [300, 777, 1500, 2000, 45] if not args.quick else [300, 1500]
    goals = {"paper32": (0.1, 0.005), "llama3-405b-16k": (2.0, 0.02)}
    print("decision latency (single-worker failure, chameleon policy)")
    print(f"{'example':18s} {'setup':>9s} {'cold median':>12s} {'cold max':>9s} "
          f"{'warm median':>12s} {'goal cold/warm':>15s}  chosen")
    for name, workers in (("paper32", small), ("llama3-405b-16k", large)):
        r = bench(name, workers, warm_repeats=21)
        cold_goal, warm_goal = goals[name]
        print(f"{name:18s} {r['setup_s'] * 1e3:7.0f}ms {r['cold_median_s'] * 1e3:10.1f}ms "
              f"{r['cold_max_s'] * 1e3:7.0f}ms {r['warm_median_s'] * 1e3:10.2f}ms "
              f"{cold_goal * 1e3:7.0f}/{warm_goal * 1e3:.0f} ms  {r['strategies']}")
    planner = Planner(load_config(ROOT / "examples" / "paper32.toml"))
    spent = planner.precompute(planner.initial_plan)
    print(f"\npaper32: precompute every single-worker and single-node failure "
          f"({len(planner.initial_plan.workers) + planner.topology.cluster.num_nodes} sets): "
          f"{spent:.2f} s")
    print()
    print("quality on paper32 (chosen plan's throughput / failure-free)")
    for label, strategy, ratio in quality():
        print(f"  {label:40s} {strategy:22s} {ratio:.4f} (gap {1 - ratio:.2%})")


if __name__ == "__main__":
    main()
