"""Decoder-only causal LMs from Hugging Face ``transformers`` as layered models
(``[model] source = "hf"``; needs the ``hf`` extra: ``pip install -e '.[hf]'`` in the
checkout).

One adapter serves every family of :data:`~chameleon_ft.spec.model_source.HF_FAMILIES`
(Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2): the layers are transformers' own modules
for the directory's ``model_type``, so each family's details (Qwen2's attention biases,
Qwen3's q/k norms, Gemma's scaled embedding and ``1 + w`` norms, Gemma 2's extra norms and
soft-capping, any ``head_dim``) are transformers' code, not ours. What the family table
adds is only how norms start when the weights are random.

- Layer 0: the family's token embedding, ids (B, T) -> hidden states (B, T, H).
- Layers 1..N: one decoder layer each. It computes its rotary embedding from positions
  0..T-1 and its attention mask with transformers' own mask functions: causal, or causal
  within the window for the layers that slide (Mistral's ``sliding_window``, the
  ``sliding_attention`` entries of ``layer_types``). So a stage needs nothing but the
  hidden states (B, T, H).
- The last layer: the final norm and the LM head (and a final logit soft-cap when the
  config has one), (B, T, H) -> logits (B, T, V).

Attention is ``sdpa``, or ``eager`` when the config soft-caps attention logits (Gemma 2),
which ``sdpa`` would silently skip. With ``tie_word_embeddings`` the LM head shares the
embedding matrix: layer 0 holds ``embed_tokens.weight`` and the last layer a copy,
``lm_head.weight``, declared by :meth:`HFCausalLM.tied_parameters` so that the runtime
sums the two copies' gradients every step; the export writes the one tensor.

With ``path`` the model is a local ``save_pretrained`` directory: config.json plus
safetensors, read with ``safe_open`` one layer's tensors at a time, never downloaded.
Without it, the weights are random, drawn per layer from a generator seeded by
``(seed, index)`` like Hugging Face's own initialisation (normal with
``initializer_range`` for matrices, zero biases, norms at their neutral value). Parameter
names inside a layer are Hugging Face's: layer ``i`` in 1..N holds ``model.layers.{i-1}.*``.
"""

from __future__ import annotations

import copy
import inspect
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import transformers
    from safetensors import safe_open
    from transformers import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        AutoConfig,
        LlamaConfig,
        PretrainedConfig,
    )
    from transformers.masking_utils import (
        create_causal_mask,
        create_sliding_window_causal_mask,
    )
except ImportError as _exc:  # pragma: no cover - the hf extra is part of `make test`
    raise ImportError('model.source: "hf" needs Hugging Face transformers and safetensors; '
                      "install the extra from the checkout: pip install -e '.[hf]'") from _exc

from chameleon_ft.runtime.workload.models.base import (
    TiedPair,
    initial_params,
    param_name,
    split_param_name,
    token_cross_entropy_sum,
)
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.model import ModelSpec
from chameleon_ft.spec.model_source import HFFamily, hf_family, read_hf_config

_COPIED_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")
"""Tokenizer and generation files copied from the source directory into an export."""
_NOT_COPIED = ("config.json", "model.safetensors.index.json")
_MASK_ARGS = inspect.signature(create_causal_mask).parameters
"""transformers 5 takes ``inputs_embeds``; 4.x took ``input_embeds`` and ``cache_position``;
5.24 and later ``cache`` for ``past_key_values``."""


def attention_of(config: PretrainedConfig) -> str:
    """The attention implementation the layers and the reference model use: ``sdpa``
    (causal when given no mask), or ``eager`` for soft-capped attention logits, which only
    the eager kernel applies on CPU."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"


def _slides(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` attends within a sliding window, as the
    family's model decides: ``layer_types`` where the config has them (Qwen2, Qwen3,
    Gemma 2), else every layer when ``sliding_window`` is set (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types:
        return bool(types[layer_idx] == "sliding_attention")
    return getattr(config, "sliding_window", None) is not None


def _attention_mask(config: PretrainedConfig, hidden: torch.Tensor, positions: torch.Tensor,
                    sliding: bool) -> torch.Tensor | None:
    """transformers' own mask for a whole unpadded sequence: ``None`` where the kernel runs
    causally by itself, else a (1 or B, 1, T, T) mask."""
    fn = create_sliding_window_causal_mask if sliding else create_causal_mask
    kwargs: dict[str, Any] = {"config": config, "attention_mask": None,
                              "position_ids": positions}
    # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns)
    kwargs["cache" if "cache" in _MASK_ARGS else "past_key_values"] = None
    kwargs["inputs_embeds" if "inputs_embeds" in _MASK_ARGS else "input_embeds"] = hidden
    if "cache_position" in _MASK_ARGS:
        kwargs["cache_position"] = positions[0]
    mask: Any = fn(**kwargs)  # a tensor or None for the sdpa and eager kernels
    return mask if isinstance(mask, torch.Tensor) else None


class _DecoderBlock(nn.Module):
    """Mixed into a family's decoder-layer class (:func:`_block_class`): the layer itself,
    so its parameter names are the family's, with a forward that needs only the hidden
    states."""

    rotary: nn.Module
    hf_config: PretrainedConfig
    sliding: bool

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, H), causal over positions 0..T-1."""
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)
        cos_sin = self.rotary(hidden, positions)  # 2 x (1, T, head_dim)
        mask = _attention_mask(self.hf_config, hidden, positions, self.sliding)
        out = super().forward(hidden, attention_mask=mask,
                              position_ids=positions, position_embeddings=cos_sin)
        # transformers before 4.54 returned a tuple (hidden, ...)
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result


_BLOCK_CLASSES: dict[type, type] = {}


def _block_class(decoder_cls: type) -> type:
    """``decoder_cls`` with :class:`_DecoderBlock`'s forward (one class per family)."""
    if decoder_cls not in _BLOCK_CLASSES:
        _BLOCK_CLASSES[decoder_cls] = type(f"{decoder_cls.__name__}Block",
                                           (_DecoderBlock, decoder_cls), {"__module__": __name__})
    return _BLOCK_CLASSES[decoder_cls]


class Embedding(nn.Module):
    """Layer 0: the family's token embedding, ids (B, T) int64 -> (B, T, H)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, H)."""
        out: torch.Tensor = self.embed_tokens(ids)
        return out

    def _apply(self, fn: Any, recurse: bool = True) -> Embedding:
        # A scaled embedding (Gemma) keeps sqrt(H) as a buffer that transformers computes in
        # the dtype the model is built in; recompute it after every cast, as loading the
        # whole model in that dtype would.
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        scale = getattr(self.embed_tokens, "scalar_embed_scale", None)
        buffer = getattr(self.embed_tokens, "embed_scale", None)
        if scale is not None and isinstance(buffer, torch.Tensor) and not buffer.is_meta:
            with torch.no_grad():
                buffer.fill_(scale)
        return self


class Head(nn.Module):
    """The last layer: the final norm and the LM head, (B, T, H) -> logits (B, T, V)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, softcap: float | None) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, V)."""
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        if self.softcap:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def llama_config(spec: ModelSpec) -> LlamaConfig:
    """A Llama configuration from the ``[model]`` architecture keys (random weights)."""
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn, num_hidden_layers=spec.num_blocks,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_size, attention_bias=spec.attention_bias == "all",
        mlp_bias=spec.mlp_bias, max_position_embeddings=spec.seq_len,
        tie_word_embeddings=spec.tied_embeddings)
    config.dtype = torch.float32
    return config


def _dtype_of(config: PretrainedConfig) -> torch.dtype:
    value = getattr(config, "dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        dtype: torch.dtype = getattr(torch, value)
        return dtype
    return torch.float32


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class HFCausalLM:
    """A Hugging Face causal LM cut into ``num_hidden_layers + 2`` layers."""

    def __init__(self, config: PretrainedConfig, *, path: Path | None = None,
                 seed: int = 0) -> None:
        """Args:
            config: the model's configuration (from ``path``'s config.json, or built).
            path: a ``save_pretrained`` directory to read the weights from; ``None``:
                random weights seeded by ``seed``.
            seed: seed of the random weights.

        Raises:
            ValueError: naming ``model.path`` for a family that is not supported or
                safetensors that cannot be indexed.
        """
        where = repr(str(path)) if path is not None else "the configuration"
        self.family: HFFamily = hf_family({"model_type": config.model_type}, where)
        self.attention = attention_of(config)
        config._attn_implementation = self.attention
        self.config = config
        self.path = path
        self.seed = seed
        self.num_layers: int = config.num_hidden_layers + 2
        self.vocab_size: int = config.vocab_size
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        """Whether the LM head shares the embedding matrix."""
        self.dtype = _dtype_of(config)
        """The model's own dtype: the stored tensors' with a path, float32 otherwise."""
        self._files: dict[str, Path] = self._index(path) if path is not None else {}
        self._meta: nn.Module | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The meta skeleton is rebuilt where it is needed, never shipped to workers.
        state = dict(self.__dict__)
        state["_meta"] = None
        return state

    @classmethod
    def from_config(cls, config: Config) -> HFCausalLM:
        """The model of ``[model]``: ``path``'s directory, or a Llama with random weights
        from the architecture keys seeded by ``[train] seed``.

        Raises:
            ValueError: naming ``model.path`` for a directory that is not supported.
        """
        src = config.model_source
        if src.path:
            return cls.from_pretrained(config.resolve(src.path), seed=config.train.seed)
        if config.model is None:
            raise ValueError('model: source = "hf" needs model.path or the architecture keys')
        return cls(llama_config(config.model), seed=config.train.seed)

    @classmethod
    def from_pretrained(cls, path: Path, *, seed: int = 0) -> HFCausalLM:
        """The model saved in ``path`` (``save_pretrained`` layout, local files only).

        Raises:
            ValueError: naming ``model.path`` for a missing or unsupported directory.
        """
        read_hf_config(path)  # one-line errors for a missing or unsupported model
        try:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"model.path: cannot read {str(path)!r}: {_first_line(exc)}") \
                from None
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

    def tied_parameters(self) -> list[TiedPair]:
        """The embedding and its copy in the head, when the head is tied: the runtime sums
        the two copies' gradients every step (see ``models.base.tied_parameters``)."""
        if not self.tied:
            return []
        return [((0, "embed_tokens.weight"), (self.num_layers - 1, "lm_head.weight"))]

    def _stored_name(self, index: int, name: str) -> str:
        """The tensor of the directory that holds parameter ``name`` of layer ``index``: a
        tied head's copy is read from the embedding (save_pretrained stores it once)."""
        for (i, a), (j, b) in self.tied_parameters():
            if (index, name) == (j, b):
                return self.hf_name(i, a)
        return self.hf_name(index, name)

    # ------------------------------------------------------------------ layers
    def _skeleton(self) -> nn.Module:
        """The whole model on the meta device (no memory): where the layers' modules come
        from. Built once per process."""
        if self._meta is None:
            model_cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config)]
            with torch.device("meta"):
                self._meta = model_cls(copy.deepcopy(self.config))
        return self._meta

    def _empty_layer(self, index: int) -> nn.Module:
        """Layer ``index`` with uninitialised parameters (no time spent initialising)."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of a {self.num_layers}-layer "
                             f"{self.family.label} model")
        skeleton: Any = self._skeleton()
        base: Any = skeleton.model  # the family's decoder-only model
        if index == 0:
            module: nn.Module = Embedding(copy.deepcopy(base.embed_tokens))
        elif index == self.num_layers - 1:
            module = Head(copy.deepcopy(base.norm), copy.deepcopy(skeleton.lm_head),
                          getattr(self.config, "final_logit_softcapping", None))
        else:
            with torch.device("meta"):
                module = _block_class(type(base.layers[0]))(self.config, index - 1)
        module = module.to_empty(device="cpu")
        if isinstance(module, _DecoderBlock):
            # its rotary buffers, computed (to_empty leaves buffers uninitialised)
            module.rotary = type(base.rotary_emb)(self.config)
            module.hf_config = self.config
            module.sliding = _slides(self.config, index - 1)
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
            hf = self._stored_name(index, name)
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
        return module.to(self.dtype)  # buffers too (Gemma's embedding scale), as transformers

    def _init_random(self, module: nn.Module, index: int) -> None:
        """Hugging Face's initialisation from a per-layer generator: normal(0, range) for
        matrices and embeddings (the padding row zero), zero biases, norms at their neutral
        value (1, or 0 for Gemma's ``1 + w`` norms). A tied head copies the embedding."""
        for (i, a), (j, b) in self.tied_parameters():
            if index == j:
                source = dict(self.build_layer(i).named_parameters())[a]
                with torch.no_grad():
                    dict(module.named_parameters())[b].copy_(source)
        copies = {b for _, (j, b) in self.tied_parameters() if j == index}
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        std = float(self.config.initializer_range)
        norm = 0.0 if self.family.norm_offset else 1.0
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name in copies:
                    continue
                if name.endswith("norm.weight"):
                    param.fill_(norm)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32)
                                * std)
            padding = getattr(self.config, "pad_token_id", None)
            if index == 0 and isinstance(padding, int) and 0 <= padding < self.vocab_size:
                module.get_parameter("embed_tokens.weight")[padding].zero_()
            module.to(self.dtype)

    # ------------------------------------------------------------------ training
    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Token cross-entropy summed over the micro-batch."""
        return token_cross_entropy_sum(output, targets)

    def describe(self) -> str:
        """One line for the logs."""
        c = self.config
        where = f"from {self.path}" if self.path is not None else f"random (seed {self.seed})"
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        tied = ", tied head" if self.tied else ""
        return (f"{self.family.label} {where}: {c.num_hidden_layers} decoder layers, hidden "
                f"{c.hidden_size}, {c.num_attention_heads} heads of {head_dim} "
                f"({c.num_key_value_heads} kv), ffn {c.intermediate_size}, vocab "
                f"{c.vocab_size}{tied}, {self.dtype}")

    # ------------------------------------------------------------------ out
    def hf_state_dict(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Runtime-named parameters -> the ``*ForCausalLM`` state dict, a tied head's copy
        left out (the model holds the one tensor).

        Raises:
            ValueError: when a tied copy in ``params`` differs from its original.
        """
        out = {}
        for (i, a), (j, b) in self.tied_parameters():
            copy_name, original = param_name(j, b), param_name(i, a)
            if (copy_name in params and original in params
                    and not torch.equal(params[copy_name], params[original])):
                raise ValueError(f"params: the tied copies {original} and {copy_name} differ")
        copies = {param_name(j, b) for _, (j, b) in self.tied_parameters()}
        for full, tensor in params.items():
            if full not in copies:
                out[self.hf_name(*split_param_name(full))] = tensor
        return out

    def export(self, params: dict[str, torch.Tensor], out_dir: Path) -> None:
        """Write ``out_dir/hf`` (see :meth:`save_pretrained`).

        Raises:
            ValueError: when ``params`` does not hold exactly this model's parameters.
        """
        self.save_pretrained(params, Path(out_dir) / "hf")

    def whole_model(self, params: dict[str, torch.Tensor]) -> nn.Module:
        """The family's ``*ForCausalLM`` holding ``params`` (runtime names; a tied head's
        copy may be left out), in their dtype, on CPU.

        Raises:
            ValueError: when ``params`` does not hold exactly this model's parameters.
        """
        state = {k: v.detach().cpu().contiguous() for k, v in self.hf_state_dict(params).items()}
        dtypes = {t.dtype for t in state.values()}
        if len(dtypes) != 1:
            raise ValueError(f"params: mixed dtypes {sorted(map(str, dtypes))}")
        config = copy.deepcopy(self.config)
        config.dtype = next(iter(dtypes))
        model_cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        with torch.device("meta"):
            model: Any = model_cls(config)
        try:
            result = model.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as exc:
            raise ValueError(f"params: do not match the model: "
                             f"{str(exc).splitlines()[-1].strip()}") from None
        tied = {"lm_head.weight"} if self.tied else set()
        if result.unexpected_keys or set(result.missing_keys) - tied:
            wrong = sorted(result.unexpected_keys) or sorted(set(result.missing_keys) - tied)
            raise ValueError(f"params: do not match the model: {len(wrong)} tensors missing "
                             f"or unexpected, e.g. {wrong[0]!r}")
        if self.tied:
            model.tie_weights()
        model.config._attn_implementation = self.attention
        result_model: nn.Module = model
        return result_model

    def save_pretrained(self, params: dict[str, torch.Tensor], target: Path) -> None:
        """Write ``target`` with ``save_pretrained``: the model with ``params`` in their
        dtype, loadable by ``AutoModelForCausalLM.from_pretrained`` as the same class;
        tokenizer files of the source directory are copied along.

        Raises:
            ValueError: when ``params`` does not hold exactly this model's parameters.
        """
        model = self.whole_model(params)
        transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        model.save_pretrained(str(target))  # type: ignore[operator]
        if self.path is not None:
            for f in sorted(self.path.iterdir()):
                if (f.is_file() and f.suffix in _COPIED_SUFFIXES and f.name not in _NOT_COPIED
                        and not (target / f.name).exists()):
                    shutil.copy2(f, target / f.name)


def save_random_hf(config: PretrainedConfig, out_dir: Path, *, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> Path:
    """Write a randomly initialised model of ``config`` (any supported family) as a
    ``save_pretrained`` directory: what the examples and the tests train from.

    Returns:
        ``out_dir``.
    """
    model = HFCausalLM(config, seed=seed)
    model.save_pretrained(initial_params(model, dtype), out_dir)
    return out_dir


def save_random_llama(spec: ModelSpec, out_dir: Path, *, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> Path:
    """:func:`save_random_hf` of a Llama of ``spec``'s shape."""
    return save_random_hf(llama_config(spec), out_dir, seed=seed, dtype=dtype)
