"""A Llama-family causal LM from Hugging Face ``transformers`` as a layered model
(``[model] source = "hf"``; needs the ``hf`` extra: ``pip install chameleon-ft[hf]``).

Layer 0 is the token embedding, layers 1..N one ``LlamaDecoderLayer`` each, the last the
final RMSNorm and the LM head. Each decoder layer computes its rotary position embeddings
itself from positions 0..T-1, so a stage needs nothing but the hidden states (B, T, H).
Attention is forced to ``sdpa`` with no mask, which transformers runs as causal attention.

With ``path`` the model is a local ``save_pretrained`` directory: config.json plus
safetensors, read with ``safe_open`` one layer's tensors at a time, never downloaded.
Without it, the weights are random, drawn per layer from a generator seeded by
``(seed, index)`` like Hugging Face's own initialisation (normal with
``initializer_range`` for matrices, ones for norms). Parameter names inside a layer are
Hugging Face's: layer ``i`` in 1..N holds ``model.layers.{i-1}.*``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

try:
    import transformers
    from safetensors import safe_open
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )
except ImportError as _exc:  # pragma: no cover - the hf extra is part of `make test`
    raise ImportError('model.source: "hf" needs Hugging Face transformers and safetensors; '
                      "install the extra: pip install 'chameleon-ft[hf]'") from _exc

from chameleon_ft.runtime.workload.models.base import (
    initial_params,
    split_param_name,
    token_cross_entropy_sum,
)
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.model import ModelSpec
from chameleon_ft.spec.model_source import read_hf_config

ATTENTION = "sdpa"
"""The attention implementation of every layer: causal when given no mask."""

_COPIED_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")
"""Tokenizer and generation files copied from the source directory into an export."""
_NOT_COPIED = ("config.json", "model.safetensors.index.json")


class LlamaEmbedding(nn.Module):
    """Layer 0: token ids (B, T) int64 -> hidden states (B, T, H)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, H)."""
        out: torch.Tensor = self.embed_tokens(ids)
        return out


class LlamaBlock(LlamaDecoderLayer):
    """Layers 1..N: one decoder layer with its own rotary embedding (no parameters)."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """(B, T, H) -> (B, T, H), causal over positions 0..T-1."""
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)
        cos_sin = self.rotary(hidden, positions)  # 2 x (1, T, head_dim)
        out = super().forward(hidden, attention_mask=None, position_ids=positions,
                              position_embeddings=cos_sin)
        # transformers before 4.54 returned a tuple (hidden, ...)
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result


class LlamaHead(nn.Module):
    """The last layer: final RMSNorm and the LM head, (B, T, H) -> logits (B, T, V)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, V)."""
        out: torch.Tensor = self.lm_head(self.norm(hidden))
        return out


def llama_config(spec: ModelSpec) -> LlamaConfig:
    """A Llama configuration from the ``[model]`` architecture keys (random weights)."""
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn, num_hidden_layers=spec.num_blocks,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.seq_len, tie_word_embeddings=False)
    config.dtype = torch.float32
    return config


def _dtype_of(config: LlamaConfig) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        dtype: torch.dtype = getattr(torch, value)
        return dtype
    return torch.float32


class HFLlama:
    """A Llama causal LM cut into ``num_hidden_layers + 2`` layers."""

    def __init__(self, config: LlamaConfig, *, path: Path | None = None, seed: int = 0) -> None:
        """Args:
            config: the Llama configuration (from ``path``'s config.json, or built).
            path: a ``save_pretrained`` directory to read the weights from; ``None``:
                random weights seeded by ``seed``.
            seed: seed of the random weights.

        Raises:
            ValueError: naming ``model.path`` when its safetensors cannot be indexed.
        """
        config._attn_implementation = ATTENTION
        self.config = config
        self.path = path
        self.seed = seed
        self.num_layers = config.num_hidden_layers + 2
        self.dtype = _dtype_of(config)
        """The model's own dtype: the stored tensors' with a path, float32 otherwise."""
        self._files: dict[str, Path] = self._index(path) if path is not None else {}

    @classmethod
    def from_config(cls, config: Config) -> HFLlama:
        """The model of ``[model]``: ``path``'s directory, or random weights from the
        architecture keys seeded by ``[train] seed``.

        Raises:
            ValueError: naming ``model.path`` for a directory that is not a supported Llama.
        """
        src = config.model_source
        if src.path:
            return cls.from_pretrained(config.resolve(src.path), seed=config.train.seed)
        if config.model is None:
            raise ValueError('model: source = "hf" needs model.path or the architecture keys')
        return cls(llama_config(config.model), seed=config.train.seed)

    @classmethod
    def from_pretrained(cls, path: Path, *, seed: int = 0) -> HFLlama:
        """The model saved in ``path`` (``save_pretrained`` layout, local files only).

        Raises:
            ValueError: naming ``model.path`` for a missing or unsupported directory.
        """
        read_hf_config(path)  # one-line errors for a missing, tied or non-Llama model
        try:
            config = LlamaConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"model.path: cannot read {str(path)!r}: {first}") from None
        return cls(config, path=path, seed=seed)

    @staticmethod
    def _index(path: Path) -> dict[str, Path]:
        """Which safetensors file holds each tensor."""
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, KeyError, json.JSONDecodeError) as exc:
                raise ValueError(f"model.path: cannot read {str(index)!r}: {exc}") from None
            return {name: path / file for name, file in weight_map.items()}
        single = path / "model.safetensors"
        try:
            with safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), single)
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"model.path: cannot read {str(single)!r}: {exc}") from None

    # ------------------------------------------------------------------ names
    def hf_name(self, index: int, name: str) -> str:
        """The Hugging Face name of parameter ``name`` of layer ``index``."""
        if index == 0:
            return f"model.{name}"
        if index == self.num_layers - 1:
            return name if name.startswith("lm_head.") else f"model.{name}"
        return f"model.layers.{index - 1}.{name}"

    def _empty_layer(self, index: int) -> nn.Module:
        """Layer ``index`` with uninitialised parameters (no time spent initialising)."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of a {self.num_layers}-layer Llama")
        with torch.device("meta"):
            if index == 0:
                module: nn.Module = LlamaEmbedding(self.config)
            elif index == self.num_layers - 1:
                module = LlamaHead(self.config)
            else:
                module = LlamaBlock(self.config, index - 1)
        module = module.to_empty(device="cpu")
        if isinstance(module, LlamaBlock):
            module.rotary = LlamaRotaryEmbedding(self.config)  # its buffers, computed
        return module

    def build_layer(self, index: int) -> nn.Module:
        """Layer ``index`` with its initial parameters, on CPU in the model's dtype.

        Raises:
            ValueError: naming ``model.path`` when a tensor is missing or misshapen.
        """
        module = self._empty_layer(index)
        if self.path is None:
            self._init_random(module, index)
            return module
        tensors: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for name, _ in module.named_parameters():
            hf = self.hf_name(index, name)
            if hf not in self._files:
                raise ValueError(f"model.path: {str(self.path)!r} has no tensor {hf!r}")
            by_file.setdefault(self._files[hf], []).append((name, hf))
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name, hf in names:
                    tensors[name] = f.get_tensor(hf)
        try:
            module.load_state_dict(tensors, strict=True, assign=True)
        except RuntimeError as exc:
            raise ValueError(f"model.path: layer {index} of {str(self.path)!r} does not "
                             f"match its config.json: {str(exc).splitlines()[-1].strip()}") \
                from None
        return module

    def _init_random(self, module: nn.Module, index: int) -> None:
        """Hugging Face's initialisation from a per-layer generator: normal(0, range) for
        matrices and embeddings, ones for the RMSNorm weights."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        std = float(self.config.initializer_range)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32)
                                * std)
            module.to(self.dtype)

    # ------------------------------------------------------------------ training
    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Token cross-entropy summed over the micro-batch."""
        return token_cross_entropy_sum(output, targets)

    def describe(self) -> str:
        """One line for the logs."""
        c = self.config
        where = f"from {self.path}" if self.path is not None else f"random (seed {self.seed})"
        return (f"Llama {where}: {c.num_hidden_layers} decoder layers, hidden "
                f"{c.hidden_size}, {c.num_attention_heads} heads ({c.num_key_value_heads} "
                f"kv), ffn {c.intermediate_size}, vocab {c.vocab_size}, {self.dtype}")

    # ------------------------------------------------------------------ out
    def hf_state_dict(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Runtime-named parameters -> a ``LlamaForCausalLM`` state dict."""
        out = {}
        for full, tensor in params.items():
            index, name = split_param_name(full)
            out[self.hf_name(index, name)] = tensor
        return out

    def export(self, params: dict[str, torch.Tensor], out_dir: Path) -> None:
        """Write ``out_dir/hf`` (see :meth:`save_pretrained`).

        Raises:
            ValueError: when ``params`` does not hold exactly this model's parameters.
        """
        self.save_pretrained(params, Path(out_dir) / "hf")

    def save_pretrained(self, params: dict[str, torch.Tensor], target: Path) -> None:
        """Write ``target`` with ``save_pretrained``: the model with ``params`` in their
        dtype, loadable by ``AutoModelForCausalLM.from_pretrained``; tokenizer files of the
        source directory are copied along.

        Raises:
            ValueError: when ``params`` does not hold exactly this model's parameters.
        """
        from transformers import LlamaForCausalLM

        state = {k: v.detach().cpu().contiguous() for k, v in self.hf_state_dict(params).items()}
        dtypes = {t.dtype for t in state.values()}
        if len(dtypes) != 1:
            raise ValueError(f"params: mixed dtypes {sorted(map(str, dtypes))}")
        config = LlamaConfig.from_dict(self.config.to_dict())
        config.dtype = next(iter(dtypes))
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise ValueError(f"params: do not match the model: "
                             f"{str(exc).splitlines()[-1].strip()}") from None
        transformers.utils.logging.disable_progress_bar()
        model.save_pretrained(str(target))
        if self.path is not None:
            for f in sorted(self.path.iterdir()):
                if (f.is_file() and f.suffix in _COPIED_SUFFIXES and f.name not in _NOT_COPIED
                        and not (target / f.name).exists()):
                    shutil.copy2(f, target / f.name)


def save_random_llama(spec: ModelSpec, out_dir: Path, *, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> Path:
    """Write a randomly initialised Llama of ``spec``'s shape as a ``save_pretrained``
    directory (what the examples train from).

    Returns:
        ``out_dir``.
    """
    model = HFLlama(llama_config(spec), seed=seed)
    model.save_pretrained(initial_params(model, dtype), out_dir)
    return out_dir
