"""Plans, candidates and estimates in other worker names.

A decision is priced once in the planner's canonical names (``symmetry.py``) and its
answer renamed back to the caller's workers: a plan's pipelines renamed (the ones whose
renamed form is known taken as they are, the ones the renaming does not touch kept), an
estimate's and a migration's per-worker tables renamed only when first read, and a
re-plan's pipelines put back in the question's order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields, replace
from itertools import compress, repeat
from operator import itemgetter, not_
from typing import Any

from chameleon_ft.perf import Bucket, Estimate
from chameleon_ft.plan import ExecutionPlan, Pipeline, Reroute
from chameleon_ft.recovery.types import Candidate, LazyFields, Migration, Transfer

_Known = tuple[Mapping[int, Pipeline], Mapping[int, Pipeline]]
"""Pipelines whose renamed form is already known, by the id of the pipeline object and by
the id of its table (:meth:`Pipeline.table`, shared by the same stages with other
micro-batch counts)."""


def rename_plan(plan: ExecutionPlan, renaming: Mapping[int, int],
                known: _Known | None = None) -> ExecutionPlan:
    """``plan`` with every worker id renamed (ids not in ``renaming`` are kept).

    ``known`` maps ids of pipeline (and stage tuple) objects of ``plan`` to their renamed
    forms, taken as they are.
    """
    def w(worker: int) -> int:
        return renaming.get(worker, worker)

    same, same_table = known if known is not None else ({}, {})

    def pipeline(pipe: Pipeline) -> Pipeline:
        found = same_table.get(id(pipe.table))
        if found is not None:
            return found.with_microbatches(pipe.num_microbatches)
        if renaming.keys().isdisjoint(pipe.workers):
            return pipe  # most pipelines keep their workers: reuse them as they are
        return pipe.on_workers(_renamed_all(pipe.workers, renaming))

    # the known pipelines looked up at C speed, the others one by one
    pipes = plan.pipelines
    found: list[Pipeline | None] = list(map(same.get, map(id, pipes)))
    for p in compress(range(len(pipes)), map(not_, found)):
        found[p] = pipeline(pipes[p])
    return ExecutionPlan(
        num_layers=plan.num_layers,
        pipelines=tuple(found),  # type: ignore[arg-type]  # every entry filled above
        reroutes=tuple(Reroute(r.pipeline, r.stage, tuple((w(x), n) for x, n in r.shares))
                       for r in plan.reroutes),
        micro_batch=plan.micro_batch,
        schedule=plan.schedule,
        defer_weight_grad=plan.defer_weight_grad,
    )


class _LazilyRenamed(LazyFields):
    """A copy of a frozen dataclass whose fields naming workers are renamed when first read.

    A decision renames only its winner back to the caller's workers, and most readers (the
    simulator, the policy's ranking) read its figures, never its per-worker tables: renaming
    those (2,048 entries and every all-reduce bucket on the 16k job) was the largest part of
    a cache hit. The copy compares and hashes as the base class does (:class:`LazyFields`).
    """

    @classmethod
    def of(cls, source: Any, renaming: Mapping[int, int]) -> Any:
        """A copy of ``source`` whose ``_lazy_fields`` ``renaming`` renames lazily."""
        return cls.lazily({f.name: getattr(source, f.name) for f in fields(source)
                           if f.name not in cls._lazy_fields}, source, renaming)


def _renamed_all(ws: Sequence[int], renaming: Mapping[int, int]) -> Iterator[int]:
    """``ws`` renamed (ids the renaming does not name keep theirs), at C speed: a renaming
    back (:class:`_Inverse`) is read by index."""
    if isinstance(renaming, _Inverse):
        return map(renaming.back.__getitem__, ws)
    return map(renaming.get, ws, ws)


def _renamed_workers(ws: tuple[int, ...], renaming: Mapping[int, int]) -> tuple[int, ...]:
    if renaming.keys().isdisjoint(ws):
        return ws
    return tuple(sorted(_renamed_all(ws, renaming)))


class _RenamedEstimate(_LazilyRenamed, Estimate):
    _base = Estimate
    _lazy_fields = ("peak_memory_bytes", "sync_rounds", "tie_workers")

    def _fill(self, source: Any, renaming: Mapping[int, int]) -> dict[str, Any]:
        def bucket(b: Bucket) -> Bucket:
            renamed = _renamed_workers(b.workers, renaming)
            return b if renamed is b.workers else Bucket(renamed, b.layers)

        peaks = source.peak_memory_bytes
        return {"peak_memory_bytes": dict(zip(_renamed_all(list(peaks), renaming), peaks.values(),
                                              strict=True)),
                "sync_rounds": tuple(tuple(bucket(b) for b in group)
                                     for group in source.sync_rounds),
                "tie_workers": _renamed_workers(source.tie_workers, renaming)}


class _RenamedMigration(_LazilyRenamed, Migration):
    _base = Migration
    _lazy_fields = ("slots", "transfers")

    def _fill(self, source: Any, renaming: Mapping[int, int]) -> dict[str, Any]:
        get = renaming.get
        slots = source.slots
        return {"slots": tuple(zip(_renamed_all([x for x, _, _ in slots], renaming),
                                   [p for _, p, _ in slots], [s for _, _, s in slots],
                                   strict=True)),
                "transfers": tuple([Transfer(t.layer, get(t.src, t.src), get(t.dst, t.dst),
                                             t.part, t.num_parts, t.num_bytes)
                                    for t in source.transfers])}


def _rename_estimate(est: Estimate, renaming: Mapping[int, int]) -> Estimate:
    """``est`` in other worker names (renamed when first read: :class:`_LazilyRenamed`)."""
    return _RenamedEstimate.of(est, renaming)  # type: ignore[no-any-return]


class _CarriedEstimate(LazyFields, Estimate):
    """An estimate carried over from a renamed plan (:func:`carried_estimate`)."""

    _base = Estimate
    _lazy_fields = ("peak_memory_bytes", "sync_rounds", "tie_workers")

    def _fill(self, compute: Callable[[], Estimate]) -> dict[str, Any]:
        computed = compute()
        return {name: getattr(computed, name) for name in self._lazy_fields}

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled whole, as a plain estimate (the computation is not sent along)
        return (Estimate, tuple(getattr(self, f.name) for f in fields(Estimate)))


def carried_estimate(estimate: Estimate, compute: Callable[[], Estimate]) -> Estimate:
    """The estimate of a plan that is ``estimate``'s plan with its workers renamed and its
    pipelines maybe reordered, by a renaming that keeps each node's workers on one node
    (so every link is the same): its step time, memory verdict and breakdown are
    ``estimate``'s; its per-worker tables are ``compute()``'s, the plan's own estimate,
    computed when one is first read (which of several peers of reroutes peaks highest
    follows the pipelines' order, which the renaming may change)."""
    return _CarriedEstimate.lazily(  # type: ignore[no-any-return]
        {f.name: getattr(estimate, f.name) for f in fields(Estimate)
         if f.name not in _CarriedEstimate._lazy_fields}, compute)


def _rename_migration(migration: Migration, renaming: Mapping[int, int]) -> Migration:
    """``migration`` in other worker names (renamed when first read)."""
    return _RenamedMigration.of(migration, renaming)  # type: ignore[no-any-return]


_FIRST = itemgetter(0)


def _in_original_order(plan: ExecutionPlan, original: ExecutionPlan) -> ExecutionPlan:
    """Put a renamed plan's pipelines back where ``original`` has them, when the plan keeps
    the original pipelines (a reroute does): pipeline ``p`` of the answer is then pipeline
    ``p`` of the question, as a direct computation would name it."""
    if plan.num_pipelines != original.num_pipelines:
        return plan
    # A live worker that no rerouted stage names sits in one row: the plan's own table
    # says which; any other first worker needs every row (the last row naming it wins).
    live, dead = original.stage_of_worker, original.dead_workers
    firsts = list(map(_FIRST, plan.worker_rows()))
    if all(map(live.__contains__, firsts)) and dead.isdisjoint(firsts):
        where = list(map(_FIRST, map(live.__getitem__, firsts)))
    else:
        index: dict[int, int] = {}
        for p, row in enumerate(original.worker_rows()):
            index.update(zip(row, repeat(p)))
        where = [index.get(w, -1) for w in firsts]
    # the answer's pipeline t goes to place where[t]: ``where`` must be a permutation
    by_place = sorted(range(len(where)), key=where.__getitem__)
    if list(map(where.__getitem__, by_place)) != list(range(plan.num_pipelines)):
        return plan
    reroutes = tuple(sorted((replace(r, pipeline=where[r.pipeline]) for r in plan.reroutes),
                            key=lambda r: (r.pipeline, r.stage)))
    if by_place == where and reroutes == plan.reroutes:
        return plan  # in place already
    return replace(plan, pipelines=tuple(map(plan.pipelines.__getitem__, by_place)),
                   reroutes=reroutes)


def rename_candidate(candidate: Candidate, renaming: Mapping[int, int],
                     original: ExecutionPlan, known: _Known | None = None) -> Candidate:
    """``candidate`` with the workers of its plans, estimate and migration renamed; plans
    that keep ``original``'s pipelines get them back in ``original``'s order. ``known``: as
    in :func:`rename_plan`."""
    def plan_of(plan: ExecutionPlan | None) -> ExecutionPlan | None:
        if plan is None:
            return None
        named = _in_original_order(rename_plan(plan, renaming, known), original)
        return original if named == original else named  # the very plan, when unchanged

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



class _Inverse(Mapping[int, int]):
    """A form's renaming back (canonical id -> worker) read from its tuple by index: the
    ids are ``0 .. n - 1``, so no dict of every worker is built for the few an answer
    renames."""

    __slots__ = ("back",)

    def __init__(self, back: tuple[int, ...]) -> None:
        self.back = back  # each canonical id's worker (every id of the cluster is one)

    def __getitem__(self, canonical: int) -> int:
        if 0 <= canonical < len(self.back):
            return self.back[canonical]
        raise KeyError(canonical)

    def get(self, canonical: int, default: Any = None) -> Any:
        return self.back[canonical] if 0 <= canonical < len(self.back) else default

    def __contains__(self, canonical: object) -> bool:
        return isinstance(canonical, int) and 0 <= canonical < len(self.back)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.back)))

    def __len__(self) -> int:
        return len(self.back)
