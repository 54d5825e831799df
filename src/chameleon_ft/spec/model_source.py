"""Where the runtime's model comes from (``[model] source``, ``path``, ``factory``).

Three sources: ``gpt`` (the built-in tiny GPT; the default for GELU architectures), ``hf``
(the default for SwiGLU architectures such as the Llama presets: a decoder-only causal LM
of a supported family (:data:`HF_FAMILIES`: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma,
Gemma 2)
through Hugging Face ``transformers``: a local ``save_pretrained`` directory, or a Llama
with random weights from the architecture keys) and ``python`` (``factory =
"package.module:function"`` returning a layered model). This module stays pure: it reads a Hugging Face directory's
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
    """``gpt`` (the built-in GPT), ``hf`` (a supported Hugging Face family via
    transformers) or ``python`` (a factory). Left out, ``hf`` for a SwiGLU architecture (the Llama presets), else
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
                        "vocab_size", "mlp", "tied_embeddings", "head_dim", "attention_bias",
                        "mlp_bias", "qk_norm", "block_norms")
"""``[model]`` keys that a Hugging Face directory's config.json decides."""


@dataclass(frozen=True, kw_only=True)
class HFFamily:
    """A decoder-only family of Hugging Face transformers and what sets it apart.

    The runtime builds every family from transformers' own modules through one adapter
    (``chameleon_ft.runtime.workload.models.hf``); this row is what the planner needs to
    count the family's parameters from config.json, and what the adapter needs beyond
    transformers' modules (how its norms start when the weights are random).
    """

    model_type: str
    """``model_type`` in config.json."""
    label: str
    """The family's name in messages."""
    examples: str
    """Published models of the family (for the README's table)."""
    qkv_bias: bool = False
    """q, k and v always carry biases, the output projection none (Qwen2)."""
    reads_attention_bias: bool = True
    """config.json's ``attention_bias = true`` puts biases on q, k, v and o (Llama, Qwen3,
    Gemma); Mistral and Qwen2 have no such key."""
    reads_mlp_bias: bool = False
    """config.json's ``mlp_bias = true`` puts biases on the MLP (Llama)."""
    qk_norm: bool = False
    """An RMSNorm over each head's queries and keys (Qwen3)."""
    block_norms: int = 2
    """Norms per decoder layer (Gemma 2: four, around attention and around the MLP)."""
    norm_offset: bool = False
    """RMSNorm weights act as ``1 + w`` and start at 0 (Gemma); otherwise they start at 1."""
    activation_key: str = "hidden_act"
    """The config.json key naming the MLP's activation."""
    default_activation: str = "silu"
    """The activation when config.json leaves the key out."""
    tied_by_default: bool = False
    """``tie_word_embeddings`` when config.json leaves it out."""


HF_FAMILIES: dict[str, HFFamily] = {f.model_type: f for f in (
    HFFamily(model_type="llama", label="Llama", examples="Llama 2, Llama 3.x, SmolLM, TinyLlama",
             reads_mlp_bias=True),
    HFFamily(model_type="mistral", label="Mistral", examples="Mistral 7B (sliding window)",
             reads_attention_bias=False),
    HFFamily(model_type="qwen2", label="Qwen2", examples="Qwen2, Qwen2.5", qkv_bias=True,
             reads_attention_bias=False),
    HFFamily(model_type="qwen3", label="Qwen3", examples="Qwen3 (dense)", qk_norm=True),
    HFFamily(model_type="phi3", label="Phi-3", examples="Phi-3 mini/medium, Phi-4 mini",
             reads_attention_bias=False),
    HFFamily(model_type="gemma", label="Gemma", examples="Gemma 2B, 7B", norm_offset=True,
             default_activation="gelu_pytorch_tanh", tied_by_default=True),
    HFFamily(model_type="gemma2", label="Gemma 2", examples="Gemma 2 2B, 9B, 27B",
             block_norms=4, norm_offset=True, activation_key="hidden_activation",
             default_activation="gelu_pytorch_tanh", tied_by_default=True),
)}
"""The families ``[model] source = "hf"`` trains, by ``model_type``."""


def hf_family(data: dict[str, Any], where: str) -> HFFamily:
    """The family of a parsed config.json.

    Raises:
        ValueError: naming ``model.path`` for a ``model_type`` that is not supported.
    """
    model_type = data.get("model_type")
    family = HF_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        fail("model.path", f"{where} holds a {model_type!r} model; supported model_type "
             f"values: {', '.join(sorted(HF_FAMILIES))}")
    return family


def hf_tied(data: dict[str, Any]) -> bool:
    """Whether a supported family's config.json ties the head to the embedding."""
    tied = data.get("tie_word_embeddings")
    family = HF_FAMILIES[data["model_type"]]
    return family.tied_by_default if tied is None else bool(tied)


def _mlp_kind(family: HFFamily, data: dict[str, Any], where: str) -> str:
    """``swiglu`` or ``geglu`` from the family's activation key."""
    activation = data.get(family.activation_key) or data.get("hidden_act") \
        or family.default_activation
    if activation in ("silu", "swish"):
        return "swiglu"
    if isinstance(activation, str) and activation.startswith("gelu"):
        return "geglu"
    fail("model.path", f"{where}: {family.activation_key} {activation!r} is not supported "
         "(silu or a gelu variant)")


def read_hf_config(path: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a ``save_pretrained`` directory, checked to be a
    decoder-only causal LM of a supported family (:data:`HF_FAMILIES`).

    Args:
        path: the directory (already resolved).

    Returns:
        The JSON object.

    Raises:
        ValueError: naming ``model.path`` for a missing directory, file or weights, or a
            model that is not of a supported family.
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
    family = hf_family(data, repr(str(path)))
    _mlp_kind(family, data, repr(str(path)))
    for key, value in sorted(data.items()):
        if (("dropout" in key or key.endswith("pdrop")) and not isinstance(value, bool)
                and isinstance(value, (int, float)) and value > 0):
            fail("model.path", f"{str(config_file)!r}: {key} = {value}: dropout is not "
                 "supported (a step redone after a failure must compute the same); set it "
                 "to 0")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                "intermediate_size", "vocab_size"):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail("model.path", f"{str(config_file)!r}: {key} must be a positive integer, "
                 f"got {value!r}")
    head_dim = data.get("head_dim")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int)
                                 or head_dim < 1):
        fail("model.path", f"{str(config_file)!r}: head_dim must be a positive integer, "
             f"got {head_dim!r}")
    if head_dim is None and data["hidden_size"] % data["num_attention_heads"]:
        fail("model.path", f"{str(config_file)!r}: hidden_size {data['hidden_size']} is not "
             f"divisible by num_attention_heads {data['num_attention_heads']} and no "
             "head_dim is given")
    if not any((path / name).is_file() for name in HF_WEIGHT_FILES):
        fail("model.path", f"{str(path)!r} has no {' or '.join(HF_WEIGHT_FILES)} (weights "
             "are read from safetensors files only)")
    return data


def hf_model_spec(data: dict[str, Any], *, seq_len: int, name: str) -> ModelSpec:
    """The planner's view of a supported config.json (see :func:`read_hf_config`): the
    shape, the family's biases, q/k norms and norms per block, ``head_dim``, the gated
    MLP and whether the head is tied. A sliding window is not priced (attention is
    counted over the whole sequence: an upper bound).

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
    family = hf_family(data, name)
    if family.qkv_bias:
        attention_bias = "qkv"
    elif family.reads_attention_bias and data.get("attention_bias", False):
        attention_bias = "all"
    else:
        attention_bias = "none"
    head_dim = data.get("head_dim") or 0
    if head_dim * data["num_attention_heads"] == data["hidden_size"]:
        head_dim = 0  # the default width, stated as such
    return ModelSpec(
        name=name,
        num_blocks=data["num_hidden_layers"],
        hidden_size=data["hidden_size"],
        num_heads=data["num_attention_heads"],
        num_kv_heads=data.get("num_key_value_heads") or data["num_attention_heads"],
        ffn_size=data["intermediate_size"],
        vocab_size=data["vocab_size"],
        seq_len=seq_len,
        mlp=_mlp_kind(family, data, name),
        tied_embeddings=hf_tied(data),
        head_dim=head_dim,
        attention_bias=attention_bias,
        mlp_bias=family.reads_mlp_bias and bool(data.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
        block_norms=family.block_norms,
    )
