"""Whether a model can be sharded over a worker's devices (``[job] tp``, design 4.11),
checked before any process starts: in the coordinator, which must not import DTensor's
modules for it (``workload.tensor_parallel`` shards; this only reads shapes)."""

from __future__ import annotations

from typing import Any

from chameleon_ft.runtime.workload.models.gpt import GPTModel

__all__ = ["check_tensor_parallel", "hf_model_class"]


def hf_model_class() -> type[Any] | None:
    """The Hugging Face adapter's class, when transformers is installed."""
    try:
        from chameleon_ft.runtime.workload.models.hf import HFCausalLM
    except ImportError:  # pragma: no cover - the hf extra is part of `make test`
        return None
    return HFCausalLM


def _divides(degree: int, count: int, what: str) -> None:
    if count % degree:
        raise ValueError(f"job.tp: {degree} does not divide the model's {count} {what}; "
                         f"choose a tp that divides it")


def check_tensor_parallel(model: Any, degree: int, seq_len: int) -> None:
    """Check that ``model`` can be sharded over ``degree`` devices (before any process
    starts).

    Supported: the built-in GPT and every Hugging Face family of the adapter, with
    ``degree`` dividing the query heads, the key/value heads (grouped heads are split,
    never replicated across ranks), the MLP's width and the sequence (sequence-parallel
    boundaries); any vocabulary (its last shard may be shorter).

    Args:
        model: the layered model.
        degree: ``[job] tp``.
        seq_len: tokens per sample.

    Raises:
        ValueError: one line naming ``job.tp``.
    """
    if degree == 1:
        return
    hf_cls = hf_model_class()
    if isinstance(model, GPTModel):
        s = model.shape
        _divides(degree, s.num_heads, "attention heads")
        _divides(degree, s.ffn_size, "MLP columns (ffn)")
    elif hf_cls is not None and isinstance(model, hf_cls):
        c: Any = model.config
        _divides(degree, c.num_attention_heads, "attention heads")
        _divides(degree, c.num_key_value_heads, "key/value heads (grouped heads are split "
                 "over the group, not replicated)")
        _divides(degree, c.intermediate_size, "MLP columns (intermediate_size)")
    else:
        raise ValueError(f"job.tp: tensor parallelism shards the built-in GPT and the "
                         f"Hugging Face families; {type(model).__name__} has no "
                         f"tensor-parallel plan: set job.tp = 1")
    _divides(degree, seq_len, "tokens per sample (sequence-parallel boundaries)")
