"""An in-process data x pipeline parallel trainer with the runtime's arithmetic.

Pipelines hold their own replicas of contiguous layer ranges (stages); each micro-batch
runs forward stage by stage with the activation detached at every boundary (what a send
and a receive do), the last stage's summed loss is divided by the step's global count of
target elements, gradients flow back boundary by boundary; then every layer's gradient is
summed over its replicas (the all-reduce), the two copies of each tied pair get the sum of
their gradients, the gradients are clipped by their global norm (each parameter counted
once), and each replica's per-layer optimizer steps. What the runtime's worker must do,
without processes: the oracle tests compare it with the single-process reference trainer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from chameleon_ft.runtime.workload.data import DataSource
from chameleon_ft.runtime.workload.models import (
    LayeredModel,
    drop_tied_copies,
    param_name,
    targets_per_sample,
    tied_copies,
    tied_parameters,
    to_run,
)
from chameleon_ft.runtime.workload.optim import (
    LayerTrainState,
    OptimizerFactory,
    clip_coefficient,
    grad_norm_squared,
)


def train_split(model: LayeredModel, data: DataSource, optimizer: OptimizerFactory, *,
                stages: Sequence[int], dp: int, global_batch: int, micro_batch: int,
                steps: int, dtype: torch.dtype = torch.float64,
                lr_schedule: Callable[[int], float] | None = None,
                reload_at: int | None = None, clip_grad_norm: float = 0.0,
                grad_norms: list[float] | None = None,
                ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train and return (pipeline 0's final parameters by runtime name, tied copies left
    out, losses).

    Args:
        stages: layer boundaries, e.g. ``[0, 2, 4]`` for two stages of two layers.
        dp: pipelines; the global batch's micro-batches are dealt to them in order.
        reload_at: before this step, every layer state goes through ``to_bytes`` /
            ``from_bytes`` into freshly built layers (a migration or a checkpoint reload).
        clip_grad_norm: clip by the global norm (0: never).
        grad_norms: receives every step's global gradient norm, before clipping.
    """
    assert stages[0] == 0 and stages[-1] == model.num_layers
    num_mb = global_batch // micro_batch
    assert num_mb % dp == 0

    def fresh(i: int) -> torch.nn.Module:
        return model.build_layer(i).to(dtype)

    replicas = [{i: LayerTrainState.create(fresh(i), optimizer, lr_schedule)
                 for i in range(model.num_layers)} for _ in range(dp)]
    ranges = [range(a, b) for a, b in itertools.pairwise(stages)]
    losses = []
    for step in range(steps):
        if step == reload_at:
            replicas = [{i: LayerTrainState.from_bytes(fresh(i), optimizer, s.to_bytes(),
                                                       lr_schedule)
                         for i, s in rep.items()} for rep in replicas]
        total = 0.0
        for p, rep in enumerate(replicas):
            for state in rep.values():
                state.zero_grad()
            for m in range(p * num_mb // dp, (p + 1) * num_mb // dp):
                x, y = data.microbatch(step, m * micro_batch, micro_batch)
                x, y = to_run(x, dtype, "cpu"), to_run(y, dtype, "cpu")
                count = global_batch * targets_per_sample(y)
                boundary: list[tuple[torch.Tensor, torch.Tensor]] = []
                h = x
                for r in ranges:
                    inp = h.detach().requires_grad_(h.is_floating_point())
                    out = inp
                    for i in r:
                        out = rep[i].module(out)
                    boundary.append((inp, out))
                    h = out
                loss = model.loss(h, y) / count
                total += float(loss.detach())
                grad: torch.Tensor | None = None
                for inp, out in reversed(boundary):
                    if grad is None:
                        loss.backward()
                    elif out.requires_grad:  # not when every parameter up to here is frozen
                        out.backward(grad)
                    grad = inp.grad
        for i in range(model.num_layers):  # the all-reduce: sum over replicas
            params = [list(rep[i].module.parameters()) for rep in replicas]
            for k in range(len(params[0])):
                grads = [ps[k].grad for ps in params]
                if grads[0] is None:
                    continue
                summed = torch.stack([g for g in grads if g is not None]).sum(0)
                for ps in params:
                    ps[k].grad = summed.clone()
        for rep in replicas:  # tied copies: each gets the sum of both gradients
            for (i, a), (j, b) in tied_parameters(model):
                x, y = rep[i].module.get_parameter(a), rep[j].module.get_parameter(b)
                both = [g for g in (x.grad, y.grad) if g is not None]
                if both:
                    x.grad, y.grad = torch.stack(both).sum(0), torch.stack(both).sum(0)
        copies = tied_copies(model)
        counted = [p for i, state in replicas[0].items()
                   for name, p in state.module.named_parameters()
                   if param_name(i, name) not in copies]
        norm = grad_norm_squared(counted).sqrt()
        if grad_norms is not None:
            grad_norms.append(float(norm))
        if clip_grad_norm > 0:
            factor = clip_coefficient(norm, clip_grad_norm)
            for rep in replicas:
                for state in rep.values():
                    for p in state.module.parameters():
                        if p.grad is not None:
                            p.grad.mul_(factor.to(p.grad.dtype))
        for rep in replicas:
            for state in rep.values():
                state.step(step)
        losses.append(total)
    out_params = {}
    for i, state in replicas[0].items():
        for name, p in state.module.named_parameters():
            out_params[param_name(i, name)] = p.detach().clone()
    for rep in replicas[1:]:
        for i, state in rep.items():
            for name, p in state.module.named_parameters():
                assert torch.equal(p, out_params[param_name(i, name)]), "replicas diverged"
    for copy_name, original in tied_copies(model).items():
        assert torch.equal(out_params[copy_name], out_params[original]), "tied copies differ"
    return drop_tied_copies(model, out_params), losses
