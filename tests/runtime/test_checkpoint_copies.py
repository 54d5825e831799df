"""The host copies a worker writes its checkpoints from."""

from __future__ import annotations

from typing import Any

import torch


def test_checkpoint_copies_reuse_their_host_buffers() -> None:
    """The snapshot a checkpoint writes from is a copy (later training does not change it),
    made into the same host buffers at the next checkpoint of the same layers."""
    from chameleon_ft.runtime.worker.checkpoints import HostBuffers
    from chameleon_ft.runtime.workload.optim import LayerTrainState

    layer, state = _trained_layer()
    host = HostBuffers()
    first = host.snapshot(5, state)
    ptrs = sorted(t.data_ptr() for t in _tensors(first))
    saved = [t.clone() for t in _tensors(first)]
    with torch.no_grad():
        layer.weight.add_(1.0)  # training goes on: the copy keeps the committed values
    assert all(torch.equal(a, b) for a, b in zip(_tensors(first), saved, strict=True))
    second = host.snapshot(5, state)
    assert sorted(t.data_ptr() for t in _tensors(second)) == ptrs  # the same buffers
    assert any(not torch.equal(a, b) for a, b in zip(_tensors(second), saved, strict=True))
    host.keep_only({6})
    assert host.arenas == {}
    other = torch.nn.Linear(4, 5)  # another shape under the same layer index: new buffers
    third = host.snapshot(5, LayerTrainState.create(
        other, lambda p: torch.optim.AdamW(p, lr=0.1), None))
    assert not set(t.data_ptr() for t in _tensors(third)) & set(ptrs)


def _trained_layer() -> tuple[torch.nn.Linear, Any]:
    """A layer and its training state after one AdamW step (moments exist)."""
    from chameleon_ft.runtime.workload.optim import LayerTrainState

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    state = LayerTrainState.create(layer, lambda p: torch.optim.AdamW(p, lr=0.1), None)
    layer(torch.randn(2, 4)).sum().backward()
    state.optimizer.step()
    return layer, state


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return []


def test_memory_reserved_ahead_is_the_memory_the_checkpoint_copies_into() -> None:
    """A generation's first commit allocates its checkpoint memory ahead (in the
    background): the first checkpoint then copies into it, allocating nothing."""
    from chameleon_ft.runtime.worker.checkpoints import (
        CheckpointIO,
        HostBuffers,
        _tensor_paths,
        layout_of,
    )

    _, state = _trained_layer()
    host = HostBuffers()
    arena = host.reserve(2, layout_of(_tensor_paths(state.state_tree())))
    copy = host.snapshot(2, state)
    assert host.arenas[2] is arena
    assert {t.data_ptr() for t in _tensors(copy)} <= {v.data_ptr() for v in arena.views.values()}
    io = CheckpointIO(0, None, None, lambda: None)  # type: ignore[arg-type]
    io.host.arenas[7] = arena  # a layer this worker no longer writes: released
    io.reserve_async({2: state})
    assert io.wait(10.0)
    assert set(io.host.arenas) == {2} and io.host.arenas[2].layout == arena.layout
    assert io.host.arenas[2].touched  # its pages mapped in ahead of the copy
