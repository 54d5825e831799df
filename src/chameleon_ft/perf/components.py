"""Components: the pipelines an estimate simulates together (linked by reroutes), the
shape a component's simulation is shared by, and timelines renamed between a shape's
names and a plan's workers.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping
from typing import Any

from chameleon_ft.perf.list_scheduler import Timeline
from chameleon_ft.perf.network import Topology
from chameleon_ft.perf.orders import Op
from chameleon_ft.plan.plan import ExecutionPlan

_WORKERS_OF = operator.attrgetter("workers")
_MICROBATCHES = operator.attrgetter("num_microbatches")
_LAYOUT_OF = operator.attrgetter("layout")


def _components(plan: ExecutionPlan) -> list[tuple[list[int], bool]]:
    """Pipelines that must be simulated together: linked by reroutes (union-find), each
    group with whether it is a lone pipeline without reroutes (shared by its look-alikes),
    in the order of their first pipelines. Only the few pipelines that reroutes touch are
    joined; every other one is a group of its own."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for r in plan.reroutes:
        find(r.pipeline)
        for worker, _ in r.shares:
            q, _ = plan.stage_of_worker[worker]
            a, b = find(r.pipeline), find(q)
            if a != b:
                parent[a] = b
    joined: dict[int, list[int]] = {}
    for p in sorted(parent):
        joined.setdefault(find(p), []).append(p)
    lead = {group[0]: group for group in joined.values()}  # by its first pipeline
    rerouted = {r.pipeline for r in plan.reroutes}
    out: list[tuple[list[int], bool]] = []
    for p in range(plan.num_pipelines):
        if p not in parent:
            out.append(([p], True))  # untouched by any reroute
        elif p in lead:
            out.append((lead[p], len(lead[p]) == 1 and p not in rerouted))
    return out


def component_key(plan: ExecutionPlan, order: list[int], speeds: Mapping[int, float],
                  topology: Topology) -> tuple[tuple[Any, ...], dict[int, int]]:
    """The shape of the component of pipelines ``order`` (:meth:`Estimator._component
    <chameleon_ft.perf.estimator.Estimator._component>`), and its
    workers' names in it.

    Workers and nodes are named by first appearance, pipeline by pipeline. With one
    worker per node, all at unit speed, and every worker named once, the names are
    positions, so a pipeline is its micro-batches and layout (the names read at C
    speed); otherwise each stage is named with its node and speed."""
    members = set(order)
    local = {p: i for i, p in enumerate(order)}
    pipes = list(map(plan.pipelines.__getitem__, order))
    rows = list(map(_WORKERS_OF, pipes))
    worker_ids = dict(zip(itertools.chain.from_iterable(rows), itertools.count()))
    shape: list[Any]
    if (topology.workers_per_node == 1 and not speeds
            and len(worker_ids) == sum(map(len, rows))):
        shape = ["by position", plan.schedule, plan.defer_weight_grad,
                 *zip(map(_MICROBATCHES, pipes), map(_LAYOUT_OF, pipes), strict=True)]
        shape.append(tuple(sorted(
            (local[r.pipeline], r.stage, tuple((worker_ids[w], n) for w, n in r.shares))
            for r in plan.reroutes if r.pipeline in members)))
        return tuple(shape), worker_ids
    worker_ids = {}
    node_ids: dict[int, int] = {}
    node_of = topology.node_of
    shape = [plan.schedule, plan.defer_weight_grad]
    for pipe in pipes:
        names = []
        for st in pipe.stages:
            w = st.worker
            names.append((worker_ids.setdefault(w, len(worker_ids)),
                          node_ids.setdefault(node_of(w), len(node_ids)),
                          st.first_layer, st.end_layer, speeds.get(w, 1.0)))
        shape.append((pipe.num_microbatches, tuple(names)))
    shape.append(tuple(sorted(
        (local[r.pipeline], r.stage,
         tuple((worker_ids[w], node_ids[node_of(w)], n) for w, n in r.shares))
        for r in plan.reroutes if r.pipeline in members)))
    return tuple(shape), worker_ids


def _relabel(tl: Timeline, mapping: Mapping[int, int], pipeline: int | None = None,
             keep_ops: bool = True) -> Timeline:
    """Rename a timeline's workers (and optionally its ops' pipeline index; the op lists are
    dropped unless ``keep_ops``)."""
    def ops(seq: list[Op]) -> list[Op]:
        if pipeline is None:
            return seq
        return [Op(op.kind, pipeline, op.stage, op.microbatch, op.chunk) for op in seq]

    def renamed(table: dict[int, Any]) -> dict[int, Any]:
        return dict(zip(map(mapping.__getitem__, table), table.values(), strict=True))

    return Timeline(
        ops={mapping[w]: ops(v) for w, v in tl.ops.items()} if keep_ops else {},
        finish_s=renamed(tl.finish_s),
        busy_s=renamed(tl.busy_s),
        peak_activation_bytes=renamed(tl.peak_activation_bytes),
        makespan_s=tl.makespan_s,
        critical_compute_s=tl.critical_compute_s,
        critical_p2p_s=tl.critical_p2p_s,
    )
