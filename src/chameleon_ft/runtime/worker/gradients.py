"""A worker's gradients between the backward passes and the optimizer: the data-parallel
all-reduce, the tied sum, the global norm and clipping (docs/design.md section 5).

The order is the one plain single-process training has: each layer's gradient summed over
its holders (the all-reduce rounds), each tied copy given the sum of both copies'
gradients, the global norm of the whole model's gradient (every parameter once), and,
when clipping, every gradient scaled by ``min(1, max_norm / (norm + 1e-6))``. Everything
here works on the gradients the optimizer steps (the fp32 masters' under mixed
precision). What to reduce with whom comes from the directive (``runtime.step_sync``).

At ``[job] tp > 1`` (design 4.11) each process holds its shards: the gradients first take
their parameters' placements (``tp_state.settle_grads``, collective over the worker's
ranks), then every reduction runs on each rank's local tensors over its plane (rank ``r``
of every replica holds the same shard), the norm counts sharded gradients whole and
replicated ones once (``tp_state.local_grad_norm_squared``, summed over the worker's
ranks), and the step ends with one all-reduce over the worker's ranks: rank 0 votes only
after every rank reduced.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.runtime.worker.comm import Comm
from chameleon_ft.runtime.worker.memory import peak_resident_bytes
from chameleon_ft.runtime.workload.models import param_name
from chameleon_ft.runtime.workload.optim import (
    LayerTrainState,
    clip_coefficient,
    grad_norm_squared,
)
from chameleon_ft.runtime.workload.tp_layout import local_tensor

REDUCE_CHUNK_BYTES = 8 * 2**20
"""Largest flattened copy of gradients one all-reduce takes (a larger tensor is reduced in
place, alone)."""


def _trainable(state: LayerTrainState) -> Iterator[nn.Parameter]:
    """The parameters the optimizer steps that take gradients (frozen ones never do)."""
    return (p for p in state.master.parameters() if p.requires_grad)


def all_reduce(comm: Comm, rounds: list[list[list[list[int]]]],
               layers: dict[int, LayerTrainState]) -> None:
    """Sum each bucket's gradients over the workers holding its layers, round by round.

    A trainable parameter without a gradient gets a zero one first, so every holder
    contributes the same tensors in the same order; a frozen one (``requires_grad``
    False) takes no part, so no optimizer ever moves it, however many workers hold it.
    A bucket is reduced in chunks of at most ``REDUCE_CHUNK_BYTES`` (as DDP caps its
    buckets): the copy a flattened chunk takes stays small beside the gradients.
    """
    for rnd in rounds:
        for workers, layer_ids in rnd:
            if comm.me not in workers:
                continue
            grads = []
            for i in layer_ids:
                for param in _trainable(layers[i]):
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    grads.append(local_tensor(param.grad))
            if len(workers) == 1 or not grads:
                continue
            for chunk in _chunks(grads):
                _all_reduce_chunk(comm, chunk, tuple(workers))


def _chunks(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """The gradients in consecutive groups of at most ``REDUCE_CHUNK_BYTES`` (a larger
    tensor alone), so that flattening never copies more than that at once."""
    chunk: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if chunk and size + nbytes > REDUCE_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(g)
        size += nbytes
    if chunk:
        yield chunk


def _all_reduce_chunk(comm: Comm, chunk: list[torch.Tensor], members: tuple[int, ...]) -> None:
    if len(chunk) == 1 and chunk[0].is_contiguous():  # in place, no copy
        comm.all_reduce(chunk[0].view(-1), members)
        return
    flat = torch.cat([g.reshape(-1) for g in chunk])
    comm.all_reduce(flat, members)
    offset = 0
    for g in chunk:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _grad_of(param: nn.Parameter) -> torch.Tensor:
    """The parameter's gradient (a zero one if it has none), this rank's part of it."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return local_tensor(param.grad)


def tie_sum(comm: Comm, ties: list[dict[str, Any]], layers: dict[int, LayerTrainState]) -> None:
    """Give each copy of every tied pair the sum of both copies' gradients.

    Args:
        comm: the generation's communication.
        ties: the directive's ``ties`` (``runtime.step_sync.tie_reductions``).
        layers: this worker's layers.
    """
    for tie in ties:
        if comm.me not in tie["members"]:
            continue
        (i, a), (j, b) = tie["pair"]
        here = [layers[i].master.get_parameter(a) if i in layers else None,
                layers[j].master.get_parameter(b) if j in layers else None]
        if not any(p is not None and p.requires_grad for p in here):
            continue  # a frozen pair never moves
        if tie["local"]:  # this worker holds both: the sum is local
            x, y = _grad_of(here[0]), _grad_of(here[1])  # type: ignore[arg-type]
            total = x + y
            x.copy_(total)
            y.copy_(total)
            continue
        first = next(p for p in here if p is not None)
        total = torch.zeros_like(_grad_of(first))
        for param, source in zip(here, tie["sources"], strict=True):
            if param is not None and source == comm.me:
                total += _grad_of(param)
        comm.all_reduce(total, tuple(tie["members"]))
        for param in here:
            if param is not None:
                _grad_of(param).copy_(total)


def partial_norm_squared(me: int, plan: ExecutionPlan, layers: dict[int, LayerTrainState],
                         copies: set[str], tp_rank: int | None = None) -> torch.Tensor:
    """This worker's share of the squared global norm (float64): the gradients of the
    layers it is the lowest-id holder of, tied copies left out (their original counts);
    at ``tp > 1`` (``tp_rank`` given) this rank's part of that share."""
    params = [p for i, state in layers.items() if plan.holders(i)[0] == me
              for name, p in state.master.named_parameters()
              if p.requires_grad and param_name(i, name) not in copies]
    if tp_rank is None:
        return grad_norm_squared(params)
    from chameleon_ft.runtime.workload.tp_state import local_grad_norm_squared

    return local_grad_norm_squared(params, tp_rank)


def clip(comm: Comm, norm: dict[str, Any], partial: torch.Tensor,
         layers: dict[int, LayerTrainState], device: torch.device) -> float:
    """Add up the squared norm over the plan's workers and scale every gradient by the
    clipping factor of its square root.

    Returns:
        The global norm before clipping.
    """
    total = partial.to(device, copy=True)  # the share itself is reported as it is
    if len(norm["members"]) > 1:
        comm.all_reduce(total, tuple(norm["members"]))
    global_norm = total.sqrt()
    factor = clip_coefficient(global_norm.cpu(), norm["clip"]).to(device)
    for state in layers.values():
        for param in _trainable(state):
            if param.grad is not None:
                grad = local_tensor(param.grad)
                grad.mul_(factor.to(grad.dtype))
    return float(global_norm)


@dataclass
class Reduced:
    """What a step's reductions report to the coordinator."""

    norm_squared: float
    """This worker's share of the squared global norm (the coordinator adds them up)."""
    global_norm: float | None
    """The global norm before clipping, when clipping made every worker compute it."""
    rank_peaks: list[int] | None = None
    """At ``tp > 1``: each rank's peak resident memory (bytes), carried by the vote's
    all-reduce (``op_times.jsonl`` reports every rank's)."""


def reduce_step(comm: Comm, directive: dict[str, Any], plan: ExecutionPlan,
                layers: dict[int, LayerTrainState], copies: set[str],
                device: torch.device, tp_rank: int = 0) -> Reduced:
    """Everything between the backward passes and the vote: all-reduce, tied sum, norm,
    clipping.

    Args:
        comm: the generation's communication.
        directive: the generation's directive (``rounds``, ``ties``, ``norm``).
        plan: its plan.
        layers: this worker's layers.
        copies: runtime names of the tied copies (``models.tied_copies``).
        device: where the norm's reduction runs.
        tp_rank: this process's rank in its worker (``comm.tp`` set: ``[job] tp > 1``).

    Raises:
        CommError: when a collective fails (one of DTensor's, settling the gradients,
            raises the ``RuntimeError`` it failed with: the caller turns it into one).
    """
    sharded = comm.tp is not None
    if sharded:
        from chameleon_ft.runtime.workload.tp_state import settle_grads

        for i in sorted(layers):  # every rank in the same order: collectives
            settle_grads(layers[i].master.parameters())
    all_reduce(comm, directive["rounds"], layers)
    tie_sum(comm, directive.get("ties", []), layers)
    partial = partial_norm_squared(comm.me, plan, layers, copies,
                                   tp_rank if sharded else None)
    if sharded:  # the worker's share: every rank's part
        partial = partial.to(device)
        comm.tp_all_reduce(partial, "the norm over the worker's ranks")
        partial = partial.cpu()
    norm = directive.get("norm")
    global_norm = None
    if norm is not None and norm["clip"] > 0:
        global_norm = clip(comm, norm, partial, layers, device)
    peaks = None
    if sharded:  # every rank reduced: rank 0 may vote (each rank's peak memory with it)
        vote = torch.zeros(comm.tp.size(), dtype=torch.float64)
        vote[tp_rank] = float(peak_resident_bytes() or 0)
        vote = vote.to(device)
        comm.tp_all_reduce(vote, "the worker's vote")
        peaks = [int(v) for v in vote.cpu().tolist()]
    return Reduced(float(partial), global_norm, peaks)
