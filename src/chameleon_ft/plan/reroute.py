"""Rerouting as a plan transformation: dead stage replicas hand their micro-batches to
live workers holding the same layers in other pipelines (DESIGN.md section 2)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from chameleon_ft.plan.plan import ExecutionPlan, Reroute


def split_evenly(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` whole items in proportion to ``weights`` (largest remainders).

    Ties go to the earlier entry, so the split is deterministic.
    """
    if total < 0 or not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("split_evenly: needs a non-negative total and positive weights")
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    out = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def reroute_plan(
    plan: ExecutionPlan,
    failed: Iterable[int],
    weight: Callable[[int], float] | None = None,
) -> ExecutionPlan:
    """Reroute every stage whose worker is in ``failed``.

    Each dead stage's micro-batches are split over the live workers holding the same
    layer range in other pipelines, in proportion to ``weight(peer)`` (default: equal),
    counting what the peer already carries for earlier reroutes of this call so that the
    extra work stays balanced. Existing reroutes of ``plan`` are kept; if a failed worker
    was a peer of an existing reroute, that reroute is rebuilt.

    Raises:
        ValueError: when some dead stage has no live replica (rerouting is infeasible) or a
            failed worker is not in the plan.
    """
    failed_set = set(failed)
    unknown = sorted(failed_set - set(plan.workers) - set(plan.dead_workers))
    if unknown:
        raise ValueError(f"failed: worker {unknown[0]} runs nothing in the current plan")
    weigh = weight or (lambda _w: 1.0)
    dead_stages = {(r.pipeline, r.stage) for r in plan.reroutes}
    dead_stages.update(
        (p, s) for p, s, st in plan.iter_stages() if st.worker in failed_set
    )
    live = {w: ps for w, ps in plan.stage_of_worker.items() if w not in failed_set}
    by_layout: dict[tuple[int, int], list[int]] = {}
    for w, (p, s) in sorted(live.items()):
        st = plan.pipelines[p].stages[s]
        by_layout.setdefault((st.first_layer, st.end_layer), []).append(w)
    load: dict[int, float] = {w: 0.0 for w in live}
    reroutes = []
    for p, s in sorted(dead_stages):
        st = plan.pipelines[p].stages[s]
        peers = [w for w in by_layout.get((st.first_layer, st.end_layer), [])
                 if live[w][0] != p]
        if not peers:
            raise ValueError(
                f"reroute: no live replica of layers [{st.first_layer}, {st.end_layer}) "
                f"(pipeline {p} stage {s}); rerouting is infeasible")
        m = plan.pipelines[p].num_microbatches
        # Give more to peers that are fast and not yet loaded by earlier dead stages.
        own = {w: plan.pipelines[live[w][0]].num_microbatches for w in peers}
        capacity = [max(weigh(w) * (own[w] + m) - load[w] - own[w], 0.0) + 1e-9 for w in peers]
        counts = split_evenly(m, capacity)
        shares = tuple((w, n) for w, n in zip(peers, counts, strict=True) if n > 0)
        for w, n in shares:
            load[w] += n
        reroutes.append(Reroute(p, s, shares))
    new = dataclasses.replace(plan, reroutes=tuple(reroutes))
    new.validate()
    return new
