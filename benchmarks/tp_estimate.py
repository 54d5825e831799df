"""Benchmark: the estimator's tensor-parallel terms against the runtime's step times.

    PYTHONPATH=src .venv/bin/python benchmarks/tp_estimate.py [--steps N] [--tp 1,2]
        [--pp N]

Trains the emulated-device testbed (``examples/testbed8.toml``: layers that wait a fixed
device time per sample, so compute does not depend on the host's load) as one pipeline
of ``--pp`` stages (4 by default), pp x dp 1, at tp 1 (pp processes) and at tp 2 (2 pp
processes: each worker is a tensor-parallel group of two, each rank waiting half of a
layer's device time and running the group's collectives on gloo), and prints the median step time of each run
(over the generation that committed the most steps, its first ``WARMUP_STEPS`` left out;
a run's failures are counted and fail the check) beside two estimates for the same plan, each with its ratio:

- *declared*: ``perf.estimate`` with the job file's own profile and network, as
  ``chameleon estimate`` prices it: at tp 2 the uniform profile's sharded compute (each
  rank half a layer's device time), its collectives in the group (``[profile]
  tp_collectives`` ring halves over the intra-node link's bandwidth at
  ``tp_collective_latency_s`` a hop) and DTensor's host time per sharded layer
  (``tp_host_fwd_s``, ``tp_host_bwd_s``), the last two measured in isolation by
  ``benchmarks/tp_layer_overhead.py`` (run it right before this one and copy its lines
  into the job file);
- *profiled*: the same plan and network with the layers' times per rank measured by the
  runtime's profiler at that tp (``python -m chameleon_ft.runtime.profiler --from-run``:
  rank 0's forward and backward seconds per micro-batch in a failure-free run of its
  own, collectives and the tensor-parallel framework's host work included, and the
  commit's control time), as ``benchmarks/policies_runtime.py`` profiles the testbed;
- *same-run*: the same with the layers' times taken from the measured run's own op
  times: the estimator's composition alone (the host's load cannot drift between the
  profile and the measurement).

Beside them: the forward and backward seconds per micro-batch of each stage, priced and
measured (rank 0's medians), which say which term misses, and the host's load average
before and after each run. The claim (design 4.11), which the exit status follows: the
profiled and the same-run estimates within 15% (``TOLERANCE``) at both degrees, and the
declared one too at every run whose processes (pp x tp) are at most the host's cores
(``os.cpu_count()``): its host time per sharded layer is measured by two processes
alone, faithful where each rank has a core (``--pp 1`` on a 2-core host). Past that the
declared verdict is printed only: at pp 4 x tp 2 a run's eight processes share the
host's two cores, a rank's host work queues behind the others' and the declared
estimate under-prices it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policies_runtime import _chameleon, _env, load_average, write_toml

ROOT = Path(__file__).resolve().parents[1]
TESTBED = ROOT / "examples" / "testbed8.toml"
TOLERANCE = 0.15
"""The largest relative gap between estimate and measurement the check accepts."""
WARMUP_STEPS = 3
"""Steps left out of the median: the first steps pay DTensor's and gloo's first use."""


def testbed_at(tp: int, steps: int, pp: int = 4) -> dict[str, Any]:
    """The testbed as one pipeline of ``pp`` stages at ``tp``: ``pp`` nodes of ``tp``
    devices, one worker (``tp`` processes) a node, 8 micro-batches of 4 samples a step.
    Below 3 stages a device's memory grows with its share of the 8 layers (the job file's
    holds 3): memory prices no time, the plan is the same pipeline."""
    doc = tomllib.loads(TESTBED.read_text())
    doc["cluster"].update(num_nodes=pp, devices_per_node=tp)
    if pp < 3:
        device = dict(doc["cluster"]["device"])
        device["memory_bytes"] = device["memory_bytes"] * 4 // pp
        doc["cluster"]["device"] = device
    doc["job"].update(pp=pp, dp=1, tp=tp)
    doc["train"].update(steps=steps, checkpoint_every=steps)  # the final checkpoint only
    if tp > 1:
        # DTensor's first operations hold the interpreter for long stretches on a loaded
        # 2-core host: the 6 s deadlines of the tp tests and the chaos benchmark (design
        # 4.11), or a sibling's first collective may time out
        doc["train"].update(timeout_s=6.0, hang_timeout_s=6.0)
    return doc


def estimated(path: Path) -> dict[str, Any]:
    """The estimator's step time and breakdown for the job file's failure-free plan, and
    each stage's forward and backward seconds per micro-batch as the profile prices them."""
    from chameleon_ft.perf import Topology, estimate
    from chameleon_ft.plan import initial_plan
    from chameleon_ft.profile import build_profile, stage_sums
    from chameleon_ft.spec.config import load_config

    config = load_config(path)
    profile = build_profile(config)
    plan = initial_plan(config, profile)
    out = estimate(plan, profile, Topology.from_config(config))
    stages = [stage_sums(profile, list(s.layers)) for s in plan.pipelines[0].stages]
    return {"step_s": out.step_s, **out.breakdown.to_dict(),
            "stage_f_s": [c.fwd_s for c in stages], "stage_b_s": [c.bwd_s for c in stages]}


def same_run(path: Path, run: Path) -> float:
    """The estimator's step for the job file's plan with each layer's time per rank taken
    from the measured run itself (``profiler.calibrate_from_run`` on its op times: rank
    0's forward and backward per micro-batch, the commit's control time): what is left
    of the gap is the estimator's composition (schedule, transfers, commit), not a
    layer's cost."""
    from chameleon_ft.perf import Topology, estimate
    from chameleon_ft.plan import initial_plan
    from chameleon_ft.profile import build_profile
    from chameleon_ft.runtime.profiler import calibrate_from_run
    from chameleon_ft.spec.config import load_config

    config = load_config(path)
    rows = [json.loads(line) for line in (run / "op_times.jsonl").read_text().splitlines()]
    profile = calibrate_from_run(build_profile(config), rows, skip_steps=WARMUP_STEPS)
    plan = initial_plan(config, profile)
    return estimate(plan, profile, Topology.from_config(config)).step_s


def profiled(path: Path, out: Path, steps: int, timeout_s: float) -> Path:
    """The job file with its layers' times per rank measured by the runtime's profiler at
    the job's tp (its network as the job file states it); returns the new file."""
    profile = out / f"{path.stem}-profile.json"
    subprocess.run([sys.executable, "-m", "chameleon_ft.runtime.profiler", "--config",
                    str(path), "--out", str(profile), "--from-run", str(steps)],
                   check=True, env=_env(), capture_output=True, text=True, timeout=timeout_s)
    doc = tomllib.loads(path.read_text())
    doc["profile"] = {"kind": "file", "path": str(profile.resolve())}
    measured_path = out / f"{path.stem}-profiled.toml"
    write_toml(doc, measured_path)
    return measured_path


def stage_medians(run: Path, gen: int) -> tuple[list[float], list[float]]:
    """Each stage's median forward and backward seconds per micro-batch (rank 0's) in
    generation ``gen``, its first ``WARMUP_STEPS`` steps left out."""
    rows = [json.loads(line) for line in (run / "op_times.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["gen"] == gen]
    first = min(r["step"] for r in rows)
    rows = [r for r in rows if r["step"] >= first + WARMUP_STEPS]
    workers = sorted({r["worker"] for r in rows})
    f = [statistics.median(x for r in rows if r["worker"] == w for x in r["f_s"])
         for w in workers]
    b = [statistics.median(x for r in rows if r["worker"] == w for x in r["b_s"])
         for w in workers]
    return f, b


def measured(path: Path, out: Path, timeout_s: float) -> dict[str, Any]:
    """One failure-free ``chameleon train`` run: its median step time and the load."""
    load_before = load_average()
    proc = subprocess.run(_chameleon("train", "--config", str(path), "--out", str(out),
                                     "--json"),
                          capture_output=True, text=True, env=_env(), timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{path.name}: {proc.stderr.strip().splitlines()[-1:]}")
    report = json.loads(proc.stdout)
    # the generation that committed the most steps (all of them in a failure-free run)
    by_gen: dict[int, list[float]] = {}
    for s in report["steps"]:
        by_gen.setdefault(s["gen"], []).append(s["step_s"])
    gen = max(by_gen, key=lambda g: len(by_gen[g]))
    steps = by_gen[gen][WARMUP_STEPS:]
    stage_f_s, stage_b_s = stage_medians(out, gen)
    return {"median_step_s": statistics.median(steps), "steps": len(steps),
            "stage_f_s": stage_f_s, "stage_b_s": stage_b_s,
            "min_step_s": min(steps), "max_step_s": max(steps),
            "failures": len(report["events"]), "generation": gen,
            "load_before": load_before,
            "load_after": load_average()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per run")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel degrees to run")
    parser.add_argument("--pp", type=int, default=4,
                        help="pipeline stages (dp 1): pp x tp processes a run")
    parser.add_argument("--out", default="", help="run folder (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the profiled estimate (the profiler's own run)")
    args = parser.parse_args(argv)
    if not 1 <= args.pp <= 8:
        parser.error("--pp: give 1 to 8 stages (the testbed has 8 layers)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out or tempfile.mkdtemp(prefix="tp_estimate_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"testbed pp {args.pp} x dp 1, {args.steps} steps, median of steps {WARMUP_STEPS}.., "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores")
    print(f"{'tp':>3} {'measured s':>11} {'declared s':>11} {'ratio':>6} {'profiled s':>11} "
          f"{'ratio':>6} {'same-run s':>11} {'ratio':>6} {'load before/after':>18}")
    within: dict[str, bool] = {"declared": True, "profiled": True, "same-run": True}
    # the declared verdict counts where each rank has a core of its own (the emulation's
    # premise, design 4.11); a contended run's is printed, not checked
    declared_checked = True
    cores = os.cpu_count() or 1
    notes = []
    for tp in [int(t) for t in args.tp.split(",")]:
        path = out / f"testbed-tp{tp}.toml"
        write_toml(testbed_at(tp, args.steps, args.pp), path)
        declared = estimated(path)
        run = measured(path, out / f"run-tp{tp}", args.timeout)
        by_rank = estimated(profiled(path, out, args.steps, args.timeout)) \
            if args.profile else None
        ratio = run["median_step_s"] / declared["step_s"]
        ratio_p = run["median_step_s"] / by_rank["step_s"] if by_rank else float("nan")
        own_s = same_run(path, out / f"run-tp{tp}")
        checked = [("declared", ratio), ("same-run", run["median_step_s"] / own_s)]
        for name, r in checked + ([("profiled", ratio_p)] if by_rank else []):
            within[name] = (within[name] and abs(r - 1) <= TOLERANCE
                            and not run["failures"])
        if args.pp * tp <= cores:
            declared_checked = (declared_checked and abs(ratio - 1) <= TOLERANCE
                                and not run["failures"])
        failed = f"  ({run['failures']} failures)" if run["failures"] else ""
        print(f"{tp:>3} {run['median_step_s']:>11.3f} {declared['step_s']:>11.3f} "
              f"{ratio:>6.3f} {by_rank['step_s'] if by_rank else float('nan'):>11.3f} "
              f"{ratio_p:>6.3f} {own_s:>11.3f} {run['median_step_s'] / own_s:>6.3f} "
              f"{run['load_before']:>8.1f}/{run['load_after']:<8.1f}{failed}")
        parts = ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in declared.items()
                          if isinstance(v, float) and k != "step_s")
        notes.append(f"tp {tp}: declared estimate {parts}")
        for name, key in (("forward", "stage_f_s"), ("backward", "stage_b_s")):
            priced = " ".join(f"{v * 1e3:5.1f}" for v in declared[key])
            got = " ".join(f"{v * 1e3:5.1f}" for v in run[key])
            notes.append(f"tp {tp}: {name} ms per micro-batch by stage, priced {priced}, "
                         f"measured {got}")
        (out / f"tp{tp}.json").write_text(json.dumps(
            {"declared": declared, "profiled": by_rank, "same_run_s": own_s, "run": run},
            indent=1))
    print("\n".join(notes))
    verdicts = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in within.items())
    print(f"within {TOLERANCE:.0%}: {verdicts} (runs in {out})")
    # the claim (design 4.11): with the layers' times per rank measured the estimate holds;
    # the declared one where each rank has a core; its host time per sharded layer,
    # measured by one group alone, misses the contention of more ranks than cores
    return 0 if within["profiled"] and within["same-run"] and declared_checked else 1


if __name__ == "__main__":
    sys.exit(main())
