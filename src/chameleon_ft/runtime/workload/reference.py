"""The plain single-process trainer: the oracle for the runtime's results.

It trains the job's model on the same samples with the ordinary whole model in one
process: for ``[model] source = "hf"`` a ``transformers.LlamaForCausalLM`` loaded from the
same directory (or holding the same random initial weights), for any other source the
layers in one ``nn.Sequential``; one optimizer from the same factory over all parameters
(``torch.optim.AdamW`` by default); the loss of a step is the mean over the whole global
batch (token cross-entropy for the GPT and Llama). It returns the final parameters by the
runtime's names (``layers.{i}.<name>``), so they compare name by name with a run under
any plan, failures and recoveries included.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from chameleon_ft.runtime.workload.data import DataSource, load_data
from chameleon_ft.runtime.workload.models import LayeredModel, load_model, param_name, to_run
from chameleon_ft.runtime.workload.optim import (
    OptimizerFactory,
    optimizer_from_config,
    schedule_from_config,
)
from chameleon_ft.runtime.workload.precision import torch_dtype
from chameleon_ft.spec.config import Config


@dataclass
class ReferenceRun:
    """What the reference trainer returns."""

    params: dict[str, torch.Tensor]
    """Final parameters by runtime name, detached, on CPU."""
    losses: list[float] = field(default_factory=list)
    """Mean loss of every step (before its update)."""


class _WholeModel:
    """The whole model as one module, with the maps between its names and the runtime's."""

    def __init__(self, module: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
                 to_runtime: dict[str, str]) -> None:
        self.module = module
        self.forward = forward
        self.to_runtime = to_runtime


def _is_hf(model: LayeredModel) -> bool:
    # An HFLlama exists only once its module (and transformers) is imported.
    module = sys.modules.get("chameleon_ft.runtime.workload.models.hf_llama")
    return module is not None and isinstance(model, module.HFLlama)


def _hf_whole(model: LayeredModel, dtype: torch.dtype) -> _WholeModel:
    from transformers import LlamaForCausalLM

    from chameleon_ft.runtime.workload.models.hf_llama import ATTENTION, HFLlama

    assert isinstance(model, HFLlama)
    to_runtime = {}
    for i in range(model.num_layers):
        for name, _ in model.build_layer(i).named_parameters():
            to_runtime[model.hf_name(i, name)] = param_name(i, name)
    if model.path is not None:
        whole = LlamaForCausalLM.from_pretrained(str(model.path), local_files_only=True,
                                                 attn_implementation=ATTENTION, dtype=dtype)
    else:
        whole = LlamaForCausalLM(model.config).to(dtype)
        initial = {}
        for i in range(model.num_layers):
            for name, p in model.build_layer(i).named_parameters():
                initial[model.hf_name(i, name)] = p.detach().to(dtype)
        whole.load_state_dict(initial, strict=True)
    whole.config.use_cache = False

    def forward(x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = whole(input_ids=x, use_cache=False).logits
        return logits

    return _WholeModel(whole, forward, to_runtime)


def _sequential_whole(model: LayeredModel, dtype: torch.dtype) -> _WholeModel:
    whole = nn.Sequential(*[model.build_layer(i) for i in range(model.num_layers)]).to(dtype)
    to_runtime = {}
    for full, _ in whole.named_parameters():
        index, _, name = full.partition(".")
        to_runtime[full] = param_name(int(index), name)
    return _WholeModel(whole, whole, to_runtime)


def train_reference(config: Config, *, model: LayeredModel | None = None,
                    data: DataSource | None = None, optimizer: OptimizerFactory | None = None,
                    lr_schedule: Callable[[int], float] | None = None,
                    steps: int | None = None, dtype: torch.dtype | None = None) -> ReferenceRun:
    """Train ``config`` in this process with the whole model.

    Args:
        config: the job; ``[train] steps``, ``dtype`` and ``[job] global_batch`` apply.
        model: the layered model (default: ``load_model(config)``); a Hugging Face model is
            trained as ``LlamaForCausalLM``, any other as its layers in sequence.
        data: the data source (default: ``load_data(config)``).
        optimizer: the optimizer factory, called ONCE over all parameters (default:
            ``[optimizer]``).
        lr_schedule: rate of each 0-based step (default: ``[optimizer]``'s schedule, or
            none when ``optimizer`` is given).
        steps: steps to train (default ``[train] steps``).
        dtype: parameter dtype (default ``[train] dtype``).

    Returns:
        The final parameters by runtime name and every step's mean loss.
    """
    model = load_model(config) if model is None else model
    data = load_data(config) if data is None else data
    if optimizer is None:
        optimizer = optimizer_from_config(config)
        if lr_schedule is None:
            lr_schedule = schedule_from_config(config)
    dtype = torch_dtype(config.train.dtype) if dtype is None else dtype
    steps = config.train.steps if steps is None else steps
    is_hf = _is_hf(model)
    whole = _hf_whole(model, dtype) if is_hf else _sequential_whole(model, dtype)
    opt = optimizer(whole.module.parameters())
    losses = []
    batch = config.job.global_batch
    for step in range(steps):
        x, y = data.microbatch(step, 0, batch)
        x, y = to_run(x, dtype, "cpu"), to_run(y, dtype, "cpu")
        out = whole.forward(x)
        if is_hf:  # the ordinary Hugging Face loss: mean token cross-entropy
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        else:
            loss = model.loss(out, y) / y.numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if lr_schedule is not None:
            for group in opt.param_groups:
                group["lr"] = float(lr_schedule(step))
        opt.step()
        losses.append(float(loss.detach()))
    params = {whole.to_runtime[name]: p.detach().cpu().clone()
              for name, p in whole.module.named_parameters()}
    return ReferenceRun(params=params, losses=losses)
