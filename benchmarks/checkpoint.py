"""Checkpoints that scale: the workers write their own state in the background.

Measured in one run, on this machine's disk:

- the disk's own sequential write speed (a 1 GB file written and fsynced, median of 3);
- the layer-file formats the choice was made between (one layer's parameters and Adam
  moments, written and fsynced): raw bytes, the runtime's streamed packed format with its
  sha256, ``torch.save``, safetensors, ``torch.distributed.checkpoint``;
- a GPT of about 2.1 GB of parameters and Adam state (14 blocks of hidden 1024, float32)
  trained on 2 worker processes (pp 2) with a checkpoint every 8 steps: each checkpoint's
  write throughput, aggregate and per worker; the step time while a checkpoint is written
  in the background against the steps without one; the coordinator's peak RSS;
- the same job with the tiny GPT: the coordinator's peak RSS, which must not grow with
  the model (it never holds a layer).

Each training job runs its coordinator in a child process, so that process's peak RSS is
the coordinator's alone.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint.py [--json FILE] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

BIG = {"name": "gpt-2gb", "num_blocks": 14, "hidden_size": 1024, "num_heads": 8,
       "vocab_size": 256, "seq_len": 32}
TINY = {"name": "tiny", "num_blocks": 2, "hidden_size": 32, "num_heads": 2,
        "vocab_size": 256, "seq_len": 32}


def job(model: dict[str, Any], steps: int, every: int) -> dict[str, Any]:
    """The benchmark's job file as a mapping."""
    return {"model": model,
            "cluster": {"num_nodes": 1, "devices_per_node": 2, "device": "cpu"},
            "job": {"pp": 2, "dp": 1, "global_batch": 2, "micro_batch": 1},
            "profile": {"kind": "analytic"},
            "train": {"steps": steps, "dtype": "float32", "checkpoint_every": every,
                      "keep_checkpoints": 2, "hang_timeout_s": 10.0,
                      "collective_timeout_s": 600.0, "storage_gb_per_s": 0.05}}


def child(doc_json: str, out: str) -> None:
    """Run one job's coordinator here; print its report's figures and this process's
    peak RSS as JSON."""
    from chameleon_ft.runtime.coordinator.shell import Coordinator
    from chameleon_ft.spec.config import config_from_mapping

    coord = Coordinator(config_from_mapping(json.loads(doc_json)), out_dir=out,
                        check_resources=False)
    report = coord.run()
    rss_mb = peak_rss_mb()
    print(json.dumps({"rss_mb": rss_mb, "step_s": report["step_s"],
                      "checkpoint_writes": report["checkpoint_writes"],
                      "checkpoints": report["checkpoints"]}))


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB: ``VmHWM``, the high-water mark of its
    own address space. (``ru_maxrss`` is not: Linux carries the parent's peak into a child
    across ``exec``, so every child of this benchmark would report at least its parent's.)"""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_job(model: dict[str, Any], steps: int, every: int, out: Path) -> dict[str, Any]:
    """One job in a child process; its figures."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(job(model, steps,
                                                                               every)),
                           str(out)], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the {model['name']} job failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def disk_write_gb_per_s(folder: Path, size: int = 1 << 30, repeats: int = 3) -> float:
    """Sequential write speed of ``folder``'s disk (fsync included), median."""
    block = os.urandom(1 << 24)
    speeds = []
    for r in range(repeats):
        path = folder / f"disk-{r}.bin"
        start = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(size // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        speeds.append(size / (time.perf_counter() - start) / 1e9)
        path.unlink()
    return statistics.median(speeds)


def formats(folder: Path, numel: int = 16 << 20, repeats: int = 3) -> dict[str, float]:
    """GB/s of writing one layer's state (fsynced) in each candidate format, medians."""
    import torch
    from safetensors.torch import save_file

    from chameleon_ft.runtime.storage.checkpoint import write_layer
    from chameleon_ft.runtime.storage.packing import pack_to

    torch.manual_seed(0)
    w, m1, m2 = torch.randn(numel), torch.randn(numel), torch.rand(numel)
    tree = {"module": {"weight": w}, "optimizer": {"state": {0: {
        "step": torch.tensor(3.0), "exp_avg": m1, "exp_avg_sq": m2}},
        "param_groups": [{"lr": 1e-3, "params": [0]}]}}
    total = 3 * numel * 4

    def fsync(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def raw() -> None:
        with open(folder / "raw.bin", "wb") as f:
            for t in (w, m1, m2):
                f.write(memoryview(t.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    def packed() -> None:
        write_layer(folder, "packed.bin", lambda write: pack_to(tree, write))

    def torch_save() -> None:
        torch.save(tree, folder / "t.pt")
        fsync(folder / "t.pt")

    def safetensors() -> None:
        save_file({"w": w, "m1": m1, "m2": m2}, str(folder / "s.safetensors"))
        fsync(folder / "s.safetensors")

    def dcp() -> None:
        import warnings

        import torch.distributed.checkpoint as dist_cp

        shutil.rmtree(folder / "dcp", ignore_errors=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist_cp.save(tree, checkpoint_id=str(folder / "dcp"), no_dist=True)
        for path in (folder / "dcp").iterdir():
            fsync(path)

    out = {}
    for name, fn in (("raw bytes", raw), ("packed + sha256 (the runtime's)", packed),
                     ("torch.save", torch_save), ("safetensors", safetensors),
                     ("torch.distributed.checkpoint", dcp)):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = total / statistics.median(times) / 1e9
    return out


def overlap(step_s: list[float], writes: list[dict[str, Any]],
            skip: int = 2) -> tuple[list[float], list[float]]:
    """Step times while a checkpoint is written in the background, and the others (the
    first ``skip`` steps left out). A checkpoint after ``k`` steps is written from the
    commit of step ``k - 1`` for ``written_after_s``: the steps from ``k`` on whose time
    falls in that span overlap it (the last checkpoint, written at the end, overlaps none)."""
    during: set[int] = set()
    for w in writes:
        k, left = int(w["step"]), float(w["written_after_s"])
        while k < len(step_s) and left > 0:
            during.add(k)
            left -= step_s[k]
            k += 1
    inside = [s for k, s in enumerate(step_s) if k >= skip and k in during]
    outside = [s for k, s in enumerate(step_s) if k >= skip and k not in during]
    return inside, outside


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=26)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--keep", metavar="DIR", help="run in DIR and keep what is written")
    parser.add_argument("--child", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(dir=ROOT))
    base.mkdir(parents=True, exist_ok=True)
    try:
        disk = disk_write_gb_per_s(base)
        fmt = formats(base)
        big = run_job(BIG, args.steps, args.every, base / "big")
        tiny = run_job(TINY, args.steps, args.every, base / "tiny")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    result = {"disk_gb_per_s": disk, "formats_gb_per_s": fmt, "big": big, "tiny": tiny,
              "load_average": os.getloadavg()[0]}
    report(result, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the tables."""
    print(f"command: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint.py --steps "
          f"{args.steps} --every {args.every}")
    print(f"load average at the end: {result['load_average']:.2f} on {os.cpu_count()} cores")
    print(f"disk sequential write (1 GB, fsync): {result['disk_gb_per_s']:.2f} GB/s")
    print("\nformat | GB/s\n---|---")
    for name, speed in result["formats_gb_per_s"].items():
        print(f"{name} | {speed:.2f}")
    big = result["big"]
    print("\ncheckpoint (big model) | bytes | every layer written after s | aggregate GB/s |"
          " per worker GB/s (bytes / its writing time)\n---|---|---|---|---")
    for w in big["checkpoint_writes"]:
        agg = w["bytes"] / max(w["written_after_s"], 1e-9) / 1e9
        per = ", ".join(f"w{k}: {v['bytes'] / max(v['write_s'], 1e-9) / 1e9:.2f}"
                        for k, v in w["workers"].items())
        print(f"after {w['step']} steps | {w['bytes'] / 1e9:.2f} GB | "
              f"{w['written_after_s']:.2f} | {agg:.2f} | {per}")
    inside, outside = overlap(big["step_s"], big["checkpoint_writes"])
    during, other = statistics.median(inside), statistics.median(outside)
    print(f"\nstep times (s): {', '.join(f'{s:.2f}' for s in big['step_s'])}")
    print(f"step time while a checkpoint is written in the background: {during:.3f} s "
          f"(median of {len(inside)}) vs {other:.3f} s without (median of {len(outside)}; "
          f"{during / other - 1:+.1%})")
    print(f"coordinator peak RSS: big model {big['rss_mb']:.0f} MB, tiny model "
          f"{result['tiny']['rss_mb']:.0f} MB ({big['rss_mb'] / result['tiny']['rss_mb'] - 1:+.1%})")


if __name__ == "__main__":
    raise SystemExit(main())
