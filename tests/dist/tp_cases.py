"""What each rank of a tensor-parallel test runs (``tp_harness.run_ranks``): the same
layers whole and sharded, side by side in one process, compared after the forward, the
backward and a few clipped AdamW steps; the state as shards and whole."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from chameleon_ft.runtime.storage.packing import pack, unpack
from chameleon_ft.runtime.workload.models import StageModel, tied_parameters
from chameleon_ft.runtime.workload.models.gpt import GPTModel
from chameleon_ft.runtime.workload.models.gpt_layers import GPTShape
from chameleon_ft.runtime.workload.optim import LayerTrainState, TorchOptimizer, clip_coefficient
from chameleon_ft.runtime.workload.tensor_parallel import (
    TensorParallelStage,
    boundary_shape,
    check_tensor_parallel,
    shard_layer,
    tensor_parallel_mesh,
)
from chameleon_ft.runtime.workload.tp_layout import (
    LayerLayout,
    join_state_trees,
    split_state_tree,
)
from chameleon_ft.runtime.workload.tp_state import (
    gather_state_tree,
    load_state_tree,
    local_grad_norm_squared,
    rebind_state,
    local_state_tree,
    create_state,
    scale_grads,
    settle_grads,
    whole_tensor,
)

ADAMW = TorchOptimizer("AdamW", (("betas", (0.9, 0.95)), ("lr", 3e-2), ("weight_decay", 0.1)))
"""Large steps, so a wrong update shows."""
MICRO_BATCH = 2
_GENERATIONS: list[int] = []
"""The generations this process rebound layers to (a family after another, as a worker's
generations follow each other)."""


def first_mesh() -> DeviceMesh:
    """The mesh of generation 0, over the whole (default) group."""
    assert dist.group.WORLD is not None
    return tensor_parallel_mesh(dist.group.WORLD, "cpu", generation=0)


def build_model(family: str) -> Any:
    """The tiny model of ``family``: ``gpt`` (vocab 256, 2 blocks of 4 heads) or a
    Hugging Face family of ``hf_families``."""
    if family == "gpt":
        return GPTModel(GPTShape(num_blocks=2, hidden_size=32, num_heads=4, vocab_size=256,
                                 seq_len=16, ffn_size=64), seed=3)
    from hf_families import family_config

    from chameleon_ft.runtime.workload.models.hf import HFCausalLM
    return HFCausalLM(family_config(family), seed=3)


def seq_len_of(model: Any) -> int:
    return int(model.shape.seq_len) if isinstance(model, GPTModel) else 12


def _batch(model: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    vocab = model.shape.vocab_size if isinstance(model, GPTModel) else model.vocab_size
    ids = torch.randint(vocab, (MICRO_BATCH, seq_len_of(model) + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


class Pair:
    """The model's layers twice, whole and sharded over the group, each with its optimizer;
    the sharded ones run as two pipeline stages joined by a sequence-sharded boundary."""

    def __init__(self, model: Any, mesh: DeviceMesh, dtype: torch.dtype,
                 compute_dtype: torch.dtype | None = None, *, frozen: tuple[int, ...] = (),
                 checkpointing: bool = False) -> None:
        self.model, self.mesh, self.checkpointing = model, mesh, checkpointing
        n = model.num_layers
        self.whole = [LayerTrainState.create(self._build(i, dtype, frozen), ADAMW,
                                             compute_dtype=compute_dtype) for i in range(n)]
        self.layouts: list[LayerLayout] = []
        self.sharded: list[LayerTrainState] = []
        for i in range(n):
            layer = self._build(i, dtype, frozen)
            self.layouts.append(shard_layer(model, i, layer, mesh))
            self.sharded.append(create_state(layer, ADAMW, compute_dtype=compute_dtype))
        self.cut = n // 2  # stage 0 holds layers 0..cut-1

    def _build(self, index: int, dtype: torch.dtype, frozen: tuple[int, ...]) -> nn.Module:
        layer: nn.Module = self.model.build_layer(index).to(dtype)
        if index in frozen:
            layer.requires_grad_(False)
        return layer

    def _stage(self, states: list[LayerTrainState], indices: range) -> StageModel:
        stage = StageModel(checkpointing=self.checkpointing and states is self.sharded)
        for i in indices:
            stage.layers[str(i)] = states[i].module
        return stage

    def forward_backward(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """One micro-batch through both: (sharded logits, whole logits, their losses)."""
        inputs, targets = _batch(self.model, step)
        n, tokens = self.model.num_layers, targets.numel()
        first = TensorParallelStage(self._stage(self.sharded, range(self.cut)), self.mesh,
                                    holds_input=True)
        second = TensorParallelStage(self._stage(self.sharded, range(self.cut, n)), self.mesh,
                                     holds_input=False)
        boundary = first(inputs)  # this rank's (B, T/k, H)
        received = boundary.detach().requires_grad_(True)
        logits = second(received)
        loss = self.model.loss(logits.float(), targets) / tokens
        loss.backward()
        assert received.grad is not None
        boundary.backward(received.grad)  # the gradient the next stage sent back
        self.whole_shard_grads = [  # a sharded parameter's gradient holding more than its shard
            name for state in self.sharded for name, p in state.master.named_parameters()
            if isinstance(p.grad, DTensor) and any(x.is_shard() for x in p.placements)
            and p.grad.placements != p.placements]
        for state in self.sharded:
            settle_grads(state.master.parameters())
        whole_logits = self._stage(self.whole, range(n))(inputs)
        whole_loss = self.model.loss(whole_logits.float(), targets) / tokens
        whole_loss.backward()
        return logits, whole_logits, float(loss.detach()), float(whole_loss.detach())

    def tied(self, states: list[LayerTrainState]) -> None:
        """Sum each tied pair's gradients (both copies in this process)."""
        for (i, a), (j, b) in tied_parameters(self.model):
            ga = states[i].master.get_parameter(a).grad
            gb = states[j].master.get_parameter(b).grad
            assert ga is not None and gb is not None
            total = ga + gb
            ga.copy_(total)
            gb.copy_(total)

    def counted(self, states: list[LayerTrainState]) -> list[nn.Parameter]:
        """The parameters the norm counts: a tied pair's copy left out."""
        copies = {(j, b) for _, (j, b) in tied_parameters(self.model)}
        return [p for i, s in enumerate(states) for name, p in s.master.named_parameters()
                if (i, name) not in copies]

    def clip_and_step(self, step: int, max_norm: float) -> tuple[float, float]:
        """Tied sums, clipping by the global norm on both, an optimizer step; the norms."""
        self.tied(self.whole)
        self.tied(self.sharded)
        # torch's own clipping over the model's parameters (a tied pair once); the copy
        # takes the same factor as its original
        whole = torch.nn.utils.clip_grad_norm_(self.counted(self.whole), max_norm)
        coefficient = clip_coefficient(whole, max_norm)
        for (_, _), (j, b) in tied_parameters(self.model):
            grad = self.whole[j].master.get_parameter(b).grad
            assert grad is not None
            grad.mul_(coefficient)
        squared = local_grad_norm_squared(self.counted(self.sharded), self.mesh.get_local_rank())
        dist.all_reduce(squared)
        norm = math.sqrt(float(squared))
        for s in self.sharded:
            scale_grads(s.master.parameters(), clip_coefficient(norm, max_norm))
        for s in self.whole + self.sharded:
            s.step(step)
            s.zero_grad()
        return norm, float(whole)


def max_tree_diff(a: Any, b: Any) -> float:
    """Largest difference between two state trees' tensors (structure must match)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, (a.shape, b.shape)
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), (list(a), list(b))
        return max([max_tree_diff(a[k], b[k]) for k in a], default=0.0)
    if isinstance(a, list | tuple):
        assert len(a) == len(b)
        return max([max_tree_diff(x, y) for x, y in zip(a, b, strict=True)], default=0.0)
    assert a == b, (a, b)
    return 0.0


def train_side_by_side(rank: int, world: int, family: str, steps: int, max_norm: float,
                       **options: Any) -> dict[str, Any]:
    """float64: forward, gradients and ``steps`` clipped AdamW steps, sharded against
    whole; returns the largest differences and what the checks saw. ``options`` go to
    :class:`Pair` (frozen layers, activation checkpointing on the sharded side)."""
    mesh = first_mesh()
    model = build_model(family)
    check_tensor_parallel(model, world, seq_len_of(model))
    pair = Pair(model, mesh, torch.float64, **options)
    initial = [_gathered_params(s, layout) for s, layout in zip(pair.sharded, pair.layouts,
                                                                 strict=True)]
    out: dict[str, Any] = {"logits": 0.0, "grads": 0.0, "norm": 0.0, "state": 0.0,
                           "clipped": 0}
    for step in range(steps):
        logits, whole_logits, _, _ = pair.forward_backward(step)
        out["logits"] = max(out["logits"], float((logits - whole_logits).abs().max()))
        for sharded, whole, layout in zip(pair.sharded, pair.whole, pair.layouts, strict=True):
            grads = _gathered_grads(sharded, layout)
            assert set(grads) == {n for n, p in whole.master.named_parameters()
                                  if p.grad is not None}  # frozen ones have none on both
            for name, p in whole.master.named_parameters():
                if p.grad is not None:
                    out["grads"] = max(out["grads"],
                                       float((grads[name] - p.grad).abs().max()))
        out["whole_shard_grads"] = pair.whole_shard_grads
        norm, whole_norm = pair.clip_and_step(step, max_norm)
        out["norm"] = max(out["norm"], abs(norm - whole_norm))
        out["clipped"] += int(whole_norm > max_norm)
    for sharded, whole, layout in zip(pair.sharded, pair.whole, pair.layouts, strict=True):
        out["state"] = max(out["state"], max_tree_diff(gather_state_tree(sharded, layout),
                                                       whole.state_tree()))
    out["boundary"] = list(boundary_shape((MICRO_BATCH, seq_len_of(model), 32), world))
    out["frozen_moved"] = [i for i in options.get("frozen", ())
                           if max_tree_diff(_gathered_params(pair.sharded[i], pair.layouts[i]),
                                            initial[i]) != 0.0]
    return out


def _gathered_params(state: LayerTrainState, layout: LayerLayout) -> dict[str, torch.Tensor]:
    return {name: whole_tensor(p.detach(), layout.of(name)).clone()
            for name, p in state.master.named_parameters()}


def family_checks(rank: int, world: int, families: list[str], steps: int,
                  max_norm: float) -> dict[str, dict[str, Any]]:
    """:func:`train_side_by_side` and :func:`state_round_trips` for each family, in one
    group (the processes start once)."""
    return {f: {**train_side_by_side(rank, world, f, steps, max_norm),
                **state_round_trips(rank, world, f)} for f in families}


def _gathered_grads(state: LayerTrainState, layout: LayerLayout) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (through the state tree's own gather)."""
    return {name: whole_tensor(p.grad, layout.of(name))
            for name, p in state.master.named_parameters() if p.grad is not None}


def state_round_trips(rank: int, world: int, family: str) -> dict[str, Any]:
    """A trained sharded layer's state: shard -> whole -> shard is exact; the whole tree
    split and joined again is exact; packed bytes of a shard load into a fresh sharded
    layer and the next step equals; a whole tree loads at this degree."""
    mesh = first_mesh()
    model = build_model(family)
    pair = Pair(model, mesh, torch.float64)
    pair.forward_backward(0)
    pair.clip_and_step(0, 1.0)
    out: dict[str, Any] = {"exact": True, "loaded": 0.0}
    for i, (state, layout) in enumerate(zip(pair.sharded, pair.layouts, strict=True)):
        local = local_state_tree(state, layout, mesh)
        whole = gather_state_tree(state, layout)
        again = split_state_tree(whole, layout, world, rank)
        shards = [split_state_tree(whole, layout, world, r) for r in range(world)]
        out["exact"] &= (max_tree_diff(local, again) == 0.0
                         and max_tree_diff(join_state_trees(shards[::-1]), whole) == 0.0)
        fresh = model.build_layer(i).to(torch.float64)
        layout_again = shard_layer(model, i, fresh, mesh)
        assert layout_again == layout
        source = unpack(pack(local)) if i % 2 else whole  # a shard's bytes, or the whole
        pair.sharded[i] = load_state_tree(fresh, layout, mesh, [source], ADAMW)
    # the next generation's group: every layer rebound to a mesh over a new group
    group = dist.new_group(list(range(world)))
    _GENERATIONS.append(len(_GENERATIONS) + 1)  # a generation's number is never reused
    next_mesh = tensor_parallel_mesh(group, "cpu", generation=_GENERATIONS[-1])
    for i, layout in enumerate(pair.layouts):
        pair.sharded[i] = rebind_state(model, i, pair.sharded[i], layout, next_mesh, ADAMW)
    pair.mesh = next_mesh
    out["rebound"] = all(p.device_mesh.get_group().group_name == group.group_name
                         for s in pair.sharded
                         for p in s.master.parameters() if isinstance(p, DTensor))
    pair.forward_backward(1)
    pair.clip_and_step(1, 1.0)
    for sharded, whole, layout in zip(pair.sharded, pair.whole, pair.layouts, strict=True):
        out["loaded"] = max(out["loaded"], max_tree_diff(gather_state_tree(sharded, layout),
                                                         whole.state_tree()))
    return out


def train_bf16(rank: int, world: int, family: str, steps: int) -> dict[str, Any]:
    """bf16 compute from fp32 masters, sharded against whole: every step's loss."""
    mesh = first_mesh()
    model = build_model(family)
    pair = Pair(model, mesh, torch.float32, compute_dtype=torch.bfloat16)
    losses: list[tuple[float, float]] = []
    for step in range(steps):
        _, _, loss, whole_loss = pair.forward_backward(step)
        assert not pair.whole_shard_grads, pair.whole_shard_grads
        pair.clip_and_step(step, 1.0)
        losses.append((loss, whole_loss))
    return {"losses": losses}
