"""The single-process reference trainer (whole model, one optimizer, whole global batch)
against an in-process data x pipeline split with per-layer optimizers: the oracle the
multi-process recovery tests rely on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from split_trainer import train_split

from chameleon_ft.runtime.workload.data import load_data
from chameleon_ft.runtime.workload.models import initial_params, load_model
from chameleon_ft.runtime.workload.models.hf_llama import save_random_llama
from chameleon_ft.runtime.workload.optim import optimizer_from_config, schedule_from_config
from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec import config_from_mapping
from chameleon_ft.spec.model import ModelSpec

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
