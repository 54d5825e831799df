"""Every policy on the real runtime: the same failure traces replayed under each policy,
each measured throughput next to the simulator's prediction for the same trace.

The testbed is ``examples/testbed8.toml``: 8 worker processes (4 nodes x 2, pp 4 x dp 2)
of a model whose layers take a fixed device time (``examples/emulated_device.py``), each
worker's memory holding at most 3 of the 8 layers. One run of the benchmark:

1. profiles the testbed on this machine (``python -m chameleon_ft.runtime.profiler``: the
   gloo latency and bandwidth, the commit latency, group formation and layer
   re-instantiation times, and the per-op times measured in a failure-free run of the
   runtime itself);
2. writes ``OUT/testbed.toml``: the testbed with that profile, the measured network and
   transition terms, and ``[recovery] checkpoint_interval_s`` set to ``checkpoint_every``
   steps at the measured failure-free step (the policy's assumption; the simulator, like
   the runtime, checkpoints every ``[train] checkpoint_every`` committed steps);
3. asks the simulator for each trace's prediction (``chameleon simulate --config
   OUT/testbed.toml --trace T --json``);
4. replays each trace under each policy (``chameleon train --config OUT/testbed.toml
   --trace T --policy P --json``), ``--repeats`` times, in round-robin order so that the
   load of other work on the host weighs on every policy alike, recording the load
   average around each run;
5. prints, per trace and policy, the median measured ``throughput_samples_s``, the run-to-run
   spread, the prediction and its error, and checks that Chameleon is at least each fixed
   policy within the measured noise (the larger of the two cells' spreads, at least the
   median spread over all cells) and that every prediction is within 15%. A second
   prediction moves every repair later by the time the runs measured between a relaunch
   and the relaunched worker being up, plus one step (a plan changes at a step
   boundary): what the runtime's repairs really take, and the simulator's do not. A
   third runs the simulator at the runs' own failure-free step (every compute time of
   the profile scaled by the measured step over the estimated one: the runtime runs a
   few percent slower than its profile, enough for a fault to fall on the other side of
   a checkpoint boundary than in the runs).

The traces are ``benchmarks/traces/testbed8-*.csv``, drawn once by ``--make-traces`` (the
simulator's generator: node MTBF 80 s, repairs after 30 s, Llama 3's mix, groups of 2
nodes; seeds whose trace keeps at least half the workers alive); traces 4 and 5 are drawn
until a stage of the layout loses both its replicas at least three times (repeated
restarts).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/policies_runtime.py --repeats 3 \\
        --out out/policies_runtime [--traces 1,2,3] [--policies chameleon,reroute,...] \\
        [--spare-nodes 1 --policies chameleon,swap]
    .venv/bin/python benchmarks/policies_runtime.py --out out/policies_runtime --summarize
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parents[1]
TESTBED = ROOT / "examples" / "testbed8.toml"
TRACES = Path(__file__).resolve().parent / "traces"
POLICIES = ("chameleon", "reroute", "dynamic", "restart", "shrink")
"""The runtime's policies the simulator also has (``swap`` too, on a testbed with spare
nodes: ``--spare-nodes``)."""
TOLERANCE = 0.15
"""The largest relative gap between prediction and measurement that the check accepts."""


def _env() -> dict[str, str]:
    # the testbed's model lives beside the example job file; the derived job file is not
    # in that folder, so the factories are found through PYTHONPATH
    env = dict(os.environ)
    paths = [str(ROOT / "examples")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _chameleon(*args: str) -> list[str]:
    return [sys.executable, "-m", "chameleon_ft", *args]


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


# ---------------------------------------------------------------------- traces
def _dead_after_each(trace: Any) -> list[set[int]]:
    """The testbed's dead workers after each event of ``trace`` (4 nodes of 2 workers)."""
    from chameleon_ft.failures import EventKind

    dead: set[int] = set()
    out = []
    for e in trace.events:
        nodes_workers = {w for n in e.target for w in (2 * n, 2 * n + 1)}
        if e.kind == EventKind.WORKER_FAIL:
            dead |= set(e.target)
        elif e.kind in (EventKind.NODE_FAIL, EventKind.GROUP_FAIL):
            dead |= nodes_workers
        elif e.kind == EventKind.REPAIR:
            dead -= nodes_workers
        out.append(set(dead))
    return out


def stage_losses(trace: Any) -> int:
    """How often some stage of the testbed's layout (pp 4 x dp 2, pipeline-major: stage s of
    pipeline p on worker 4p + s) loses both its replicas: each such loss leaves a layer
    without a live copy, so every policy restarts from the checkpoint."""
    count, lost_before = 0, False
    for dead in _dead_after_each(trace):
        lost = any({s, 4 + s} <= dead for s in range(4))
        count += lost and not lost_before
        lost_before = lost
    return count


def make_traces(count: int = 3, duration_s: float = 150.0, *, first: int = 1,
                first_seed: int = 0, min_stage_losses: int = 0) -> list[Path]:
    """Draw committed traces: the first seeds (from ``first_seed``) whose trace never has
    fewer than half the workers alive, holds a software fault and a repair, and at least
    ``min_stage_losses`` stage losses (:func:`stage_losses`); written to ``traces/`` as
    ``testbed8-<first>.csv`` and on."""
    from chameleon_ft.failures import EventKind, trace_to_csv
    from chameleon_ft.sim.traces import generate_trace
    from chameleon_ft.spec.scenario import FailureSpec

    failures = FailureSpec(node_mtbf_hours=80 / 3600, repair="fixed", repair_hours=30 / 3600,
                           group_nodes=2)
    paths: list[Path] = []
    seed = first_seed
    while len(paths) < count:
        trace = generate_trace(failures, num_nodes=4, workers_per_node=2,
                               duration_s=duration_s, seed=seed)
        fewest = 8 - max((len(d) for d in _dead_after_each(trace)), default=0)
        kinds = {e.kind for e in trace.events}
        losses = stage_losses(trace)
        if (fewest >= 4 and EventKind.REPAIR in kinds and EventKind.SOFTWARE in kinds
                and losses >= min_stage_losses):
            path = TRACES / f"testbed8-{first + len(paths)}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(trace_to_csv(trace))
            print(f"{path.name}: seed {seed}, {len(trace.events)} events, at least {fewest} "
                  f"workers alive, {losses} stage losses", flush=True)
            paths.append(path)
        seed += 1
    return paths


def make_stage_loss_traces() -> list[Path]:
    """Traces 4 and 5: the same failures, drawn from seed 1000 on until a stage of the
    layout loses both replicas at least three times: repeated restarts, where the
    checkpoint cadence decides what each one loses."""
    return make_traces(2, first=4, first_seed=1000, min_stage_losses=3)


# ---------------------------------------------------------------------- testbed
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def write_toml(doc: dict[str, Any], path: Path) -> None:
    """Write a job file (tables of scalars and one level of inline tables)."""
    lines = []
    for table, values in doc.items():
        lines.append(f"[{table}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
        lines.append("")
    path.write_text("\n".join(lines))


def testbed_doc(workers: int = 8, spare_nodes: int = 0) -> dict[str, Any]:
    """The testbed's job file as a dict (``workers=4``: the suite's smaller variant, 2 nodes,
    pp 2 x dp 2, room for 5 layers per worker; ``spare_nodes``: warm spare nodes of 2
    workers after the layout's, idle at the start)."""
    doc = tomllib.loads(TESTBED.read_text())
    if spare_nodes:
        doc["cluster"]["spare_nodes"] = spare_nodes
    if workers == 4:
        doc["cluster"].update(num_nodes=2, device={"preset": "cpu", "memory_bytes": 6_000_000})
        doc["job"].update(pp=2, dp=2, global_batch=16)
    elif workers != 8:
        raise ValueError(f"--workers: 4 or 8, got {workers}")
    return doc


def profile_testbed(doc: dict[str, Any], out: Path, from_run: int = 30) -> dict[str, Any]:
    """Run the runtime's profiler on the testbed; returns the profile's JSON."""
    out.mkdir(parents=True, exist_ok=True)
    base = out / "testbed-declared.toml"
    write_toml(doc, base)
    profile = out / "profile.json"
    subprocess.run([sys.executable, "-m", "chameleon_ft.runtime.profiler", "--config",
                    str(base), "--out", str(profile), "--from-run", str(from_run)],
                   check=True, env=_env(), capture_output=True, text=True, timeout=900)
    return dict(json.loads(profile.read_text()))


def measured_testbed(doc: dict[str, Any], profile: dict[str, Any], out: Path) -> Path:
    """The testbed with the measured profile and network; returns its path."""
    from chameleon_ft.perf import Topology, estimate
    from chameleon_ft.plan import initial_plan
    from chameleon_ft.profile import build_profile
    from chameleon_ft.spec.config import load_config

    doc = json.loads(json.dumps(doc))
    meta = profile["meta"]
    for link in ("intra_node", "inter_node"):
        doc["cluster"][f"{link}_latency_us"] = round(meta["p2p_latency_s"] * 1e6, 1)
        doc["cluster"][f"{link}_gb_per_s"] = round(meta["p2p_bandwidth_bytes_s"] / 1e9, 3)
    doc["recovery"].update({k: float(f"{v:.4g}") for k, v in meta["recovery"].items()})
    doc["profile"] = {"kind": "file", "path": str((out / "profile.json").resolve())}
    path = out / "testbed.toml"
    write_toml(doc, path)
    config = load_config(path)
    prof = build_profile(config)
    step_s = estimate(initial_plan(config, prof), prof, Topology.from_config(config)).step_s
    # both checkpoint every checkpoint_every committed steps; the interval is what the
    # policy assumes of a restart's lost work when it prices fragility (design 3.4)
    doc["recovery"]["checkpoint_interval_s"] = round(doc["train"]["checkpoint_every"] * step_s,
                                                     3)
    write_toml(doc, path)
    return path


def calibrated_testbed(config: Path, ratio: float) -> Path:
    """The measured testbed with every compute time of its profile times ``ratio`` (the
    failure-free step the runs measured over the one the profile estimates): what the
    simulator predicts when it runs at the runtime's own pace, so that faults fall on
    the same side of a checkpoint boundary as in the runs. Returns the new job file."""
    doc = tomllib.loads(config.read_text())
    profile = json.loads(Path(doc["profile"]["path"]).read_text())
    for key in ("optimizer_step_s", "control_s"):
        profile[key] *= ratio
    for layer in profile["layers"]:
        for key in ("fwd_s", "bwd_input_s", "bwd_weight_s"):
            layer[key] *= ratio
    path = config.with_name("profile-calibrated.json")
    path.write_text(json.dumps(profile, indent=1))
    doc["profile"]["path"] = str(path.resolve())
    doc["recovery"]["checkpoint_interval_s"] = round(
        doc["recovery"]["checkpoint_interval_s"] * ratio, 3)
    out = config.with_name("testbed-calibrated.toml")
    write_toml(doc, out)
    return out


# ---------------------------------------------------------------------- runs
def simulate(config: Path, trace: Path, policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The simulator's result of each policy on the trace (its JSON report's entry)."""
    proc = subprocess.run(_chameleon("simulate", "--config", str(config), "--trace", str(trace),
                                     "--policies", ",".join(policies), "--json", "--jobs", "1"),
                          check=True, capture_output=True, text=True, env=_env(), timeout=600)
    doc = json.loads(proc.stdout)
    return {p["name"]: p for p in doc["cells"][0]["policies"]}


def predict(config: Path, trace: Path, policies: Sequence[str]) -> dict[str, float]:
    """The simulator's average throughput of each policy on the trace."""
    return {name: float(p["avg_throughput_samples_s"])
            for name, p in simulate(config, trace, policies).items()}


def simulated_restarts(config: Path, trace: Path,
                       policies: Sequence[str]) -> dict[str, dict[str, float]]:
    """Restarts from the checkpoint in the simulator (decided ones and software faults) and
    the work they threw away, in failure-free seconds."""
    return {name: {"restarts": round(p["decisions"].get("restart", 0)
                                     + p["num_software_restarts"]),
                   "lost_s": p["time_lost_s"].get("lost_work_s", 0.0)}
            for name, p in simulate(config, trace, policies).items()}


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """What the benchmark reads from one run's report."""
    events = [e for e in report["events"] if not e["idle"]]
    strategies: dict[str, int] = {}
    for e in events:
        strategies[e["strategy"]] = strategies.get(e["strategy"], 0) + 1
    first_gen = [s["step_s"] for s in report["steps"][1:] if s["gen"] == 0]
    repairs = report["trace"].get("repairs", [])
    return {
        "throughput_samples_s": report["throughput_samples_s"],
        "committed_steps": report["trace"]["committed_steps"],
        "end_reached": report["trace"]["end_reached"],
        "strategies": strategies,
        "rejoins": [r["strategy"] for r in report["rejoins"]],
        "lost_steps": sum(e["lost_steps"] for e in events),
        "failure_free_step_s": statistics.median(first_gen) if first_gen else None,
        "repair_up_s": [r["up_at_s"] - r["relaunched_at_s"] for r in repairs
                        if r["up_at_s"] is not None],
        "repair_in_plan_s": [r["in_plan_at_s"] - r["relaunched_at_s"] for r in repairs
                             if r["in_plan_at_s"] is not None],
    }


def replay(config: Path, trace: Path, policy: str, out: Path,
           timeout_s: float = 900.0) -> dict[str, Any]:
    """One ``chameleon train --trace`` run; returns its figures."""
    load_before = load_average()
    t = time.monotonic()
    proc = subprocess.run(_chameleon("train", "--config", str(config), "--trace", str(trace),
                                     "--policy", policy, "--out", str(out), "--json"),
                          capture_output=True, text=True, env=_env(), timeout=timeout_s)
    wall_s = time.monotonic() - t
    (out.parent / f"{out.name}.log").write_text(proc.stderr)
    run: dict[str, Any] = {"policy": policy, "out": str(out), "wall_s": wall_s,
                           "load_before": load_before, "load_after": load_average()}
    if proc.returncode != 0:
        run["failed"] = proc.stderr.strip().splitlines()[-1:]
    else:
        run.update(figures(json.loads(proc.stdout)))
    return run


def delayed_repairs(trace_path: Path, delay_s: float, out: Path) -> Path:
    """The trace with every repair ``delay_s`` later (never past the next failure of one of
    the repaired nodes' workers, nor the end); returns the new file."""
    from chameleon_ft.failures import EventKind, Trace, TraceEvent, trace_from_csv, trace_to_csv

    trace = trace_from_csv(trace_path.read_text(), num_nodes=4, workers_per_node=2)

    def workers(e: TraceEvent) -> set[int]:
        if e.kind == EventKind.WORKER_FAIL:
            return set(e.target)
        return {w for n in e.target for w in (2 * n, 2 * n + 1)}

    moved = []
    for i, e in enumerate(trace.events):
        at = e.time_s
        if e.kind == EventKind.REPAIR:
            at = min(e.time_s + delay_s, trace.duration_s - 1e-3)
            for later in trace.events[i + 1:]:
                if later.kind != EventKind.REPAIR and workers(later) & workers(e):
                    at = min(at, later.time_s)
                    break
        moved.append((at, i, TraceEvent(at, e.kind, e.target)))
    events = tuple(e for _, _, e in sorted(moved, key=lambda x: (x[0], x[1])))
    path = out / f"{trace_path.stem}-repairs+{delay_s:.1f}s.csv"
    path.write_text(trace_to_csv(Trace(events=events, duration_s=trace.duration_s)))
    return path


def summarize(runs: list[dict[str, Any]], predictions: dict[str, dict[str, float]],
              traces: Sequence[str], policies: Sequence[str],
              delayed: dict[str, dict[str, float]] | None = None,
              restarts: dict[str, dict[str, dict[str, float]]] | None = None,
              step_s: float | None = None,
              calibrated: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """Medians, spreads, prediction errors and the checks (``step_s``: the estimated
    failure-free step, to express steps thrown away by restarts in failure-free seconds
    as the simulator does)."""
    cells: dict[str, dict[str, Any]] = {}
    spreads = []
    for trace in traces:
        for policy in policies:
            cell_runs = [r for r in runs
                         if r["trace"] == trace and r["policy"] == policy and "failed" not in r]
            values = [r["throughput_samples_s"] for r in cell_runs]
            if not values:
                continue
            median = statistics.median(values)
            spread = (max(values) - min(values)) / median if len(values) > 1 and median else 0.0
            if len(values) > 1:
                spreads.append(spread)
            predicted = predictions[trace].get(policy)
            later = (delayed or {}).get(trace, {}).get(policy)
            paced = (calibrated or {}).get(trace, {}).get(policy)
            cells[f"{trace}/{policy}"] = {
                "trace": trace, "policy": policy, "runs": values, "median": median,
                "spread": spread, "predicted": predicted,
                "error": None if predicted is None else (predicted - median) / median,
                "predicted_delayed": later,
                "error_delayed": None if later is None else (later - median) / median,
                "predicted_paced": paced,
                "error_paced": None if paced is None else (paced - median) / median,
                "restarts": [r["strategies"].get("restart", 0) for r in cell_runs],
                "restarts_simulated": (restarts or {}).get(trace, {}).get(policy),
                "lost_s": statistics.median(r["lost_steps"] for r in cell_runs) * step_s
                if step_s else None}
    noise = statistics.median(spreads) if spreads else 0.0
    ahead, within = [], []
    for trace in traces:
        ours = cells.get(f"{trace}/chameleon")
        for policy in policies:
            cell = cells.get(f"{trace}/{policy}")
            if cell is None:
                continue
            if cell["error"] is not None:
                within.append({"trace": trace, "policy": policy,
                               "ok": abs(cell["error"]) <= TOLERANCE, "error": cell["error"]})
            if policy != "chameleon" and ours is not None:
                # two medians differ by luck up to what either cell's own runs spread
                pair = max(noise, ours["spread"], cell["spread"])
                gap = (ours["median"] - cell["median"]) / cell["median"]
                ahead.append({"trace": trace, "policy": policy, "gap": gap, "noise": pair,
                              "ok": gap >= -pair})
    return {"cells": cells, "noise_median_spread": noise,
            "noise_max_spread": max(spreads, default=0.0),
            "chameleon_ahead": ahead, "prediction_within": within,
            "failed_runs": sum(1 for r in runs if "failed" in r)}


def table(summary: dict[str, Any], traces: Sequence[str], policies: Sequence[str]) -> str:
    """The Markdown table of RESULTS.md."""
    lines = ["| trace | policy | measured samples/s (runs) | spread | simulator | error | "
             "simulator, repairs delayed | error | simulator at the measured step | error | "
             "restarts (runs / simulator) | work lost to restarts, s (median run / simulator) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for trace in traces:
        for policy in policies:
            cell = summary["cells"].get(f"{trace}/{policy}")
            if cell is None:
                continue
            runs = ", ".join(f"{v:.1f}" for v in cell["runs"])
            pred = "-" if cell["predicted"] is None else f"{cell['predicted']:.1f}"
            err = "-" if cell["error"] is None else f"{cell['error']:+.1%}"
            later = "-" if cell["predicted_delayed"] is None else \
                f"{cell['predicted_delayed']:.1f}"
            err_later = "-" if cell["error_delayed"] is None else \
                f"{cell['error_delayed']:+.1%}"
            paced = "-" if cell.get("predicted_paced") is None else \
                f"{cell['predicted_paced']:.1f} | {cell['error_paced']:+.1%}"
            paced = paced if paced != "-" else "- | -"
            restarts = ", ".join(str(n) for n in cell["restarts"])
            sim = cell["restarts_simulated"]
            simulated = "-" if sim is None else sim["restarts"]
            lost = "-" if cell["lost_s"] is None or sim is None else \
                f"{cell['lost_s']:.0f} / {sim['lost_s']:.0f}"
            lines.append(f"| {trace} | {policy} | {cell['median']:.1f} ({runs}) | "
                         f"{cell['spread']:.1%} | {pred} | {err} | {later} | {err_later} | "
                         f"{paced} | {restarts} / {simulated} | {lost} |")
    return "\n".join(lines)


def _print_run(run: dict[str, Any], predicted: float | None) -> None:
    print(f"{run['trace']} {run['policy']} #{run['repeat']}: "
          + (f"FAILED {run['failed']}" if "failed" in run else
             f"{run['throughput_samples_s']:.2f} samples/s (predicted "
             f"{float('nan') if predicted is None else predicted:.2f}), "
             f"{json.dumps(run['strategies'])}, rejoins {run['rejoins']}, failure-free step "
             f"{run['failure_free_step_s'] or float('nan'):.3f} s")
          + f", load {run['load_before']:.1f}, {run['wall_s']:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/policies_runtime", help="output folder")
    parser.add_argument("--repeats", type=int, default=3, help="runs per trace and policy")
    parser.add_argument("--traces", default="1,2,3,4,5", help="which testbed8-N.csv traces")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workers", type=int, default=8, choices=(4, 8))
    parser.add_argument("--spare-nodes", type=int, default=0, metavar="K",
                        help="warm spare nodes beside the layout (the traces never fail them; "
                             "add swap to --policies to compare it)")
    parser.add_argument("--make-traces", action="store_true",
                        help="draw the committed traces again and exit")
    parser.add_argument("--summarize", action="store_true",
                        help="only re-read the runs in --out and print the table again")
    args = parser.parse_args(argv)
    if args.make_traces:
        make_traces()
        make_stage_loss_traces()
        return 0
    policies = [p for p in args.policies.split(",") if p]
    trace_paths = [TRACES / f"testbed8-{n}.csv" for n in args.traces.split(",") if n]
    names = [p.stem for p in trace_paths]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.summarize:
        config = out / "testbed.toml"
        runs = json.loads((out / "runs.json").read_text())
        for run in runs:  # figures added since the run are read from its report
            report = Path(run["out"]) / "report.json"
            if "failed" not in run and report.exists():
                run.update(figures(json.loads(report.read_text())))
        runs = [r for r in runs if r["trace"] in names and r["policy"] in policies]
    else:
        doc = testbed_doc(args.workers, args.spare_nodes)
        print(f"profiling the testbed (load {load_average():.1f})", flush=True)
        config = measured_testbed(doc, profile_testbed(doc, out), out)
    predictions = {p.stem: predict(config, p, policies) for p in trace_paths}
    print(json.dumps(predictions, indent=1), flush=True)
    if not args.summarize:
        runs = []
        for rep in range(args.repeats):
            for path in trace_paths:
                # rotate the order per trace and repeat: drift in the host's load spreads out
                shift = (rep + names.index(path.stem)) % len(policies)
                for policy in policies[shift:] + policies[:shift]:
                    run = replay(config, path, policy,
                                 out / "runs" / f"{path.stem}-{policy}-{rep}")
                    run.update(trace=path.stem, repeat=rep)
                    runs.append(run)
                    _print_run(run, predictions[path.stem].get(policy))
                    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    for run in runs:
        if args.summarize:
            _print_run(run, predictions[run["trace"]].get(run["policy"]))
    ok_runs = [r for r in runs if "failed" not in r]
    # the runtime's repairs take effect later than the trace says: the relaunched process
    # starts (seconds on a loaded host), then the plan changes at the next step boundary
    up = [x for r in ok_runs for x in r.get("repair_up_s", [])]
    steps = [r["failure_free_step_s"] for r in ok_runs if r.get("failure_free_step_s")]
    delay = statistics.median(up) + statistics.median(steps) if up and steps else 0.0
    delayed = {p.stem: predict(config, delayed_repairs(p, delay, out), policies)
               for p in trace_paths} if delay else None
    restarts = {p.stem: simulated_restarts(config, p, policies) for p in trace_paths}
    # measured_testbed set the interval to checkpoint_every estimated failure-free steps
    testbed = tomllib.loads(config.read_text())
    step_s = testbed["recovery"]["checkpoint_interval_s"] / testbed["train"]["checkpoint_every"]
    # a third prediction at the runs' own failure-free step (the runtime is a few percent
    # slower than its profile: faults then fall on the same side of a checkpoint)
    paced_config = calibrated_testbed(config, statistics.median(steps) / step_s) \
        if steps else None
    calibrated = {p.stem: predict(paced_config, p, policies)
                  for p in trace_paths} if paced_config is not None else None
    summary = summarize(runs, predictions, names, policies, delayed, restarts, step_s,
                        calibrated)
    # re-read runs: the time they took then, not this summary's
    summary["wall_s"] = (sum(r.get("wall_s", 0.0) for r in runs) if args.summarize
                         else time.monotonic() - started)
    summary["load"] = [r["load_before"] for r in runs]
    summary["repair_delay_s"] = delay
    summary["repair_up_s"] = sorted(up)
    summary["failure_free_step_s"] = sorted(steps)
    profile = json.loads((out / "profile.json").read_text())
    (out / "summary.json").write_text(json.dumps(
        {"args": vars(args), "predictions": predictions, "delayed_predictions": delayed,
         "paced_predictions": calibrated,
         "summary": summary, "profile_meta": profile["meta"], "runs": runs}, indent=1))
    print(table(summary, names, policies))
    if up and steps:
        print(f"relaunched worker up after {statistics.median(up):.2f} s (median of "
              f"{len(up)}, {min(up):.2f}-{max(up):.2f}); failure-free step "
              f"{statistics.median(steps):.3f} s ({min(steps):.3f}-{max(steps):.3f}); "
              f"repairs delayed by {delay:.2f} s in the second prediction")
    print(f"noise (run-to-run spread): median {summary['noise_median_spread']:.1%}, "
          f"max {summary['noise_max_spread']:.1%}; load average "
          f"{min(summary['load']):.1f}-{max(summary['load']):.1f}; "
          f"{summary['wall_s'] / 60:.0f} min")
    for check in summary["chameleon_ahead"]:
        if not check["ok"]:
            print(f"chameleon behind {check['policy']} on {check['trace']}: "
                  f"{check['gap']:+.1%} (noise {check['noise']:.1%})")
    for check in summary["prediction_within"]:
        if not check["ok"]:
            print(f"prediction off on {check['trace']}/{check['policy']}: {check['error']:+.1%}")
    ok = summary["failed_runs"] == 0 and all(c["ok"] for c in summary["chameleon_ahead"]) and \
        all(c["ok"] for c in summary["prediction_within"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
