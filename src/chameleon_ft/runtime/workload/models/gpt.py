"""The built-in tiny GPT (``[model] source = "gpt"``, the default) as a layered model.

Layer 0 is the embedding (tokens + positions), layers 1..N the transformer blocks, the last
the final norm and the head (``chameleon_ft.runtime.workload.models.gpt_layers``). Every layer draws its initial
values from its own generator seeded by ``(seed, index)`` in float64, the same values the
runtime has always used: casting them to float32 gives exactly the float32 parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from chameleon_ft.runtime.workload.models.base import token_cross_entropy_sum
from chameleon_ft.runtime.workload.models.gpt_layers import GPTShape
from chameleon_ft.runtime.workload.models.gpt_layers import build_layer as build_gpt_layer
from chameleon_ft.spec.config import Config


class GPTModel:
    """The tiny GPT: ``num_blocks + 2`` layers, float64 initial values."""

    def __init__(self, shape: GPTShape, *, seed: int = 0) -> None:
        """Args:
            shape: the GPT's shape.
            seed: seed of the initial parameters.
        """
        self.shape = shape
        self.seed = seed
        self.num_layers = shape.num_layers

    @classmethod
    def from_config(cls, config: Config) -> GPTModel:
        """The GPT of ``[model]`` seeded by ``[train] seed``.

        Raises:
            ValueError: naming the ``[model]`` field the built-in GPT cannot honour.
        """
        spec = config.model
        if spec is None:
            raise ValueError('model: source = "gpt" needs the architecture keys (num_blocks, '
                             "hidden_size, num_heads, vocab_size, seq_len) or a preset")
        if spec.mlp != "gelu":
            raise ValueError(f'model.mlp: the built-in GPT has GELU blocks, got {spec.mlp!r}; '
                             'use source = "hf" for Llama (swiglu) blocks')
        if spec.tied_embeddings:
            raise ValueError("model.tied_embeddings: the built-in GPT keeps the embedding "
                             "and the head apart")
        if spec.kv_heads != spec.num_heads:
            raise ValueError(f"model.num_kv_heads: the built-in GPT has no grouped-query "
                             f"attention ({spec.kv_heads} != num_heads {spec.num_heads}); "
                             'use source = "hf"')
        return cls(GPTShape.from_spec(spec), seed=config.train.seed)

    def build_layer(self, index: int) -> nn.Module:
        """Layer ``index`` with its seeded initial parameters, float64 on CPU."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of a {self.num_layers}-layer GPT")
        return build_gpt_layer(self.shape, index, seed=self.seed, dtype=torch.float64)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Token cross-entropy summed over the micro-batch."""
        return token_cross_entropy_sum(output, targets)

    def describe(self) -> str:
        """One line for the logs."""
        s = self.shape
        return (f"GPT: {s.num_blocks} blocks, hidden {s.hidden_size}, {s.num_heads} heads, "
                f"vocab {s.vocab_size}, seq_len {s.seq_len} ({self.num_layers} layers)")
