"""Every supported Hugging Face family on real worker processes: a tiny random model saved
with ``save_pretrained`` (tied where the family ties), 4 workers (2 pipelines x 2 stages),
a worker killed mid-step, clipping at 1.0 active from the first step, AdamW with weight
decay: ``params.pt`` and the ``hf/`` export equal plain single-process transformers +
``torch.optim.AdamW`` + ``clip_grad_norm_`` on the same samples (the reference trainer),
float64."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import chameleon_ft
from chameleon_ft.runtime.workload.models import load_model, split_param_name
from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec.config import config_from_mapping

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from hf_families import SEQ_LEN, VOCAB, family_config

from chameleon_ft.runtime.workload.models.hf import save_random_hf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LAYOUT: dict[str, Any] = {
    "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
    "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
    "recovery": {"detect_s": 0.05, "rebuild_s": 0.05, "restart_s": 0.1,
                 "checkpoint_load_s": 0.05, "checkpoint_interval_s": 3.0},
    "profile": {"kind": "analytic"},
}
TRAIN = {"steps": 4, "dtype": "float64", "hang_timeout_s": 2.0, "heartbeat_s": 0.1,
         "checkpoint_every": 2}
FAMILIES = {  # family -> (policy after the kill, tolerance)
    "llama": ("dynamic", 1e-9),   # tied: embedding and head on different workers
    "mistral": ("reroute", 1e-9),
    "qwen2": ("restart", 1e-9),   # tied: both copies through a checkpoint reload
    "qwen3": ("dynamic", 1e-9),
    "phi3": ("chameleon", 1e-9),
    # transformers computes parts of these in float32 even in a float64 model (Gemma's
    # 1 + w norms take w.float(), Gemma 2's eager softmax runs in float32): the tolerance
    # of tests/runtime/test_reference.py
    "gemma": ("dynamic", 1e-6),   # tied
    "gemma2": ("reroute", 1e-6),  # tied
}
INIT_RANGE = {"gemma": 0.2}
"""Larger initial weights where the fixture's gradient norm stays under 1 (Gemma's scaled
embedding and zero-started norms), so that clipping at 1.0 bites."""


def family_job(family: str, root: Path, *, train: dict[str, Any] | None = None,
               optimizer: dict[str, Any] | None = None,
               saved_dtype: torch.dtype = torch.float64) -> Any:
    """The family's tiny model (stored in ``saved_dtype``) and a token file under
    ``root``, and its job."""
    hf_config = family_config(family)
    if family in INIT_RANGE:
        hf_config.initializer_range = INIT_RANGE[family]
    save_random_hf(hf_config, root / family, seed=4, dtype=saved_dtype)
    (np.arange(3000) * 31 % VOCAB).astype(np.uint16).tofile(root / "tokens.bin")
    return config_from_mapping({
        **LAYOUT,
        "model": {"source": "hf", "path": family, "seq_len": SEQ_LEN},
        "data": {"kind": "tokens", "path": "tokens.bin", "shuffle": True},
        "optimizer": optimizer or {"name": "AdamW", "lr": 1e-2, "weight_decay": 0.1,
                                   "clip_grad_norm": 1.0},
        "train": {**TRAIN, **(train or {})}}, base_dir=str(root))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest elementwise difference over identically named tensors."""
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:5]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def exported(config: Any, run: Path) -> dict[str, torch.Tensor]:
    """``run/hf`` reloaded with ``AutoModelForCausalLM``, by runtime name (a tied head's
    copy left out, as the reference names it)."""
    from transformers import AutoModelForCausalLM

    model = load_model(config)
    hf = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float64).state_dict()
    names = {model.hf_name(*split_param_name(n)): n  # type: ignore[attr-defined]
             for n in torch.load(run / "params.pt")}
    return {runtime: hf[name] for name, runtime in names.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_survives_a_kill_as_plain_pytorch(family: str, tmp_path: Path) -> None:
    policy, tolerance = FAMILIES[family]
    config = family_job(family, tmp_path)
    report = chameleon_ft.train(config, out_dir=tmp_path / "run", log=None, policy=policy,
                                faults=["rank=3,step=2,kind=kill,phase=backward"])
    assert [e["workers"] for e in report["events"]] == [[3]]
    reference = train_reference(config)
    assert reference.grad_norms[0] > 1.0, "clipping must be active"
    params = dict(torch.load(tmp_path / "run" / "params.pt"))
    assert max_diff(params, reference.params) < tolerance
    assert max_diff(exported(config, tmp_path / "run"), reference.params) < tolerance
    metrics = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(TRAIN["steps"]))
    assert [m["grad_norm"] for m in metrics] == pytest.approx(reference.grad_norms,
                                                              rel=tolerance * 1e3)
    assert all(m["lr"] == pytest.approx(1e-2) for m in metrics)
