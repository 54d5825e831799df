"""Per-layer torch.optim optimizers: the same update as one optimizer over the whole model,
state that survives a trip through bytes at any point, the [optimizer] table's checks."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from chameleon_ft.runtime.workload.models.gpt import GPTModel
from chameleon_ft.runtime.workload.models.gpt_layers import GPTShape
from chameleon_ft.runtime.workload.optim import (
    LayerTrainState,
    LRSchedule,
    TorchOptimizer,
    optimizer_from_config,
    schedule_from_config,
)
from chameleon_ft.spec import config_from_mapping

SHAPE = GPTShape(num_blocks=2, hidden_size=16, num_heads=2, vocab_size=256, seq_len=8,
                 ffn_size=32)
MODEL = GPTModel(SHAPE, seed=4)
FACTORIES: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": TorchOptimizer("SGD", (("lr", 0.05), ("momentum", 0.9),
                                           ("weight_decay", 0.01))),
    "adam": TorchOptimizer("Adam", (("lr", 3e-3), ("weight_decay", 0.02))),
    "adamw": TorchOptimizer("AdamW", (("betas", (0.9, 0.95)), ("lr", 3e-3),
                                      ("weight_decay", 0.1))),
}


def _config(**tables: dict[str, Any]) -> Any:
    doc = _config_doc()
    doc.update(tables)
    return config_from_mapping(doc)


def _config_doc() -> dict[str, Any]:
    return {
        "model": {"num_blocks": 2, "hidden_size": 16, "num_heads": 2, "vocab_size": 256,
                  "seq_len": 8},
        "cluster": {"num_nodes": 1, "devices_per_node": 2, "device": "cpu"},
        "job": {"pp": 2, "dp": 1, "global_batch": 4, "micro_batch": 2}}


def _grads(layers: list[nn.Module], step: int) -> None:
    """Gradients of a step's loss on the whole model (a different batch every step)."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (3, SHAPE.seq_len), generator=gen)
    h = x
    for layer in layers:
        h = layer(h)
    MODEL.loss(h, torch.roll(x, -1, 1)).backward()


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_per_layer_optimizers_equal_one_over_the_whole_model(name: str) -> None:
    factory = FACTORIES[name]
    whole = [MODEL.build_layer(i) for i in range(MODEL.num_layers)]
    one = factory([p for layer in whole for p in layer.parameters()])
    split = [LayerTrainState.create(MODEL.build_layer(i), factory)
             for i in range(MODEL.num_layers)]
    for step in range(5):
        one.zero_grad(set_to_none=True)
        _grads(whole, step)
        for state, layer in zip(split, whole, strict=True):
            state.zero_grad()
            for p, q in zip(state.module.parameters(), layer.parameters(), strict=True):
                assert q.grad is not None
                p.grad = q.grad.clone()
        one.step()
        for state in split:
            state.step(step)
    for state, layer in zip(split, whole, strict=True):
        for p, q in zip(state.module.parameters(), layer.parameters(), strict=True):
            assert p.dtype == torch.float64
            assert float((p - q).detach().abs().max()) < 1e-12
    moved = sum(float((p - q).detach().abs().sum()) for layer, fresh in
                zip(whole, (MODEL.build_layer(i) for i in range(MODEL.num_layers)), strict=True)
                for p, q in zip(layer.parameters(), fresh.parameters(), strict=True))
    assert moved > 0


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("reload_at", [0, 2])
def test_state_through_bytes_changes_nothing(name: str, reload_at: int) -> None:
    factory = FACTORIES[name]

    def run(reload: bool) -> list[LayerTrainState]:
        states = [LayerTrainState.create(MODEL.build_layer(i), factory)
                  for i in range(MODEL.num_layers)]
        for step in range(4):
            if reload and step == reload_at:  # before the first step: no state yet
                states = [LayerTrainState.from_bytes(MODEL.build_layer(i), factory,
                                                     s.to_bytes())
                          for i, s in enumerate(states)]
            for s in states:
                s.zero_grad()
            _grads([s.module for s in states], step)
            for s in states:
                s.step(step)
        return states

    plain, reloaded = run(False), run(True)
    for a, b in zip(plain, reloaded, strict=True):
        for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
            assert torch.equal(p, q)
        sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
        assert sa.keys() == sb.keys() and sa
        for k in sa:
            for key, value in sa[k].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb[k][key])), key


def test_parameters_without_a_gradient_are_untouched() -> None:
    state = LayerTrainState.create(MODEL.build_layer(1), FACTORIES["adamw"])
    params = dict(state.module.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    params["fc.weight"].grad = torch.ones_like(params["fc.weight"])
    state.step(0)
    assert not torch.equal(params["fc.weight"], before["fc.weight"])
    assert all(torch.equal(params[k], before[k]) for k in params if k != "fc.weight")


def test_bytes_of_another_layer_are_rejected() -> None:
    data = LayerTrainState.create(MODEL.build_layer(0), FACTORIES["adam"]).to_bytes()
    with pytest.raises(ValueError, match="does not match the layer"):
        LayerTrainState.from_bytes(MODEL.build_layer(1), FACTORIES["adam"], data)
    with pytest.raises(ValueError, match="unreadable"):
        LayerTrainState.from_bytes(MODEL.build_layer(1), FACTORIES["adam"], b"junk")


def test_config_builds_the_optimizer_with_train_shorthands() -> None:
    default = optimizer_from_config(_config())
    assert default == TorchOptimizer("AdamW", (("lr", 1e-3), ("weight_decay", 0.0)))
    sgd = optimizer_from_config(_config(optimizer={"name": "SGD", "momentum": 0.9},
                                        train={"lr": 0.1, "weight_decay": 0.01}))
    opt = sgd([nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.SGD)
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.9, 0.01)
    adamw = optimizer_from_config(_config(optimizer={"lr": 0.01, "betas": [0.8, 0.9]}))
    assert adamw([nn.Parameter(torch.zeros(2))]).param_groups[0]["betas"] == (0.8, 0.9)
    assert adamw.lr == 0.01
    # the same value in both places is not a conflict
    optimizer_from_config(_config(optimizer={"lr": 0.01}, train={"lr": 0.01}))


@pytest.mark.parametrize(("tables", "field"), [
    ({"optimizer": {"name": "Adamm"}}, "optimizer.name"),
    ({"optimizer": {"name": "LBFGS"}}, "optimizer.name"),
    ({"optimizer": {"name": "SGD", "betas": [0.9, 0.9]}}, "optimizer.betas"),
    ({"optimizer": {"momentum": -1.0, "name": "SGD"}}, "optimizer:"),
    ({"optimizer": {"name": "Rprop"}, "train": {"weight_decay": 0.1}}, "train.weight_decay"),
    # checked by the class after the base constructor has added the parameters
    ({"optimizer": {"fused": True, "foreach": True}}, "optimizer:"),
    ({"optimizer": {"name": "Adam", "betas": [1.0, 0.9]}}, "optimizer:"),
])
def test_bad_optimizers_name_the_field(tables: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        optimizer_from_config(_config(**tables))
    assert str(info.value).startswith(field) and "\n" not in str(info.value)


@pytest.mark.parametrize(("tables", "field"), [
    ({"optimizer": {"lr": 0.1}, "train": {"lr": 0.2}}, "train.lr"),
    ({"optimizer": {"weight_decay": 0.1}, "train": {"weight_decay": 0.2}},
     "train.weight_decay"),
    ({"optimizer": {"schedule": "linear"}}, "optimizer.schedule"),
    ({"optimizer": {"warmup_steps": -1}}, "optimizer.warmup_steps"),
    ({"optimizer": {"params": 1}}, "optimizer.params"),
    ({"optimizer": {"betas": {"a": 1}}}, "optimizer.betas"),
    ({"optimizer": {"name": 3}}, "optimizer.name"),
])
def test_bad_optimizer_tables_are_rejected_at_load(tables: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        _config(**tables)
    assert str(info.value).startswith(field), str(info.value)


def test_schedules() -> None:
    assert schedule_from_config(_config()) is None
    cosine = schedule_from_config(_config(
        optimizer={"lr": 0.1, "schedule": "cosine", "warmup_steps": 4, "min_lr": 0.01},
        train={"steps": 24}))
    assert cosine == LRSchedule(lr=0.1, kind="cosine", warmup_steps=4, decay_steps=24,
                                min_lr=0.01)
    assert [cosine(s) for s in range(4)] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    assert cosine(14) == pytest.approx(0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert cosine(24) == pytest.approx(0.01) and cosine(100) == pytest.approx(0.01)
    values = [cosine(s) for s in range(4, 25)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    warm = LRSchedule(lr=0.2, warmup_steps=2)
    state = LayerTrainState.create(MODEL.build_layer(0), FACTORIES["sgd-momentum"], warm)
    next(state.module.parameters()).grad = torch.zeros(256, 16, dtype=torch.float64)
    state.step(0)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    state.step(5)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match=r"optimizer\.decay_steps"):
        schedule_from_config(_config(optimizer={"schedule": "cosine", "warmup_steps": 30}))


def test_mixed_precision_state_keeps_fp32_masters() -> None:
    """A bf16 compute copy of fp32 masters: gradients of two micro-batches sum into the
    masters in fp32, the optimizer steps the masters and the copy follows; the state's
    bytes hold the masters and rebuild the same pair."""
    from chameleon_ft.runtime.workload.optim import LayerTrainState, TorchOptimizer

    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    frozen_bias = layer.bias.detach().clone()
    layer.bias.requires_grad_(False)
    factory = TorchOptimizer("AdamW", (("lr", 0.1), ("weight_decay", 0.1)))
    state = LayerTrainState.create(layer, factory, compute_dtype=torch.bfloat16)
    assert state.mixed and state.master is layer
    assert state.module.weight.dtype == torch.bfloat16 and layer.weight.dtype == torch.float32
    x = [torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(2)]
    for xb in x:  # two micro-batches
        state.module(xb).float().sum().backward()
    assert state.module.weight.grad is None  # handed to the master at once
    expected = sum(xb.float().sum(0) for xb in x)
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32
    assert torch.allclose(layer.weight.grad, expected.expand(4, 8), rtol=1e-2)
    before = layer.weight.detach().clone()
    state.step(0)
    assert not torch.equal(layer.weight, before)
    assert torch.equal(state.module.weight, layer.weight.to(torch.bfloat16))
    assert torch.equal(layer.bias, frozen_bias)  # frozen: never moves
    again = nn.Linear(8, 4)
    again.bias.requires_grad_(False)
    rebuilt = LayerTrainState.from_bytes(again, factory, state.to_bytes(),
                                         compute_dtype=torch.bfloat16)
    assert torch.equal(rebuilt.master.weight, layer.weight)  # fp32 masters, exactly
    assert torch.equal(rebuilt.module.weight, state.module.weight)
    assert rebuilt.optimizer.state_dict()["state"][0]["exp_avg"].dtype == torch.float32


def test_validating_the_optimizer_leaves_the_compiler_stack_unloaded() -> None:
    # the coordinator validates [optimizer]; building an optimizer imports torch._dynamo
    # (about 70 MB of resident memory) unless the checks run without its wrapper
    code = ("import sys\n"
            "from chameleon_ft.spec import config_from_mapping\n"
            "from chameleon_ft.runtime.workload.optim import optimizer_from_config\n"
            f"optimizer_from_config(config_from_mapping({_config_doc()!r}))\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
