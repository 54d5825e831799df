"""Benchmark: where a sharded layer's time goes, for ``benchmarks/tp_estimate.py``.

    PYTHONPATH=src .venv/bin/python benchmarks/tp_layer_overhead.py [--repeats N]
        [--groups G] [--device-time]

Two gloo processes on loopback (a worker of tp 2 on this host). With the emulated
device's waits set to zero, times (medians over ``--repeats``, rank 0's, both ranks
released together by a barrier): gloo's all-reduce, reduce-scatter and all-gather of a
residual layer's output (4 x 256 float32, 4 KB), a whole residual layer's forward (its
host work), and the same layer sharded by its tensor-parallel plan, forward and forward
plus backward (DTensor's host work and the layer's reduce-scatter and all-gather). The
difference between the sharded and the whole layer is the per-layer time at tp 2 that
neither the device share nor the collectives account for.

Then the ``[profile]`` lines a uniform profile at tp 2 needs (design 4.11), each measured
here, none fitted to a step time: ``tp_host_fwd_s``, the sharded layer's forward less its
device share (0 by default: the waits are off) and less its reduce-scatter measured alone;
``tp_host_bwd_s``, its backward (forward plus backward less forward) less its all-gather;
``tp_collective_latency_s``, one hop of gloo's reduce-scatter and all-gather (their mean,
less the bytes over ``examples/testbed8.toml``'s intra-node bandwidth).

``--groups 4 --device-time`` times four groups at once with the emulated device's waits
kept (and subtracted), the eight processes of ``tp_estimate.py``'s pipeline at tp 2: the
host's contention, which one group alone does not see, with every group's host work
released at the same moment (an upper bound: a pipeline's stages are not in step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from chameleon_ft.profile.profile import ring_half_s

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _rank(rank: int, port: int, repeats: int, groups: int, device_time: bool) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2 * groups)
    sys.path.insert(0, str(EXAMPLES))
    import emulated_device as ed
    from torch.distributed.device_mesh import init_device_mesh

    from chameleon_ft.runtime.workload.tensor_parallel import TensorParallelStage, shard_layer

    if not device_time:
        ed.FWD_S_PER_SAMPLE = ed.BWD_S_PER_SAMPLE = 0.0  # host work only
    model = ed.EmulatedDeviceModel(ed.NUM_LAYERS)
    # ``groups`` tensor-parallel groups of two, as a pipeline of that many stages lays
    # its workers out on this host; each times its own layer, all released together
    mesh = init_device_mesh("cpu", (groups, 2), mesh_dim_names=("group", "tp"))["tp"]
    tp_group = mesh.get_group()
    whole_out, half = torch.randn(4 * ed.HIDDEN), torch.randn(2 * ed.HIDDEN)
    gathered, scattered = torch.empty(4 * ed.HIDDEN), torch.empty(2 * ed.HIDDEN)
    out = {"all-reduce 4 KB": _median_ms(
               lambda: dist.all_reduce(whole_out, group=tp_group), repeats),
           "reduce-scatter 4 KB": _median_ms(
               lambda: dist.reduce_scatter_tensor(scattered, whole_out, group=tp_group),
               repeats),
           "all-gather 4 KB": _median_ms(
               lambda: dist.all_gather_into_tensor(gathered, half, group=tp_group), repeats)}
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
        print(f"load average {os.getloadavg()[0]:.1f}, {groups} group(s) of 2, device "
              f"time {'on' if device_time else 'off'}")
        # the emulated device's waits of one rank's share (a micro-batch of 4 samples)
        share_s = (ed.FWD_S_PER_SAMPLE * 4 / 2, ed.BWD_S_PER_SAMPLE * 4 / 2)
        print(profile_lines(out, output_bytes=whole_out.numel() * whole_out.element_size(),
                            device_share_s=share_s))
    dist.destroy_process_group()


def profile_lines(out_ms: dict[str, float], *, output_bytes: int,
                  device_share_s: tuple[float, float], degree: int = 2) -> str:
    """The ``[profile]`` lines for the testbed at tp ``degree`` from the timings above.

    Args:
        out_ms: the medians in milliseconds, by the names :func:`_rank` prints.
        output_bytes: bytes of the whole output each collective reduces or gathers.
        device_share_s: one rank's device waits in the forward and in the backward
            (zero when the benchmark turns them off).
        degree: the group's size the timings were taken at.

    Returns:
        TOML lines with ``tp_host_fwd_s``, ``tp_host_bwd_s`` and
        ``tp_collective_latency_s`` (clamped at 0: a noisy sample can go below).
    """
    scatter_s = out_ms["reduce-scatter 4 KB"] / 1e3
    gather_s = out_ms["all-gather 4 KB"] / 1e3
    fwd_s = out_ms["sharded layer forward"] / 1e3
    bwd_s = out_ms["sharded layer forward+backward"] / 1e3 - fwd_s
    cluster = tomllib.loads((EXAMPLES / "testbed8.toml").read_text())["cluster"]
    # a ring half is its bytes over the link plus ``degree - 1`` hops (the estimator's rule)
    bytes_s = ring_half_s(output_bytes, degree, 0.0, cluster["intra_node_gb_per_s"] * 1e9)
    hop_s = ((scatter_s + gather_s) / 2 - bytes_s) / (degree - 1)
    values = {"tp_host_fwd_s": fwd_s - device_share_s[0] - scatter_s,
              "tp_host_bwd_s": bwd_s - device_share_s[1] - gather_s,
              "tp_collective_latency_s": hop_s}
    return "\n".join([f"# [profile] at tp {degree}, load {os.getloadavg()[0]:.1f}:"]
                     + [f"{k} = {max(v, 0.0):.5f}" for k, v in values.items()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--port", type=int, default=29541)
    parser.add_argument("--groups", type=int, default=1,
                        help="tensor-parallel groups of two timed at once (4: the 8 "
                             "processes of tp_estimate's pipeline of 4 stages at tp 2)")
    parser.add_argument("--device-time", action="store_true",
                        help="keep the emulated device's waits (subtracted as the device "
                             "share): the host's cores idle between a rank's host work as "
                             "in a run")
    args = parser.parse_args(argv)
    if args.groups < 1:
        parser.error("--groups: must be >= 1")
    spawn(_rank, args=(args.port, args.repeats, args.groups, args.device_time),  # type: ignore[no-untyped-call]
          nprocs=2 * args.groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
