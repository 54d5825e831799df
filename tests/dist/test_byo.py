"""Real processes train the user's own model, optimizer and data, survive a kill, and end
with the same weights as plain single-process training (float64, < 1e-9)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from byo_models import TinyMLP, TinyRegression

import chameleon_ft
from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec.config import config_from_mapping

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

LAYOUT: dict[str, Any] = {
    "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
    "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
    "recovery": {"detect_s": 0.05, "rebuild_s": 0.05, "restart_s": 0.1,
                 "checkpoint_load_s": 0.05, "checkpoint_interval_s": 3.0},
}
TRAIN = {"steps": 6, "dtype": "float64", "hang_timeout_s": 2.0, "heartbeat_s": 0.1,
         "checkpoint_every": 2}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a)[:5], sorted(b)[:5])
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _train(config: Any, out: Path, faults: tuple[str, ...], **kwargs: Any) -> dict[str, Any]:
    report = chameleon_ft.train(config, out_dir=out, faults=faults, log=None, **kwargs)
    return report


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import make_llama
        import make_tokens
    finally:
        sys.path.remove(str(EXAMPLES))
    root = tmp_path_factory.mktemp("llama")
    tokens = make_tokens.main(["--out", str(root / "tokens.bin"), "--max-bytes", "40000"])
    model = make_llama.main(["--out", str(root / "llama")])
    return model, tokens


def test_hf_llama_tokens_adamw_survive_a_kill(tmp_path: Path,
                                              llama_dir: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, tokens = llama_dir
    doc = {**LAYOUT, "model": {"source": "hf", "path": str(model_dir), "seq_len": 32},
           "data": {"kind": "tokens", "path": str(tokens), "shuffle": True},
           "optimizer": {"name": "AdamW", "lr": 3e-3, "betas": [0.9, 0.95],
                         "weight_decay": 0.01},
           "profile": {"kind": "analytic"}, "train": dict(TRAIN)}
    config = config_from_mapping(doc)
    report = _train(config, tmp_path / "run", ("rank=3,step=3,kind=kill,phase=backward",),
                    policy="dynamic")
    assert [e["workers"] for e in report["events"]] == [[3]]
    reference = train_reference(config)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf",
                                                    torch_dtype=torch.float64)
    from chameleon_ft.runtime.workload.models import load_model

    model = load_model(config)
    hf = exported.state_dict()
    diffs = [float((hf[model.hf_name(*_split(name))] - value).abs().max())  # type: ignore[attr-defined]
             for name, value in reference.params.items()]
    assert len(diffs) == len(reference.params) and max(diffs) < 1e-9
    assert _max_diff(dict(torch.load(tmp_path / "run" / "params.pt")), reference.params) < 1e-9
    assert (tmp_path / "run" / "report.png").stat().st_size > 1000


def _split(name: str) -> tuple[int, str]:
    from chameleon_ft.runtime.workload.models import split_param_name

    return split_param_name(name)


def test_gpt_bytes_against_plain_pytorch_adamw(tmp_path: Path) -> None:
    doc = {**LAYOUT, "model": {"num_blocks": 2, "hidden_size": 32, "num_heads": 2,
                               "vocab_size": 256, "seq_len": 32},
           "profile": {"kind": "analytic"}, "train": dict(TRAIN, lr=3e-3, weight_decay=0.1)}
    config = config_from_mapping(doc)
    _train(config, tmp_path / "run", ("rank=1,step=2,kind=kill,phase=forward",),
           policy="reroute")
    reference = train_reference(config)
    assert _max_diff(dict(torch.load(tmp_path / "run" / "params.pt")), reference.params) < 1e-9


@pytest.mark.parametrize(("optimizer", "policy"), [
    ({"name": "SGD", "lr": 0.05, "momentum": 0.9}, "dynamic"),
    ({"name": "SGD", "lr": 0.05, "momentum": 0.9}, "restart"),
    ({"name": "Adam", "lr": 0.003}, "dynamic"),
    ({"name": "Adam", "lr": 0.003}, "restart")])
def test_any_optimizer_state_moves_with_its_layer(tmp_path: Path, optimizer: dict[str, Any],
                                                  policy: str) -> None:
    doc = {**LAYOUT, "model": {"num_blocks": 2, "hidden_size": 32, "num_heads": 2,
                               "vocab_size": 256, "seq_len": 32},
           "optimizer": optimizer, "profile": {"kind": "analytic"}, "train": dict(TRAIN)}
    config = config_from_mapping(doc)
    report = _train(config, tmp_path / "run", ("rank=2,step=3,kind=kill,phase=backward",
                                               "rank=3,step=3,kind=kill,phase=backward")
                    if policy == "restart" else ("rank=2,step=3,kind=kill,phase=backward",),
                    policy=policy)
    assert {e["strategy"] for e in report["events"]} == {policy}
    reference = train_reference(config)
    assert _max_diff(dict(torch.load(tmp_path / "run" / "params.pt")), reference.params) < 1e-9


def test_python_model_and_data_through_the_api(tmp_path: Path) -> None:
    # no [model] or [data]: the objects handed to train() are the model and the data
    doc = {**LAYOUT,
           "profile": {"kind": "uniform", "num_layers": 4, "fwd_s": 1e-4, "bwd_input_s": 1e-4,
                       "bwd_weight_s": 1e-4, "param_bytes": 2000, "optimizer_bytes": 2000,
                       "activation_bytes": 500, "output_bytes": 500},
           "train": dict(TRAIN)}
    config = config_from_mapping(doc)
    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    objects = {"model": TinyMLP(), "data": TinyRegression(8), "optimizer": sgd}
    report = _train(config, tmp_path / "run", ("rank=0,step=2,kind=kill,phase=backward",),
                    policy="dynamic", **objects)
    assert [e["workers"] for e in report["events"]] == [[0]]
    reference = train_reference(config, **objects)
    assert _max_diff(dict(torch.load(tmp_path / "run" / "params.pt")), reference.params) < 1e-9


def test_a_torch_lr_scheduler_through_a_kill_as_plain_pytorch(tmp_path: Path) -> None:
    # a torch.optim.lr_scheduler factory where a schedule goes: the runtime's layers get
    # the rates that the scheduler gives a single-process loop's optimizer, whose own
    # training (train_reference: the scheduler stepping its one optimizer) is the oracle
    doc = {**LAYOUT,
           "profile": {"kind": "uniform", "num_layers": 4, "fwd_s": 1e-4, "bwd_input_s": 1e-4,
                       "bwd_weight_s": 1e-4, "param_bytes": 2000, "optimizer_bytes": 2000,
                       "activation_bytes": 500, "output_bytes": 500},
           "train": dict(TRAIN)}
    config = config_from_mapping(doc)
    objects = {"model": TinyMLP(), "data": TinyRegression(8),
               "optimizer": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
               "lr_schedule": functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR,
                                                T_max=4, eta_min=0.005)}
    report = _train(config, tmp_path / "run", ("rank=3,step=3,kind=kill,phase=backward",),
                    policy="dynamic", **objects)
    assert [e["workers"] for e in report["events"]] == [[3]]
    reference = train_reference(config, **objects)
    assert _max_diff(dict(torch.load(tmp_path / "run" / "params.pt")), reference.params) < 1e-9
    # the rates the workers applied are the scheduler's, step by step
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    applied = [json.loads(line)["lr"] for line in lines]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05)
    scheduler = objects["lr_schedule"](optimizer)
    expected = []
    for _ in range(TRAIN["steps"]):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert applied == pytest.approx(expected, abs=1e-15)
