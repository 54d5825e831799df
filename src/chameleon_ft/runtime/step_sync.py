"""What a step reduces beyond the data-parallel buckets, as the coordinator publishes it
(pure: a plan in, JSON-ready values out).

After the all-reduce rounds of ``perf.build_schedule`` (each layer's gradient summed over
its holders), two more reductions make a step what one process over the whole model
would do:

- **tied pairs** (``model.tied_parameters()``): each copy's gradient becomes the sum of
  both copies' gradients. The holders of either layer form one group (Megatron-LM's
  embedding group); the lowest-id holder of each layer contributes that layer's (already
  reduced) gradient, every other member zeros, so one all-reduce gives every member
  ``g_a + g_b``. When every member holds both layers the sum is taken locally.
- **the global gradient norm**: each worker adds up the squares of the gradients of the
  layers it is the lowest-id holder of (each layer once, a tied copy not at all); with
  ``[optimizer] clip_grad_norm`` the sums are all-reduced over the plan's workers and
  every worker scales its gradients by the same factor. Without clipping no collective
  runs: the workers report their sums and the coordinator adds them for the metrics.

A group over the same members as an all-reduce bucket is that bucket's group.
"""

from __future__ import annotations

from typing import Any

from chameleon_ft.plan.plan import ExecutionPlan

TiedLayers = tuple[tuple[int, str], tuple[int, str]]
"""``((layer, name), (layer, name))``: a tied pair, the original first."""


def tie_reductions(plan: ExecutionPlan, pairs: list[TiedLayers]) -> list[dict[str, Any]]:
    """One entry per tied pair: ``members`` (the holders of either layer, sorted),
    ``pair`` (``[[layer, name], [layer, name]]``), ``sources`` (the lowest-id holder of
    each layer: who contributes its gradient) and ``local`` (every member holds both)."""
    out = []
    for (i, a), (j, b) in pairs:
        hi, hj = plan.holders(i), plan.holders(j)
        members = sorted(set(hi) | set(hj))
        out.append({"members": members, "pair": [[i, a], [j, b]],
                    "sources": [hi[0], hj[0]],
                    "local": set(hi) == set(hj)})
    return out


def norm_reduction(plan: ExecutionPlan, clip_grad_norm: float) -> dict[str, Any]:
    """The global norm's reduction: ``members`` (the plan's workers) and ``clip`` (the
    maximum norm; 0: no clipping, and then no collective)."""
    return {"members": sorted(plan.workers), "clip": float(clip_grad_norm)}


def step_reductions(plan: ExecutionPlan, pairs: list[TiedLayers],
                    clip_grad_norm: float) -> dict[str, Any]:
    """The directive's ``ties`` and ``norm`` fields for ``plan``."""
    return {"ties": tie_reductions(plan, pairs),
            "norm": norm_reduction(plan, clip_grad_norm)}


def extra_groups(directive: dict[str, Any]) -> list[tuple[int, ...]]:
    """Members of every process group the step's extra reductions need (beyond the
    buckets'): a tie that is not local, the norm when clipping; single workers need none."""
    groups = {tuple(t["members"]) for t in directive.get("ties", ()) if not t["local"]}
    norm = directive.get("norm")
    if norm is not None and norm["clip"] > 0:
        groups.add(tuple(norm["members"]))
    return sorted(g for g in groups if len(g) > 1)
