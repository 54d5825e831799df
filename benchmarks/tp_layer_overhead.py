"""Benchmark: where a sharded layer's time goes, for ``benchmarks/tp_estimate.py``.

    PYTHONPATH=src .venv/bin/python benchmarks/tp_layer_overhead.py [--repeats N]

Two gloo processes on loopback (a worker of tp 2 on this host). With the emulated
device's waits set to zero, times (medians over ``--repeats``, rank 0's, both ranks
released together by a barrier): gloo's all-reduce, reduce-scatter and all-gather of a
residual layer's output (4 x 256 float32, 4 KB), a whole residual layer's forward (its
host work), and the same layer sharded by its tensor-parallel plan, forward and forward
plus backward (DTensor's host work and the layer's reduce-scatter and all-gather). The
difference between the sharded and the whole layer is the per-layer time at tp 2 that
neither the device share nor the collectives account for.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _rank(rank: int, port: int, repeats: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sys.path.insert(0, str(EXAMPLES))
    import emulated_device as ed
    from torch.distributed.device_mesh import init_device_mesh

    from chameleon_ft.runtime.workload.tensor_parallel import TensorParallelStage, shard_layer

    ed.FWD_S_PER_SAMPLE = ed.BWD_S_PER_SAMPLE = 0.0  # host work only
    model = ed.EmulatedDeviceModel(ed.NUM_LAYERS)
    mesh = init_device_mesh("cpu", (2,))
    whole_out, half = torch.randn(4 * ed.HIDDEN), torch.randn(2 * ed.HIDDEN)
    gathered, scattered = torch.empty(4 * ed.HIDDEN), torch.empty(2 * ed.HIDDEN)
    out = {"all-reduce 4 KB": _median_ms(lambda: dist.all_reduce(whole_out), repeats),
           "reduce-scatter 4 KB": _median_ms(
               lambda: dist.reduce_scatter_tensor(scattered, whole_out), repeats),
           "all-gather 4 KB": _median_ms(
               lambda: dist.all_gather_into_tensor(gathered, half), repeats)}
    whole = model.build_layer(1)
    x_whole = torch.randn(4, ed.HIDDEN, requires_grad=True)
    out["whole layer forward"] = _median_ms(lambda: whole(x_whole), repeats)
    layer = model.build_layer(1)
    shard_layer(model, 1, layer, mesh)
    stage = TensorParallelStage(torch.nn.Sequential(layer), mesh, holds_input=False)
    x = torch.randn(4, ed.HIDDEN // 2, requires_grad=True)

    def forward_backward() -> None:
        y = stage(x)
        y.backward(torch.ones_like(y))

    out["sharded layer forward"] = _median_ms(lambda: stage(x), repeats)
    out["sharded layer forward+backward"] = _median_ms(forward_backward, repeats)
    if rank == 0:
        for name, ms in out.items():
            print(f"{name:32} {ms:7.3f} ms")
        print(f"load average {os.getloadavg()[0]:.1f}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--port", type=int, default=29541)
    args = parser.parse_args(argv)
    spawn(_rank, args=(args.port, args.repeats), nprocs=2)  # type: ignore[no-untyped-call]
    return 0


if __name__ == "__main__":
    sys.exit(main())
