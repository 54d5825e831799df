"""The single-process reference trainer (whole model, one optimizer, whole global batch)
against an in-process data x pipeline split with per-layer optimizers: the oracle the
multi-process recovery tests rely on. Tied pairs, clipping by global norm and frozen
parameters included: the split trainer does what the runtime's worker must do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from split_trainer import train_split

from chameleon_ft.runtime.workload.data import load_data
from chameleon_ft.runtime.workload.models import initial_params, load_model
from chameleon_ft.runtime.workload.models.hf import save_random_llama
from chameleon_ft.runtime.workload.optim import optimizer_from_config, schedule_from_config
from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec import config_from_mapping
from chameleon_ft.spec.model import ModelSpec
from chameleon_ft.spec.model_source import HF_FAMILIES

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLUSTER = {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"}
JOB = {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2}
STEPS = 4


def _gpt(_tmp: Path) -> Any:
    return config_from_mapping({
        "model": {"num_blocks": 2, "hidden_size": 16, "num_heads": 2, "vocab_size": 256,
                  "seq_len": 16},
        "cluster": CLUSTER, "job": JOB,
        "optimizer": {"weight_decay": 0.1},
        "train": {"dtype": "float64", "lr": 3e-3, "steps": STEPS}})


def _hf(tmp: Path) -> Any:
    spec = ModelSpec(num_blocks=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                     ffn_size=48, vocab_size=97, seq_len=16, mlp="swiglu")
    save_random_llama(spec, tmp / "llama", seed=3)
    (np.arange(3000) * 31 % 97).astype(np.uint16).tofile(tmp / "tokens.bin")
    return config_from_mapping({
        "model": {"source": "hf", "path": "llama", "seq_len": 16},
        "data": {"kind": "tokens", "path": "tokens.bin", "shuffle": True},
        "cluster": CLUSTER, "job": JOB,
        "optimizer": {"name": "AdamW", "lr": 1e-2, "weight_decay": 0.05,
                      "schedule": "cosine", "warmup_steps": 1},
        "train": {"dtype": "float64", "steps": STEPS}}, base_dir=str(tmp))


def _python(_tmp: Path) -> Any:
    return config_from_mapping({
        "model": {"source": "python", "factory": "mlp_regression:build_model"},
        "data": {"kind": "python", "factory": "mlp_regression:build_data"},
        "optimizer": {"name": "SGD", "lr": 0.05, "momentum": 0.9},
        "cluster": CLUSTER, "job": JOB,
        "profile": {"kind": "uniform", "num_layers": 4, "fwd_s": 1e-4},
        "train": {"dtype": "float64", "steps": STEPS}}, base_dir=str(EXAMPLES))


@pytest.mark.parametrize("make", [_gpt, _hf, _python], ids=["gpt", "hf", "python"])
def test_reference_equals_a_split_run(make: Any, tmp_path: Path) -> None:
    config = make(tmp_path)
    reference = train_reference(config)
    model = load_model(config)
    split, losses = train_split(
        model, load_data(config), optimizer_from_config(config),
        lr_schedule=schedule_from_config(config), stages=[0, 1, model.num_layers], dp=2,
        global_batch=8, micro_batch=2, steps=STEPS, reload_at=2)
    assert split.keys() == reference.params.keys()
    initial = initial_params(model, torch.float64)
    for name, value in reference.params.items():
        assert value.dtype == torch.float64
        assert float((value - split[name]).abs().max()) < 1e-9, name
    assert any(not torch.equal(reference.params[k], initial[k]) for k in initial)
    assert losses == pytest.approx(reference.losses, rel=1e-9)
    assert len(reference.losses) == STEPS


def test_reference_learns(tmp_path: Path) -> None:
    config = _gpt(tmp_path)
    losses = train_reference(config, steps=12).losses
    assert losses[0] == pytest.approx(np.log(256), abs=0.05)
    assert losses[-1] < losses[0] - 0.05


def _family(family: str, tmp: Path) -> Any:
    from hf_families import SEQ_LEN, VOCAB, save_family

    save_family(family, tmp / family, seed=4)
    (np.arange(3000) * 31 % VOCAB).astype(np.uint16).tofile(tmp / "tokens.bin")
    return config_from_mapping({
        "model": {"source": "hf", "path": family, "seq_len": SEQ_LEN},
        "data": {"kind": "tokens", "path": "tokens.bin", "shuffle": True},
        "cluster": CLUSTER, "job": JOB,
        "optimizer": {"name": "AdamW", "lr": 1e-2, "weight_decay": 0.1,
                      "clip_grad_norm": 0.5},
        "train": {"dtype": "float64", "steps": STEPS}}, base_dir=str(tmp))


FLOAT32_INSIDE = {"gemma": 1e-6, "gemma2": 1e-6}
"""Families whose transformers code computes in float32 even in a float64 model: Gemma's
``1 + w`` norms take ``w.float()`` (so their weight gradients are float32 sums, whose order
differs between micro-batches and the whole batch) and Gemma 2's eager softmax runs in
float32. They agree to about 1e-7 relative; every other family to 1e-9."""


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_every_family_trains_as_transformers_does(family: str, tmp_path: Path) -> None:
    """AdamW with weight decay, clipping at 0.5 active from the first step (the unclipped
    norm above it), tied heads summed across stages, a reload mid-run."""
    tolerance = FLOAT32_INSIDE.get(family, 1e-9)
    config = _family(family, tmp_path)
    reference = train_reference(config)
    assert reference.grad_norms[0] > 0.5, "clipping must be active"
    unclipped = train_reference(config, clip_grad_norm=0.0)
    assert unclipped.grad_norms[0] == pytest.approx(reference.grad_norms[0], rel=1e-12)
    model = load_model(config)
    for stages in ([0, 2, model.num_layers], [0, model.num_layers]):  # embedding and head
        norms: list[float] = []                                     # apart, then together
        split, losses = train_split(
            model, load_data(config), optimizer_from_config(config), stages=stages, dp=2,
            global_batch=8, micro_batch=2, steps=STEPS, reload_at=2,
            clip_grad_norm=config.optimizer.clip_grad_norm, grad_norms=norms)
        assert split.keys() == reference.params.keys()
        assert max(float((reference.params[k] - split[k]).abs().max()) for k in split) \
            < tolerance
        assert losses == pytest.approx(reference.losses, rel=tolerance)
        assert norms == pytest.approx(reference.grad_norms, rel=tolerance)
    assert any(float((reference.params[k] - unclipped.params[k]).abs().max()) > 1e-6
               for k in reference.params)
    if model.tied_parameters():  # type: ignore[attr-defined]
        assert "layers.4.lm_head.weight" not in reference.params  # one tensor


class _TinyTiedLM:
    """A user's layered model with a tied head: embedding, a block, the head reusing the
    embedding matrix (declared through tied_parameters)."""

    num_layers = 3

    def build_layer(self, index: int) -> torch.nn.Module:
        gen = torch.Generator().manual_seed(index if index < 2 else 0)
        if index == 0:
            layer: torch.nn.Module = torch.nn.Embedding(256, 16)
        elif index == 1:
            layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        else:
            layer = torch.nn.Linear(16, 256, bias=False)
        with torch.no_grad():
            for p in layer.parameters():  # the head draws what the embedding draws
                p.copy_(torch.randn(p.shape if index < 2 else (256, 16), generator=gen) * 0.3)
        return layer

    def tied_parameters(self) -> list[tuple[tuple[int, str], tuple[int, str]]]:
        return [((0, "weight"), (2, "weight"))]

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output.reshape(-1, 256), targets.reshape(-1),
                                                 reduction="sum")


class _FrozenEmbedding:
    """A model whose embedding is frozen (requires_grad = False), as when fine-tuning."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_layers = inner.num_layers

    def build_layer(self, index: int) -> torch.nn.Module:
        layer: torch.nn.Module = self.inner.build_layer(index)
        if index == 0:
            layer.requires_grad_(False)
        return layer

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner.loss(output, targets)  # type: ignore[no-any-return]


@pytest.mark.parametrize("frozen", [False, True], ids=["tied", "tied-frozen"])
def test_a_users_tied_model_and_frozen_parameters(frozen: bool, tmp_path: Path) -> None:
    config = _gpt(tmp_path)
    model: Any = _TinyTiedLM()
    if frozen:
        model = _FrozenEmbedding(model)
        model.tied_parameters = lambda: []  # a frozen embedding, an untied head
    data = load_data(config)
    factory = optimizer_from_config(config)  # AdamW, weight decay 0.1
    reference = train_reference(config, model=model, data=data, optimizer=factory,
                                clip_grad_norm=0.5)
    initial = initial_params(model, torch.float64)
    split, losses = train_split(model, data, factory, stages=[0, 1, 3], dp=2, global_batch=8,
                                micro_batch=2, steps=STEPS, reload_at=2, clip_grad_norm=0.5)
    assert split.keys() == reference.params.keys()
    assert max(float((reference.params[k] - split[k]).abs().max()) for k in split) < 1e-9
    assert losses == pytest.approx(reference.losses, rel=1e-9)
    if frozen:  # bit for bit, although AdamW decays every parameter it steps
        assert torch.equal(reference.params["layers.0.weight"], initial["layers.0.weight"])
        assert torch.equal(split["layers.0.weight"], initial["layers.0.weight"])
        assert not torch.equal(split["layers.2.weight"], initial["layers.2.weight"])
    else:
        assert sorted(reference.params) == ["layers.0.weight", "layers.1.0.bias",
                                            "layers.1.0.weight"]


def test_a_frozen_parameter_given_a_gradient_does_not_move() -> None:
    from chameleon_ft.runtime.workload.optim import LayerTrainState, TorchOptimizer

    layer = torch.nn.Linear(4, 4).double()
    layer.weight.requires_grad_(False)
    before = layer.weight.detach().clone()
    state = LayerTrainState.create(layer, TorchOptimizer("AdamW", (("lr", 0.1),
                                                                   ("weight_decay", 0.5))))
    layer.weight.grad = torch.zeros_like(layer.weight)  # as an all-reduce fills one in
    layer.bias.grad = torch.ones_like(layer.bias)
    state.step(0)
    assert torch.equal(layer.weight, before) and layer.weight.grad is None
    assert not torch.equal(layer.bias, torch.zeros(4))


def test_a_frozen_embedding_of_a_hugging_face_model(tmp_path: Path) -> None:
    from chameleon_ft.runtime.workload.models.hf import HFCausalLM

    class FrozenEmbedding(HFCausalLM):  # fine-tuning: the embedding stays as loaded
        def build_layer(self, index: int) -> torch.nn.Module:
            layer = super().build_layer(index)
            if index == 0:
                layer.requires_grad_(False)
            return layer

    config = _family("qwen3", tmp_path)
    model = FrozenEmbedding.from_pretrained(tmp_path / "qwen3")
    reference = train_reference(config, model=model)
    split, _ = train_split(model, load_data(config), optimizer_from_config(config),
                           stages=[0, 1, model.num_layers], dp=2, global_batch=8,
                           micro_batch=2, steps=STEPS, reload_at=2,
                           clip_grad_norm=config.optimizer.clip_grad_norm)
    initial = initial_params(model, torch.float64)["layers.0.embed_tokens.weight"]
    assert torch.equal(reference.params["layers.0.embed_tokens.weight"], initial)
    assert torch.equal(split["layers.0.embed_tokens.weight"], initial)
    assert max(float((reference.params[k] - split[k]).abs().max()) for k in split) < 1e-9
