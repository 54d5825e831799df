"""The layered-model protocol: what the runtime needs of any model it trains.

A model is ``num_layers`` layers run in order. ``build_layer(i)`` returns layer ``i`` with
its initial parameters, the same values in every process and on every call, so a worker
builds only the layers of its stage and any plan starts from the same model. A stage is
the layers of a contiguous range run in order (:class:`StageModel`): layer 0 takes the
inputs, the last returns the output that ``loss`` takes. The runtime names parameters
``layers.{i}.<name within the layer>``; the names never depend on the plan, so runs
under different plans compare name by name.

``loss(output, targets)`` is SUMMED over the micro-batch's target elements; the runtime
divides by the number of target elements in the whole step, so that the sum over
micro-batches in any grouping is the step's mean.

Optional: ``tied_parameters() -> [((layer, name), (layer, name)), ...]`` declares
parameters that are one tensor in the model but live in two layers (a head tied to the
embedding): each holder keeps a copy, built equal; the runtime sums the two copies'
gradients every step (after the data-parallel reduction), so every optimizer moves both
copies alike and they never differ. The first of a pair is the original: ``params.pt``,
the reference trainer and exports name it alone (:func:`drop_tied_copies`). A parameter
built with ``requires_grad = False`` is frozen: it never gets a gradient and never moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@runtime_checkable
class LayeredModel(Protocol):
    """A model cut into layers, as the runtime trains it."""

    num_layers: int
    """Layers, run in order: layer 0 takes the inputs, the last returns the output."""

    def build_layer(self, index: int) -> nn.Module:
        """Layer ``index`` with its initial parameters, on CPU, in the model's own dtype
        (the runtime casts it to the run's dtype and moves it to the device).

        Deterministic: the same values in every process and on every call.
        """
        ...

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Scalar loss SUMMED over the micro-batch's target elements."""
        ...


TiedPair = tuple[tuple[int, str], tuple[int, str]]
"""``((layer, name), (layer, name))``: the original and its copy."""


def token_cross_entropy_sum(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default loss: token cross-entropy summed over every target token.

    Args:
        output: logits (B, T, V) (or any (..., V)).
        targets: token ids (B, T) (or the matching leading shape), int64.

    Returns:
        A scalar tensor.
    """
    vocab = output.shape[-1]
    return F.cross_entropy(output.reshape(-1, vocab), targets.reshape(-1), reduction="sum")


def param_name(index: int, name: str) -> str:
    """The runtime's name of parameter ``name`` of layer ``index``."""
    return f"layers.{index}.{name}"


def split_param_name(full: str) -> tuple[int, str]:
    """Inverse of :func:`param_name`.

    Raises:
        ValueError: for a name that is not ``layers.{i}.<name>``.
    """
    head, index, *rest = full.split(".", 2)
    if head != "layers" or not index.isdigit() or not rest:
        raise ValueError(f"params: {full!r} is not a runtime parameter name layers.I.NAME")
    return int(index), rest[0]


def tied_parameters(model: Any) -> list[TiedPair]:
    """The model's tied pairs (``[]`` when it declares none), checked for form.

    Raises:
        ValueError: naming ``model`` for a declaration that is not a list of
            ``((layer, name), (layer, name))`` with layers in range, or a parameter tied
            twice.
    """
    fn = getattr(model, "tied_parameters", None)
    if fn is None:
        return []
    pairs = list(fn())
    seen: set[tuple[int, str]] = set()
    out: list[TiedPair] = []
    for pair in pairs:
        try:
            (i, a), (j, b) = pair
        except (TypeError, ValueError):
            raise ValueError(f"model: tied_parameters() gave {pair!r}; expected "
                             "((layer, name), (layer, name))") from None
        for layer, name in ((i, a), (j, b)):
            if (isinstance(layer, bool) or not isinstance(layer, int)
                    or not 0 <= layer < model.num_layers or not isinstance(name, str)):
                raise ValueError(f"model: tied_parameters() names ({layer!r}, {name!r}); "
                                 f"expected a layer in 0..{model.num_layers - 1} and a "
                                 "parameter name")
            if (layer, name) in seen:
                raise ValueError(f"model: tied_parameters() ties layers.{layer}.{name} twice")
            seen.add((layer, name))
        out.append(((i, a), (j, b)))
    return out


def tied_copies(model: Any) -> dict[str, str]:
    """Runtime name of each tied copy -> the runtime name of its original."""
    return {param_name(j, b): param_name(i, a) for (i, a), (j, b) in tied_parameters(model)}


def tied_end_elements(model: Any) -> int:
    """Elements of the parameter the model's first and last layers share (a head tied to
    the embedding): what the planner prices as the profile's ``tied_bytes``. 0 when they
    share none, or when it is frozen (its copies are never summed). Pairs between other
    layers are not priced.
    """
    last = model.num_layers - 1
    for (i, a), (j, _) in tied_parameters(model):
        if {i, j} == {0, last}:
            param = dict(model.build_layer(i).named_parameters()).get(a)
            if param is None or not param.requires_grad:
                return 0
            return int(param.numel())
    return 0


def drop_tied_copies(model: Any, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` without the tied copies: one tensor per model parameter, as
    ``params.pt``, the reference trainer and the exports name them."""
    copies = tied_copies(model)
    return {k: v for k, v in params.items() if k not in copies}


def with_tied_copies(model: Any, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` with every tied copy filled in from its original: the parameters of
    every layer, for loading ``params.pt`` back into the layers."""
    out = dict(params)
    for copy_name, original in tied_copies(model).items():
        if original in out:
            out.setdefault(copy_name, out[original])
    return out


def check_tied_parameters(model: Any) -> None:
    """Build the layers of every tied pair and check that both names exist with the same
    shape, dtype, ``requires_grad`` and initial values.

    Raises:
        ValueError: naming ``model`` for a pair that does not hold.
    """
    for (i, a), (j, b) in tied_parameters(model):
        params = {i: dict(model.build_layer(i).named_parameters())}
        params.setdefault(j, dict(model.build_layer(j).named_parameters()))
        if a not in params[i] or b not in params[j]:
            missing = param_name(i, a) if a not in params[i] else param_name(j, b)
            raise ValueError(f"model: tied parameter {missing} does not exist")
        x, y = params[i][a], params[j][b]
        if (x.shape != y.shape or x.dtype != y.dtype or x.requires_grad != y.requires_grad
                or not torch.equal(x, y)):
            raise ValueError(f"model: tied parameters {param_name(i, a)} and "
                             f"{param_name(j, b)} are not built equal (shape, dtype, "
                             "requires_grad, values)")


class StageModel(nn.Module):
    """The layers one worker holds, run in order; names are ``layers.{i}.<param>``.

    With ``checkpointing`` (``[train] activation_checkpointing = "full"``) each layer keeps
    only its input for the backward and runs its forward again there
    (``torch.utils.checkpoint``, non-reentrant): the same gradients, less memory.
    """

    def __init__(self, checkpointing: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        self.checkpointing = checkpointing

    def indices(self) -> list[int]:
        """Held layer indices, ascending."""
        return sorted(int(k) for k in self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the held layers in order: the model's inputs or the previous stage's output
        in, the next stage's input or the loss's input out."""
        recompute = self.checkpointing and torch.is_grad_enabled()
        for i in self.indices():
            layer = self.layers[str(i)]
            x = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        return x


def build_stage(model: LayeredModel, indices: Iterable[int], *,
                dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> StageModel:
    """A :class:`StageModel` holding freshly built layers ``indices``.

    Args:
        model: the layered model.
        indices: contiguous layer indices.
        dtype: cast floating-point parameters to this dtype (default: the model's own).
        device: move the layers here (default: CPU).
    """
    stage = StageModel()
    for i in indices:
        layer = model.build_layer(i)
        if dtype is not None:
            layer = layer.to(dtype)
        if device is not None:
            layer = layer.to(device)
        stage.layers[str(i)] = layer
    return stage


def initial_params(model: LayeredModel, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every initial parameter by runtime name (builds the layers one at a time)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(model.num_layers):
        layer = model.build_layer(i)
        for name, p in layer.named_parameters():
            out[param_name(i, name)] = p.detach().to(dtype) if dtype else p.detach()
    return out


class _WithDefaultLoss:
    """A user's model object without a ``loss``: token cross-entropy summed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_layers: int = inner.num_layers

    def build_layer(self, index: int) -> nn.Module:
        module: nn.Module = self.inner.build_layer(index)
        return module

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy_sum(output, targets)

    def __getattr__(self, name: str) -> Any:  # export, describe...
        return getattr(self.inner, name)


def check_model(obj: Any, field: str = "model") -> LayeredModel:
    """Check that ``obj`` is a layered model; give it the default loss if it has none.

    Args:
        obj: a user's model object.
        field: the config field or argument named in errors.

    Returns:
        ``obj``, or a thin wrapper adding :func:`token_cross_entropy_sum` as its loss.

    Raises:
        ValueError: naming ``field`` when ``num_layers`` or ``build_layer`` is missing or
            wrong.
    """
    num_layers = getattr(obj, "num_layers", None)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{field}: {type(obj).__name__} needs an integer num_layers >= 1, "
                         f"got {num_layers!r}")
    if not callable(getattr(obj, "build_layer", None)):
        raise ValueError(f"{field}: {type(obj).__name__} has no build_layer(index) method")
    if not callable(getattr(obj, "loss", None)):
        return _WithDefaultLoss(obj)
    model: LayeredModel = obj
    return model


def describe(model: LayeredModel) -> str:
    """One line about the model: its ``describe()`` when it has one."""
    fn: Callable[[], str] | None = getattr(model, "describe", None)
    if fn is not None:
        return fn()
    return f"{type(model).__name__} with {model.num_layers} layers"


def export_model(model: LayeredModel, params: dict[str, torch.Tensor], out_dir: Path) -> bool:
    """Write the trained model in the model's own format, when it has an ``export``.

    Args:
        model: the layered model.
        params: final parameters by runtime name.
        out_dir: the run's output folder (a Hugging Face model writes ``out_dir/hf``).

    Returns:
        Whether the model exported anything.
    """
    fn = getattr(model, "export", None)
    if fn is None:
        return False
    fn(params, Path(out_dir))
    return True


def targets_per_sample(targets: torch.Tensor) -> int:
    """Target elements of one sample (the loss's normaliser is this times the global
    batch): ``T`` for (B, T) tokens, 1 for (B,) labels, ``D`` for (B, D) regression."""
    return int(targets[0].numel()) if targets.dim() > 0 and targets.shape[0] else 0


def to_run(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Move a data tensor to the device; floating-point data takes the run's dtype,
    integer data (token ids, labels) keeps its own."""
    if tensor.is_floating_point():
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)


def probe_outputs(model: LayeredModel, inputs: torch.Tensor,
                  dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every layer's output for ``inputs``: what a stage boundary sends
    and receives. Each layer is built and run on the meta device (no memory, no
    arithmetic); a layer that cannot be built there (weights read from files) is built on
    the CPU, one at a time, and one that cannot run there (some transformers versions
    enter autocast, which meta lacks) runs once on CPU on zeros of the right shape.

    Args:
        model: the layered model.
        inputs: a micro-batch's inputs (only its shape and dtype are used).
        dtype: the run's dtype.

    Returns:
        ``[(shape, dtype)]`` per layer, in order.
    """
    shape = tuple(inputs.shape)
    x_dtype = dtype if inputs.is_floating_point() else inputs.dtype
    out: list[tuple[tuple[int, ...], torch.dtype]] = []
    with torch.no_grad():
        for i in range(model.num_layers):
            try:  # built on meta too: the coordinator never allocates a layer
                with torch.device("meta"):
                    layer = model.build_layer(i).to(dtype)
                y = layer.to("meta")(torch.empty(shape, dtype=x_dtype, device="meta"))
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                layer = model.build_layer(i).to(dtype)
                try:
                    y = layer.to("meta")(torch.empty(shape, dtype=x_dtype, device="meta"))
                except (RuntimeError, NotImplementedError):
                    layer = model.build_layer(i).to(dtype)
                    y = layer(torch.zeros(shape, dtype=x_dtype))
            shape, x_dtype = tuple(y.shape), y.dtype
            out.append((shape, x_dtype))
    return out
