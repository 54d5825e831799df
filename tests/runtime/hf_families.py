"""Tiny random models of every supported Hugging Face family, saved with
``save_pretrained`` (no download): the fixtures of the adapter's contract tests.

Each shape exercises what sets its family apart: a ``head_dim`` (16) that is not
hidden / heads (32 / 4), grouped-query heads, a tied head where the family ties, and a
sliding window (4) shorter than the sequence (12) where the family has one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from chameleon_ft.runtime.workload.models.hf import save_random_hf

SEQ_LEN = 12
VOCAB = 97
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 64, "bos_token_id": 1,
         "eos_token_id": 2}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": True},  # the Llama 3.2 1B/3B layout
    "mistral": {"sliding_window": 4},
    "qwen2": {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 4,
              "max_window_layers": 1},  # layers 1.. slide, as Qwen2.5 small ties
    "qwen3": {"tie_word_embeddings": False},
    "phi3": {"pad_token_id": 0, "partial_rotary_factor": 0.5},  # fused qkv and gate_up
    "gemma": {"pad_token_id": 0},  # tied by default; the padding row never learns
    "gemma2": {"sliding_window": 4, "pad_token_id": 0, "initializer_range": 0.2},
}
"""Per family: config.json settings beyond the shared shape (gemma2's larger weights make
its soft-caps bite)."""


def family_config(model_type: str) -> Any:
    """The transformers configuration of ``model_type``'s tiny model."""
    return AutoConfig.for_model(model_type, **SHAPE, **FAMILIES[model_type])


def save_family(model_type: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write ``model_type``'s tiny model (float64) to ``out_dir``."""
    return save_random_hf(family_config(model_type), out_dir, seed=seed, dtype=torch.float64)
