"""The plain single-process trainer: the oracle for the runtime's results.

It trains the job's model on the same samples with the ordinary whole model in one
process: for ``[model] source = "hf"`` the family's ``AutoModelForCausalLM`` loaded from
the same directory (or holding the same random initial weights), for any other source the
layers in one ``nn.Sequential``; one optimizer from the same factory over all parameters
(``torch.optim.AdamW`` by default); the loss of a step is the mean over the whole global
batch (token cross-entropy for the GPT and Hugging Face models). As in transformers, a
tied pair is one parameter (the Sequential shares the original with the layer that holds
the copy), so it gets the sum of both uses' gradients and counts once in the gradient
norm; ``[optimizer] clip_grad_norm`` clips with ``torch.nn.utils.clip_grad_norm_`` over
the whole model before each step; parameters built with ``requires_grad = False`` never
get a gradient and never move. ``[train] dtype = "bfloat16"`` trains the plain mixed
precision recipe (the whole model computing in bf16 from fp32 master weights that one
fp32 optimizer steps). It returns the final parameters by the runtime's names
(``layers.{i}.<name>``, tied copies left out), so they compare name by name with a run
under any plan, failures and recoveries included.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from chameleon_ft.runtime.workload.data import DataSource, load_data
from chameleon_ft.runtime.workload.models import (
    LayeredModel,
    load_model,
    param_name,
    split_param_name,
    tied_copies,
    tied_parameters,
)
from chameleon_ft.runtime.workload.optim import (
    OptimizerFactory,
    optimizer_from_config,
    schedule_from_config,
)
from chameleon_ft.runtime.workload.precision import Precision, dtype_name
from chameleon_ft.runtime.workload.schedules import TorchLRSchedule
from chameleon_ft.spec.config import Config


@dataclass
class ReferenceRun:
    """What the reference trainer returns."""

    params: dict[str, torch.Tensor]
    """Final parameters by runtime name (a tied pair under its original's name), detached,
    on CPU."""
    losses: list[float] = field(default_factory=list)
    """Mean loss of every step (before its update)."""
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norm of every step, before clipping."""


class _WholeModel:
    """The whole model as one module, with the map from its names to the runtime's."""

    def __init__(self, module: nn.Module,
                 forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                 to_runtime: dict[str, str], is_hf: bool) -> None:
        self.module = module
        self.forward = forward
        """``(module, inputs) -> output``: the module may be a compute copy of ``module``."""
        self.to_runtime = to_runtime
        self.is_hf = is_hf


def _is_hf(model: LayeredModel) -> bool:
    # An HFCausalLM exists only once its module (and transformers) is imported.
    module = sys.modules.get("chameleon_ft.runtime.workload.models.hf")
    return module is not None and isinstance(model, module.HFCausalLM)


def _layer_params(model: LayeredModel) -> dict[tuple[int, str], nn.Parameter]:
    """Every parameter of every layer as built (values and ``requires_grad``)."""
    return {(i, name): p for i in range(model.num_layers)
            for name, p in model.build_layer(i).named_parameters()}


def _hf_whole(model: LayeredModel, dtype: torch.dtype) -> _WholeModel:
    from transformers import AutoModelForCausalLM

    from chameleon_ft.runtime.workload.models.hf import HFCausalLM

    assert isinstance(model, HFCausalLM)
    layers = _layer_params(model)
    to_runtime = {model.hf_name(i, name): param_name(i, name) for i, name in layers}
    if model.path is not None:
        whole = AutoModelForCausalLM.from_pretrained(
            str(model.path), local_files_only=True, attn_implementation=model.attention,
            dtype=dtype)
    else:
        whole = AutoModelForCausalLM.from_config(model.config, dtype=dtype,
                                                 attn_implementation=model.attention)
        whole.load_state_dict({model.hf_name(i, name): p.detach().to(dtype)
                               for (i, name), p in layers.items()}, strict=True)
    whole.config.use_cache = False
    for name, p in whole.named_parameters():  # frozen where the layer is frozen
        p.requires_grad_(layers[split_param_name(to_runtime[name])].requires_grad)
    return _WholeModel(whole, _hf_forward, to_runtime, is_hf=True)


def _hf_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits: torch.Tensor = module(input_ids=x, use_cache=False).logits
    return logits


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = module(x)
    return out


def _sequential_whole(model: LayeredModel, dtype: torch.dtype) -> _WholeModel:
    whole = nn.Sequential(*[model.build_layer(i) for i in range(model.num_layers)]).to(dtype)
    for (i, a), (j, b) in tied_parameters(model):  # one parameter, as transformers ties
        owner, _, leaf = f"{j}.{b}".rpartition(".")
        setattr(whole.get_submodule(owner), leaf, whole.get_parameter(f"{i}.{a}"))
    copies = tied_copies(model)
    to_runtime = {}
    for full, _ in whole.named_parameters():
        index, _, name = full.partition(".")
        runtime = param_name(int(index), name)
        to_runtime[full] = copies.get(runtime, runtime)
    return _WholeModel(whole, _call, to_runtime, is_hf=False)


def train_reference(config: Config, *, model: LayeredModel | None = None,
                    data: DataSource | None = None, optimizer: OptimizerFactory | None = None,
                    lr_schedule: Callable[[int], float] | None = None,
                    steps: int | None = None, dtype: torch.dtype | None = None,
                    clip_grad_norm: float | None = None) -> ReferenceRun:
    """Train ``config`` in this process with the whole model.

    Args:
        config: the job; ``[train] steps``, ``dtype`` and ``[job] global_batch`` apply.
        model: the layered model (default: ``load_model(config)``); a Hugging Face model is
            trained as its family's ``AutoModelForCausalLM``, any other as its layers in
            sequence.
        data: the data source (default: ``load_data(config)``).
        optimizer: the optimizer factory, called ONCE over all parameters (default:
            ``[optimizer]``).
        lr_schedule: rate of each 0-based step (default: ``[optimizer]``'s schedule, or
            none when ``optimizer`` is given); or a ``torch.optim.lr_scheduler`` class or
            factory, which then drives the optimizer as in any PyTorch loop
            (``scheduler.step()`` after each ``optimizer.step()``), or instance (its rates).
        steps: steps to train (default ``[train] steps``).
        dtype: the dtype (default ``[train] dtype``); ``torch.bfloat16`` trains as the
            runtime's mixed precision does, plainly: the whole model computes in bf16 from
            fp32 master weights that the optimizer steps (gradients cast to fp32, clipped
            there), the loss in fp32 from the bf16 logits.
        clip_grad_norm: clip by global norm (default ``[optimizer] clip_grad_norm``; 0:
            never).

    Returns:
        The final parameters by runtime name (the masters under mixed precision), every
        step's mean loss and gradient norm.
    """
    model = load_model(config) if model is None else model
    data = load_data(config) if data is None else data
    if optimizer is None:
        optimizer = optimizer_from_config(config)
        if lr_schedule is None:
            lr_schedule = schedule_from_config(config)
    precision = Precision.of(config.train.dtype if dtype is None else dtype_name(dtype))
    clip = config.optimizer.clip_grad_norm if clip_grad_norm is None else clip_grad_norm
    if lr_schedule is not None:
        lr_schedule = TorchLRSchedule.wrap(lr_schedule, optimizer,
                                           config.train.steps if steps is None else steps)
    whole = (_hf_whole if _is_hf(model) else _sequential_whole)(model, precision.master)
    trainer = _Plain(model, whole, optimizer, lr_schedule, precision, clip)
    run = ReferenceRun(params={})
    batch = config.job.global_batch
    for step in range(config.train.steps if steps is None else steps):
        x, y = data.microbatch(step, 0, batch)
        loss, norm = trainer.step(step, precision.inputs(x, "cpu"), precision.targets(y, "cpu"))
        run.losses.append(loss)
        run.grad_norms.append(norm)
    run.params = {whole.to_runtime[name]: p.detach().cpu().clone()
                  for name, p in whole.module.named_parameters()}
    return run


class _Plain:
    """One optimizer over the whole model (and its bf16 compute copy under mixed
    precision), stepped on the whole global batch."""

    def __init__(self, model: LayeredModel, whole: _WholeModel, optimizer: OptimizerFactory,
                 lr_schedule: Callable[[int], float] | None, precision: Precision,
                 clip: float) -> None:
        self.model, self.whole, self.precision, self.clip = model, whole, precision, clip
        self.params = list(whole.module.parameters())  # a tied pair once
        self.opt = optimizer(self.params)
        # a torch scheduler drives the optimizer itself; other schedules set the rate
        self.scheduler = lr_schedule.start(self.opt) \
            if isinstance(lr_schedule, TorchLRSchedule) else None
        self.lr_schedule = None if self.scheduler is not None else lr_schedule
        self.compute = whole.module
        if precision.mixed:
            self.compute = copy.deepcopy(whole.module).to(precision.compute)
        self.pairs = list(zip(self.compute.parameters(), self.params, strict=True))

    def step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """Train one step on ``(x, y)``; return its mean loss and gradient norm."""
        out = self.precision.for_loss(self.whole.forward(self.compute, x))
        if self.whole.is_hf:  # the ordinary Hugging Face loss: mean token cross-entropy
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        else:
            loss = self.model.loss(out, y) / y.numel()
        self.opt.zero_grad(set_to_none=True)
        self.compute.zero_grad(set_to_none=True)
        loss.backward()
        if self.precision.mixed:  # the bf16 gradients onto the fp32 masters
            for compute, master in self.pairs:
                master.grad = None if compute.grad is None else compute.grad.to(master.dtype)
        params = self.params
        if self.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if self.lr_schedule is not None:
            for group in self.opt.param_groups:
                group["lr"] = float(self.lr_schedule(step))
        self.opt.step()
        if self.scheduler is not None:
            self.scheduler.step()
        if self.precision.mixed:
            with torch.no_grad():
                for compute, master in self.pairs:
                    compute.copy_(master)
        return float(loss.detach()), float(norm)
