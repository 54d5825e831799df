"""Recovery time and step time of the real runtime, next to the estimator's predictions.

For each strategy (reroute, dynamic, restart) it trains ``examples/tiny_cpu.toml`` on 4
worker processes, SIGKILLs worker 3 in the backward pass of step ``--fault-step``, and
reports:

- ``transition_s``: time from the kill to the first step committed after the recovery,
  minus that plan's own step time (median of its later steps);
- ``detected_after_s``: kill to detection;
- the transition measured in three parts (detection; setup: the decision, the new
  generation's groups, loading or migrating state, until every worker is ready; the first
  step's excess over the plan's median step) next to the planner's estimate of the same
  recovery in the transition model's terms (``detect_s``; ``comm_s + build_s + migrate_s``;
  ``warmup_s``), from the decision the run took (``lost_step_s`` is left out: the
  measurement starts at the kill);
- step time before and after (medians of the committed steps of each plan, the first steps
  of each plan excluded) next to ``estimate(plan).step_s`` for the same plans: with the
  profile and network the config names (measured by ``chameleon_ft.runtime.profiler``);
  with the profile calibrated online from the compute times the workers measured before
  the failure, plus the measured per-step commit latency (control overhead, which the
  estimator does not model); and, after the failure, with that online profile plus
  per-worker speeds for the CPU share (4 processes on 2 cores before; fewer busy
  processes after run faster).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recovery.py [--repeats 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny_cpu.toml"


def _median_step(report: dict[str, Any], gen_filter: Any, skip: int) -> float | None:
    steps = [s["step_s"] for s in report["steps"] if gen_filter(s["gen"])]
    steps = steps[skip:]
    return statistics.median(steps) if steps else None


def run_one(strategy: str, steps: int, fault_step: int, out: Path) -> dict[str, Any]:
    """One training run with one kill; returns the measured and estimated numbers."""
    from chameleon_ft.perf import Topology, estimate
    from chameleon_ft.plan import ExecutionPlan
    from chameleon_ft.runtime.coordinator.shell import Coordinator
    from chameleon_ft.spec import load_config
    from chameleon_ft.spec.train import parse_fault

    config = load_config(CONFIG)
    config = replace(config, train=replace(config.train, steps=steps, checkpoint_every=10))
    fault = parse_fault(f"rank=3,step={fault_step},kind=kill,phase=backward")
    coord = Coordinator(config, policy=strategy, faults=[fault], out_dir=out)
    report = coord.run()
    (event,) = report["events"]
    first_gen = report["steps"][0]["gen"]
    last_gen = report["steps"][-1]["gen"]
    topology = Topology.from_config(config)
    plan_before = ExecutionPlan.from_dict(report["initial_plan"])
    plan_after = ExecutionPlan.from_dict(report["final_plan"])
    # Online calibration: the compute times the workers measured before the failure
    # (healthy plan only) replace the profile's, as a runtime-measured profile would.
    from chameleon_ft.runtime.profiler import calibrate_from_run

    healthy = [r for r in coord.op_times if r["gen"] == first_gen and r["step"] < fault_step]
    online = calibrate_from_run(coord.profile, healthy)  # compute and control times
    control_s = online.control_s
    # This testbed runs every worker process on the same few cores, so a process runs
    # faster when fewer processes are busy: model it as the estimator's per-worker speed,
    # share(n) = min(1, cores / n) relative to the calibration run's n.
    cores = os.cpu_count() or 1

    def share(n: int) -> float:
        return min(1.0, cores / n)

    n_before, n_after = len(plan_before.workers), len(plan_after.workers)
    speed = share(n_after) / share(n_before)
    speeds = {w: speed for w in plan_after.workers}
    # Model-structure check: the new plan's estimate with the compute times its workers
    # measured in the new generation (after two warm-up steps). Compute per op changes
    # after a recovery on this shared-core testbed; with it taken as measured, what is
    # left of the error is the graph's schedule, transfers, synchronisation and control.
    # The transition in parts, measured and estimated (the chosen candidate's terms).
    after = [r for r in report["steps"] if r["gen"] == last_gen]
    median_after = _median_step(report, lambda g: g == last_gen, 2)
    first_step_s = after[0]["step_s"]
    setup_s = event["resumed_at_s"] - first_step_s - event["detected_at_s"]
    chosen = next(c for c in event["decision"]["candidates"]
                  if c["strategy"] == event["strategy"] and c["feasible"])
    terms = {k: v for k, v in chosen["terms"].items() if k not in ("lost_step_s", "search_s")}
    settled = [r for r in coord.op_times if r["gen"] == last_gen and r["step"] >= fault_step + 3]
    measured_after = calibrate_from_run(coord.profile, settled, skip_steps=0) if settled \
        else online
    return {
        "strategy": strategy,
        "busy_processes": [n_before, n_after],
        "measured_ops_after_s": estimate(plan_after, measured_after, topology).step_s,
        "online_cpu_after_s": estimate(plan_after, online, topology,
                                       speeds=speeds).step_s,
        "control_s": control_s,
        "online_before_s": estimate(plan_before, online, topology).step_s,
        "online_after_s": estimate(plan_after, online, topology).step_s,
        "chosen": event["strategy"],
        "detected_after_s": event["detected_after_s"],
        "transition_s": event["transition_s"],
        "first_commit_s": event["resumed_at_s"] - event["fault_at_s"],
        "setup_s": setup_s,
        "first_step_excess_s": first_step_s - (median_after or first_step_s),
        "estimated_terms": terms,
        "estimated_transition_s": sum(terms.values()),
        "decide_s": event["decide_s"],
        "lost_steps": event["lost_steps"],
        "step_before_s": _median_step(report, lambda g: g == first_gen, 3),
        "step_after_s": _median_step(report, lambda g: g == last_gen, 2),
        "estimate_before_s": estimate(plan_before, coord.profile, topology).step_s,
        "estimate_after_s": estimate(plan_after, coord.profile, topology).step_s,
        "plan_after": plan_after.describe(),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--fault-step", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--strategies", default="reroute,dynamic,restart")
    parser.add_argument("--json", metavar="FILE", help="also write the raw rows here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            for r in range(args.repeats):
                rows.append(run_one(strategy, args.steps, args.fault_step,
                                    Path(tmp) / f"{strategy}{r}"))
                row = rows[-1]
                print(f"{strategy:8s} run {r}: kill to first commit {row['first_commit_s']:.3f} s, "
                      f"transition {row['transition_s']:.3f} s, detected "
                      f"after {row['detected_after_s']:.3f} s, step {row['step_before_s']:.3f}"
                      f" -> {row['step_after_s']:.3f} s (online estimate "
                      f"{row['online_before_s']:.3f} -> {row['online_after_s']:.3f} s)",
                      file=sys.stderr, flush=True)
    print(f"command: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recovery.py "
          f"--steps {args.steps} --fault-step {args.fault_step} --repeats {args.repeats}")
    print(f"load average before the table: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print("control overhead (commit latency) per run, s: "
          + ", ".join(f"{row['control_s']:.4f}" for row in rows))
    header = ("strategy", "kill to first commit s", "transition s", "detect s", "lost steps",
              "step before s",
              "est. before s (file / online)", "step after s",
              "est. after s (file / online / online + CPU share / new generation's op times)")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    def est(row: dict[str, Any], which: str) -> str:
        measured = row[f"step_{which}_s"]
        parts = []
        sources = ["estimate", "online"] + (
            ["online_cpu", "measured_ops"] if which == "after" else [])
        for source in sources:
            value = row[f"{source}_{which}_s"]
            parts.append(f"{value:.3f} ({value / measured - 1:+.0%})")
        return " / ".join(parts)

    for row in rows:
        print(" | ".join([
            row["chosen"], f"{row['first_commit_s']:.3f}", f"{row['transition_s']:.3f}",
            f"{row['detected_after_s']:.3f}",
            str(row["lost_steps"]), f"{row['step_before_s']:.3f}", est(row, "before"),
            f"{row['step_after_s']:.3f}", est(row, "after")]))
    print()
    print("transition, measured vs the planner's estimate (s): detection / setup (decision, "
          "groups, state) / first step's excess")
    header = ("strategy", "measured", "estimated", "error", "measured parts", "estimated parts")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for row in rows:
        t = row["estimated_terms"]
        setup_est = sum(v for k, v in t.items() if k not in ("detect_s", "warmup_s"))
        print(" | ".join([
            row["chosen"], f"{row['transition_s']:.3f}", f"{row['estimated_transition_s']:.3f}",
            f"{row['estimated_transition_s'] / row['transition_s'] - 1:+.0%}",
            f"{row['detected_after_s']:.3f} / {row['setup_s']:.3f} / "
            f"{row['first_step_excess_s']:.3f}",
            f"{t.get('detect_s', 0.0):.3f} / {setup_est:.3f} / {t.get('warmup_s', 0.0):.3f}"]))
    for strategy in dict.fromkeys(row["chosen"] for row in rows):
        mine = [row for row in rows if row["chosen"] == strategy]
        measured = statistics.median(row["transition_s"] for row in mine)
        estimated = statistics.median(row["estimated_transition_s"] for row in mine)
        print(f"{strategy}: median measured transition {measured:.3f} s over {len(mine)} "
              f"run(s), estimate {estimated:.3f} s ({estimated / measured - 1:+.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
