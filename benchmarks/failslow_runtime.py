"""Fail-slow on the real runtime: detection, Chameleon's answer against keeping the slow
worker, exactness, precision and recall, and false alarms on a loaded host.

The testbed is ``examples/testbed8.toml`` (8 worker processes, pp 4 x dp 2, layers of a
fixed device time: ``examples/emulated_device.py``), in float64. Three parts:

1. **The must-hold run**: worker 3 slowed 3x from step 20 for 60 steps
   (``--fault rank=3,step=20,kind=slow,factor=3,steps=60``), trained 100 steps under
   ``--slow-policy chameleon`` and ``--slow-policy keep`` (interleaved, ``--repeats``
   times, so the host's load weighs on both alike), beside a failure-free run. Reported:
   the slow steps measured before the detection, the slowdown's end to its clearing, the
   strategy chosen, each run's training time (first to last commit) with Chameleon's
   saving over keep (the goal: at least 10%), and every run's largest parameter
   difference from the failure-free run (the goal: below 1e-9).
2. **Precision and recall**: one run under ``keep`` (the plan never changes, so every
   injection meets the same plan) with slowdowns of 1.3x, 1.5x, 2x and 3x on different
   workers, one at a time, each for ``--slow-steps`` steps with as many clean steps
   between. A slowdown is found when its worker is declared slow between its first slow
   step and its end (plus the clearing window); precision is the share of declarations
   that found one. Reported per factor: recall and the slow steps measured before the
   detection.
3. **False alarms**: ``--clean-steps`` (default 1,000) steps without a fault while
   ``--load`` processes spin on the host's cores; every slow declaration is a false alarm.

``--quick`` runs a short version of each (40-step must-hold runs with the slowdown from
step 10 for 20 steps, one injection per factor, 200 clean steps).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/failslow_runtime.py --out out/failslow \\
        [--quick] [--repeats 1] [--parts 1,2,3] [--load 1] [--hang-timeout S] \\
        [--json out/failslow.json]
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
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parents[1]
TESTBED = ROOT / "examples" / "testbed8.toml"
FACTORS = (1.3, 1.5, 2.0, 3.0)
"""The injected slowdowns of part 2 (Falcon's range, docs/design.md 6)."""
CLEAR_SLACK = 8
"""Steps after a slowdown's end its declaration may still come from it (part 2)."""


HANG_TIMEOUT_S: float | None = None
"""``--hang-timeout``: the testbed's hang deadline replaced (None: its own, 3 s)."""


def testbed(steps: int) -> dict[str, Any]:
    """The testbed's job, in float64, ``steps`` steps, checkpoints every 20."""
    doc = tomllib.loads(TESTBED.read_text())
    doc["train"].update(steps=steps, dtype="float64")
    if HANG_TIMEOUT_S is not None:
        doc["train"]["hang_timeout_s"] = HANG_TIMEOUT_S
    return doc


def run(doc: dict[str, Any], out: Path, faults: list[str], slow_policy: str) -> dict[str, Any]:
    """Train once in this process; returns the figures of the run."""
    from chameleon_ft.runtime.coordinator.shell import Coordinator
    from chameleon_ft.spec.config import config_from_mapping
    from chameleon_ft.spec.train import parse_fault

    doc = json.loads(json.dumps(doc))
    doc["recovery"]["slow_policy"] = slow_policy
    lines: list[str] = []
    coord = Coordinator(config_from_mapping(doc), out_dir=out, log=lines.append,
                        faults=[parse_fault(f) for f in faults])
    try:
        report = coord.run()
    except Exception as exc:
        (out / "log.txt").write_text("\n".join(lines))
        return {"failed": f"{type(exc).__name__}: {exc}"}
    (out / "log.txt").write_text("\n".join(lines))
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    at = {m["step"]: m["at_s"] for m in metrics}
    return {"report": report, "params": coord.params,
            "train_s": at[max(at)] - at[min(at)] if at else None,
            "committed": len(at)}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest elementwise difference between two runs' parameters."""
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


def slow_events(report: dict[str, Any], cause: str = "slow") -> list[dict[str, Any]]:
    """The run's records of ``cause`` (``slow`` or ``slow-end``)."""
    return [e for e in report["events"] if e["cause"] == cause]


# ---------------------------------------------------------------------- part 1
def must_hold(out: Path, steps: int, start: int, length: int, repeats: int) -> dict[str, Any]:
    """Worker 3 slowed 3x: Chameleon against keep, beside a failure-free run."""
    doc = testbed(steps)
    fault = f"rank=3,step={start},kind=slow,factor=3,steps={length}"
    reference = run(doc, out / "reference", [], "chameleon")
    if "failed" in reference:
        return {"failed": f"reference: {reference['failed']}"}
    cells: dict[str, list[dict[str, Any]]] = {"chameleon": [], "keep": []}
    for i in range(repeats):
        for policy in cells:
            r = run(doc, out / f"{policy}-{i}", [fault], policy)
            if "failed" in r:
                cells[policy].append({"failed": r["failed"]})
                continue
            report = r["report"]
            found = slow_events(report)
            ended = slow_events(report, "slow-end")
            fired = report["faults"][0]
            cells[policy].append({
                "train_s": r["train_s"], "committed": r["committed"],
                "max_diff": max_diff(r["params"], reference["params"]),
                "detected_after_steps": found[0]["step"] - fired["fired_step"] if found
                else None,
                "factor": found[0]["factor"] if found else None,
                "strategy": found[0]["strategy"] if found else None,
                "cleared_after_steps": ended[0]["step"] - fired.get("ended_step", 0)
                if ended and "ended_step" in fired else None,
                "end_strategy": ended[0]["strategy"] if ended else None,
                "false_alarms": len(found) - 1 if found else 0,
                "failures": [e["cause"] for e in report["events"]
                             if e["cause"] not in ("slow", "slow-end")]})
            print(f"  {policy} {i}: {json.dumps(cells[policy][-1])}", flush=True)
    ok = [c for c in cells["chameleon"] + cells["keep"] if "failed" not in c]
    median = {p: statistics.median(c["train_s"] for c in cs if "failed" not in c)
              for p, cs in cells.items() if any("failed" not in c for c in cs)}
    saving = 1 - median["chameleon"] / median["keep"] if len(median) == 2 else None
    return {"fault": fault, "steps": steps, "reference_train_s": reference["train_s"],
            "runs": cells, "median_train_s": median, "saving_vs_keep": saving,
            "max_diff": max((c["max_diff"] for c in ok), default=None),
            "goal_saving": saving is not None and saving >= 0.10,
            "goal_exact": bool(ok) and max(c["max_diff"] for c in ok) < 1e-9,
            "goal_detect": bool(ok) and all(c["detected_after_steps"] is not None
                                            and c["detected_after_steps"] <= 5 for c in ok)}


# ---------------------------------------------------------------------- part 2
def precision_recall(out: Path, slow_steps: int, per_factor: int) -> dict[str, Any]:
    """Slowdowns of 1.3x to 3x injected one at a time under keep: precision and recall."""
    injections = []
    step = 20
    workers = [3, 6, 1, 4, 0, 7, 2, 5]
    for i, factor in enumerate(f for f in FACTORS for _ in range(per_factor)):
        injections.append((workers[i % len(workers)], step, factor))
        step += 2 * slow_steps
    doc = testbed(step + 10)
    faults = [f"rank={w},step={s},kind=slow,factor={f},steps={slow_steps}"
              for w, s, f in injections]
    r = run(doc, out / "precision-recall", faults, "keep")
    if "failed" in r:
        return {"failed": r["failed"]}
    report = r["report"]
    declared = slow_events(report)
    fired = {i: f for i, f in enumerate(report["faults"])}
    matched: set[int] = set()
    rows = []
    for i, (w, s, f) in enumerate(injections):
        first = fired[i].get("fired_step", s)
        last = fired[i].get("ended_step", first + slow_steps)
        hit = next((e for j, e in enumerate(declared) if j not in matched
                    and e["workers"] == [w] and first < e["step"] <= last + CLEAR_SLACK), None)
        if hit is not None:
            matched.add(declared.index(hit))
        rows.append({"worker": w, "factor": f, "found": hit is not None,
                     "after_steps": None if hit is None else hit["step"] - first,
                     "measured": None if hit is None else hit["factor"]})
    by_factor = {str(f): {"recall": sum(x["found"] for x in rows if x["factor"] == f)
                          / sum(1 for x in rows if x["factor"] == f),
                          "after_steps": [x["after_steps"] for x in rows
                                          if x["factor"] == f and x["found"]],
                          "measured": [x["measured"] for x in rows
                                       if x["factor"] == f and x["found"]]}
                 for f in FACTORS}
    return {"injections": rows, "declared": len(declared),
            "failures": [e["cause"] for e in report["events"]
                         if e["cause"] not in ("slow", "slow-end")],
            "precision": len(matched) / len(declared) if declared else None,
            "recall": sum(x["found"] for x in rows) / len(rows), "by_factor": by_factor,
            "train_s": r["train_s"]}


# ---------------------------------------------------------------------- part 3
def false_alarms(out: Path, steps: int, load: int) -> dict[str, Any]:
    """A clean run while ``load`` processes spin: every slow declaration is false."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(load)]
    try:
        r = run(testbed(steps), out / "clean", [], "chameleon")
        load_avg = os.getloadavg()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    if "failed" in r:
        return {"failed": r["failed"]}
    report = r["report"]
    return {"steps": r["committed"], "load_processes": load,
            "load_average_1m": round(load_avg[0], 2),
            "false_alarms": len(slow_events(report)),
            "other_events": [e["cause"] for e in report["events"] if e["cause"] != "slow"],
            "train_s": r["train_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the runs")
    parser.add_argument("--quick", action="store_true", help="a short version of each part")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run (1,2,3)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="part 1: runs of each policy (interleaved)")
    parser.add_argument("--slow-steps", type=int, default=None,
                        help="part 2: steps of each slowdown (default 30; quick 20)")
    parser.add_argument("--per-factor", type=int, default=None,
                        help="part 2: slowdowns per factor (default 2; quick 1)")
    parser.add_argument("--clean-steps", type=int, default=None,
                        help="part 3: clean steps (default 1000; quick 200)")
    parser.add_argument("--load", type=int, default=1,
                        help="part 3: processes spinning on the host meanwhile")
    parser.add_argument("--hang-timeout", type=float, metavar="S",
                        help="the testbed's hang deadline (default its own, 3 s): a host "
                             "whose CPUs are contended for seconds holds every heartbeat "
                             "back that long, a false hang that is no part of this benchmark")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    global HANG_TIMEOUT_S
    HANG_TIMEOUT_S = args.hang_timeout
    sys.path.insert(0, str(ROOT / "examples"))  # the testbed's model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = {int(p) for p in args.parts.split(",") if p}
    result: dict[str, Any] = {"quick": args.quick, "hang_timeout_s": args.hang_timeout,
                              "load_average_1m_start": round(os.getloadavg()[0], 2)}
    t = time.monotonic()
    if 1 in parts:
        print("part 1: worker 3 slowed 3x, chameleon against keep", flush=True)
        steps, start, length = (40, 10, 20) if args.quick else (100, 20, 60)
        result["must_hold"] = must_hold(out, steps, start, length, args.repeats)
        print(json.dumps({k: v for k, v in result["must_hold"].items() if k != "runs"}),
              flush=True)
    if 2 in parts:
        print("part 2: precision and recall over 1.3x-3x", flush=True)
        result["precision_recall"] = precision_recall(
            out, args.slow_steps or (20 if args.quick else 30),
            args.per_factor or (1 if args.quick else 2))
        print(json.dumps(result["precision_recall"]), flush=True)
    if 3 in parts:
        steps = args.clean_steps or (200 if args.quick else 1000)
        print(f"part 3: {steps} clean steps with {args.load} spinning process(es)", flush=True)
        result["false_alarms"] = false_alarms(out, steps, args.load)
        print(json.dumps(result["false_alarms"]), flush=True)
    result["wall_s"] = round(time.monotonic() - t, 1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
