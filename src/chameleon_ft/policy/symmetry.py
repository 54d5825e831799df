"""Decisions up to symmetry.

In a plan whose pipelines are identical (same layer splits, same micro-batch counts, no
reroutes), two failures that hit the same stages of different pipelines are the same
problem with the workers renamed, provided the renaming keeps which workers share a node.
The planner keys its cache by a canonical failure (damaged pipelines first, by the stages
they lost) and renames the cached answer back, so on the healthy 2,048-worker Llama 3 plan
every single failure is one of 16 cached problems instead of 2,048.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from itertools import accumulate, chain, count, filterfalse, repeat
from typing import Any, ClassVar

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


_Known = tuple[Mapping[int, Pipeline], Mapping[int, tuple[Stage, ...]]]
"""Pipelines (and stage tuples) whose renamed form is already known, by object id."""


def rename_plan(plan: ExecutionPlan, renaming: Mapping[int, int],
                known: _Known | None = None) -> ExecutionPlan:
    """``plan`` with every worker id renamed (ids not in ``renaming`` are kept).

    ``known`` maps ids of pipeline (and stage tuple) objects of ``plan`` to their renamed
    forms, taken as they are.
    """
    def w(worker: int) -> int:
        return renaming.get(worker, worker)

    same, same_stages = known if known is not None else ({}, {})

    def pipeline(pipe: Pipeline) -> Pipeline:
        found = same.get(id(pipe))
        if found is not None:
            return found
        stages = same_stages.get(id(pipe.stages))
        if stages is not None:
            return Pipeline(stages, pipe.num_microbatches)
        if renaming.keys().isdisjoint(pipe.workers):
            return pipe  # most pipelines keep their workers: reuse them as they are
        get = renaming.get
        return pipe.on_workers(map(get, pipe.workers, pipe.workers))

    return ExecutionPlan(
        num_layers=plan.num_layers,
        pipelines=tuple(pipeline(pipe) for pipe in plan.pipelines),
        reroutes=tuple(Reroute(r.pipeline, r.stage, tuple((w(x), n) for x, n in r.shares))
                       for r in plan.reroutes),
        micro_batch=plan.micro_batch,
        schedule=plan.schedule,
        defer_weight_grad=plan.defer_weight_grad,
    )


class _RenamedField:
    """A field of a :class:`_LazilyRenamed` copy: renamed at its first read, then an
    ordinary attribute (a non-data descriptor yields to the instance's own value)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        state = obj.__dict__
        lazy = state.get("_lazy")
        if lazy is not None:  # two threads may both fill: they store the same values
            state.update(obj._fill(*lazy))
            state.pop("_lazy", None)
        return state[self._name]


class _LazilyRenamed:
    """A copy of a frozen dataclass whose fields naming workers are renamed when first read.

    A decision renames only its winner back to the caller's workers, and most readers (the
    simulator, the policy's ranking) read its figures, never its per-worker tables: renaming
    those (2,048 entries and every all-reduce bucket on the 16k job) was the largest part of
    a cache hit. The copy compares and hashes as the base class does, field by field, so it
    is interchangeable with an eagerly renamed one.
    """

    _base: ClassVar[type]
    _renamed: ClassVar[tuple[str, ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls._renamed:
            setattr(cls, name, _RenamedField(name))

    @classmethod
    def of(cls, source: Any, renaming: Mapping[int, int]) -> Any:
        """A copy of ``source`` whose ``_renamed`` fields ``renaming`` renames lazily."""
        out = object.__new__(cls)
        for f in fields(source):
            if f.name not in cls._renamed:
                object.__setattr__(out, f.name, getattr(source, f.name))
        out.__dict__["_lazy"] = (source, renaming)
        return out

    def _fill(self, source: Any, renaming: Mapping[int, int]) -> dict[str, Any]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, self._base):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self._base))

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self._base)))


def _renamed_workers(ws: tuple[int, ...], renaming: Mapping[int, int]) -> tuple[int, ...]:
    if renaming.keys().isdisjoint(ws):
        return ws
    return tuple(sorted(map(renaming.get, ws, ws)))


class _RenamedEstimate(_LazilyRenamed, Estimate):
    _base = Estimate
    _renamed = ("peak_memory_bytes", "sync_rounds", "tie_workers")

    def _fill(self, source: Any, renaming: Mapping[int, int]) -> dict[str, Any]:
        get = renaming.get

        def bucket(b: Bucket) -> Bucket:
            renamed = _renamed_workers(b.workers, renaming)
            return b if renamed is b.workers else Bucket(renamed, b.layers)

        peaks = source.peak_memory_bytes
        return {"peak_memory_bytes": dict(zip(map(get, peaks, peaks), peaks.values(),
                                              strict=True)),
                "sync_rounds": tuple(tuple(bucket(b) for b in group)
                                     for group in source.sync_rounds),
                "tie_workers": _renamed_workers(source.tie_workers, renaming)}


class _RenamedMigration(_LazilyRenamed, Migration):
    _base = Migration
    _renamed = ("slots", "transfers")

    def _fill(self, source: Any, renaming: Mapping[int, int]) -> dict[str, Any]:
        get = renaming.get
        return {"slots": tuple([(get(x, x), p, s) for x, p, s in source.slots]),
                "transfers": tuple([Transfer(t.layer, get(t.src, t.src), get(t.dst, t.dst),
                                             t.part, t.num_parts, t.num_bytes)
                                    for t in source.transfers])}


def _rename_estimate(est: Estimate, renaming: Mapping[int, int]) -> Estimate:
    """``est`` in other worker names (renamed when first read: :class:`_LazilyRenamed`)."""
    return _RenamedEstimate.of(est, renaming)  # type: ignore[no-any-return]


def _rename_migration(migration: Migration, renaming: Mapping[int, int]) -> Migration:
    """``migration`` in other worker names (renamed when first read)."""
    return _RenamedMigration.of(migration, renaming)  # type: ignore[no-any-return]


def _in_original_order(plan: ExecutionPlan, original: ExecutionPlan) -> ExecutionPlan:
    """Put a renamed plan's pipelines back where ``original`` has them, when the plan keeps
    the original pipelines (a reroute does): pipeline ``p`` of the answer is then pipeline
    ``p`` of the question, as a direct computation would name it."""
    if plan.num_pipelines != original.num_pipelines:
        return plan
    # A live worker that no rerouted stage names sits in one row: the plan's own table
    # says which; any other first worker needs every row (the last row naming it wins).
    live, dead = original.stage_of_worker, original.dead_workers
    firsts = [pipe.stages[0].worker for pipe in plan.pipelines]
    if all(w in live and w not in dead for w in firsts):
        where = [live[w][0] for w in firsts]
    else:
        index: dict[int, int] = {}
        for p, row in enumerate(original.worker_rows()):
            index.update(zip(row, repeat(p)))
        where = [index.get(w, -1) for w in firsts]
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


# ----------------------------------------------------------------------------------------
# Interchangeable workers: a canonical form of the whole state.
#
# With one worker per node every pair of workers is joined by the same kind of link, so any
# renaming of workers keeps the problem the same. Two states (plan, who is alive, who just
# failed or came back) that differ only in worker ids and pipeline order are then the same
# problem, and one canonical representative stands for all of them: pipelines sorted by
# what they look like (layout, micro-batches, which stages are dead, failed or rerouted,
# what they host for other pipelines), workers numbered in that order, then the idle
# workers. Ties between look-alike pipelines are broken by their position, so two
# equivalent states can (rarely) get different forms: that costs a cache miss, never a
# wrong answer, because the cache key is the renamed state itself.


@dataclass(frozen=True)
class CanonicalForm:
    """A state renamed to its canonical representative."""

    plan: ExecutionPlan
    """The plan, pipelines in canonical order, workers renamed."""
    renaming: Mapping[int, int]
    """Every worker of the cluster -> its canonical id (a permutation)."""
    order: tuple[int, ...]
    """The original index of each canonical pipeline."""

    def rename(self, workers: frozenset[int]) -> frozenset[int]:
        """``workers`` in canonical ids."""
        return frozenset(map(self.renaming.__getitem__, workers))

    def answer(self, candidate: Candidate, original: ExecutionPlan,
               stored: ExecutionPlan | None = None) -> Candidate:
        """A candidate computed for the canonical state, in the original state's names.

        ``stored`` is the canonical plan the candidate was computed from (equal to
        ``self.plan``, maybe another object): pipelines of the answer that are its very
        objects are replaced by the original pipelines, without renaming stage by stage.
        """
        return self.answerer(original, stored)(candidate)

    def answerer(self, original: ExecutionPlan, stored: ExecutionPlan | None = None
                 ) -> Callable[[Candidate], Candidate]:
        """:meth:`answer` for several candidates of one state: the renaming back and the
        original pipelines are looked up once, at the first candidate."""
        maps: list[tuple[dict[int, int], _Known]] = []

        def named(candidate: Candidate) -> Candidate:
            if not maps:
                source = stored if stored is not None else self.plan
                pairs = list(zip(source.pipelines, self.order, strict=True))
                maps.append((dict(zip(self.renaming.values(), self.renaming, strict=True)),
                             ({id(pipe): original.pipelines[p] for pipe, p in pairs},
                              {id(pipe.stages): original.pipelines[p].stages
                               for pipe, p in pairs})))
            back, known = maps[0]
            return rename_candidate(candidate, back, original, known=known)

        return named


_CANONICAL_PIPELINES: dict[tuple[int, int, int], tuple[Any, Pipeline]] = {}
"""Canonical pipelines by (first id, layout, micro-batches), the layout named by the
identity of its shared row of range objects (``Pipeline.layer_ranges``), kept with the
entry so that the identity stays valid: shared objects make canonical plans cheap to
build, hash and compare, and the key costs no walk over the layout."""


def _canonical_pipeline(first: int, pipe: Pipeline) -> Pipeline:
    """``pipe``'s layout and micro-batches on workers ``first, first + 1, ...``."""
    row = pipe.layer_ranges
    key = (first, id(row), pipe.num_microbatches)
    found = _CANONICAL_PIPELINES.get(key)
    if found is not None and found[0] is row:
        return found[1]
    if len(_CANONICAL_PIPELINES) > 65536:
        _CANONICAL_PIPELINES.clear()
    canon = Pipeline(tuple(Stage(first + s, lo, hi) for s, (lo, hi) in enumerate(pipe.layout)),
                     pipe.num_microbatches)
    _CANONICAL_PIPELINES[key] = (row, canon)
    return canon


def _shape_ranks(pipelines: tuple[Pipeline, ...]) -> list[int]:
    """Each pipeline's rank among the distinct (layout, micro-batches) of ``pipelines``,
    in value order; pipelines of one layout share a row of range objects, so each distinct
    layout is compared once."""
    by_row: dict[tuple[int, int], tuple[tuple[tuple[int, int], ...], int]] = {}
    keys = [(id(pipe.layer_ranges), pipe.num_microbatches) for pipe in pipelines]
    for key, pipe in zip(keys, pipelines, strict=True):
        if key not in by_row:
            by_row[key] = (pipe.layout, pipe.num_microbatches)
    rank = {shape: i for i, shape in enumerate(sorted(set(by_row.values())))}
    of_row = {key: rank[shape] for key, shape in by_row.items()}
    return list(map(of_row.__getitem__, keys))


def interchangeable_form(plan: ExecutionPlan, alive: frozenset[int],
                         marks: tuple[frozenset[int], ...],
                         topology: Topology) -> CanonicalForm | None:
    """The canonical form of ``(plan, alive, marks)`` when workers are interchangeable.

    Args:
        plan: the current plan.
        alive: every live worker.
        marks: worker sets the answer depends on (the newly failed, the returned).
        topology: the cluster; the form exists only with one worker per node.

    Returns:
        The form, or ``None`` when workers are not interchangeable.
    """
    if topology.workers_per_node != 1:
        return None
    num_workers = topology.num_workers
    # Workers whose status is not "alive, unmarked": few, so pipelines without any share
    # one status tuple.
    rows = plan.worker_rows()
    special = set().union(*marks)
    special.update(filterfalse(alive.__contains__, chain.from_iterable(rows)))

    def status(w: int) -> tuple[bool, ...]:
        return (w in alive, *(w in m for m in marks))

    own: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for r in plan.reroutes:
        own.setdefault(r.pipeline, []).append((r.stage, tuple(n for _, n in r.shares)))
    # Pipelines compare by a small shape rank first (cheap), then by the status of their
    # stages (only pipelines with a dead, failed or returned worker have one), then by
    # their own reroutes.
    ranks = _shape_ranks(plan.pipelines)
    own_sorted = {p: tuple(sorted(found)) for p, found in own.items()}
    lite: list[tuple[Any, ...]] = []
    for p, row in enumerate(rows):
        statuses: tuple[Any, ...] = ()
        if special and not special.isdisjoint(row):
            statuses = tuple(status(w) for w in row)
        lite.append((ranks[p], statuses, own_sorted.get(p, ())))
    hosting: dict[int, list[tuple[Any, ...]]] = {}
    where = plan.stage_of_worker if plan.reroutes else {}
    for r in plan.reroutes:
        for i, (w, n) in enumerate(r.shares):
            q, s = where[w]
            hosting.setdefault(q, []).append((s, lite[r.pipeline], r.stage, i, n))
    hosted = {p: sorted(hosts) for p, hosts in hosting.items()}
    no_hosts: list[tuple[Any, ...]] = []
    keys = [(lite[p], hosted.get(p, no_hosts), p) for p in range(plan.num_pipelines)]
    order = sorted(range(plan.num_pipelines), key=keys.__getitem__)
    # workers numbered pipeline by pipeline in canonical order (one dictionary, built at C
    # speed); pipeline k's first worker is the count of those before it
    ordered = list(map(rows.__getitem__, order))
    renaming = dict(zip(chain.from_iterable(ordered), count()))
    if len(renaming) != sum(map(len, rows)):
        return None  # a worker named twice: not a valid plan
    pipelines = list(map(_canonical_pipeline, accumulate(map(len, ordered), initial=0),
                         map(plan.pipelines.__getitem__, order)))
    rest = sorted(filterfalse(renaming.__contains__, range(num_workers)),
                  key=lambda w: (tuple(not x for x in status(w)), w))
    renaming.update(zip(rest, count(len(renaming))))
    if len(renaming) != num_workers:
        return None  # a plan naming workers outside the cluster: no form
    position = {p: k for k, p in enumerate(order)}
    reroutes = tuple(sorted(
        (Reroute(position[r.pipeline], r.stage, tuple((renaming[w], n) for w, n in r.shares))
         for r in plan.reroutes), key=lambda r: (r.pipeline, r.stage)))
    canon = ExecutionPlan(num_layers=plan.num_layers, pipelines=tuple(pipelines),
                          reroutes=reroutes, micro_batch=plan.micro_batch,
                          schedule=plan.schedule, defer_weight_grad=plan.defer_weight_grad)
    return CanonicalForm(plan=canon, renaming=renaming, order=tuple(order))
