"""Decisions up to symmetry.

In a plan whose pipelines are identical (same layer splits, same micro-batch counts, no
reroutes), two failures that hit the same stages of different pipelines are the same
problem with the workers renamed, provided the renaming keeps which workers share a node.
The planner keys its cache by a canonical failure (damaged pipelines first, by the stages
they lost) and renames the cached answer back, so on the healthy 2,048-worker Llama 3 plan
every single failure is one of 16 cached problems instead of 2,048.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from chameleon_ft.perf import Bucket, Estimate, Topology
from chameleon_ft.plan import ExecutionPlan, Pipeline, Reroute, Stage
from chameleon_ft.recovery.types import Candidate, Migration, Transfer


def canonical_renaming(plan: ExecutionPlan, failed: frozenset[int], alive: frozenset[int],
                       topology: Topology) -> dict[int, int] | None:
    """A renaming of ``plan``'s workers that maps ``failed`` to its canonical form; workers
    it does not name keep their ids (an empty renaming: already canonical).

    Returns ``None`` when the plan is not symmetric enough (reroutes, pipelines that differ,
    idle or unknown workers) or when the renaming would not keep the node structure.
    """
    if plan.reroutes or not failed or alive != frozenset(plan.workers) - failed:
        return None
    if not failed <= frozenset(plan.workers):
        return None
    first = plan.pipelines[0]
    if any(p.layout != first.layout or p.num_microbatches != first.num_microbatches
           for p in plan.pipelines):
        return None
    pattern = {p: tuple(s for s, st in enumerate(pipe.stages) if st.worker in failed)
               for p, pipe in enumerate(plan.pipelines)}
    damaged = sorted((p for p, lost in pattern.items() if lost), key=lambda p: (pattern[p], p))
    # Damaged pipelines go to positions 0, 1, ... ordered by the stages they lost, each by
    # swapping places with the pipeline there, so few workers are renamed (a single
    # failure renames two pipelines) and renaming answers back stays cheap.
    at = list(range(plan.num_pipelines))  # position -> pipeline
    where = list(range(plan.num_pipelines))  # pipeline -> position
    for i, p in enumerate(damaged):
        j = where[p]
        at[i], at[j] = at[j], at[i]
        where[at[i]], where[at[j]] = i, j
    renaming = {}
    for target, p in enumerate(at):
        if target != p:
            for s, st in enumerate(plan.pipelines[p].stages):
                renaming[st.worker] = plan.pipelines[target].stages[s].worker
    return renaming if _keeps_nodes(renaming, topology) else None


def _keeps_nodes(renaming: Mapping[int, int], topology: Topology) -> bool:
    """Whether workers share a node after the renaming exactly when they did before."""
    image: dict[int, int] = {}
    for w, v in renaming.items():
        node, new_node = topology.node_of(w), topology.node_of(v)
        if image.setdefault(node, new_node) != new_node:
            return False
    return len(set(image.values())) == len(image)


def rename_plan(plan: ExecutionPlan, renaming: Mapping[int, int]) -> ExecutionPlan:
    """``plan`` with every worker id renamed (ids not in ``renaming`` are kept)."""
    def w(worker: int) -> int:
        return renaming.get(worker, worker)

    def pipeline(pipe: Pipeline) -> Pipeline:
        if not any(st.worker in renaming for st in pipe.stages):
            return pipe  # most pipelines keep their workers: reuse them as they are
        return Pipeline(tuple(Stage(w(st.worker), st.first_layer, st.end_layer)
                              for st in pipe.stages), pipe.num_microbatches)

    return ExecutionPlan(
        num_layers=plan.num_layers,
        pipelines=tuple(pipeline(pipe) for pipe in plan.pipelines),
        reroutes=tuple(Reroute(r.pipeline, r.stage, tuple((w(x), n) for x, n in r.shares))
                       for r in plan.reroutes),
        micro_batch=plan.micro_batch,
        schedule=plan.schedule,
    )


def _rename_estimate(est: Estimate, renaming: Mapping[int, int]) -> Estimate:
    def w(worker: int) -> int:
        return renaming.get(worker, worker)

    def bucket(b: Bucket) -> Bucket:
        if not any(x in renaming for x in b.workers):
            return b
        return Bucket(tuple(sorted(w(x) for x in b.workers)), b.layers)

    return replace(
        est,
        peak_memory_bytes={w(k): v for k, v in est.peak_memory_bytes.items()},
        sync_rounds=tuple(tuple(bucket(b) for b in group) for group in est.sync_rounds),
    )


def _rename_migration(migration: Migration, renaming: Mapping[int, int]) -> Migration:
    def w(worker: int) -> int:
        return renaming.get(worker, worker)

    return replace(
        migration,
        slots=tuple((w(x), p, s) for x, p, s in migration.slots),
        transfers=tuple(Transfer(layer=t.layer, src=w(t.src), dst=w(t.dst), part=t.part,
                                 num_parts=t.num_parts, num_bytes=t.num_bytes)
                        for t in migration.transfers),
    )


def _in_original_order(plan: ExecutionPlan, original: ExecutionPlan) -> ExecutionPlan:
    """Put a renamed plan's pipelines back where ``original`` has them, when the plan keeps
    the original pipelines (a reroute does): pipeline ``p`` of the answer is then pipeline
    ``p`` of the question, as a direct computation would name it."""
    if plan.num_pipelines != original.num_pipelines:
        return plan
    index = {st.worker: p for p, _, st in original.iter_stages()}
    where = [index.get(pipe.stages[0].worker, -1) for pipe in plan.pipelines]
    if sorted(where) != list(range(plan.num_pipelines)):
        return plan
    pipelines: list[Pipeline | None] = [None] * plan.num_pipelines
    for t, p in enumerate(where):
        pipelines[p] = plan.pipelines[t]
    assert all(pipe is not None for pipe in pipelines)
    return replace(plan, pipelines=tuple(p for p in pipelines if p is not None),
                   reroutes=tuple(sorted((replace(r, pipeline=where[r.pipeline])
                                          for r in plan.reroutes),
                                         key=lambda r: (r.pipeline, r.stage))))


def rename_candidate(candidate: Candidate, renaming: Mapping[int, int],
                     original: ExecutionPlan) -> Candidate:
    """``candidate`` with the workers of its plans, estimate and migration renamed; plans
    that keep ``original``'s pipelines get them back in ``original``'s order."""
    def plan_of(plan: ExecutionPlan | None) -> ExecutionPlan | None:
        if plan is None:
            return None
        return _in_original_order(rename_plan(plan, renaming), original)

    migration = candidate.migration
    if migration is not None:
        migration = _rename_migration(migration, renaming)
    return replace(
        candidate,
        plan=plan_of(candidate.plan),
        estimate=(None if candidate.estimate is None
                  else _rename_estimate(candidate.estimate, renaming)),
        migration=migration,
        interim_plan=plan_of(candidate.interim_plan),
    )
