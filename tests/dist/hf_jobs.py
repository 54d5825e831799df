"""Jobs of the supported Hugging Face families for the multi-process tests: a tiny random
model per family (``tests/runtime/hf_families.py``'s shapes, saved with
``save_pretrained``), a token file, 4 workers (2 pipelines x 2 stages), AdamW with weight
decay and clipping at 1.0; and how their results are compared."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chameleon_ft.runtime.workload.models import load_model, split_param_name
from chameleon_ft.runtime.workload.models.hf import save_random_hf
from chameleon_ft.spec.config import config_from_mapping

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from hf_families import SEQ_LEN, VOCAB, family_config

LAYOUT: dict[str, Any] = {
    "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
    "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
    "recovery": {"detect_s": 0.05, "rebuild_s": 0.05, "restart_s": 0.1,
                 "checkpoint_load_s": 0.05, "checkpoint_interval_s": 3.0},
    "profile": {"kind": "analytic"},
}
TRAIN = {"steps": 4, "dtype": "float64", "hang_timeout_s": 2.0, "heartbeat_s": 0.1,
         "checkpoint_every": 2}
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
