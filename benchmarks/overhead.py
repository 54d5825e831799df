"""Failure-free step time: our runtime against PyTorch's own implementation of the same
layout and model, on this machine, in the same run.

PyTorch's side runs the job's model (``load_model(config)``: the same layers, the same
initial values) on ``dp x pp`` worker processes over gloo:

- ``pp > 1``: ``torch.distributed.pipelining`` — a ``PipelineStage`` per worker over its
  pipeline's group and ``Schedule1F1B`` with the job's micro-batches — then each stage's
  gradients all-reduced across the pipelines (one flat bucket per stage, like DDP's) and
  ``torch.optim.AdamW``;
- ``pp = 1``: ``DistributedDataParallel`` over the whole model, gradient accumulation over
  the pipeline's micro-batches (``no_sync`` but for the last), then AdamW.

Our side is ``chameleon_ft.runtime.coordinator.shell.Coordinator(config).run()``; its report has
every committed step's ``step_s``. Each run is a fresh process; the two sides alternate
``--repeats`` times (the machine's load drifts), and each side reports the median of all
its timed steps (after warm-up); the ratio is ours / PyTorch's. Every wait is bounded:
process groups have a timeout, runs and children have deadlines and are killed after
them.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py \\
        [--config examples/tiny_cpu.toml] [--steps 40] [--warmup 5] [--repeats 3] [--pp-one]
        [--json FILE]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py --torch-only --steps 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny_cpu.toml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _stage_bounds(num_layers: int, pp: int) -> list[int]:
    """Contiguous, as even as possible (the planner's layouts are the same for uniform
    layers; the exact split matters little for a comparison on one machine)."""
    return [round(k * num_layers / pp) for k in range(pp + 1)]


def _torch_worker(rank: int, world: int, port: int, config_path: str, pp: int, dp: int,
                  steps: int, timeout_s: float, queue: Any) -> None:
    """One PyTorch worker: rank ``s * dp + p`` runs stage ``s`` of pipeline ``p``
    (stage-major, like the runtime's default placement)."""
    try:
        import torch
        import torch.distributed as dist
        from torch import nn

        from chameleon_ft.runtime.workload.data import load_data
        from chameleon_ft.runtime.workload.models import load_model, to_run
        from chameleon_ft.runtime.workload.precision import torch_dtype

        torch.set_num_threads(1)
        config = _config(config_path, pp=pp, dp=dp)
        dtype = torch_dtype(config.train.dtype)
        model, data = load_model(config), load_data(config)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        stage, pipe = divmod(rank, dp)
        pipe_groups = [dist.new_group([s * dp + p for s in range(pp)]) for p in range(dp)]
        dp_groups = [dist.new_group([s * dp + p for p in range(dp)]) for s in range(pp)]
        bounds = _stage_bounds(model.num_layers, pp)
        module = nn.Sequential(*[model.build_layer(i).to(dtype)
                                 for i in range(bounds[stage], bounds[stage + 1])])
        job = config.job
        mb_per_pipe = job.global_batch // job.micro_batch // dp
        per_pipe = job.global_batch // dp
        count = job.global_batch * config.seq_len

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # scale_grads=False below: each micro-batch's summed loss over the global count
            return model.loss(out, y) / count

        if pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B

            pstage = PipelineStage(module, stage, pp, torch.device("cpu"),
                                   group=pipe_groups[pipe])
            schedule = Schedule1F1B(pstage, mb_per_pipe, loss_fn=loss_fn, scale_grads=False)
            params = list(module.parameters())
        else:
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(module)
            params = list(ddp.parameters())
        optimizer = torch.optim.AdamW(params, lr=config.train.lr,
                                      weight_decay=config.train.weight_decay)
        times = []
        dist.barrier()
        for step in range(steps):
            t0 = time.perf_counter()
            x, y = data.microbatch(step, pipe * per_pipe, per_pipe)
            x, y = to_run(x, dtype, "cpu"), to_run(y, dtype, "cpu")
            optimizer.zero_grad(set_to_none=True)
            if pp > 1:
                if stage == 0:
                    schedule.step(x)
                elif stage == pp - 1:
                    schedule.step(target=y)
                else:
                    schedule.step()
                # the all-reduce across pipelines, one flat bucket per stage
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=dp_groups[stage])
                offset = 0
                for p, g in zip(params, grads, strict=True):
                    p.grad = flat[offset:offset + g.numel()].view_as(g)
                    offset += g.numel()
            else:
                xs, ys = x.chunk(mb_per_pipe), y.chunk(mb_per_pipe)
                for m in range(mb_per_pipe):
                    if m < mb_per_pipe - 1:
                        with ddp.no_sync():
                            loss_fn(ddp(xs[m]), ys[m]).backward()
                    else:
                        loss_fn(ddp(xs[m]), ys[m]).backward()
            optimizer.step()
            dist.barrier()  # a step ends when every worker finished it, as a commit does
            times.append(time.perf_counter() - t0)
        queue.put((rank, "ok", times))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _config(path: str, *, pp: int | None = None, dp: int | None = None,
            steps: int | None = None) -> Any:
    from chameleon_ft.spec import load_config

    config = load_config(path)
    if pp is not None and dp is not None and (pp, dp) != (config.job.pp, config.job.dp):
        config = replace(config, job=replace(config.job, pp=pp, dp=dp))
    if steps is not None:
        config = replace(config, train=replace(config.train, steps=steps,
                                               checkpoint_every=0))
    return config


def measure_torch(config_path: str, *, pp: int, dp: int, steps: int,
                  timeout_s: float = 60.0) -> list[float]:
    """Per-step seconds of PyTorch's implementation (rank 0's view, each step ended by a
    barrier).

    Raises:
        RuntimeError: with the failing worker's traceback, or when the run overran.
    """
    world = pp * dp
    ctx = mp.get_context("fork")  # a fresh process that has not started torch: safe to fork
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_torch_worker, args=(r, world, port, config_path, pp, dp,
                                                     steps, timeout_s, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s + 10 * steps
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"PyTorch run overran its deadline; finished ranks: "
                                   f"{sorted(results)}")
            try:
                rank, status, payload = queue.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check the children are still there
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"PyTorch worker(s) {dead} died") from None
                continue
            if status != "ok":
                raise RuntimeError(f"PyTorch worker {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    times: list[float] = results[0]
    return times


def measure_ours(config_path: str, *, pp: int, dp: int, steps: int) -> list[float]:
    """Per-step seconds of our runtime (``step_s`` of every committed step)."""
    from chameleon_ft.runtime.coordinator.shell import Coordinator

    config = _config(config_path, pp=pp, dp=dp, steps=steps)
    with tempfile.TemporaryDirectory() as out:
        report = Coordinator(config, out_dir=out, policy="reroute").run()
    times: list[float] = report["step_s"]
    return times


def _side(side: str, config_path: str, pp: int, dp: int, steps: int,
          timeout_s: float) -> list[float]:
    """One side's per-step seconds, measured in a fresh process (so that PyTorch's forked
    workers never inherit a process that has started torch, and runs do not share state)."""
    cmd = [sys.executable, __file__, "--side", side, "--config", config_path, "--pp", str(pp),
           "--dp", str(dp), "--steps", str(steps)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{side} run overran {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"{side} run failed (status {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    times: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both sides, alternating, and print the medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="first steps not timed")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each side, alternating (the median of all timed "
                             "steps is reported)")
    parser.add_argument("--pp-one", action="store_true",
                        help="also compare at pp = 1 (DistributedDataParallel)")
    parser.add_argument("--torch-only", action="store_true",
                        help="only PyTorch's side (a smoke check)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="deadline of one run")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--side", choices=("torch", "ours"), help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.side is not None:  # a child run: print the step times as JSON
        measure = measure_torch if args.side == "torch" else measure_ours
        print(json.dumps(measure(args.config, pp=args.pp, dp=args.dp, steps=args.steps)))
        return {"side": args.side}
    config = _config(args.config)
    layouts = [(config.job.pp, config.job.dp)]
    if args.pp_one and config.job.pp > 1:
        layouts.append((1, config.job.pp * config.job.dp))
    out: dict[str, Any] = {"config": args.config, "steps": args.steps, "warmup": args.warmup,
                           "repeats": args.repeats, "load_before": os.getloadavg()}
    rows: list[dict[str, Any]] = []
    sides = ["torch"] if args.torch_only else ["torch", "ours"]
    for pp, dp in layouts:
        row: dict[str, Any] = {"pp": pp, "dp": dp,
                               "torch": "pipelining 1F1B + all-reduce" if pp > 1 else "DDP"}
        timed: dict[str, list[float]] = {side: [] for side in sides}
        per_run: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(args.repeats):
            for side in sides:
                try:
                    steps_s = _side(side, args.config, pp, dp, args.steps, args.timeout_s)
                except RuntimeError as exc:
                    row[f"{side}_error"] = str(exc)
                    continue
                kept = steps_s[args.warmup:] or steps_s
                timed[side].extend(kept)
                per_run[side].append(statistics.median(kept))
        for side in sides:
            if timed[side]:
                row[f"{side}_median_s"] = statistics.median(timed[side])
                row[f"{side}_run_medians_s"] = per_run[side]
        if "torch_median_s" in row and "ours_median_s" in row:
            row["ratio"] = row["ours_median_s"] / row["torch_median_s"]
        rows.append(row)
        torch_text = (f"{row['torch_median_s'] * 1e3:.1f} ms" if "torch_median_s" in row
                      else "failed: " + row.get("torch_error", "").splitlines()[-1])
        line = f"pp {pp} x dp {dp}: PyTorch ({row['torch']}) {torch_text}"
        if "ours_median_s" in row:
            line += f"; ours {row['ours_median_s'] * 1e3:.1f} ms"
        if "ratio" in row:
            line += f"; ratio {row['ratio']:.2f}"
        line += "  (run medians: " + ", ".join(
            f"{side} " + " ".join(f"{v * 1e3:.1f}" for v in per_run[side]) for side in sides) + ")"
        print(line, flush=True)
    out["layouts"] = rows
    out["load_after"] = os.getloadavg()
    print(f"load average before {out['load_before']}, after {out['load_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
