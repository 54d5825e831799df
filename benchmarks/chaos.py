"""Chaos benchmark: hundreds of random faults against the real runtime, every run held
against a failure-free run of the same job in float64.

Each run trains a small GPT on ``--workers`` worker processes with re-join on, while
``chameleon_ft.runtime.chaos.ChaosHooks`` injects ``--faults`` faults in episodes: kills,
hangs, errors and glitches in every phase of a step, slowdowns (a worker 1.3 to 3 times
slower for 5 to 25 steps), two workers at once, a fault during a recovery, during a
migration, on a repaired worker. Then one more run has its
coordinator SIGKILLed (with one worker stopped) and is continued with ``--resume``.

Reported: faults injected and fired, runs whose parameters equal the failure-free run's
(max difference), steps lost outside restarts, stray processes, detection and recovery
time (median, p99), how often each strategy was chosen, and how many slow workers were
declared and found at full speed again.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chaos.py --workers 8 --faults 20 \\
        --runs 15 --seed 1 [--json out/chaos8.json] [--no-resume] [--tp 2]

``--tp 2``: every worker is two processes sharding its layers (design 4.11), on twice the
devices per node, with the hang deadline a loaded host keeps for twice the processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

LAYOUTS = {4: (2, 2, 2, 2), 8: (2, 4, 2, 4), 16: (4, 4, 4, 4), 32: (8, 4, 4, 8)}
"""workers -> (nodes, devices per node, pp, dp)."""


def chaos_doc(workers: int, steps: int, tp: int = 1) -> dict[str, Any]:
    """The job: a 2-block GPT in float64 on ``workers`` workers of ``tp`` processes."""
    nodes, per_node, pp, dp = LAYOUTS[workers]
    big = workers * tp >= 16  # many processes on few cores: heartbeats arrive later
    return {
        "model": {"name": f"chaos{workers}", "num_blocks": max(2, pp), "hidden_size": 32,
                  "num_heads": 2, "vocab_size": 256, "seq_len": 32},
        "cluster": {"num_nodes": nodes, "devices_per_node": per_node * tp, "device": "cpu"},
        "job": {"pp": pp, "dp": dp, "tp": tp, "global_batch": 4 * dp, "micro_batch": 2},
        "profile": {"kind": "analytic"},
        # the runtime's own transition terms, as measured for examples/tiny_cpu.toml
        "recovery": {"detect_s": 0.03, "comm_init_s": 0.0017, "comm_per_rank_s": 0.0095,
                     "rebuild_all_groups": True, "layer_build_s": 0.0,
                     "layer_build_gb_per_s": 0.74, "warmup_steps": 0.4, "restart_s": 0.1,
                     "checkpoint_load_s": 0.05, "checkpoint_interval_s": 3.0},
        "train": {"steps": steps, "dtype": "float64", "lr": 3e-3,
                  "hang_timeout_s": 6.0 if tp > 1 else 3.0 if big else 1.0,
                  # DTensor's first operations on a loaded host outlast the 3 s floor
                  **({"collective_timeout_s": 6.0} if tp > 1 else {}),
                  "heartbeat_s": 0.1 if big else 0.05, "checkpoint_every": 5,
                  "rejoin": True, "max_retries": 3, "join_timeout_s": 300.0},
    }


def _toml(doc: dict[str, Any]) -> str:
    lines = []
    for table, values in doc.items():
        lines.append(f"[{table}]")
        for key, value in values.items():
            text = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


NCCL_SEMANTICS = False
"""``--nccl-semantics``: every worker group completes operations as NCCL's do."""


def run_reference(doc: dict[str, Any], out: Path) -> dict[str, Any]:
    from chameleon_ft.runtime.coordinator.shell import Coordinator
    from chameleon_ft.spec.config import config_from_mapping

    coord = Coordinator(config_from_mapping(doc), out_dir=out, nccl_semantics=NCCL_SEMANTICS)
    report = coord.run()
    assert not report["events"], ("the failure-free reference had failures: "
                                  f"{[(e['workers'], e['cause']) for e in report['events']]}")
    return coord.params


POLICIES = ("chameleon", "reroute", "dynamic", "shrink", "reroute-then-dynamic", "restart")
"""Run i uses POLICIES[i % 6] (``--policy`` fixes one): every strategy meets chaos."""


def run_chaos(doc: dict[str, Any], faults: int, seed: int, out: Path,
              reference: dict[str, Any], policy: str,
              log_file: Path | None = None) -> dict[str, Any]:
    from chameleon_ft.runtime.chaos import ChaosHooks, check_run
    from chameleon_ft.runtime.coordinator.shell import Coordinator, WorkerFailure
    from chameleon_ft.spec.config import config_from_mapping

    steps = doc["train"]["steps"]
    hooks = ChaosHooks(seed=seed, budget=faults, last_step=steps - 25)
    sink = open(log_file, "a") if log_file else None  # noqa: SIM115 - closed in finally

    def log(line: str) -> None:
        if sink is not None:
            sink.write(f"[{time.monotonic():.3f}] {line}\n")
            sink.flush()

    if sink is not None:
        sink.write(f"=== run: policy {policy}, seed {seed}\n")
    started = time.monotonic()
    try:
        coord = Coordinator(config_from_mapping(doc), out_dir=out, hooks=hooks,
                            policy=policy, log=log, nccl_semantics=NCCL_SEMANTICS)
    except ValueError as exc:  # e.g. the host's memory is taken by other work right now
        if sink is not None:
            sink.close()
        return {"failed": f"could not start: {exc}", "policy": policy, "injected": 0,
                "fired": 0, "exact": False, "max_diff": float("inf"), "stray": 0,
                "events": 0, "strategies": {}, "lost_by_restarts": 0,
                "lost_outside_restarts": 0, "detect_s": [], "recover_s": [],
                "episodes": []}
    try:
        report = coord.run()
    except (WorkerFailure, ValueError) as exc:
        log(f"FAILED: {exc}")
        pids = list(coord.launched_pids)
        time.sleep(0.5)
        return {"failed": str(exc), "policy": policy, "injected": len(hooks.injected),
                "fired": 0, "exact": False, "max_diff": float("inf"),
                "stray": sum(1 for p in pids if _alive(p)), "events": 0, "strategies": {},
                "lost_by_restarts": 0, "lost_outside_restarts": 0, "detect_s": [],
                "recover_s": [], "episodes": [x.episode for x in hooks.injected]}
    finally:
        if sink is not None:
            sink.close()
    pids = list(coord.launched_pids)
    time.sleep(0.5)
    result = check_run(report, coord.params, reference, hooks, pids, steps)
    result["wall_s"] = time.monotonic() - started
    result["policy"] = policy
    result["unfired"] = [f["fault"] for f in report["faults"]
                         if not f["fired"] and not f["retracted"]]
    return result


def _alive(pid: int) -> bool:
    from chameleon_ft.runtime.chaos import alive

    return alive(pid)


def run_coordinator_kill(doc: dict[str, Any], out: Path,
                         reference: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL the coordinator (one worker stopped), then ``--resume``; compare."""
    import torch

    config = out / "job.toml"
    out.mkdir(parents=True, exist_ok=True)
    # no grace: the workers leave with their coordinator and the run resumes from its
    # checkpoint (benchmarks/reattach.py measures a coordinator replaced within the grace)
    doc = {**doc, "train": {**doc["train"], "coordinator_grace_s": 0.0}}
    config.write_text(_toml(doc))
    hang_s = doc["train"]["hang_timeout_s"]
    cmd = [sys.executable, "-m", "chameleon_ft", "train", "--config", str(config), "--out",
           str(out / "run")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    pids: list[int] = []
    killed_at_step = None
    lines: list[str] = []
    with open(out / "train.log", "w") as log:  # kept: a run that ends early says why
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            m = re.search(r"launched workers 0-\d+ \(pids ([\d ]+)\)", line)
            if m:
                pids = [int(p) for p in m.group(1).split()]
            m = re.search(r"step +(\d+) ", line)
            if m and int(m.group(1)) >= doc["train"]["steps"] // 2:
                killed_at_step = int(m.group(1))
                break
    if killed_at_step is None or len(pids) < 2 or not _alive(pids[1]):
        proc.kill()
        raise RuntimeError(f"the run to kill ended or lost its workers before step "
                           f"{doc['train']['steps'] // 2} (exit {proc.wait(10)}); its output "
                           f"ends:\n{''.join(lines[-40:])}")
    stopped = pids[1]
    os.kill(stopped, signal.SIGSTOP)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    others = [p for p in pids if p != stopped]
    gone_at: dict[int, float] = {}
    while len(gone_at) < len(others) and time.monotonic() - t0 < hang_s + 10:
        for p in others:
            if p not in gone_at and not _alive(p):
                gone_at[p] = time.monotonic() - t0
        time.sleep(0.01)
    others_gone_s = max(gone_at.values(), default=float("inf"))
    proc.wait(10)
    time.sleep(hang_s + 0.5)
    os.kill(stopped, signal.SIGCONT)
    t1 = time.monotonic()
    while _alive(stopped) and time.monotonic() - t1 < hang_s + 10:
        time.sleep(0.02)
    continued_gone_s = time.monotonic() - t1
    stray = sum(1 for p in pids if _alive(p))
    for p in pids:
        if _alive(p):
            os.kill(p, signal.SIGKILL)
    resumed = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=900)
    ok = resumed.returncode == 0
    params = torch.load(out / "run" / "params.pt") if ok else {}
    max_diff = max(float((params[k] - reference[k]).abs().max()) for k in reference) \
        if ok else float("inf")
    m = re.search(r"resuming from .*\((\d+) steps\)", resumed.stdout)
    return {"killed_at_step": killed_at_step, "resumed_from": int(m.group(1)) if m else None,
            "exit_after_s": sorted(gone_at.values()),
            "workers_gone_after_s": others_gone_s, "continued_gone_after_s": continued_gone_s,
            "hang_timeout_s": hang_s, "stray": stray, "resume_ok": ok,
            "max_diff": max_diff, "exact": max_diff < 1e-9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8, choices=sorted(LAYOUTS))
    parser.add_argument("--faults", type=int, default=20, help="faults per run")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--start", type=int, default=0, metavar="K",
                        help="number the runs from K (seed + K + i, policy (K + i) mod 6): "
                             "continue an interrupted series")
    parser.add_argument("--policy", choices=POLICIES,
                        help="one policy for every run (default: run i uses the i-th of "
                             f"{', '.join(POLICIES)})")
    parser.add_argument("--steps", type=int, help="steps per run (default 12 per fault + 40)")
    parser.add_argument("--no-resume", action="store_true",
                        help="skip the coordinator-kill + --resume run")
    parser.add_argument("--nccl-semantics", action="store_true",
                        help="the workers' gloo groups complete operations as NCCL's do "
                             "(wait returns at once, a dead peer's transfers hang until "
                             "an abort): the NCCL completion path on CPU")
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2),
                        help="processes per worker, sharding its layers (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write every run's figures here")
    parser.add_argument("--log", metavar="FILE", help="append every run's coordinator log here")
    args = parser.parse_args()
    global NCCL_SEMANTICS
    NCCL_SEMANTICS = args.nccl_semantics

    from chameleon_ft.runtime.chaos import summarize

    steps = args.steps or 12 * args.faults + 40
    doc = chaos_doc(args.workers, steps, args.tp)
    with tempfile.TemporaryDirectory(prefix="chameleon-chaos-") as tmp:
        root = Path(tmp)
        t = time.monotonic()
        reference = run_reference(doc, root / "reference")
        print(f"reference: {steps} steps on {args.workers} workers in "
              f"{time.monotonic() - t:.1f} s", flush=True)
        runs = []
        for i in range(args.start, args.start + args.runs):
            seed = args.seed + i
            policy = args.policy or POLICIES[i % len(POLICIES)]
            result = run_chaos(doc, args.faults, seed, root / f"run{i}", reference, policy,
                               Path(args.log) if args.log else None)
            runs.append(result)
            if args.json:  # after every run: an interrupted series keeps what it measured
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs},
                                                      indent=1))
            print(f"run {i} ({policy}, seed {seed}): {result['injected']} injected, "
                  f"{result['fired']} "
                  f"fired, {result['events']} failures "
                  f"{json.dumps(result['strategies'])}, max diff {result['max_diff']:.2e}, "
                  f"stray {result['stray']}, slow declared {result.get('slow_declared', 0)} "
                  f"of {result.get('slow_injected', 0)} injected, "
                  f"{result.get('wall_s', 0):.0f} s"
                  + (f", FAILED: {result['failed']}" if "failed" in result else "")
                  + (f", unfired: {result['unfired']}" if result.get("unfired") else ""),
                  flush=True)
        summary = summarize([r for r in runs if "failed" not in r])
        summary["failed_runs"] = sum(1 for r in runs if "failed" in r)
        kill = None
        if not args.no_resume:
            kill = run_coordinator_kill(doc, root / "coordinator-kill", reference)
            print(f"coordinator kill at step {kill['killed_at_step']}: workers gone after "
                  f"{kill['workers_gone_after_s']:.2f} s, the stopped one "
                  f"{kill['continued_gone_after_s']:.2f} s after SIGCONT (hang timeout "
                  f"{kill['hang_timeout_s']} s); resumed from step {kill['resumed_from']}, "
                  f"max diff {kill['max_diff']:.2e}, stray {kill['stray']}", flush=True)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary,
                                               "runs": runs, "coordinator_kill": kill},
                                              indent=1))
    ok = summary["failed_runs"] == 0 and summary["runs_exact"] == summary["runs"] and \
        summary["faults_fired"] == summary["faults_injected"] and \
        summary["stray_processes"] == 0 and (kill is None or kill["exact"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
