"""Whether a model can be sharded over a worker's devices (``[job] tp``, design 4.11),
checked before any process starts: in the coordinator, which must not import DTensor's
modules for it (``workload.tensor_parallel`` shards; this only reads shapes)."""

from __future__ import annotations

from typing import Any

from chameleon_ft.runtime.workload.models.gpt import GPTModel

__all__ = ["CHECK_METHOD", "PLAN_METHOD", "check_tensor_parallel", "hf_model_class",
           "user_plan"]

PLAN_METHOD = "tensor_parallel_plan"
"""A user's model shards its layers by having this method:
``tensor_parallel_plan(index, layer, degree) -> {submodule name: ParallelStyle}``, the
plan ``parallelize_module`` applies to layer ``index`` (it may also tell the layer its
share of the work). The stage boundary it must keep is the runtime's: each rank holds
its ``1/degree`` of the activation's dimension 1 (``tensor_parallel.boundary_shape``),
as ``Shard(1)`` DTensors between the layers of a stage; the last layer's output whole
(``Replicate``) on every rank."""
CHECK_METHOD = "check_tensor_parallel"
"""Optionally, ``check_tensor_parallel(degree)``: raise ``ValueError`` naming ``job.tp``
when the model cannot be split ``degree`` ways (run in the coordinator before launch)."""


def user_plan(model: Any) -> bool:
    """Whether ``model`` brings its own tensor-parallel plan (:data:`PLAN_METHOD`)."""
    return callable(getattr(model, PLAN_METHOD, None))


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
    boundaries); any vocabulary (its last shard may be shorter). A user's model brings
    its own plan (:data:`PLAN_METHOD`) and checks its own sizes (:data:`CHECK_METHOD`).

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
    # the plans in tensor_parallel.shard_layer's order: the one checked is the one applied
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
    elif user_plan(model):
        check = getattr(model, CHECK_METHOD, None)
        if callable(check):
            check(degree)  # the model's own ValueError, naming job.tp
        return
    else:
        raise ValueError(f"job.tp: {type(model).__name__} has no tensor-parallel plan (the "
                         f"built-in GPT, the Hugging Face families and models with a "
                         f"{PLAN_METHOD} method have one): set job.tp = 1")
    _divides(degree, seq_len, "tokens per sample (sequence-parallel boundaries)")
