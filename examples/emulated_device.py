"""A model whose layers take a fixed device time, for testbeds with fewer cores than workers.

``examples/testbed8.toml`` trains it on 8 worker processes. Each layer is a real residual
``tanh`` layer (its parameters train, migrate and checkpoint like any other), and each
forward and backward also *waits* a fixed time per sample, as a kernel on an accelerator
would take: the wait uses no CPU, so a worker's compute time does not depend on how many
other processes share the host's cores. On a 2-core host with 8 workers, real CPU compute
would measure the operating system's scheduler (a worker with more work simply gets a
larger share of the cores) instead of the plan; with this model a worker that carries
rerouted micro-batches really takes longer, as on a cluster, and the trade-off between
rerouting and re-planning is the one the estimator and the simulator price.
Communication, commits, checkpoints, migrations and recoveries are the runtime's own.

At ``[job] tp = k`` (design 4.11) each layer is sharded over the worker's ``k`` processes
(:meth:`EmulatedDeviceModel.tensor_parallel_plan`): every rank waits ``1/k`` of the
layer's device time, and its real tensors are split as Megatron-LM splits a linear, so the
group's collectives really run. Between layers each rank holds ``HIDDEN / k`` features of
the hidden state (the runtime's boundary, dimension 1 split). The first layer is
column-parallel (each rank computes its features: no communication); a residual layer is
row-parallel with its output reduce-scattered back to the rank's features (a
reduce-scatter forward, an all-gather backward: half an all-reduce each way, the ring's
two halves); the head is row-parallel with its output all-reduced (whole on every rank,
where the loss runs).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

NUM_LAYERS = 8
IN_FEATURES = 16
HIDDEN = 256
FWD_S_PER_SAMPLE = 0.003
"""Device time of one layer's forward, per sample (12 ms for a micro-batch of 4): long
enough that the few milliseconds a loaded host takes to wake a process are small."""
BWD_S_PER_SAMPLE = 0.006
"""Device time of one layer's backward, per sample (twice the forward)."""


class DeviceTime(torch.autograd.Function):
    """Identity that waits ``fwd_s`` in the forward and ``bwd_s`` in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.bwd_s)
        return grad, None, None


class TimedLayer(nn.Module):
    """``f(x)`` followed by the device time of ``x.shape[0]`` samples: (B, in) -> (B, out)."""

    def __init__(self, inner: nn.Module, residual: bool) -> None:
        super().__init__()
        self.inner = inner
        self.residual = residual
        self.share = 1.0
        """This device's share of the layer's work: ``1/k`` when sharded over ``k``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.residual:
            y = x + torch.tanh(y)
        work = x.shape[0] * self.share  # samples (a DTensor's shape is the whole one)
        return DeviceTime.apply(y, FWD_S_PER_SAMPLE * work, BWD_S_PER_SAMPLE * work)


class EmulatedDeviceModel:
    """A layered model: an input projection, ``num_layers - 2`` residual layers, a head."""

    def __init__(self, num_layers: int, seed: int = 0) -> None:
        self.num_layers = num_layers
        self.seed = seed

    def build_layer(self, index: int) -> nn.Module:
        """Layer ``index``, initialised from its own seeded generator (deterministic)."""
        if index == 0:
            inner: nn.Module = nn.Linear(IN_FEATURES, HIDDEN)
        elif index == self.num_layers - 1:
            inner = nn.Linear(HIDDEN, 1)
        else:
            inner = nn.Linear(HIDDEN, HIDDEN)
        gen = torch.Generator().manual_seed(self.seed * 7919 + index)
        with torch.no_grad():
            for p in inner.parameters():
                bound = 1 / p.shape[-1] ** 0.5
                p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
        return TimedLayer(inner, residual=0 < index < self.num_layers - 1)

    def check_tensor_parallel(self, degree: int) -> None:
        """``[job] tp``: ``degree`` must split the hidden features evenly."""
        if HIDDEN % degree:
            raise ValueError(f"job.tp: {degree} does not divide the emulated model's "
                             f"{HIDDEN} hidden features; choose a tp that divides it")

    def tensor_parallel_plan(self, index: int, layer: nn.Module, degree: int) -> dict[str, Any]:
        """Layer ``index`` sharded over ``degree`` ranks (the module docstring's layout);
        the layer waits ``1/degree`` of its device time from now on."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        assert isinstance(layer, TimedLayer)
        layer.share = 1.0 / degree
        features = Shard(1)  # (B, HIDDEN / degree) on each rank
        if index == 0:  # (B, 16), the same on every rank -> this rank's features
            style: Any = ColwiseParallel(output_layouts=features, use_local_output=False)
        elif index == self.num_layers - 1:  # -> (B, 1), whole on every rank
            style = RowwiseParallel(input_layouts=features, output_layouts=Replicate(),
                                    use_local_output=False)
        else:  # x + tanh(W x + b): W x reduce-scattered to this rank's features
            style = RowwiseParallel(input_layouts=features, output_layouts=features,
                                    use_local_output=False)
        return {"inner": style}

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Squared error summed over the micro-batch (the runtime takes the mean)."""
        return F.mse_loss(output, targets, reduction="sum")


class RegressionData:
    """``y = sin(x . w)`` with ``x`` of 16 standard normal features, keyed by position."""

    def __init__(self, global_batch: int, seed: int = 0) -> None:
        self.global_batch = global_batch
        self.seed = seed
        self.w = np.random.default_rng([seed, 2**31]).normal(size=IN_FEATURES) / 4

    def microbatch(self, step: int, first_sample: int,
                   size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (size, 16) and targets (size, 1), float32; sample ``g = step *
        global_batch + i`` is drawn from a generator keyed by ``g`` alone."""
        first = step * self.global_batch + first_sample
        x = np.stack([np.random.default_rng([self.seed, g]).normal(size=IN_FEATURES)
                      for g in range(first, first + size)])
        y = np.sin(x @ self.w)[:, None]
        return (torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32))

    def digest(self) -> str:
        return f"emulated-regression-{self.seed}-{self.global_batch}"


def build_model(config: Any) -> EmulatedDeviceModel:
    """``[model] factory``: ``NUM_LAYERS`` layers seeded by ``[train] seed``."""
    return EmulatedDeviceModel(NUM_LAYERS, seed=config.train.seed)


def build_data(config: Any) -> RegressionData:
    """``[data] factory``."""
    return RegressionData(config.job.global_batch, seed=config.data_seed)
