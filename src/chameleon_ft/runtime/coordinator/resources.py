"""Will the workers fit? Memory needed per worker against what this host gives them.

Checked before any worker starts: a job that cannot fit would otherwise launch, thrash,
and end by the kernel's out-of-memory killer a minute or two later with a misleading
"worker exited with status -9".

The need of a worker is the runtime's own: every parameter of its stage in the run's
dtype, its gradient, and the optimizer's state (AdamW: two moments); under mixed precision
(``bfloat16``) the bf16 compute copy plus fp32 masters, fp32 gradients and fp32 moments
(18 bytes a parameter); plus the activations kept for the micro-batches in flight (at most
the number of stages, 1F1B), in the compute dtype (with activation checkpointing only each
layer's input, plus one layer's activations while its forward runs again), plus the
process itself (the Python interpreter and torch). CPU workers of one host share its
available memory; a GPU worker has its device's memory.

At ``[job] tp = k`` a worker is k processes (design 4.11), each counted on its own: its
shard of the stage (sharded tensors divided by k, replicated ones whole: norms,
row-parallel biases, the GPT's position table), their gradients and optimizer state
alike, the activations at the estimator's sequence-parallel ``1 / k``, its host copy of
its shards, and the process itself; on GPUs each rank has a device of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.profile import Profile
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.model import ModelSpec

PROCESS_BYTES = 300 * 2**20
"""Resident memory of a worker process before its layers (measured: ~220 MiB after
importing torch, plus gloo's buffers and threads)."""
OPTIMIZER_COPIES = 2
"""Optimizer state per parameter, in parameter-sized tensors (AdamW: two moments)."""
_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}
"""Bytes of one element in the dtype the layers compute in (activations)."""
_MASTER_BYTES = {"float32": 4, "float64": 8, "bfloat16": 4}
"""Bytes of one element of the master weights, gradients and optimizer state."""
GIB = 2**30


BF16_BYTES = 2
"""A uniform or file profile's parameter bytes are read as bf16 bytes when no layer can
be built to count them."""


def layer_parameters(config: Config, profile: Profile,
                     build_layer: Callable[[int], Any] | None = None) -> list[int]:
    """Parameters of each layer: from the model's shape when the profile is analytic (the
    same count the analytic profile prices, and the same architecture the runtime
    builds: a tied head's copy included), else by building each layer once (one at a
    time)."""
    from chameleon_ft.profile.analytic import layer_parameters as model_parameters
    from chameleon_ft.spec.profile_source import ProfileKind

    if config.profile.kind == ProfileKind.ANALYTIC and config.model is not None:
        # not from the profile's bytes: the runtime's own profile prices [train] dtype
        return model_parameters(config.model)
    if build_layer is None:
        return [round(layer.param_bytes * config.job.tp / BF16_BYTES)
                for layer in profile.layers]
    counts = []
    for i in range(profile.num_layers):
        module = build_layer(i)
        counts.append(sum(p.numel() for p in module.parameters()))
        del module
    return counts


def replicated_parameters(config: Config, num_layers: int) -> list[int]:
    """Parameters of each layer that every tensor-parallel rank holds whole: each
    block's norms (weight and bias, counted generously) and row-parallel biases, the
    final norm, and the built-in GPT's position table (0s without an architecture)."""
    model = config.model
    if config.job.tp == 1 or model is None or num_layers < 2:
        return [0] * num_layers
    h = model.hidden_size
    first = model.seq_len * h if config.model_source.source == "gpt" else 0
    return [first, *[2 * (model.block_norms + 1) * h] * (num_layers - 2), 2 * h]


def rank_parameters(config: Config, params: list[int]) -> list[float]:
    """Parameters of each layer one tensor-parallel rank holds: its shard of the sharded
    tensors and the replicated ones whole (``params`` at ``tp = 1``)."""
    tp = config.job.tp
    replicated = replicated_parameters(config, len(params))
    return [(n - r) / tp + r for n, r in zip(params, replicated, strict=True)]


def _activation_elements(model: ModelSpec, micro_batch: int) -> float:
    """Elements autograd keeps per block and micro-batch (no recomputation): the
    Korthikanti et al. count in elements, ``s b h (34 + 5 a s / h) / 2``, rounded up."""
    s, b, h, a = model.seq_len, micro_batch, model.hidden_size, model.num_heads
    return s * b * h * (34 + 5 * a * s / h) / 2


def state_bytes_per_param(dtype: str) -> int:
    """Resident bytes per parameter: weights, gradients and optimizer state (AdamW's two
    moments), and under mixed precision the bf16 compute copy beside the fp32 masters."""
    master = _MASTER_BYTES[dtype] * (2 + OPTIMIZER_COPIES)
    return master + (_DTYPE_BYTES[dtype] if _DTYPE_BYTES[dtype] != _MASTER_BYTES[dtype] else 0)


def _activations(config: Config, profile: Profile, num_layers: int) -> tuple[list[float],
                                                                               list[float]]:
    """Per layer and micro-batch in flight: the bytes kept for the backward, and the bytes
    a layer's forward holds while it runs (the same without activation checkpointing)."""
    from chameleon_ft.spec.train import ActivationCheckpointing

    elem = _DTYPE_BYTES[config.train.dtype]
    if config.model is not None:
        full = [_activation_elements(config.model, config.job.micro_batch) * elem] * num_layers
        layer_input = float(config.model.seq_len * config.job.micro_batch
                            * config.model.hidden_size * elem)
    else:  # the profile's activations are bf16 bytes per micro-batch
        full = [layer.activation_bytes * elem / BF16_BYTES for layer in profile.layers]
        layer_input = max((layer.output_bytes * elem / BF16_BYTES for layer in profile.layers),
                          default=0.0)
    if config.train.activation_checkpointing == ActivationCheckpointing.FULL:
        return [min(layer_input, f) for f in full], full
    return full, full


def worker_bytes(config: Config, plan: ExecutionPlan, profile: Profile,
                 params: list[int]) -> dict[int, float]:
    """Bytes each process of each worker of ``plan`` needs in the runtime (itself
    included): one rank's (every rank of a worker needs the same); the worker's at
    ``tp = 1``.

    Args:
        config: the job.
        plan: the plan.
        profile: per-layer costs (activations, when the architecture is unknown).
        params: parameters of each layer (:func:`layer_parameters`).
    """
    per_param = state_bytes_per_param(config.train.dtype)
    tp = config.job.tp
    held = rank_parameters(config, params)
    kept, running = _activations(config, profile, len(params))
    out: dict[int, float] = {}
    pipe_stages = max(p.num_stages for p in plan.pipelines)
    for _, stage_index, stage in plan.iter_stages():
        in_flight = max(1, pipe_stages - stage_index)
        state = sum(held[i] for i in stage.layers) * per_param
        recompute = max(running[i] - kept[i] for i in stage.layers) / tp
        out[stage.worker] = out.get(stage.worker, 0.0) + state + in_flight * sum(
            kept[i] for i in stage.layers) / tp + recompute + PROCESS_BYTES
    return out


def checkpoint_copy_bytes(config: Config, plan: ExecutionPlan,
                          params: list[int]) -> dict[int, float]:
    """Host memory each worker of ``plan`` keeps for its checkpoint copies (each of its
    processes, at ``tp > 1``: its shards): the master weights and optimizer state of the
    layers it writes (replicas take turns by layer), kept from one checkpoint to the next.
    None without periodic checkpoints (the final one is written from the live state)."""
    from chameleon_ft.runtime.control.checkpoints import writer_of

    if config.train.checkpoint_every <= 0:
        return {}
    per_param = _MASTER_BYTES[config.train.dtype] * (1 + OPTIMIZER_COPIES)
    held = rank_parameters(config, params)  # each rank copies its own shards
    holders: dict[int, list[int]] = {}
    for _, _, stage in plan.iter_stages():
        for layer in stage.layers:
            holders.setdefault(layer, []).append(stage.worker)
    out: dict[int, float] = {}
    for layer, workers in holders.items():
        writer = writer_of(workers, layer)
        out[writer] = out.get(writer, 0.0) + held[layer] * per_param
    return out


def available_bytes() -> int | None:
    """This host's available memory (``MemAvailable``), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _fmt(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB / 10 else \
        f"{num_bytes / 2**20:.0f} MiB"


def _backend(config: Config) -> str:
    from chameleon_ft.runtime.worker.groups import resolve_backend

    return resolve_backend(config.train.backend, config.train.device)


def _check_gpus(local: list[float], gpu_bytes: list[int] | None,
                dtype: str, tp: int = 1) -> None:  # pragma: no cover - needs GPUs
    if gpu_bytes is None:
        import torch

        gpu_bytes = [torch.cuda.get_device_properties(d).total_memory
                     for d in range(torch.cuda.device_count())]
    per_gpu: dict[int, float] = {}
    for w, n in enumerate(local):
        for rank in range(tp):  # each rank on its own device: tp * i + rank
            d = (tp * w + rank) % len(gpu_bytes)
            per_gpu[d] = per_gpu.get(d, 0.0) + n
    for d, n in per_gpu.items():
        if n > gpu_bytes[d]:
            raise ValueError(f"memory: the workers on GPU {d} need {_fmt(n)} ({dtype} "
                             f"parameters, gradients, optimizer state, activations), the "
                             f"device has {_fmt(gpu_bytes[d])}; use more GPUs, a longer "
                             "pipeline (job.pp) or a smaller model")


def _local_needs(config: Config, need: dict[int, float], num_local: int) -> list[float]:
    """Each local worker's bytes: its stage's; a spare node's worker the largest (it may
    take any stage's place); a worker the plan leaves idle the process alone."""
    spare = max(need.values(), default=float(PROCESS_BYTES))
    idle = float(PROCESS_BYTES * config.job.tp)
    return [need.get(w, spare if w >= config.num_workers else idle)
            for w in range(num_local)]


def check_memory(config: Config, plan: ExecutionPlan, profile: Profile, num_local: int, *,
                 backend: str | None = None, available: int | None = None,
                 gpu_bytes: list[int] | None = None,
                 build_layer: Callable[[int], Any] | None = None) -> list[str]:
    """Refuse a job whose local workers cannot fit; return notes worth a log line.

    Args:
        config: the job.
        plan: the initial plan.
        profile: per-layer costs (unused for the need, which is the runtime's own).
        num_local: workers launched on this host (ids ``0..num_local-1``; a spare
            node's worker is charged the largest worker's need, its place once swapped in).
        backend: ``gloo``/``nccl`` (default: ``[train] backend`` resolved on this host).
        available: bytes of host memory available (default: read from the system).
        gpu_bytes: memory of each local GPU (default: asked of torch when NCCL runs).
        build_layer: builds a layer, to count its parameters when the profile is not
            analytic.

    Raises:
        ValueError: naming what is needed and what there is.
    """
    notes: list[str] = []
    if num_local == 0:
        return notes
    params = layer_parameters(config, profile, build_layer)
    need = worker_bytes(config, plan, profile, params)
    backend = backend or _backend(config)
    device = config.cluster.device
    device_name = device.name if device is not None else "custom"
    mismatch = ""
    if backend == "gloo" and device_name != "cpu":
        mismatch = (f" (cluster.device is {device_name!r}, but the workers would run on this "
                    "host's CPU)")
        notes.append(f"note: cluster.device is {device_name!r}, but the workers run on this "
                     "host's CPU (gloo): the plan's timings are estimates for that device, "
                     "not for this machine")
    dtype = config.train.dtype
    if backend == "nccl":  # pragma: no cover - needs GPUs
        _check_gpus(_local_needs(config, need, num_local), gpu_bytes, dtype, config.job.tp)
        return notes
    copies = checkpoint_copy_bytes(config, plan, params)  # host memory on gloo
    tp = config.job.tp  # a worker's processes share its host
    local = _local_needs(config, {w: tp * (n + copies.get(w, 0.0)) for w, n in need.items()},
                         num_local)
    have = available_bytes() if available is None else available
    total = sum(local)
    if have is not None and total > have:
        largest = max(local)
        raise ValueError(
            f"memory: {num_local} local workers need {_fmt(total)} (up to {_fmt(largest)} "
            f"each: {dtype} parameters, gradients and optimizer state of the stage, "
            f"activations, the checkpoint's copy, and the process itself), this host has {_fmt(have)} available"
            f"{mismatch}; use a smaller model, fewer local workers (--remote-workers), or "
            "more hosts")
    return notes

