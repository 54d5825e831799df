"""Where the runtime's model comes from (``[model] source``, ``path``, ``factory``).

Three sources: ``gpt`` (the built-in tiny GPT; the default for GELU architectures), ``hf``
(the default for SwiGLU architectures such as the Llama presets: a Llama-family causal
LM through Hugging Face ``transformers``: a local ``save_pretrained`` directory, or random
weights from the architecture keys) and ``python`` (``factory = "package.module:function"``
returning a layered model). This module stays pure: it reads a Hugging Face directory's
``config.json`` as JSON, never through torch or transformers, so that the analytic profile
and the memory model see the same architecture the runtime trains.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from chameleon_ft.spec._fields import check_choice, check_int, fail
from chameleon_ft.spec.model import ModelSpec


class ModelSourceKind(StrEnum):
    """Model sources."""

    GPT = "gpt"
    HF = "hf"
    PYTHON = "python"


FACTORY_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""``package.module:function``."""

HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
"""What a ``save_pretrained`` directory holds its weights in (one file, or shards + index)."""


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """The runtime side of ``[model]``: which implementation builds the layers."""

    source: str = ModelSourceKind.GPT.value
    """``gpt`` (the built-in GPT), ``hf`` (Llama via transformers) or ``python`` (a
    factory). Left out, ``hf`` for a SwiGLU architecture (the Llama presets), else
    ``gpt``."""
    path: str = ""
    """For ``hf``: a local ``save_pretrained`` directory (config.json + safetensors),
    relative to the config file's folder; empty: random weights from the architecture
    keys."""
    factory: str = ""
    """For ``python``: ``package.module:function``, called with the job's ``Config``,
    returning a layered model; the config file's folder is on ``sys.path``."""
    seq_len: int = 0
    """For ``python`` without architecture keys: the training sequence length handed to
    the data (0: none). Otherwise the architecture's ``seq_len`` is used."""

    def __post_init__(self) -> None:
        check_choice("source", self.source, [k.value for k in ModelSourceKind])
        check_int("seq_len", self.seq_len, minimum=0)
        if self.path and self.source != ModelSourceKind.HF:
            fail("path", f'is only read for source = "hf" (source is {self.source!r})')
        if self.source == ModelSourceKind.PYTHON:
            check_factory("factory", self.factory)
        elif self.factory:
            fail("factory", f'is only read for source = "python" (source is {self.source!r})')


def check_factory(field: str, value: str) -> None:
    """Reject a factory reference that is not ``package.module:function``.

    Raises:
        ValueError: naming ``field``.
    """
    if not value:
        fail(field, 'is required: give "package.module:function"')
    if not FACTORY_PATTERN.match(value):
        fail(field, f'{value!r} is not of the form "package.module:function"')


HF_ARCHITECTURE_KEYS = ("num_blocks", "hidden_size", "num_heads", "num_kv_heads", "ffn_size",
                        "vocab_size", "mlp", "tied_embeddings")
"""``[model]`` keys that a Hugging Face directory's config.json decides."""


def read_hf_config(path: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a ``save_pretrained`` directory, checked to be a
    Llama model this project trains (untied embeddings, SwiGLU, no biases).

    Args:
        path: the directory (already resolved).

    Returns:
        The JSON object.

    Raises:
        ValueError: naming ``model.path`` for a missing directory, file or weights, or a
            model that is not a supported Llama.
    """
    if not path.is_dir():
        fail("model.path", f"{str(path)!r} is not a directory (a Hugging Face "
             "save_pretrained directory is expected)")
    config_file = path / "config.json"
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except OSError:
        fail("model.path", f"{str(path)!r} has no readable config.json")
    except json.JSONDecodeError as exc:
        fail("model.path", f"{str(config_file)!r} is not valid JSON: {exc}")
    if not isinstance(data, dict):
        fail("model.path", f"{str(config_file)!r} does not hold a JSON object")
    model_type = data.get("model_type")
    if model_type != "llama":
        fail("model.path", f"{str(path)!r} holds a {model_type!r} model; only Llama-family "
             "models (model_type \"llama\") are supported")
    if data.get("tie_word_embeddings", False):
        fail("model.path", f"{str(path)!r} ties the word embeddings to the LM head "
             "(tie_word_embeddings = true); the runtime keeps the embedding (first layer) "
             "and the head (last layer) apart, so tied models are not supported")
    if data.get("hidden_act", "silu") != "silu":
        fail("model.path", f"{str(path)!r}: hidden_act {data.get('hidden_act')!r} is not "
             "supported (Llama uses silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if data.get(flag, False):
            fail("model.path", f"{str(path)!r}: {flag} = true is not supported")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                "intermediate_size", "vocab_size"):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail("model.path", f"{str(config_file)!r}: {key} must be a positive integer, "
                 f"got {value!r}")
    head_dim = data.get("head_dim")
    if head_dim is not None and head_dim * data["num_attention_heads"] != data["hidden_size"]:
        fail("model.path", f"{str(path)!r}: head_dim {head_dim} x num_attention_heads "
             f"{data['num_attention_heads']} differs from hidden_size {data['hidden_size']}; "
             "the performance model assumes they are equal")
    if not any((path / name).is_file() for name in HF_WEIGHT_FILES):
        fail("model.path", f"{str(path)!r} has no {' or '.join(HF_WEIGHT_FILES)} (weights "
             "are read from safetensors files only)")
    return data


def hf_model_spec(data: dict[str, Any], *, seq_len: int, name: str) -> ModelSpec:
    """The planner's view of a Llama ``config.json`` (see :func:`read_hf_config`).

    Args:
        data: the parsed config.json.
        seq_len: the training sequence length.
        name: a label for reports.

    Raises:
        ValueError: naming ``model.seq_len`` when it exceeds the model's
            ``max_position_embeddings``, or the field the architecture breaks.
    """
    max_positions = data.get("max_position_embeddings")
    if isinstance(max_positions, int) and seq_len > max_positions:
        fail("model.seq_len", f"{seq_len} exceeds the model's max_position_embeddings "
             f"{max_positions}")
    return ModelSpec(
        name=name,
        num_blocks=data["num_hidden_layers"],
        hidden_size=data["hidden_size"],
        num_heads=data["num_attention_heads"],
        num_kv_heads=data.get("num_key_value_heads") or data["num_attention_heads"],
        ffn_size=data["intermediate_size"],
        vocab_size=data["vocab_size"],
        seq_len=seq_len,
        mlp="swiglu",
        tied_embeddings=False,
    )
