"""Measure a job's model on this machine and write the JSON profile the estimator reads.

Per layer: forward seconds, input-gradient and weight-gradient seconds (the backward
split by timing an input-only backward), parameter and AdamW-state bytes, the bytes of the
tensors autograd keeps for the backward (counted with saved-tensor hooks), and the bytes
of the output sent to the next stage. Plus the optimizer step, gloo point-to-point latency
and bandwidth between two processes, and the control round trip of a step commit. A model
other than the built-in GPT (``[model] source = "python"`` or ``"hf"``) takes its layers'
bytes and time ratios from the job's ``[profile]``; its times come from the failure-free
run (``--from-run``).

Plus the runtime's own transition terms: how long a gloo group of ``k`` workers takes to
form and exchange a first message between every pair (``comm_init_s + comm_per_rank_s *
k``), and how long re-instantiating a layer takes (``layer_build_s`` plus its state bytes
at ``layer_build_gb_per_s``): the ``[recovery]`` values of ``examples/tiny_cpu.toml``.

Honesty about the machine: a CPU run puts ``num_workers`` processes on the machine's cores,
so each layer is timed while ``num_workers`` processes run the same measurement at once
(per-layer medians over processes and repeats). The estimator then times the same
contended speed the runtime sees.

Usage::

    python -m chameleon_ft.runtime.profiler --config examples/tiny_cpu.toml \\
        --out examples/tiny_cpu_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from chameleon_ft.profile import LayerCost, Profile
from chameleon_ft.runtime.workload.corpus import ByteCorpus
from chameleon_ft.runtime.workload.models.gpt_layers import (
    GPTShape,
    build_layer,
    loss_sum,
)
from chameleon_ft.runtime.workload.optim import LayerTrainState
from chameleon_ft.runtime.workload.precision import torch_dtype


def _adamw(params: Any) -> torch.optim.Optimizer:
    """The optimizer the profile prices: AdamW, two moments per parameter."""
    return torch.optim.AdamW(params, lr=1e-3)


def _built_state(shape: GPTShape, index: int, dtype: torch.dtype) -> LayerTrainState:
    """A layer as a worker re-instantiates it: module, initial values and optimizer, with
    the optimizer's moments allocated (torch.optim creates them at the first step)."""
    state = LayerTrainState.create(build_layer(shape, index, seed=0, dtype=dtype), _adamw)
    for group in state.optimizer.param_groups:
        for p in group["params"]:
            state.optimizer.state[p] = {"exp_avg": torch.zeros_like(p),
                                        "exp_avg_sq": torch.zeros_like(p)}
    return state


def _sync() -> None:
    """Wait for queued GPU work (a no-op on the CPU), so a timing covers what it ran."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _measure_layer(layer: torch.nn.Module, i: int, num_layers: int, tokens: torch.Tensor,
                   targets: torch.Tensor, hidden: torch.Tensor, elem: int,
                   repeats: int) -> dict[str, Any]:
    """One layer's forward, backward and input-gradient times, its bytes."""
    is_first, is_last = i == 0, i == num_layers - 1
    x_in = tokens if is_first else hidden.clone().requires_grad_(True)

    def forward() -> torch.Tensor:
        y = layer(x_in)
        return loss_sum(y, targets, targets.numel()) if is_last else y

    def fused() -> None:
        y = forward()
        y.backward(None if is_last else torch.ones_like(y))

    def input_only() -> None:
        y = forward()
        torch.autograd.grad(y, [x_in], None if is_last else torch.ones_like(y))

    for _ in range(3):  # warm the per-shape kernels
        fused()
    # Interleave the three timings so that they see the same contention from the other
    # processes measuring at the same time.
    samples: list[tuple[float, float, float]] = []
    for _ in range(repeats):
        samples.append((_median_s(forward, 1), _median_s(fused, 1),
                        0.0 if is_first else _median_s(input_only, 1)))
    fwd_s = statistics.median(f for f, _, _ in samples)
    bwd_s = max(0.0, statistics.median(b for _, b, _ in samples) - fwd_s)
    bwd_input_s = 0.0 if is_first else min(
        bwd_s, max(0.0, statistics.median(i for _, _, i in samples) - fwd_s))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t, acc=saved: acc.append(t.numel() * t.element_size()) or t,
            lambda t: t):
        y = forward()
    param_bytes = sum(p.numel() for p in layer.parameters()) * elem
    return {
        "name": "embedding" if is_first else "head" if is_last else f"block{i}",
        "fwd_s": fwd_s, "bwd_input_s": bwd_input_s, "bwd_weight_s": bwd_s - bwd_input_s,
        "param_bytes": float(param_bytes), "optimizer_bytes": float(2 * param_bytes),
        "activation_bytes": float(sum(saved)),
        "output_bytes": 0.0 if is_last else float(y.numel() * y.element_size()),
    }


def measure_layers(shape: GPTShape, micro_batch: int, dtype_name: str,
                   repeats: int = 20, device: str = "cpu") -> dict[str, Any]:
    """Time every layer of ``shape`` at ``micro_batch`` samples (one process, one thread;
    on ``device``, ``cpu`` or ``cuda``).

    Returns:
        ``{"layers": [dict per layer], "optimizer_step_s": float}`` (JSON-ready).
    """
    torch.set_num_threads(1)
    dtype = torch_dtype(dtype_name)
    elem = torch.tensor([], dtype=dtype).element_size()
    corpus = ByteCorpus(shape.seq_len)
    tokens, targets = corpus.microbatch(0, 0, micro_batch)  # (b, T) each
    tokens, targets = tokens.to(device), targets.to(device)
    hidden = torch.randn(micro_batch, shape.seq_len, shape.hidden_size, dtype=dtype,
                         device=device)  # (b, T, H)
    out: list[dict[str, Any]] = []
    states = []
    for i in range(shape.num_layers):
        layer = build_layer(shape, i, seed=0, dtype=dtype).to(device)
        states.append(LayerTrainState.create(layer, _adamw))
        out.append(_measure_layer(layer, i, shape.num_layers, tokens, targets, hidden, elem,
                                  repeats))
    for state in states:
        for p in state.module.parameters():
            p.grad = torch.ones_like(p)

    def step() -> None:
        for state in states:
            state.step(0)

    return {"layers": out, "optimizer_step_s": _median_s(step, max(3, repeats // 4))}


def _measure_worker(args: tuple[dict[str, Any], int, str, int]) -> dict[str, Any]:
    shape_doc, micro_batch, dtype_name, repeats = args
    return measure_layers(GPTShape(**shape_doc), micro_batch, dtype_name, repeats)


def _p2p_worker(rank: int, port: int, sizes: list[int], repeats: int, queue: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=30)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("p2p/", store), rank, 2, opts)
    results = {}
    for n in sizes:
        buf = torch.zeros(max(1, n // 4), dtype=torch.float32)
        times = []
        for it in range(repeats + 2):
            t = time.perf_counter()
            if rank == 0:
                pg.send([buf], 1, it).wait()
                pg.recv([buf], 1, it).wait()
            else:
                pg.recv([buf], 0, it).wait()
                pg.send([buf], 0, it).wait()
            if it >= 2:
                times.append((time.perf_counter() - t) / 2)  # one way
        results[n] = statistics.median(times)
    if rank == 0:
        queue.put(results)
        queue.close()
        queue.join_thread()  # os._exit would drop what the feeder thread has not sent
    os._exit(0)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b)`` with ``a`` clamped at 0."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
             if spread > 0 else 0.0)
    return max(0.0, mean_y - slope * mean_x), slope


def _group_worker(rank: int, size: int, port: int, repeats: int, queue: Any) -> None:
    from chameleon_ft.runtime.worker.groups import make_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    times = []
    for it in range(repeats + 1):
        # start together: every member announces itself, the last one opens the gate
        if store.add(f"arrived/{it}", 1) == size:
            store.set(f"go/{it}", "1")
        store.wait([f"go/{it}"])
        start = time.perf_counter()
        group = make_group(store, f"group{size}/{it}/", rank, size, backend="gloo",
                           timeout_s=60.0, address="127.0.0.1")
        formed = time.perf_counter()
        # a first message each way between every pair, as the runtime's warm-up does
        works = []
        for peer in range(size):
            if peer != rank:
                works.append(group.send([torch.zeros(1)], peer, it))
                works.append(group.recv([torch.zeros(1)], peer, it))
        for work in works:
            work.wait()
        if it > 0:  # the first round pays one-off costs (imports, first sockets)
            times.append((formed - start, time.perf_counter() - start))
    queue.put((rank, times))
    queue.close()
    queue.join_thread()
    os._exit(0)


def measure_groups(sizes: tuple[int, ...] = (2, 3, 4), repeats: int = 10) -> dict[str, Any]:
    """How long a gloo group of ``k`` local workers takes to form and exchange a first
    message between every pair (what the runtime does for each generation's groups).

    Returns:
        ``comm_init_s`` and ``comm_per_rank_s`` of a least-squares line through the median
        time of each size (a round lasts until its slowest member is done), and the raw
        ``times_s`` per size.
    """
    from chameleon_ft.runtime.coordinator.launcher import forkserver_context

    ctx = forkserver_context()
    medians, formed = {}, {}
    for size in sizes:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        queue = ctx.Queue()
        procs = [ctx.Process(target=_group_worker, args=(r, size, store.port, repeats, queue))
                 for r in range(size)]
        for proc in procs:
            proc.start()
        try:
            per_rank = [queue.get(timeout=120)[1] for _ in procs]
        finally:
            for proc in procs:
                proc.join(10)
                if proc.exitcode is None:
                    proc.kill()
        rounds = list(zip(*per_rank, strict=True))
        medians[size] = statistics.median(max(t[1] for t in ts) for ts in rounds)
        formed[size] = statistics.median(max(t[0] for t in ts) for ts in rounds)
    init_s, per_rank_s = _fit_line([float(k) for k in sizes], [medians[k] for k in sizes])
    return {"comm_init_s": init_s, "comm_per_rank_s": max(0.0, per_rank_s),
            "times_s": {str(k): medians[k] for k in sizes},
            "formed_s": {str(k): formed[k] for k in sizes}}


def measure_layer_build(shape: GPTShape, dtype_name: str, repeats: int = 10) -> dict[str, Any]:
    """How long re-instantiating each layer takes here (module, initial values, AdamW
    moments), as a worker does for a layer it receives.

    Returns:
        ``layer_build_s`` (fixed part) and ``layer_build_gb_per_s`` of a least-squares line
        through each layer's median time against its static bytes (parameters, gradients,
        moments), and the raw ``times_s`` per layer.
    """
    torch.set_num_threads(1)
    dtype = torch_dtype(dtype_name)
    elem = torch.tensor([], dtype=dtype).element_size()
    xs, ys = [], []
    for i in range(shape.num_layers):
        numel = sum(p.numel() for p in build_layer(shape, i, seed=0, dtype=dtype).parameters())
        xs.append(float(4 * numel * elem))  # parameters, gradients, two moments
        ys.append(_median_s(lambda i=i: _built_state(shape, i, dtype), repeats))
    fixed_s, s_per_byte = _fit_line(xs, ys)
    rate = 1e-9 / s_per_byte if s_per_byte > 0 else 1e3  # GB/s; flat: effectively free
    return {"layer_build_s": fixed_s, "layer_build_gb_per_s": rate,
            "times_s": [round(y, 6) for y in ys]}


def measure_p2p(sizes: tuple[int, ...] = (4, 1 << 17, 1 << 21, 1 << 24),
                repeats: int = 30) -> dict[str, Any]:
    """Gloo one-way transfer time between two processes of this host (ping-pong / 2).

    Returns:
        ``latency_s`` and ``bandwidth_bytes_s`` of a least-squares line through the median
        one-way time of each message size, and the raw ``times_s`` per size.
    """
    from chameleon_ft.runtime.coordinator.launcher import forkserver_context

    ctx = forkserver_context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_p2p_worker, args=(r, store.port, list(sizes), repeats, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        results: dict[int, float] = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
    latency_s, slope = _fit_line([float(n) for n in sizes], [results[n] for n in sizes])
    return {"latency_s": latency_s, "bandwidth_bytes_s": 1.0 / max(slope, 1e-15),
            "times_s": {str(n): results[n] for n in sizes}}


def measure_control(repeats: int = 200) -> float:
    """Round trip of one store operation: a step commit costs about two of them plus the
    coordinator's poll interval."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    return _median_s(lambda: client.add("x", 1), repeats)


def profile_job(config: Any, *, repeats: int = 20, concurrency: int | None = None) -> Profile:
    """Measure the job's model on this machine under the job's process count.

    Args:
        config: a job with a ``[model]``.
        repeats: timed repetitions per measurement.
        concurrency: processes measuring at once (default: the job's workers).
    """
    from chameleon_ft.runtime.coordinator.launcher import forkserver_context

    shape = GPTShape.from_spec(config.model)
    dtype = config.train.dtype
    n = concurrency or config.num_workers
    ctx = forkserver_context()
    with ctx.Pool(n) as pool:
        runs = pool.map(_measure_worker, [(vars(shape), config.job.micro_batch, dtype,
                                           repeats)] * n)
    layers = []
    for i in range(shape.num_layers):
        doc = dict(runs[0]["layers"][i])
        for key in ("fwd_s", "bwd_input_s", "bwd_weight_s"):
            doc[key] = statistics.median(r["layers"][i][key] for r in runs)
        layers.append(LayerCost(**doc))
    p2p = measure_p2p()
    control_s = measure_control()
    groups = measure_groups()
    build = measure_layer_build(shape, dtype, repeats=max(3, repeats // 2))
    return Profile(
        layers=tuple(layers),
        optimizer_step_s=statistics.median(r["optimizer_step_s"] for r in runs),
        tokens_per_sample=shape.seq_len, micro_batch=config.job.micro_batch, source="measured",
        meta={"model": vars(shape), "dtype": dtype, "processes_at_once": n,
              "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "p2p_latency_s": p2p["latency_s"], "p2p_bandwidth_bytes_s":
              p2p["bandwidth_bytes_s"], "p2p_times_s": p2p["times_s"],
              "store_round_trip_s": control_s,
              "recovery": {"comm_init_s": groups["comm_init_s"],
                           "comm_per_rank_s": groups["comm_per_rank_s"],
                           "layer_build_s": build["layer_build_s"],
                           "layer_build_gb_per_s": build["layer_build_gb_per_s"]},
              "group_times_s": groups["times_s"], "layer_build_times_s": build["times_s"]})


def measure_model_layer_build(config: Any, repeats: int = 10) -> dict[str, Any]:
    """:func:`measure_layer_build` for any layered model (the job's ``[model]``): each
    layer built in the run's dtype with its optimizer, as a worker does for a layer it
    receives.

    Returns:
        As :func:`measure_layer_build`.
    """
    from chameleon_ft.runtime.workload.bundle import Workload
    from chameleon_ft.runtime.workload.optim import LayerTrainState

    torch.set_num_threads(1)
    work = Workload(config)
    model, factory = work.model(), work.optimizer()
    dtype = torch_dtype(config.train.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    xs, ys = [], []
    for i in range(model.num_layers):
        numel = sum(p.numel() for p in model.build_layer(i).parameters())
        xs.append(float(4 * numel * elem))  # parameters, gradients, two moments
        ys.append(_median_s(lambda i=i: LayerTrainState.create(
            model.build_layer(i).to(dtype), factory), repeats))
    fixed_s, s_per_byte = _fit_line(xs, ys)
    rate = 1e-9 / s_per_byte if s_per_byte > 0 else 1e3
    return {"layer_build_s": max(0.0, fixed_s), "layer_build_gb_per_s": rate,
            "times_s": [round(y, 6) for y in ys]}


def declared_profile(config: Any) -> Profile:
    """The job's own ``[profile]`` (bytes and time ratios of a model that is not the built-in
    GPT) with this host's gloo point-to-point, store round-trip, group formation and layer
    re-instantiation times measured, and the bytes of the weight its head shares with its
    embedding, if it does (``Profile.tied_bytes``, from the model's tied pair).

    Args:
        config: a job whose ``[profile]`` is ``uniform`` or ``file``.
    """
    from chameleon_ft.profile import build_profile
    from chameleon_ft.runtime.workload.models import load_model, tied_end_elements

    base = build_profile(config)
    # a head tied to the embedding: the copies' sum, in the run's dtype (as the layers'
    # bytes the profiler measures)
    elem = torch.tensor([], dtype=torch_dtype(config.train.dtype)).element_size()
    tied_bytes = float(tied_end_elements(load_model(config)) * elem)
    p2p = measure_p2p()
    groups = measure_groups()
    build = measure_model_layer_build(config)
    meta = dict(base.meta)
    meta.update({"dtype": config.train.dtype, "cpu_count": os.cpu_count(),
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "p2p_latency_s": p2p["latency_s"],
                 "p2p_bandwidth_bytes_s": p2p["bandwidth_bytes_s"],
                 "p2p_times_s": p2p["times_s"], "store_round_trip_s": measure_control(),
                 "recovery": {"comm_init_s": groups["comm_init_s"],
                              "comm_per_rank_s": groups["comm_per_rank_s"],
                              "layer_build_s": build["layer_build_s"],
                              "layer_build_gb_per_s": build["layer_build_gb_per_s"]},
                 "group_times_s": groups["times_s"], "layer_build_times_s": build["times_s"],
                 "layers_from": "the job's [profile]"})
    return replace(base, meta=meta, source="measured", tied_bytes=tied_bytes)


def control_overhead_s(op_times: list[dict[str, Any]], *, skip_steps: int = 3) -> float:
    """Median per-step commit latency of a run: for each step, the shortest wait from
    "reduced" to the verdict over its workers (the last worker to reduce waits only for the
    coordinator's poll and the store round trips). 0 when nothing was measured."""
    by_step: dict[tuple[int, int], list[float]] = {}
    for rec in op_times:
        wait = rec.get("commit_wait_s")
        if rec["step"] > skip_steps and wait is not None:
            # a record carries the previous step's wait
            by_step.setdefault((rec["gen"], rec["step"] - 1), []).append(wait)
    return statistics.median(min(w) for w in by_step.values()) if by_step else 0.0


def calibrate_from_run(base: Profile, op_times: list[dict[str, Any]], *,
                       skip_steps: int = 3) -> Profile:
    """Replace ``base``'s times by the compute and control times the runtime measured in a
    real run (the per-step commit latency becomes the profile's ``control_s``).

    Each worker reports the compute seconds of its forward and backward ops per step (waits
    excluded) and of its optimizer step. A stage's median op time is split over its layers
    in the proportions of ``base`` (an isolated measurement), so the profile carries the
    speed the workers really had: with every process of the job sharing the cores.

    Args:
        base: the isolated per-layer measurement (shapes, bytes and time ratios).
        op_times: ``Coordinator.op_times`` (or ``op_times.json``) of a failure-free run.
        skip_steps: leading steps to ignore (warm-up).
    """
    stages: dict[tuple[int, int], dict[str, list[float]]] = {}
    for rec in op_times:
        if rec["step"] < skip_steps or not rec["layers"]:
            continue
        acc = stages.setdefault((rec["layers"][0], rec["layers"][1]),
                                {"f": [], "b": [], "opt": []})
        acc["f"].extend(rec["f_s"])
        acc["b"].extend(rec["b_s"])
        if rec["optimizer_s"] is not None:
            acc["opt"].append(rec["optimizer_s"])
    layers = list(base.layers)
    total_params = base.total_param_bytes
    optimizer = []
    for (lo, hi), acc in stages.items():
        chosen = base.layers[lo:hi]
        f_total = sum(c.fwd_s for c in chosen) or 1.0
        b_total = sum(c.bwd_s for c in chosen) or 1.0
        f_med, b_med = statistics.median(acc["f"]), statistics.median(acc["b"])
        for i in range(lo, hi):
            c = base.layers[i]
            bwd = b_med * c.bwd_s / b_total
            split = c.bwd_input_s / c.bwd_s if c.bwd_s else 0.5
            layers[i] = replace(c, fwd_s=f_med * c.fwd_s / f_total, bwd_input_s=bwd * split,
                                bwd_weight_s=bwd * (1 - split))
        share = sum(c.param_bytes for c in chosen) / total_params
        if acc["opt"] and share:
            optimizer.append(statistics.median(acc["opt"]) / share)
    meta = dict(base.meta)
    meta["calibration"] = ("compute seconds per op measured inside a failure-free run "
                           "(every worker process sharing the cores), split over a stage's "
                           "layers in the isolated measurement's proportions")
    return replace(base, layers=tuple(layers), meta=meta,
                   optimizer_step_s=statistics.median(optimizer) if optimizer
                   else base.optimizer_step_s,
                   control_s=control_overhead_s(op_times, skip_steps=skip_steps))


def storage_gb_per_s(folder: Path, size: int = 256 << 20, repeats: int = 3) -> float:
    """Write speed of ``folder``'s disk as a checkpoint sees it: ``size`` bytes written
    and fsynced, GB/s, median (``[train] storage_gb_per_s``)."""
    block = os.urandom(1 << 22)
    speeds = []
    for r in range(repeats):
        path = folder / f".disk-probe-{os.getpid()}-{r}"
        start = time.perf_counter()
        try:
            with open(path, "wb") as f:
                for _ in range(max(1, size // len(block))):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
            speeds.append(size / (time.perf_counter() - start) / 1e9)
        finally:
            path.unlink(missing_ok=True)
    return statistics.median(speeds)


def main(argv: list[str] | None = None) -> int:
    """``python -m chameleon_ft.runtime.profiler --config FILE --out PROFILE.json``."""
    from chameleon_ft.spec import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", choices=("float32", "float64"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--from-run", type=int, default=30, metavar="STEPS",
                        help="calibrate the compute times with a failure-free run of this many "
                             "steps (0: keep the isolated measurement)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    if args.dtype:
        config = replace(config, train=replace(config.train, dtype=args.dtype))
    if config.model_source.source == "gpt":
        profile = profile_job(config, repeats=args.repeats, concurrency=1)
    else:
        # no built-in shape to time layer by layer: the job's [profile] gives the bytes and
        # the time ratios, the failure-free run below measures the times
        profile = declared_profile(config)
    if args.from_run:
        from chameleon_ft.runtime.coordinator.shell import Coordinator

        run_config = replace(config, train=replace(config.train, steps=args.from_run,
                                                   checkpoint_every=0, faults=()))
        coord = Coordinator(run_config, profile=profile)
        coord.run()
        profile = calibrate_from_run(profile, coord.op_times)
    profile.save(Path(args.out))
    meta = profile.meta
    print(json.dumps({
        "out": args.out,
        "step_compute_s_one_worker": sum(c.fwd_s + c.bwd_s for c in profile.layers),
        "p2p_latency_us": meta["p2p_latency_s"] * 1e6,
        "p2p_bandwidth_gb_per_s": meta["p2p_bandwidth_bytes_s"] / 1e9,
        "p2p_one_way_s_by_bytes": meta["p2p_times_s"],
        "store_round_trip_us": meta["store_round_trip_s"] * 1e6,
        "group_form_s_by_size": meta["group_times_s"],
        "layer_build_s_by_layer": meta["layer_build_times_s"],
        "recovery_keys": meta["recovery"],
        "train_keys": {"storage_gb_per_s": round(storage_gb_per_s(
            Path(args.out).resolve().parent), 3)},
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
