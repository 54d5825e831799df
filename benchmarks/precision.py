"""Mixed precision and activation checkpointing on this machine: step time and peak
memory per worker of the real runtime, bf16 against fp32, with and without activation
checkpointing, next to what the planner predicts.

A Llama of ``--hidden`` / ``--blocks`` / ``--vocab`` is built locally (random weights,
``save_pretrained``; nothing downloads), trained on random tokens by 4 worker processes
(2 pipelines x 2 stages, gloo) for ``--steps`` steps per run, no checkpoints written. Each
worker reports, with every step's timings (``op_times.jsonl``), its resident memory when
it started (forked from the server that imported torch and transformers) and its peak
since (``VmHWM``): the peak per worker is the largest difference, i.e. what the worker
added for its layers, their optimizer state, the activations and every transient. The
planner's figure is the estimator's peak per worker (``estimate(plan).peak_memory_bytes``
on the profile the runtime builds for the job: ``build_profile(config, runtime=True)``,
the [train] dtype's bytes and ``[profile] recompute`` from the activation-checkpointing
switch), which counts parameters, gradients, optimizer state and the activations of the
micro-batches in flight, not the process itself.

Resident memory is what the kernel counts, so the allocator's habits show in it: glibc keeps
freed blocks below a threshold that grows up to 32 MiB as large tensors come and go, and a
peak then includes memory the program no longer uses. The benchmark fixes that threshold
at 64 KiB (``MALLOC_MMAP_THRESHOLD_``, inherited by the workers' forkserver): every tensor
larger than that is its own mapping, returned when freed, so the peak is live memory
(``--keep-malloc`` leaves glibc's default for comparison).

The machine is shared and its load drifts: the variants alternate ``--repeats`` times and
every figure is a median (step time: over the timed steps of each run, then over runs;
memory: over runs).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision.py [--steps 6] [--warmup 2]
        [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

VARIANTS = [("float32", "none"), ("float32", "full"), ("bfloat16", "none"),
            ("bfloat16", "full")]


def _model_dir(root: Path, args: argparse.Namespace) -> Path:
    from chameleon_ft.runtime.workload.models.hf import save_random_llama
    from chameleon_ft.spec.model import ModelSpec

    spec = ModelSpec(num_blocks=args.blocks, hidden_size=args.hidden, num_heads=args.heads,
                     num_kv_heads=args.heads, ffn_size=args.ffn, vocab_size=args.vocab,
                     seq_len=args.seq_len, mlp="swiglu")
    save_random_llama(spec, root / "llama", seed=0)
    rng = np.random.default_rng(0)
    rng.integers(0, args.vocab, 400_000).astype(np.uint16).tofile(root / "tokens.bin")
    return root


def _config(root: Path, args: argparse.Namespace, dtype: str, checkpointing: str) -> Any:
    from chameleon_ft.spec.config import config_from_mapping

    return config_from_mapping({
        "model": {"source": "hf", "path": "llama", "seq_len": args.seq_len},
        "data": {"kind": "tokens", "path": "tokens.bin"},
        "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
        "job": {"pp": 2, "dp": 2, "global_batch": 4 * args.micro_batch,
                "micro_batch": args.micro_batch},
        "profile": {"kind": "analytic"},
        "optimizer": {"name": "AdamW", "lr": 1e-3, "weight_decay": 0.1, "clip_grad_norm": 1.0},
        "train": {"steps": args.steps, "dtype": dtype, "checkpoint_every": 0,
                  "activation_checkpointing": checkpointing, "timeout_s": 120.0,
                  "heartbeat_s": 0.5}}, base_dir=str(root))


def predicted_peak_bytes(config: Any) -> dict[int, float]:
    """The estimator's peak bytes per worker of the job's initial plan."""
    from chameleon_ft.perf import Topology, estimate
    from chameleon_ft.plan import initial_plan
    from chameleon_ft.profile import build_profile

    profile = build_profile(config, runtime=True)
    plan = initial_plan(config, profile)
    return dict(estimate(plan, profile, Topology.from_config(config)).peak_memory_bytes)


def run_once(config: Any, out: Path, warmup: int) -> dict[str, Any]:
    """One run: median step time after ``warmup`` steps, each worker's peak added bytes."""
    from chameleon_ft.runtime.coordinator.shell import Coordinator

    report = Coordinator(config, out_dir=out, log=lambda _line: None).run()
    peaks: dict[int, int] = {}
    for line in (out / "op_times.jsonl").read_text().splitlines():
        t = json.loads(line)
        if t.get("rss_peak_bytes") is not None and t.get("rss_base_bytes") is not None:
            added = t["rss_peak_bytes"] - t["rss_base_bytes"]
            peaks[t["worker"]] = max(peaks.get(t["worker"], 0), added)
    return {"step_s": statistics.median(report["step_s"][warmup:]), "peak_bytes": peaks,
            "final_loss": report["loss"][-1]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1376)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--keep-malloc", action="store_true",
                        help="leave glibc's dynamic mmap threshold as it is")
    args = parser.parse_args(argv)
    if not args.keep_malloc:  # before the workers' forkserver starts: they inherit it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    runs: dict[str, list[dict[str, Any]]] = {f"{d}/{c}": [] for d, c in VARIANTS}
    predicted: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = _model_dir(Path(tmp), args)
        for repeat in range(args.repeats):
            for dtype, checkpointing in VARIANTS:
                key = f"{dtype}/{checkpointing}"
                config = _config(root, args, dtype, checkpointing)
                predicted[key] = predicted_peak_bytes(config)
                result = run_once(config, root / f"run-{repeat}-{dtype}-{checkpointing}",
                                  args.warmup)
                runs[key].append(result)
                print(f"repeat {repeat} {key}: step {result['step_s']:.3f} s, peak "
                      f"{max(result['peak_bytes'].values()) / 2**20:.0f} MiB", flush=True)
    summary = _summarise(runs, predicted)
    _print(summary, args)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary


def _summarise(runs: dict[str, list[dict[str, Any]]],
               predicted: dict[str, dict[int, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, results in runs.items():
        workers = sorted(results[0]["peak_bytes"])
        measured = {w: statistics.median(r["peak_bytes"][w] for r in results) for w in workers}
        out[key] = {
            "step_s": statistics.median(r["step_s"] for r in results),
            "final_loss": statistics.median(r["final_loss"] for r in results),
            "peak_mib": {w: measured[w] / 2**20 for w in workers},
            "predicted_mib": {w: predicted[key][w] / 2**20 for w in workers},
            "measured_over_predicted": {w: measured[w] / predicted[key][w] for w in workers},
        }
    return out


def _print(summary: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nLlama hidden {args.hidden}, {args.blocks} blocks, vocab {args.vocab}, seq "
          f"{args.seq_len}, micro-batch {args.micro_batch}; 4 workers (dp 2 x pp 2); "
          f"medians of {args.repeats} runs")
    print("| dtype | activation checkpointing | step (s) | peak per worker, measured (MiB) "
          "| predicted (MiB) | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for key, s in summary.items():
        dtype, ckpt = key.split("/")
        measured = " / ".join(f"{v:.0f}" for v in s["peak_mib"].values())
        predicted = " / ".join(f"{v:.0f}" for v in s["predicted_mib"].values())
        ratio = " / ".join(f"{v:.2f}" for v in s["measured_over_predicted"].values())
        print(f"| {dtype} | {ckpt} | {s['step_s']:.3f} | {measured} | {predicted} | {ratio} |")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
