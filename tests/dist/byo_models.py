"""Objects the Python-API tests hand to ``chameleon_ft.train``: module-level, so they
pickle to the worker processes."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn


class TinyMLP:
    """A layered model that is not a transformer: (B, 6) -> (B, 2) in 4 layers."""

    num_layers = 4

    def build_layer(self, index: int) -> nn.Module:
        gen = torch.Generator().manual_seed(100 + index)
        sizes = [(6, 16), (16, 16), (16, 16), (16, 2)]
        layer = nn.Linear(*sizes[index])
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
        return layer if index == 3 else nn.Sequential(layer, nn.Tanh())

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, targets, reduction="sum")


class TinyRegression:
    """Sample ``i`` of step ``k``: drawn from a generator keyed by its global position."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch

    def microbatch(self, step: int, first_sample: int,
                   size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g0 = step * self.global_batch + first_sample
        x = np.stack([np.random.default_rng(g0 + i).normal(size=6) for i in range(size)])
        y = np.stack([np.sin(x[:, :3].sum(axis=1)), np.cos(x[:, 3:].sum(axis=1))], axis=1)
        return torch.tensor(x), torch.tensor(y)


class SlowData:
    """Deterministic byte samples (each a function of its global position only), each
    micro-batch from step ``from_step`` on slowed down (a step that outlasts the hang
    deadline and the old drain grace). Small to pickle: it holds no corpus."""

    def __init__(self, seq_len: int, delay_s: float, from_step: int,
                 global_batch: int) -> None:
        self.seq_len, self.delay_s, self.from_step = seq_len, delay_s, from_step
        self.global_batch = global_batch

    def microbatch(self, step: int, first_sample: int, size: int) -> Any:
        if step >= self.from_step:
            time.sleep(self.delay_s)
        start = step * self.global_batch + first_sample
        g = torch.arange(start, start + size).unsqueeze(1)  # (size, 1)
        t = torch.arange(self.seq_len + 1).unsqueeze(0)  # (1, T + 1)
        tokens = (g * 31 + t * 7) % 256  # (size, T + 1)
        return tokens[:, :-1], tokens[:, 1:]

    def digest(self) -> str:
        return f"slow:{self.seq_len}:{self.delay_s}:{self.from_step}:{self.global_batch}"


class FrozenLayers:
    """Any layered model with its first layers frozen (``requires_grad = False``), as when
    fine-tuning the top of a model; everything else is the inner model's."""

    def __init__(self, inner: object, frozen: int) -> None:
        self.inner = inner
        self.frozen = frozen
        self.num_layers: int = inner.num_layers  # type: ignore[attr-defined]

    def build_layer(self, index: int) -> nn.Module:
        layer: nn.Module = self.inner.build_layer(index)  # type: ignore[attr-defined]
        if index < self.frozen:
            layer.requires_grad_(False)
        return layer

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner.loss(output, targets)  # type: ignore[attr-defined]
        return out

    def __getattr__(self, name: str) -> object:  # export, tied_parameters, hf_name...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
