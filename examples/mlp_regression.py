"""A model that is not a transformer, trained by Chameleon through Python factories.

``examples/mlp_cpu.toml`` names the two factories below (``[model] source = "python"``,
``[data] kind = "python"``); the Python API takes the same objects directly. The model is
a small residual MLP cut into 4 layers; the data is a synthetic regression problem whose
every sample is drawn from a generator keyed by its global position, so any plan trains
on the same samples.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

IN_FEATURES = 8
HIDDEN = 32


class ResidualBlock(nn.Module):
    """``x + W2 tanh(W1 x)``: (B, H) -> (B, H)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class RegressionMLP:
    """A layered model: input projection, ``num_blocks`` residual blocks, output head."""

    def __init__(self, num_blocks: int = 2, seed: int = 0) -> None:
        self.num_layers = num_blocks + 2
        self.seed = seed

    def build_layer(self, index: int) -> nn.Module:
        """Layer ``index``, initialised from its own seeded generator (deterministic)."""
        if index == 0:
            layer: nn.Module = nn.Linear(IN_FEATURES, HIDDEN)
        elif index == self.num_layers - 1:
            layer = nn.Linear(HIDDEN, 1)
        else:
            layer = ResidualBlock(HIDDEN)
        gen = torch.Generator().manual_seed(self.seed * 7919 + index)
        with torch.no_grad():
            for p in layer.parameters():
                bound = 1 / p.shape[-1] ** 0.5
                p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
        return layer

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Squared error SUMMED over the micro-batch (the runtime takes the mean)."""
        return F.mse_loss(output, targets, reduction="sum")

    def describe(self) -> str:
        return f"regression MLP, {self.num_layers} layers, hidden {HIDDEN}"


class RegressionData:
    """``y = sin(x . w) + 0.1 * noise`` with ``x`` of 8 standard normal features."""

    def __init__(self, global_batch: int, seed: int = 0) -> None:
        self.global_batch = global_batch
        self.seed = seed
        self.w = np.random.default_rng([seed, 2**31]).normal(size=IN_FEATURES) / 2

    def microbatch(self, step: int, first_sample: int,
                   size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (size, 8) and targets (size, 1), float32; each sample is drawn from a
        generator keyed by its global position ``step * global_batch + i``."""
        xs, ys = [], []
        for i in range(first_sample, first_sample + size):
            rng = np.random.default_rng([self.seed, step * self.global_batch + i])
            x = rng.normal(size=IN_FEATURES)
            xs.append(x)
            ys.append([np.sin(x @ self.w) + 0.1 * rng.normal()])
        return (torch.tensor(np.array(xs), dtype=torch.float32),
                torch.tensor(np.array(ys), dtype=torch.float32))

    def digest(self) -> str:
        return f"regression-{self.seed}-{self.global_batch}"


def build_model(config: object) -> RegressionMLP:
    """``[model] factory``: called with the job's Config."""
    return RegressionMLP(num_blocks=2, seed=config.train.seed)  # type: ignore[attr-defined]


def build_data(config: object) -> RegressionData:
    """``[data] factory``: called with the job's Config."""
    return RegressionData(config.job.global_batch,  # type: ignore[attr-defined]
                          seed=config.data_seed)  # type: ignore[attr-defined]
