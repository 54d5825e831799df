"""How one worker process makes, loads, packs and stores its layers: whole without tensor
parallelism, this rank's shard with it (design 4.11).

At ``[job] tp = k`` each rank builds a layer whole (deterministic: the same values on
every rank) and keeps its shard (``workload.tensor_parallel.shard_layer``) on the
generation's mesh. What leaves the process is always this rank's own part: a migration
sends its shard's packed tree to its counterpart rank, a checkpoint stores it as one of
the layer's ``k`` files. What arrives may be a shard at this degree, every shard at
another, or a whole layer (a checkpoint written at another ``tp``): it is joined and split
for this rank (``tp_state.load_state_tree``). A generation rebuilds the worker's group, so
each held layer moves onto the new mesh before it computes again (:meth:`Layers.rebind`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from chameleon_ft.runtime.storage.packing import PackError, pack, unpack
from chameleon_ft.runtime.workload.models import StageModel
from chameleon_ft.runtime.workload.optim import LayerTrainState, LRScheduleFn, OptimizerFactory
from chameleon_ft.runtime.workload.precision import Precision
from chameleon_ft.runtime.workload.tp_layout import LayerLayout, join_state_trees

Shard = tuple[int, int]
"""``(rank, degree)`` of a process of a tensor-parallel worker."""


def _unpacked(data: bytes) -> Any:
    try:
        return unpack(data)
    except PackError as exc:  # a truncated or foreign payload
        raise ValueError(f"layer state: unreadable payload of {len(data)} bytes: "
                         f"{exc}") from None


class _Stored:
    """A layer's state as this rank stores and sends it (its shard, with the ``shard``
    entry): what ``worker.checkpoints`` snapshots."""

    def __init__(self, state: LayerTrainState, layers: Layers, index: int) -> None:
        self.state, self.layers, self.index = state, layers, index
        self.module = state.module

    def state_tree(self) -> dict[str, Any]:
        return self.layers.tree(self.index, self.state)


class Layers:
    """This process's way with layers.

    Args:
        model: the layered model.
        precision: the run's numerics.
        device: the worker's device.
        optimizer: the optimizer factory.
        lr_schedule: the learning-rate schedule, if any.
        shard: ``(rank, degree)`` at ``tp > 1``; None without tensor parallelism.
    """

    def __init__(self, model: Any, precision: Precision, device: torch.device,
                 optimizer: OptimizerFactory, lr_schedule: LRScheduleFn | None,
                 shard: Shard | None = None) -> None:
        self.model, self.precision, self.device = model, precision, device
        self.optimizer, self.lr_schedule = optimizer, lr_schedule
        self.shard = shard
        self.mesh: Any = None
        """The current generation's mesh over the worker's ranks (``shard`` only)."""
        self.layouts: dict[int, LayerLayout] = {}
        """Each sharded layer's layout (the same in every generation)."""

    def module(self, index: int) -> nn.Module:
        """Layer ``index`` with its initial parameters, in the master dtype, on the
        device, whole."""
        module: nn.Module = self.model.build_layer(index).to(self.precision.master)
        return module.to(self.device)

    def _sharded(self, index: int) -> nn.Module:
        from chameleon_ft.runtime.workload.tensor_parallel import shard_layer

        module = self.module(index)
        self.layouts[index] = shard_layer(self.model, index, module, self.mesh)
        return module

    def new(self, index: int) -> LayerTrainState:
        """Layer ``index`` with its initial parameters and a fresh optimizer."""
        compute = self.precision.compute_if_mixed
        if self.shard is None:
            return LayerTrainState.create(self.module(index), self.optimizer,
                                          self.lr_schedule, compute)
        from chameleon_ft.runtime.workload.tp_state import create_state

        return create_state(self._sharded(index), self.optimizer, self.lr_schedule, compute)

    def from_trees(self, index: int, blobs: Sequence[bytes]) -> LayerTrainState:
        """Layer ``index`` from stored states: this process's own part, every shard of the
        layer (any degree), or the whole layer.

        Raises:
            ValueError: for bytes that do not hold this layer's state.
        """
        trees = [_unpacked(b) for b in blobs]
        compute = self.precision.compute_if_mixed
        if self.shard is None:
            tree = join_state_trees(trees)
            return LayerTrainState.from_tree(self.module(index), self.optimizer, tree,
                                             self.lr_schedule, compute)
        from chameleon_ft.runtime.workload.tp_state import load_state_tree

        module = self._sharded(index)
        return load_state_tree(module, self.layouts[index], self.mesh, trees, self.optimizer,
                               self.lr_schedule, compute)

    def tree(self, index: int, state: LayerTrainState) -> dict[str, Any]:
        """What this process stores and sends of a layer: its state tree, or this rank's
        shard of it."""
        if self.shard is None:
            return state.state_tree()
        from chameleon_ft.runtime.workload.tp_state import local_state_tree

        return local_state_tree(state, self.layouts[index], self.shard)

    def to_bytes(self, index: int, state: LayerTrainState) -> bytes:
        """:meth:`tree`, packed (a migration's payload)."""
        return pack(self.tree(index, state))

    def stored(self, states: dict[int, LayerTrainState]) -> dict[int, Any]:
        """The layers as a checkpoint takes them (their ``state_tree`` is :meth:`tree`)."""
        if self.shard is None:
            return dict(states)
        return {i: _Stored(state, self, i) for i, state in states.items()}

    def rebind(self, mesh: Any, layers: dict[int, LayerTrainState]
               ) -> dict[int, LayerTrainState]:
        """Make ``mesh`` (a new generation's) current and move ``layers`` onto it (no
        communication); without tensor parallelism, ``layers`` as they are."""
        if self.shard is None:
            return layers
        from torch.distributed.tensor import DTensor

        from chameleon_ft.runtime.workload.tp_state import rebind_state

        self.mesh = mesh
        out = {}
        for i, state in layers.items():
            first = next(iter(state.master.parameters()), None)
            if isinstance(first, DTensor) and first.device_mesh is mesh:
                out[i] = state
                continue
            out[i] = rebind_state(self.model, i, state, self.layouts[i], mesh,
                                  self.optimizer, self.lr_schedule,
                                  self.precision.compute_if_mixed)
        return out

    def runner(self, stage: StageModel) -> nn.Module:
        """What the executor runs for a stage: the stage itself, or the stage behind
        ``TensorParallelStage`` (local tensors in and out)."""
        if self.shard is None:
            return stage
        from chameleon_ft.runtime.workload.tensor_parallel import TensorParallelStage

        held = stage.indices()
        return TensorParallelStage(stage, self.mesh, holds_input=bool(held) and held[0] == 0)
