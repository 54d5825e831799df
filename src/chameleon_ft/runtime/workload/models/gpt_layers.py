"""A nanoGPT-shaped GPT cut into the planner's layers.

Layer 0 is the embedding (tokens + positions), layers 1..N the transformer blocks, layer
N+1 the final norm and the head. A worker builds only the layers of its stage inside a
:class:`StageModel`; parameter names are ``layers.{i}.<name>`` whatever the plan, and every
layer is initialised from its own seeded generator, so any plan starts from the same
parameters and two runs compare name by name.
Each layer's optimizer state lives beside it (``runtime.optim.LayerTrainState``), so that a
layer's parameters and moments move together when the plan changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from chameleon_ft.runtime.workload.models.base import StageModel
from chameleon_ft.spec.model import ModelSpec

__all__ = ["GPTShape", "StageModel", "build_layer", "layer_param_names", "loss_sum"]


@dataclass(frozen=True)
class GPTShape:
    """The tiny GPT's shape, from a :class:`ModelSpec` (vocab 256: byte-level tokens)."""

    num_blocks: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_len: int
    ffn_size: int

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> GPTShape:
        """The runtime shape of ``spec`` (only GELU MLPs and untied embeddings)."""
        return cls(num_blocks=spec.num_blocks, hidden_size=spec.hidden_size,
                   num_heads=spec.num_heads, vocab_size=spec.vocab_size, seq_len=spec.seq_len,
                   ffn_size=spec.ffn)

    @property
    def num_layers(self) -> int:
        """Planner layers: embedding + blocks + head."""
        return self.num_blocks + 2


class Embedding(nn.Module):
    """Layer 0: token and position embeddings."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.pos = nn.Embedding(shape.seq_len, shape.hidden_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx`` (B, T) int64 -> hidden (B, T, H)."""
        positions = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        return self.tok(idx) + self.pos(positions)  # (B, T, H) + (T, H) broadcasts


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP.

    The attention projections have no bias: the key bias's gradient is zero in exact
    arithmetic (softmax ignores a shift), so in floating point it is pure rounding noise
    that AdamW would amplify differently under different plans.
    """

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        h = shape.hidden_size
        self.num_heads = shape.num_heads
        self.head_dim = h // shape.num_heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, shape.ffn_size)
        self.out = nn.Linear(shape.ffn_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, H) -> (B, T, H).

        Head counts are read from the projections' outputs, not the shape: sharded over
        ``k`` tensor-parallel ranks (``workload.tensor_parallel``), ``qkv`` gives this rank's
        ``heads / k`` heads, ``[q_r; k_r; v_r]``, and ``proj`` takes their outputs.
        """
        qkv = self.qkv(self.ln1(x))  # (B, T, 3 H), or (B, T, 3 H / k) on one of k ranks
        b, t, _ = qkv.shape
        # 3 x (B, T, H) -> (B, heads, T, H / heads)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, H/heads)
        y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, H)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))  # MLP: (B,T,H)->(B,T,F)->(B,T,H)


class Head(nn.Module):
    """Layer N+1: final layer norm and the (untied) output projection to logits."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(shape.hidden_size)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, H) -> logits (B, T, V)."""
        return self.lm_head(self.ln(x))


def build_layer(shape: GPTShape, index: int, *, seed: int, dtype: torch.dtype) -> nn.Module:
    """Layer ``index`` with its deterministic initial parameters.

    Each layer draws from its own generator seeded by ``(seed, index)``, so its initial
    values do not depend on which other layers the worker holds.
    """
    if index == 0:
        module: nn.Module = Embedding(shape)
    elif index == shape.num_layers - 1:
        module = Head(shape)
    else:
        module = Block(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    # GPT-2 scaling of the residual projections keeps the residual stream's variance flat.
    residual_std = 0.02 / math.sqrt(2 * shape.num_blocks)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif name.startswith(("ln", "ln1", "ln2")) and name.endswith("weight"):
                param.fill_(1.0)
            else:
                std = residual_std if name in ("proj.weight", "out.weight") else 0.02
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * std)
    return module.to(dtype)


def layer_param_names(shape: GPTShape, index: int) -> list[str]:
    """Parameter names of layer ``index`` (without the ``layers.{i}.`` prefix), in order."""
    return [n for n, _ in build_layer(shape, index, seed=0, dtype=torch.float32).named_parameters()]


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, num_tokens_global: int) -> torch.Tensor:
    """Cross-entropy summed over the micro-batch's tokens and divided by the GLOBAL token
    count, so summing over micro-batches (in any grouping) gives the step's mean loss.

    Args:
        logits: (B, T, V).
        targets: (B, T) int64.
        num_tokens_global: tokens in the whole step (global batch x sequence length).
    """
    v = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1),
                           reduction="sum") / num_tokens_global
