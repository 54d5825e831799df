"""Decisions up to symmetry.

In a plan whose pipelines are identical (same layer splits, same micro-batch counts, no
reroutes), two failures that hit the same stages of different pipelines are the same
problem with the workers renamed, provided the renaming keeps which workers share a node.
The planner keys its cache by a canonical failure (damaged pipelines first, by the stages
they lost) and renames the cached answer back, so on the healthy 2,048-worker Llama 3 plan
every single failure is one of 16 cached problems instead of 2,048.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from itertools import accumulate, chain, compress, count, filterfalse, repeat
from operator import attrgetter, itemgetter, not_
from typing import Any

from chameleon_ft.perf import Bucket, Estimate, Topology
from chameleon_ft.plan import ExecutionPlan, Pipeline, Reroute, Stage
from chameleon_ft.recovery.types import Candidate, LazyFields, Migration, Transfer


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
    """Whether the renaming (every other worker keeps its id) moves each node's workers onto
    one node's: only then are the links between any two workers the same after it. A
    node whose workers are renamed only in part (the rest keeping their ids, on that
    node) is split, so the renaming is refused."""
    image: dict[int, int] = {}
    for node in {topology.node_of(w) for w in renaming}:
        targets = {topology.node_of(renaming.get(w, w)) for w in topology.workers_of_node(node)}
        if len(targets) != 1:
            return False
        image[node] = targets.pop()
    return len(set(image.values())) == len(image)


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
    """A state renamed to its canonical representative.

    The renaming is kept as its inverse (a tuple, built at C speed) and looked up forward
    one worker at a time: a decision renames its few failed, dead or returned workers into
    the canonical names and its answer back, never every live worker one by one.
    """

    plan: ExecutionPlan
    """The plan, pipelines in canonical order, workers renamed."""
    back: tuple[int, ...]
    """Each canonical id's worker: the renaming's inverse, a permutation of the cluster."""
    order: tuple[int, ...]
    """The original index of each canonical pipeline."""
    _named: tuple[Mapping[int, tuple[int, int]], ...]
    """Where the original plan names each worker, ``(pipeline, stage)``: its live stages'
    table, then its dead (rerouted) stages'."""
    _start: Sequence[int]
    """The canonical id of each original pipeline's first stage."""
    _idle: Mapping[int, int]
    """The canonical id of each worker the plan does not name."""
    _everyone: frozenset[int]
    """Every worker of the cluster (:attr:`Topology.all_workers`)."""
    _alive: frozenset[int] = frozenset()
    """The live workers the form was made for."""
    _dead: frozenset[int] = frozenset()
    """The cluster's other workers (few), found once by the form."""

    def __getitem__(self, worker: int) -> int:
        """``worker``'s canonical id."""
        live, dead = self._named
        found = live.get(worker) or dead.get(worker)
        if found is None:
            return self._idle[worker]
        return self._start[found[0]] + found[1]

    @property
    def renaming(self) -> dict[int, int]:
        """Every worker of the cluster -> its canonical id (built whole at each read)."""
        return dict(zip(self.back, count()))

    def rename(self, workers: Iterable[int]) -> frozenset[int]:
        """``workers`` in canonical ids, looked up one by one: for the few (the failed, the
        dead), not for every live worker (:meth:`rename_alive`)."""
        return frozenset(map(self.__getitem__, workers))

    def rename_alive(self, alive: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
        """The canonical ids of ``alive`` and of the cluster's other workers, renaming only
        the latter (few): the live ones are every other id."""
        dead = self.rename(self._dead if alive is self._alive else self._everyone - alive)
        return self._everyone - dead, dead

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
        maps: list[tuple[Mapping[int, int], _Known]] = []

        def named(candidate: Candidate) -> Candidate:
            if not maps:
                source = stored if stored is not None else self.plan
                pipes = source.pipelines
                theirs = list(map(original.pipelines.__getitem__, self.order))
                # built at C speed: 512 pipelines on the 65k job
                maps.append((_Inverse(self.back),
                             (dict(zip(map(id, pipes), theirs, strict=True)),
                              dict(zip(map(id, map(_TABLE, pipes)), theirs, strict=True)))))
            back, known = maps[0]
            return rename_candidate(candidate, back, original, known=known)

        return named


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


_TABLE = attrgetter("table")
"""A pipeline's kept table (:attr:`Pipeline.table`)."""

_CANONICAL_PIPELINES: dict[tuple[int, int, int], tuple[Any, Pipeline]] = {}
"""Canonical pipelines by (first id, layout, micro-batches), the layout named by the
identity of its shared row of range objects (``Pipeline.layer_ranges``), kept with the
entry so that the identity stays valid: shared objects make canonical plans cheap to
build, hash and compare, and the key costs no walk over the layout."""

_CANONICAL_ROWS: dict[tuple[tuple[int, ...], tuple[tuple[int, int], ...]],
                      tuple[tuple[Any, ...], tuple[Pipeline, ...]]] = {}
"""Whole tuples of canonical pipelines, by the shapes in canonical order (each shape's
rank, then each rank's (layout row id, micro-batches)), kept with the rows that give the
ids their meaning: most states of one job share a handful of such tuples."""


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


_RANGES_OF = attrgetter("layer_ranges")
_MICROBATCHES_OF = attrgetter("num_microbatches")


class _Shapes:
    """The distinct (layout, micro-batches) of a plan's pipelines, ranked in value order.

    Pipelines of one layout share a row of range objects, so a shape is named by the
    identity of its row and each distinct layout is compared once."""

    def __init__(self, plan: ExecutionPlan) -> None:
        pipelines = plan.pipelines
        rows = plan.range_rows()
        ids = list(map(id, rows))
        counts = list(map(_MICROBATCHES_OF, pipelines))
        single = ids.count(ids[0]) == len(ids) and counts.count(counts[0]) == len(counts)
        keys = [] if single else list(zip(ids, counts, strict=True))
        first = ({(ids[0], counts[0]): 0} if single
                 else dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True)))
        values = {key: (pipelines[p].layout, key[1]) for key, p in first.items()}
        by_value = {v: i for i, v in enumerate(sorted(set(values.values())))}
        rank = {key: by_value[v] for key, v in values.items()}
        self.ranks = [0] * len(ids) if single else list(map(rank.__getitem__, keys))
        """Each pipeline's rank among the distinct shapes."""
        self.exact = len(rank) == len(by_value)
        """Whether every shape has one row (else :meth:`canonical` does not cache)."""
        distinct = sorted(rank, key=rank.__getitem__)
        self._key = tuple(distinct)
        self._rows = tuple(rows[first[key]] for key in distinct)

    def canonical(self, order: list[int], ordered: list[Pipeline]) -> tuple[Pipeline, ...]:
        """The pipelines ``ordered`` (the plan's, in canonical ``order``) on workers
        numbered from 0 in that order."""
        firsts = accumulate(map(len, map(_RANGES_OF, ordered)), initial=0)
        if not self.exact:
            return tuple(map(_canonical_pipeline, firsts, ordered))
        key = (tuple(map(self.ranks.__getitem__, order)), self._key)
        found = _CANONICAL_ROWS.get(key)
        if found is not None and all(a is b for a, b in zip(found[0], self._rows, strict=True)):
            return found[1]
        pipelines = tuple(map(_canonical_pipeline, firsts, ordered))
        if len(_CANONICAL_ROWS) > 4096:
            _CANONICAL_ROWS.clear()
        _CANONICAL_ROWS[key] = (self._rows, pipelines)
        return pipelines


_Named = tuple[Mapping[int, tuple[int, int]], Mapping[int, tuple[int, int]]]


def _pipeline_keys(plan: ExecutionPlan, rows: list[tuple[int, ...]], ranks: list[int],
                   named: _Named, special: set[int],
                   status: Callable[[int], tuple[bool, ...]]
                   ) -> tuple[list[tuple[Any, ...]], dict[int, list[tuple[Any, ...]]], set[int]]:
    """Each pipeline's key up to its index, in two parts: ``(rank, statuses of its stages,
    its own reroutes)``, and, for the pipelines hosting others' reroutes, what they host,
    sorted; then the pipelines whose first part is more than ``(rank, (), ())`` (a
    ``special`` worker, or reroutes of their own)."""
    own: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for r in plan.reroutes:
        own.setdefault(r.pipeline, []).append((r.stage, tuple(n for _, n in r.shares)))
    lite: list[tuple[Any, ...]] = list(zip(ranks, repeat(()), repeat(())))
    live, dead = named
    touched = set(own)
    for w in special:
        found = live.get(w) or dead.get(w)
        if found is not None:
            touched.add(found[0])
    for p in touched:
        row = rows[p]
        statuses = tuple(status(w) for w in row) if not special.isdisjoint(row) else ()
        lite[p] = (ranks[p], statuses, tuple(sorted(own.get(p, ()))))
    hosting: dict[int, list[tuple[Any, ...]]] = {}
    for r in plan.reroutes:
        for i, (w, n) in enumerate(r.shares):
            q, s = live[w]
            hosting.setdefault(q, []).append((s, lite[r.pipeline], r.stage, i, n))
    return lite, {p: sorted(hosts) for p, hosts in hosting.items()}, touched


def _canonical_order(plan: ExecutionPlan, rows: list[tuple[int, ...]], ranks: list[int],
                     named: _Named, special: set[int],
                     status: Callable[[int], tuple[bool, ...]]) -> list[int]:
    """The pipelines of ``plan`` in canonical order: by shape rank (cheap), then by the
    status of their stages (only pipelines with a ``special`` worker have one), then by
    their own reroutes, then by what they host of others' reroutes; ties by index
    (:func:`_pipeline_keys`)."""
    lite, hosted, touched = _pipeline_keys(plan, rows, ranks, named, special, status)
    # A plain pipeline (no special worker, no reroute of its own or of others) has the key
    # ((rank, (), ()), [], index): it comes before every other pipeline of its rank, and
    # plain ones of one rank come by index. So the plain ones are sorted by rank alone
    # (at C speed) and the few others, sorted by their whole keys, go after those of
    # their rank.
    marked = touched.union(hosted)
    others = sorted((lite[p], hosted.get(p, []), p) for p in marked)
    plain = list(filterfalse(marked.__contains__, range(plan.num_pipelines)))
    if any(ranks):
        plain.sort(key=ranks.__getitem__)
    plain_ranks = list(map(ranks.__getitem__, plain))
    order: list[int] = []
    done = 0
    for key in others:
        end = bisect_right(plain_ranks, key[0][0], done)
        order.extend(plain[done:end])
        order.append(key[2])
        done = end
    order.extend(plain[done:])
    return order


def interchangeable_form(plan: ExecutionPlan, alive: frozenset[int],
                         marks: tuple[frozenset[int], ...],
                         topology: Topology, *, dead: frozenset[int] | None = None,
                         own: bool = False) -> CanonicalForm | None:
    """The canonical form of ``(plan, alive, marks)`` when workers are interchangeable.

    Args:
        plan: the current plan.
        alive: every live worker.
        marks: worker sets the answer depends on (the newly failed, the returned).
        topology: the cluster; the form exists only with one worker per node.
        dead: the cluster's workers not in ``alive``, when the caller has them.
        own: ``plan`` is one the caller made of the cluster's workers: they are not
            checked to be the cluster's again.

    Returns:
        The form, or ``None`` when workers are not interchangeable.
    """
    if topology.workers_per_node != 1:
        return None
    everyone = topology.all_workers
    rows = plan.worker_rows()
    # The plan's live stages' table (kept with the plan: the engine and the estimator read
    # it too) and its rerouted stages' dead workers name every worker the plan names.
    live = plan.stage_of_worker
    rerouted = {plan.pipelines[r.pipeline].stages[r.stage].worker: (r.pipeline, r.stage)
                for r in plan.reroutes}
    twice = (len(live) + len(rerouted) != sum(map(len, rows))
             or not rerouted.keys().isdisjoint(live.keys()))
    outside = not own and (not live.keys() <= everyone or not rerouted.keys() <= everyone)
    if twice or outside:
        return None  # a worker named twice, or outside the cluster: not a valid plan
    where: _Named = (live, rerouted)
    # Workers whose status is not "alive, unmarked": few. The cluster's dead are few too,
    # found in one pass; the named ones among them are looked up one by one.
    if dead is None:
        dead = everyone - alive
    special = set().union(*marks)
    special.update(w for w in dead if w in live or w in rerouted)

    def status(w: int) -> tuple[bool, ...]:
        return (w in alive, *(w in m for m in marks))

    shapes = _Shapes(plan)
    order = _canonical_order(plan, rows, shapes.ranks, where, special, status)
    # workers numbered pipeline by pipeline in canonical order, then the idle ones
    ordered = list(map(rows.__getitem__, order))
    back = list(chain.from_iterable(ordered))
    # The workers the plan does not name: its dead ones, and the idle live ones (counted
    # from the sizes; looked for among every live worker only when there are some).
    unnamed = [w for w in dead if w not in live and w not in rerouted]
    if len(everyone) - len(back) > len(unnamed):
        unnamed.extend(w for w in alive.difference(live) if w not in rerouted)
    rest = sorted(unnamed, key=lambda w: (tuple(not x for x in status(w)), w))
    first = dict(zip(order, accumulate(map(len, ordered[:-1]), initial=0), strict=True))
    start = list(map(first.__getitem__, range(len(order))))
    form = CanonicalForm(plan=plan, back=(*back, *rest), order=tuple(order), _named=where,
                         _start=start, _idle=dict(zip(rest, count(len(back)))),
                         _everyone=everyone, _alive=alive, _dead=frozenset(dead))
    position = {p: k for k, p in enumerate(order)}
    reroutes = tuple(sorted(
        (Reroute(position[r.pipeline], r.stage, tuple((form[w], n) for w, n in r.shares))
         for r in plan.reroutes), key=lambda r: (r.pipeline, r.stage)))
    canon = ExecutionPlan(
        num_layers=plan.num_layers,
        pipelines=shapes.canonical(order, list(map(plan.pipelines.__getitem__, order))),
        reroutes=reroutes, micro_batch=plan.micro_batch, schedule=plan.schedule,
        defer_weight_grad=plan.defer_weight_grad)
    return replace(form, plan=canon)  # the form above named the reroutes' workers
