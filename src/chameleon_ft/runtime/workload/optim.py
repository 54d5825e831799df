"""Optimizers per layer: any ``torch.optim`` optimizer, its state moving with its layer.

Every layer has its own optimizer over its own parameters (:class:`LayerTrainState`), built
by an optimizer factory ``params -> torch.optim.Optimizer``. An element-wise optimizer
(SGD, Adam, AdamW, RMSprop...) then updates every parameter exactly as one optimizer over
the whole model would, whatever the split. A layer's state travels as bytes: the module's
and the optimizer's own ``state_dict`` (momentum buffers, moments, step counts, created
lazily by the first step or not yet), so migration, checkpoints and restarts work for any
optimizer. The receiving side rebuilds the layer (``build_layer(i)``), a fresh optimizer
from the same factory, and loads the bytes into both.

An optional learning-rate schedule ``lr_at(step) -> float`` sets every parameter group's
``lr`` before each step; ``[optimizer] schedule`` builds one (:class:`LRSchedule`), the
Python API takes any callable.

Clipping by global norm (``[optimizer] clip_grad_norm``) is torch's own arithmetic spread
over the layers: each holder sums :func:`grad_norm_squared` over the parameters it counts
(every parameter once: one replica per layer, a tied pair once, frozen parameters not at
all), the sums are added up, and every gradient is multiplied by
:func:`clip_coefficient` of the square root. A frozen parameter (``requires_grad =
False``) never moves: :meth:`LayerTrainState.step` drops any gradient it was given.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chameleon_ft.runtime.storage.packing import PackError, pack, unpack
from chameleon_ft.runtime.workload.schedules import LRSchedule
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.optimizer import ScheduleKind

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""Builds an optimizer over one layer's parameters."""
LRScheduleFn = Callable[[int], float]
"""The learning rate of a 0-based step."""

_STATE_FORMAT = 1
_NEEDS_CLOSURE = ("LBFGS",)
"""Optimizers whose ``step`` needs a closure that re-runs the model: not per layer."""


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every optimizer class of ``torch.optim`` by name."""
    out = {}
    for name in dir(torch.optim):
        value = getattr(torch.optim, name)
        if (isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
                and value is not torch.optim.Optimizer):
            out[name] = value
    return out


@dataclass(frozen=True)
class TorchOptimizer:
    """An optimizer factory: ``torch.optim.<name>(params, **kwargs)``. A plain value (it
    pickles, unlike a lambda), so it travels to worker processes."""

    name: str
    kwargs: tuple[tuple[str, Any], ...]

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over ``params``."""
        optimizer: torch.optim.Optimizer = getattr(torch.optim, self.name)(
            params, **dict(self.kwargs))
        return optimizer

    @property
    def lr(self) -> float:
        """The base learning rate."""
        return float(dict(self.kwargs)["lr"])


def optimizer_from_config(config: Config) -> TorchOptimizer:
    """The optimizer factory of ``[optimizer]`` (with the ``[train]`` shorthands), checked
    against the class's signature and by building it once over a dummy parameter.

    ``lr`` and ``weight_decay`` come from ``[optimizer]`` when set there, else from
    ``[train]`` (defaults 1e-3 and 0.0, overriding torch's own defaults);
    ``[train] weight_decay`` is dropped for a class without that argument when it is 0.

    Raises:
        ValueError: one line naming the field: an unknown optimizer or argument, or
            arguments the class rejects.
    """
    spec, train = config.optimizer, config.train
    classes = optimizer_classes()
    cls = classes.get(spec.name)
    if cls is None:
        raise ValueError(f"optimizer.name: unknown optimizer {spec.name!r}; torch.optim has: "
                         f"{', '.join(sorted(classes))}")
    if spec.name in _NEEDS_CLOSURE:
        raise ValueError(f"optimizer.name: {spec.name} needs a closure that re-runs the whole "
                         "model at every step, which a pipeline cannot give it")
    params = inspect.signature(cls.__init__).parameters
    accepts_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    names = [n for n in params if n not in ("self", "params")
             and params[n].kind not in (inspect.Parameter.VAR_KEYWORD,
                                        inspect.Parameter.VAR_POSITIONAL)]
    kwargs = dict(spec.args)
    for key in kwargs:
        if key not in names and not accepts_any:
            raise ValueError(f"optimizer.{key}: not an argument of torch.optim.{spec.name}; "
                             f"its arguments are: {', '.join(names)}")
    kwargs.setdefault("lr", train.lr)
    if "weight_decay" not in kwargs:
        if "weight_decay" in names or accepts_any:
            kwargs["weight_decay"] = train.weight_decay
        elif train.weight_decay != 0:
            raise ValueError(f"train.weight_decay: torch.optim.{spec.name} takes no "
                             "weight_decay; remove it or set it to 0")
    factory = TorchOptimizer(spec.name, tuple(sorted(kwargs.items())))
    try:
        _light(cls)([nn.Parameter(torch.zeros(2, 2))], **kwargs)
    except Exception as exc:  # torch raises ValueError, TypeError or RuntimeError
        raise ValueError(f"optimizer: torch.optim.{spec.name} rejects the arguments "
                         f"{dict(kwargs)}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
                         ) from None
    return factory


def _light(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` with the same checks, built without importing torch's compiler stack.

    ``Optimizer.add_param_group`` is wrapped so that its first call imports
    ``torch._dynamo`` (about 70 MB of resident memory); the coordinator only validates the
    arguments, so this subclass calls the unwrapped checks. Every argument check of the
    class's ``__init__`` still runs. Without the unwrapped function (another torch), the
    class itself.
    """
    raw = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if raw is None:
        return cls

    def add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
        raw(self, param_group)

    return type(f"Checked{cls.__name__}", (cls,), {"add_param_group": add_param_group})


def schedule_from_config(config: Config, base_lr: float | None = None) -> LRSchedule | None:
    """The ``[optimizer]`` schedule, or ``None`` when the rate is constant (the optimizer's
    own ``lr`` is then never touched).

    Args:
        config: the job.
        base_lr: the peak rate (default: the optimizer factory's ``lr``).

    Raises:
        ValueError: naming the ``[optimizer]`` field.
    """
    spec = config.optimizer
    if spec.is_default_schedule():
        return None
    lr = optimizer_from_config(config).lr if base_lr is None else base_lr
    decay = spec.decay_steps or config.train.steps
    if spec.schedule == ScheduleKind.COSINE and decay <= spec.warmup_steps:
        raise ValueError(f"optimizer.decay_steps: {decay} must exceed warmup_steps "
                         f"{spec.warmup_steps}")
    if spec.min_lr > lr:
        raise ValueError(f"optimizer.min_lr: {spec.min_lr} exceeds the learning rate {lr}")
    return LRSchedule(lr=lr, kind=spec.schedule, warmup_steps=spec.warmup_steps,
                      decay_steps=decay, min_lr=spec.min_lr)


CLIP_EPS = 1e-6
"""What ``torch.nn.utils.clip_grad_norm_`` adds to the norm before dividing by it."""


def grad_norm_squared(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """Sum over ``params`` with a gradient of the square of each gradient's 2-norm, in
    float64: a holder's share of the global norm's square (torch computes the global
    norm as the norm of the per-tensor norms)."""
    norms = [torch.linalg.vector_norm(p.grad).to(torch.float64)
             for p in params if p.grad is not None]
    return torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64)


def _dtype_of(module: nn.Module) -> torch.dtype | None:
    """The dtype of the module's first floating-point parameter (None: it has none)."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return None


def _into_master(master: nn.Parameter) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook for a compute parameter: add its gradient to
    ``master``'s, in the master's dtype, and drop it (so micro-batches sum in the master
    dtype)."""

    def hook(param: torch.Tensor) -> None:
        assert param.grad is not None
        grad = param.grad.to(master.dtype)
        if master.grad is None:
            master.grad = grad
        else:
            master.grad.add_(grad)
        param.grad = None

    return hook


def clip_coefficient(total_norm: torch.Tensor | float, max_norm: float) -> torch.Tensor:
    """The factor every gradient is multiplied by when clipping to ``max_norm``:
    ``min(1, max_norm / (total_norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``
    computes it (which multiplies by it even when it is 1)."""
    norm = torch.as_tensor(total_norm, dtype=torch.float64)
    return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)


class LayerTrainState:
    """One layer's module and its optimizer: what moves when the layer moves.

    Under mixed precision (``compute_dtype`` given) the layer exists twice: ``master``,
    the module in the master dtype whose parameters the optimizer steps and whose state
    moves and is checkpointed, and ``module``, a copy in the compute dtype that the stage
    runs. Each compute parameter's gradient is added into its master's gradient (in the
    master dtype) as soon as autograd has accumulated it, and dropped; after each step the
    masters are copied into the compute copy. Without mixed precision ``module`` and
    ``master`` are one object.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                 lr_schedule: LRScheduleFn | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        """Args:
            module: the layer (on its device, in the run's master dtype).
            optimizer: over exactly ``module.parameters()``, in that order.
            lr_schedule: sets every group's ``lr`` before each step; ``None`` keeps it.
            compute_dtype: the dtype the layer computes in, when it differs from its
                parameters' (mixed precision); ``None``: the module itself computes.
        """
        self.master = module
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.module = module
        """What the stage runs (the compute copy under mixed precision)."""
        if compute_dtype is not None and compute_dtype != _dtype_of(module):
            self.module = copy.deepcopy(module).to(compute_dtype)
            masters = dict(module.named_parameters())
            for name, param in self.module.named_parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        _into_master(masters[name]))

    @classmethod
    def create(cls, module: nn.Module, optimizer_factory: OptimizerFactory,
               lr_schedule: LRScheduleFn | None = None,
               compute_dtype: torch.dtype | None = None) -> LayerTrainState:
        """A fresh state: the factory's optimizer over the module's parameters."""
        return cls(module, optimizer_factory(module.parameters()), lr_schedule, compute_dtype)

    @property
    def mixed(self) -> bool:
        """Whether the stage runs a compute copy of the master weights."""
        return self.module is not self.master

    def zero_grad(self) -> None:
        """Drop every gradient (``None``, so unused parameters stay untouched)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.mixed:
            self.module.zero_grad(set_to_none=True)

    def step(self, step_index: int) -> None:
        """Apply the accumulated gradients: set the rate of 0-based step ``step_index``
        from the schedule, then ``optimizer.step()``. Parameters without a gradient are
        left alone (torch.optim skips them); a frozen parameter's gradient (a zero one
        filled in for an all-reduce) is dropped first, so weight decay never moves it.
        Under mixed precision the stepped masters are then copied into the compute copy."""
        for param in self.master.parameters():
            if not param.requires_grad:
                param.grad = None
        if self.lr_schedule is not None:
            lr = float(self.lr_schedule(step_index))
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for compute, master in zip(self.module.parameters(), self.master.parameters(),
                                           strict=True):
                    compute.copy_(master)

    def lr(self, step_index: int) -> float | None:
        """The learning rate step ``step_index`` applies (``None`` when unknown)."""
        if self.lr_schedule is not None:
            return float(self.lr_schedule(step_index))
        groups = self.optimizer.param_groups
        value = groups[0].get("lr") if groups else None
        return float(value) if isinstance(value, int | float) else None

    def state_tree(self) -> dict[str, Any]:
        """What :meth:`to_bytes` packs: the master weights' and the optimizer's
        ``state_dict`` (their tensors are the live ones: copy them to keep a snapshot)."""
        return {"format": _STATE_FORMAT, "module": self.master.state_dict(),
                "optimizer": self.optimizer.state_dict()}

    def to_bytes(self) -> bytes:
        """The module's and the optimizer's ``state_dict``, packed (``runtime.packing``:
        no pickle, device-neutral, and deterministic, so replicas of a layer give the same
        bytes and a migration may take slices of them from several senders)."""
        return pack(self.state_tree())

    @classmethod
    def from_bytes(cls, module: nn.Module, optimizer_factory: OptimizerFactory, data: bytes,
                   lr_schedule: LRScheduleFn | None = None,
                   compute_dtype: torch.dtype | None = None) -> LayerTrainState:
        """Rebuild a state from :meth:`to_bytes` output.

        Args:
            module: the same layer freshly built (``build_layer(i)``), already cast and
                moved to this worker's dtype and device; its values are overwritten.
            optimizer_factory: the same factory that built the sender's optimizer.
            data: the bytes.
            lr_schedule: as for :meth:`create`.
            compute_dtype: as for :meth:`create` (the bytes hold the master weights).

        Raises:
            ValueError: for bytes that do not hold this layer's state.
        """
        try:
            blob = unpack(data)
        except PackError as exc:  # a truncated or foreign payload
            raise ValueError(f"layer state: unreadable payload of {len(data)} bytes: "
                             f"{exc}") from None
        return cls.from_tree(module, optimizer_factory, blob, lr_schedule, compute_dtype)

    @classmethod
    def from_tree(cls, module: nn.Module, optimizer_factory: OptimizerFactory, blob: Any,
                  lr_schedule: LRScheduleFn | None = None,
                  compute_dtype: torch.dtype | None = None) -> LayerTrainState:
        """Rebuild a state from an unpacked :meth:`state_tree` (see :meth:`from_bytes`).

        Raises:
            ValueError: for a tree that does not hold this layer's state.
        """
        if not isinstance(blob, dict) or blob.get("format") != _STATE_FORMAT:
            raise ValueError("layer state: not a layer state payload")
        try:
            module.load_state_dict(blob["module"], strict=True)
        except RuntimeError as exc:
            raise ValueError(f"layer state: does not match the layer: "
                             f"{str(exc).splitlines()[-1].strip()}") from None
        state = cls.create(module, optimizer_factory, lr_schedule, compute_dtype)
        state.optimizer.load_state_dict(blob["optimizer"])
        return state
