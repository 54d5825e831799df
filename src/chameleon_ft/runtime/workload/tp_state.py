"""A sharded layer's training state: as this rank's shard, as the whole layer, and back;
moved onto the next generation's group; its gradients settled to their parameters'
placements; the global gradient norm over sharded and replicated parameters.

A layer sharded by ``tensor_parallel.shard_layer`` holds DTensor parameters (and its
optimizer, built over them, DTensor moments). Its state leaves a process in one of two
forms, both ``LayerTrainState.state_tree``'s shape and packed by ``storage.packing``:

- **this rank's shard** (:func:`local_state_tree`): plain local tensors and a ``shard``
  entry (rank, degree, layout). No communication. What checkpoints store and migration
  moves: rank ``r`` of a group writes and sends shard ``r``, which rank ``r`` of any
  replica holds bit for bit (design 4.11);
- **the whole layer** (:func:`gather_state_tree`): exactly the unsharded layer's tree (one
  all-gather per sharded tensor over the group), for a whole-layer file or a tp-1 reader.

Either loads into a sharded layer at any degree (:func:`load_state_tree`): a tree of this
rank's shard at this degree directly, anything else re-sharded (``tp_layout``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from chameleon_ft.runtime.workload.optim import (
    LayerTrainState,
    LRScheduleFn,
    OptimizerFactory,
)
from chameleon_ft.runtime.workload.tensor_parallel import keep_grads_sharded, shard_layer
from chameleon_ft.runtime.workload.tp_layout import (
    SHARD_KEY,
    LayerLayout,
    TensorLayout,
    chunk_bounds,
    join_state_trees,
    join_tensor,
    shard_header,
    split_state_tree,
)


def _map_tree(tree: Any, fn: Any) -> Any:
    """``tree`` with every tensor replaced by ``fn(tensor)`` (containers rebuilt)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tree(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tree(v, fn) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_map_tree(v, fn) for v in tree)
    return tree


def local_state_tree(state: LayerTrainState, layout: LayerLayout,
                     mesh: DeviceMesh | tuple[int, int]) -> dict[str, Any]:
    """This rank's shard of a sharded layer's state (master weights and optimizer state),
    as plain tensors with its ``shard`` entry. No communication.

    Args:
        state: the sharded layer's state.
        layout: its layout (``shard_layer``'s answer).
        mesh: the worker's tensor-parallel mesh, or this rank's ``(rank, degree)`` (the
            state's group may be gone: a worker writes its final shards after its last
            generation's groups were closed).
    """
    tree: dict[str, Any] = _map_tree(
        state.state_tree(), lambda t: t.to_local() if isinstance(t, DTensor) else t)
    rank, degree = mesh if isinstance(mesh, tuple) else (mesh.get_local_rank(), mesh.size())
    tree[SHARD_KEY] = {"rank": rank, "degree": degree, "layout": layout.to_json()}
    return tree


def whole_tensor(value: torch.Tensor, spec: TensorLayout) -> torch.Tensor:
    """The whole tensor of a DTensor (an all-gather over its mesh), fused parts put back
    in order; a plain tensor is replicated and returned as it is."""
    if not isinstance(value, DTensor):
        return value
    full = value.full_tensor()
    if spec.dim is None or not spec.parts:
        return full
    degree = value.device_mesh.size()
    bounds = [chunk_bounds(full.shape[spec.dim], degree, r) for r in range(degree)]
    return join_tensor([full.narrow(spec.dim, a, b - a) for a, b in bounds], spec)


def gather_state_tree(state: LayerTrainState, layout: LayerLayout) -> dict[str, Any]:
    """The whole layer's state tree, equal to the unsharded layer's
    (``LayerTrainState.state_tree``). Collective: every rank of the group calls it.

    Args:
        state: the sharded layer's state.
        layout: its layout.
    """
    tree = state.state_tree()
    module = {name: whole_tensor(value, layout.of(name)) for name, value in tree["module"].items()}
    opt = tree["optimizer"]
    states = {}
    for index, entries in opt.get("state", {}).items():
        spec = layout.of(layout.params[int(index)])
        states[index] = {k: whole_tensor(v, spec) if isinstance(v, torch.Tensor) else v
                         for k, v in entries.items()}
    return {**tree, "module": module, "optimizer": {**opt, "state": states}}


def create_state(module: nn.Module, optimizer_factory: OptimizerFactory,
                 lr_schedule: LRScheduleFn | None = None,
                 compute_dtype: torch.dtype | None = None) -> LayerTrainState:
    """``LayerTrainState.create`` for a sharded layer: under mixed precision the compute
    copy's sharded gradients keep to their shards too (``keep_grads_sharded``)."""
    state = LayerTrainState.create(module, optimizer_factory, lr_schedule, compute_dtype)
    if state.mixed:
        keep_grads_sharded(state.module)
    return state


def _as_shard(trees: Sequence[Mapping[str, Any]], layout: LayerLayout,
              mesh: DeviceMesh) -> dict[str, Any]:
    """This rank's shard tree from ``trees``: its own shard at this degree as it is,
    otherwise the layer joined (a whole tree, or every shard at another degree) and
    split for this rank."""
    rank, degree = mesh.get_local_rank(), mesh.size()
    header = shard_header(trees[0]) if len(trees) == 1 else None
    if header is not None and header[:2] == (rank, degree):
        if header[2] != layout:
            raise ValueError("layer state: the shard's layout is not this layer's")
        return dict(trees[0])
    return split_state_tree(join_state_trees(trees), layout, degree, rank)


def _to_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A local shard as a tensor like ``param`` (a DTensor with its placements)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def _load_module(module: nn.Module, local: Mapping[str, torch.Tensor]) -> None:
    """Copy each local shard into the module's tensor of that name."""
    own = module.state_dict(keep_vars=True)
    if set(own) != set(local):
        missing = sorted(set(own) ^ set(local))
        raise ValueError(f"layer state: does not match the layer: {missing[0]!r} "
                         "missing or unexpected")
    with torch.no_grad():
        for name, target in own.items():
            into = target.to_local() if isinstance(target, DTensor) else target
            if into.shape != local[name].shape:
                raise ValueError(f"layer state: {name} has shape "
                                 f"{tuple(local[name].shape)}, the shard {tuple(into.shape)}")
            into.copy_(local[name])


def load_state_tree(module: nn.Module, layout: LayerLayout, mesh: DeviceMesh,
                    trees: Sequence[Mapping[str, Any]], optimizer_factory: OptimizerFactory,
                    lr_schedule: LRScheduleFn | None = None,
                    compute_dtype: torch.dtype | None = None) -> LayerTrainState:
    """A sharded layer's state from stored trees: ``LayerTrainState.from_bytes`` for
    tensor parallelism. No communication.

    Args:
        module: the layer freshly built and sharded (``shard_layer``), in the run's dtype
            on this rank's device; its values are overwritten.
        layout: its layout.
        mesh: the worker's tensor-parallel mesh.
        trees: unpacked state trees: this rank's shard at this degree; or the whole layer;
            or every shard of the layer at any degree (re-sharded here).
        optimizer_factory: the factory that built the writer's optimizer.
        lr_schedule: as for ``LayerTrainState.create``.
        compute_dtype: as for ``LayerTrainState.create``.

    Raises:
        ValueError: for trees that do not hold this layer's state.
    """
    tree = _as_shard(trees, layout, mesh)
    _load_module(module, tree["module"])  # before the compute copy is made from it
    state = create_state(module, optimizer_factory, lr_schedule, compute_dtype)
    params = list(state.master.parameters())
    saved = tree["optimizer"]
    states = {}
    for index, entries in saved.get("state", {}).items():
        param = params[int(index)]
        states[index] = {
            k: _to_param(v, param) if isinstance(v, torch.Tensor) and v.dim() else v
            for k, v in entries.items()}
    state.optimizer.load_state_dict({**saved, "state": states})
    return state


def rebind_state(model: Any, index: int, state: LayerTrainState, layout: LayerLayout,
                 mesh: DeviceMesh, optimizer_factory: OptimizerFactory,
                 lr_schedule: LRScheduleFn | None = None,
                 compute_dtype: torch.dtype | None = None) -> LayerTrainState:
    """Layer ``index``'s state moved onto ``mesh``, a new group over the same ranks (the
    next generation's tensor-parallel group: communicators are rebuilt, never patched, and
    a DTensor keeps the mesh it was made on). The layer is built and sharded again and
    takes this rank's shard of ``state``. No communication.

    Raises:
        ValueError: when the new mesh's rank or size differ from the old one's.
    """
    tree = local_state_tree(state, layout, mesh)
    first = next(state.master.parameters())
    layer = model.build_layer(index).to(dtype=first.dtype, device=first.device)
    if shard_layer(model, index, layer, mesh) != layout:
        raise ValueError("layer state: the new mesh shards the layer another way")
    return load_state_tree(layer, layout, mesh, [tree], optimizer_factory, lr_schedule,
                           compute_dtype)


# ---------------------------------------------------------------------------- gradients
def settle_grads(params: Iterable[nn.Parameter]) -> None:
    """Give every gradient its parameter's placements, after the step's last backward and
    before the data-parallel reduction, the tied sum and the norm.

    DTensor's backward leaves a replicated parameter used on sequence shards (a norm's
    weight) with a partial gradient (each rank's tokens' share: one all-reduce over the
    group, once per step however many micro-batches accumulated), and a vocabulary-parallel
    embedding with its whole gradient on every rank (each keeps its rows: no
    communication). Afterwards rank ``r`` of every replica holds the same part of every
    gradient, so the data-parallel all-reduce and the tied sums run on local tensors.
    Collective: every rank of the group calls it with its layers' parameters in the same
    order.
    """
    for p in params:
        grad = p.grad
        if isinstance(p, DTensor) and isinstance(grad, DTensor) \
                and tuple(grad.placements) != tuple(p.placements):
            p.grad = grad.redistribute(p.device_mesh, p.placements)


# ---------------------------------------------------------------------------- the norm
def _counted_once(grad: torch.Tensor) -> bool:
    """Whether every rank holds this gradient whole (replicated), so one rank counts it."""
    if not isinstance(grad, DTensor):
        return True
    return not any(p.is_shard() for p in grad.placements)


def local_grad_norm_squared(params: Iterable[nn.Parameter], tp_rank: int) -> torch.Tensor:
    """This rank's share of the global gradient norm's square, in float64: the squares of
    its shards of sharded gradients, and, on tensor-parallel rank 0 only, of the
    replicated ones. Summed over the group (and the plan's other workers), it is the
    unsharded model's ``grad_norm_squared``: sharded parameters counted whole, replicated
    ones once.

    Args:
        params: the parameters this worker counts (one replica of each layer, a tied
            pair once, as at tp 1).
        tp_rank: this rank's index in its tensor-parallel group.
    """
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        grad = p.grad
        if grad is None or (_counted_once(grad) and tp_rank != 0):
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local.numel():
            total = total + torch.linalg.vector_norm(local).to(torch.float64).cpu().square()
    return total


def scale_grads(params: Iterable[nn.Parameter], factor: torch.Tensor | float) -> None:
    """Multiply every gradient by ``factor`` in place (clipping), each rank its shards."""
    value = float(factor)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.mul_(value)
