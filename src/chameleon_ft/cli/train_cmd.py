"""``chameleon train``: train a GPT on worker processes and survive failures in place.

Progress goes to stdout (stderr with ``--json``, so stdout holds only the report): about
25 step lines per run (loss, step time, plan generation), each failure with its detection
time, the decision with every candidate, and the measured transition time. SIGINT or
SIGTERM drains the run: the step in flight commits (or is aborted), the state is
checkpointed, the workers stop, and the command exits 130 / 143 saying how to resume.

Exit statuses: 0 trained; 1 training could not go on (one line says why, ``report.json``
too); 2 bad input; 3 trained and ``params.pt`` written, but the checkpoint folder refused
the final checkpoint (the final state is in the run folder's ``final-state/``); 130 / 143
stopped by SIGINT / SIGTERM. torch is imported only inside :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from dataclasses import replace
from typing import Any

from chameleon_ft import logs
from chameleon_ft.runtime import auth
from chameleon_ft.spec.recovery import SLOW_POLICY_NAMES
from chameleon_ft.spec.train import TRAIN_DTYPES, parse_fault

EXIT_FAILED = 1
"""Training could not go on (``report.json`` says why)."""
EXIT_FINAL_ELSEWHERE = 3
"""Training completed and ``params.pt`` was written, but the checkpoint folder refused the
final checkpoint: the final state is in the run folder's ``final-state/`` instead, and a
resume starts from the last complete checkpoint (listed in the report, with the dropped
ones)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chameleon train``."""
    parser.add_argument("--config", required=True, metavar="FILE.toml", help="job file")
    parser.add_argument("--steps", type=int, metavar="N", help="steps to train ([train] steps)")
    parser.add_argument("--fault", action="append", default=[], metavar="SPEC",
                        help="inject a fault: rank=R,step=S,kind=kill|hang|stall|error|glitch|"
                             "disk-full|disk-error|read-only[,phase=forward|backward|reduce|"
                             "optimizer|recovery|migration|checkpoint]; fires once, the first "
                             "time worker R reaches the phase at a step >= S (disk faults fail "
                             "its checkpoint write); or rank=R,step=S,kind=slow,factor=F,"
                             "steps=N: worker R computes F times slower for N steps from "
                             "step S; repeatable")
    parser.add_argument("--policy", metavar="NAME",
                        help="chameleon (adaptive), reroute, dynamic, restart, shrink or "
                             "reroute-then-dynamic ([policy] name)")
    parser.add_argument("--slow-policy", choices=SLOW_POLICY_NAMES,
                        help="the answer to a slow worker: chameleon (the best score), or "
                             "keep, rebalance, dynamic, swap or evict ([recovery] "
                             "slow_policy)")
    parser.add_argument("--dtype", choices=TRAIN_DTYPES,
                        help="numerics ([train] dtype): float32; float64 for exact "
                             "comparisons; bfloat16 for mixed precision (bf16 compute, "
                             "fp32 master weights, gradients and optimizer state)")
    parser.add_argument("--out", metavar="DIR",
                        help="the run directory: checkpoints, report.json, params.pt, "
                             "metrics.jsonl (default: a new runs/train-<time>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out: under its live workers when its "
                             "coordinator went away less than [train] coordinator_grace_s "
                             "ago (same --host/--port), else from its newest complete "
                             "checkpoint")
    parser.add_argument("--tensorboard", action="store_true",
                        help="also write TensorBoard event files (loss, grad_norm, lr, "
                             "tokens/s, step time) under the run directory's tensorboard/; "
                             "needs the tensorboard package (the [tensorboard] extra)")
    parser.add_argument("--log-every", type=int, metavar="N",
                        help="a progress line every N steps (default: about 25 per run; "
                             "failures, decisions and recoveries always)")
    parser.add_argument("--json", action="store_true",
                        help="print the final report as JSON on stdout (progress on stderr)")
    _add_cluster_arguments(parser)


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chameleon train`` about where its workers run and who may join."""
    parser.add_argument("--workers", type=int, metavar="N",
                        help="worker processes to launch on this host (default: every worker "
                             "the layout and its spare nodes need, minus --remote-workers)")
    parser.add_argument("--remote-workers", type=int, default=0, metavar="N",
                        help="workers that join from other hosts with `chameleon worker`")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the coordinator's store listens on (default 127.0.0.1; "
                             "0.0.0.0 for other hosts)")
    parser.add_argument("--port", type=int, default=0, help="store port (default: any free)")
    parser.add_argument("--rejoin", action="store_true",
                        help="relaunch dead local workers (repair), admit remote "
                             "replacements, and let the policy fold them back in "
                             "([train] rejoin)")
    parser.add_argument("--trace", metavar="FILE.csv",
                        help="replay a failure trace (the simulator's CSV: time_s,event,target) "
                             "in wall-clock seconds from the first step: worker-fail, "
                             "node-fail and group-fail kill workers, software restarts the "
                             "running plan from the checkpoint, repair relaunches the nodes' "
                             "dead workers, end stops training; the report gains "
                             "throughput_samples_s")
    parser.add_argument("--token", metavar="TOKEN",
                        help="job token remote workers must know (default: "
                             f"${auth.TOKEN_ENV}; generated and printed when workers may "
                             "join from other hosts)")
    parser.add_argument("--drain-timeout", type=float, metavar="S",
                        help="the scheduler's grace between SIGTERM and SIGKILL: a drain lets "
                             "the step in flight finish while that leaves time to write the "
                             "final checkpoint ([train] drain_timeout_s, default 30; with "
                             "Slurm's --signal=B:TERM@S give S)")
    parser.add_argument("--job-name", metavar="NAME",
                        help="the job's name, which workers may check with `--job` "
                             "(default: [model] name)")


def _config(args: argparse.Namespace) -> Any:
    from chameleon_ft.spec import load_config

    config = load_config(args.config)
    train = config.train
    overrides: dict[str, Any] = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.dtype is not None:
        overrides["dtype"] = args.dtype
    if args.rejoin:
        overrides["rejoin"] = True
    if args.drain_timeout is not None:
        overrides["drain_timeout_s"] = args.drain_timeout
    if overrides:
        try:
            train = replace(train, **overrides)
        except ValueError as exc:
            raise ValueError(f"train.{exc}") from None
    recovery = config.recovery
    if args.slow_policy is not None:
        recovery = replace(recovery, slow_policy=args.slow_policy)
    return replace(config, train=train, recovery=recovery)


def _summary(report: dict[str, Any]) -> list[str]:
    lines = [f"trained {len(report['steps'])} steps in {report['total_s']:.1f} s; "
             f"final loss {report['loss'][-1]:.4f}" if report["steps"] else "no steps"]
    for e in report["events"]:
        if e["cause"] in ("slow", "slow-end"):
            what = f"slow ({e['factor']:.2f}x)" if e["cause"] == "slow" else \
                f"at full speed again ({e['measured']:.2f}x, was {e['factor']:.2f}x)"
            lines.append(f"worker {e['workers'][0]} {what} at step {e['step']}: "
                         f"{e['strategy'] or 'no answer'}")
            continue
        detect = "-" if e["detected_after_s"] is None else f"{e['detected_after_s']:.3f} s"
        trans = "-" if e["transition_s"] is None else f"{e['transition_s']:.3f} s"
        lines.append(f"failure of worker(s) {e['workers']} at step {e['step']}: detected after "
                     f"{detect}, {e['strategy']}, transition {trans}"
                     + (f", {e['lost_steps']} steps redone" if e["lost_steps"] else "")
                     + (f", {e['from_memory_layers']} layer loads from peers' memory"
                        if e.get("from_memory_layers") else ""))
    for r in report.get("rejoins", []):
        lines.append(f"idle worker(s) {r['workers']} (repaired or spare) at step {r['step']}: "
                     f"{r['strategy']}")
    if "trace" in report:
        t = report["trace"]
        lines.append(f"trace replayed: {t['committed_steps']} steps committed in "
                     f"{t['measured_s']:.1f} s, {report['throughput_samples_s']:.2f} samples/s"
                     + ("" if t["end_reached"] else " (steps ran out before the end row)"))
    lines.append(f"final parameters sha256 {report['param_hash']}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status.

    Raises:
        ValueError: for a bad config, fault, or a layout the launched workers cannot fill.
    """
    config = _config(args)
    faults = [parse_fault(f) for f in (*config.train.faults, *args.fault)]
    if args.resume and not args.out:
        raise ValueError("--resume: give the run directory to continue with --out DIR")
    token = auth.resolve_token(args.token)
    if args.remote_workers < 0:
        raise ValueError("--remote-workers: must be >= 0")
    fleet = config.total_workers
    local = fleet - args.remote_workers if args.workers is None else args.workers
    if local < 0 or local + args.remote_workers != fleet:
        spares = (f" and {config.num_spare_workers} spare workers ([cluster] spare_nodes)"
                  if config.num_spare_workers else "")
        raise ValueError(f"workers: the layout dp x pp = {config.job.dp} x {config.job.pp} needs "
                         f"{config.num_workers} workers{spares}, but {local} local + "
                         f"{args.remote_workers} remote were requested")
    out = sys.stderr if args.json else sys.stdout
    # the coordinator's lines are records of its logger: shown on `out`, as always
    logs.configure(args.log_level, out)

    def log(message: str) -> None:  # this command's own closing lines
        print(message, file=out, flush=True)

    trace = None
    if args.trace is not None:
        from chameleon_ft.runtime.replay import TraceDriver, load_trace

        trace = TraceDriver(load_trace(args.trace, num_nodes=config.cluster.total_nodes,
                                       workers_per_node=config.workers_per_node),
                            config.workers_per_node, path=args.trace)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # the workers' server imports torch while this process does (seconds, on 2 cores)
    from chameleon_ft.runtime.coordinator.forkserver import start_early

    start_early(config.model_source.source)
    from chameleon_ft.runtime.coordinator.shell import Coordinator, WorkerFailure

    coord = Coordinator(config, policy=args.policy, faults=faults, out_dir=args.out,
                        num_local_workers=local, host=args.host, port=args.port,
                        token=token, job_name=args.job_name, resume=args.resume,
                        log_every=args.log_every, trace=trace, tensorboard=args.tensorboard)
    try:
        report = coord.run()
    except WorkerFailure as exc:
        print(f"chameleon train: training failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for line in _summary(report):
        log(line)
    log(f"report, parameters and checkpoints in {report['run_dir']}")
    if args.json:
        print(json.dumps(report, indent=2))
    return _exit_status(report, args.config)


def _exit_status(report: dict[str, Any], config_path: str) -> int:
    """The command's exit status for a finished run, with the line that explains any but 0."""
    if report["interrupted"]:
        name = report["interrupted"]
        again = ["chameleon", "train", "--config", config_path, "--out", report["run_dir"],
                 "--resume"]
        print(f"chameleon train: stopped by {name} after {report['committed_steps']} steps; "
              f"resume with: {shlex.join(again)}", file=sys.stderr, flush=True)
        return 128 + int(getattr(signal, name))
    if report["final_state"] not in (None, "checkpoints"):
        print(f"chameleon train: trained {report['committed_steps']} steps and wrote "
              f"params.pt, but the checkpoint folder refused the final checkpoint: the final "
              f"state is in {report['run_dir']}/{report['final_state']}; a resume starts "
              "from the last complete checkpoint", file=sys.stderr, flush=True)
        return EXIT_FINAL_ELSEWHERE
    return 0
