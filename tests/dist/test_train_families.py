"""Every supported Hugging Face family on real worker processes: a tiny random model saved
with ``save_pretrained`` (tied where the family ties), 4 workers (2 pipelines x 2 stages),
a worker killed mid-step, clipping at 1.0 active from the first step, AdamW with weight
decay: ``params.pt`` and the ``hf/`` export equal plain single-process transformers +
``torch.optim.AdamW`` + ``clip_grad_norm_`` on the same samples (the reference trainer),
float64."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_jobs import TRAIN, exported, family_job, max_diff

import chameleon_ft
from chameleon_ft.runtime.workload.reference import train_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

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
