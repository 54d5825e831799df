"""Decisions up to symmetry.

In a plan whose pipelines are identical (same layer splits, same micro-batch counts, no
reroutes), two failures that hit the same stages of different pipelines are the same
problem with the workers renamed, provided the renaming keeps which workers share a node.
The planner keys its cache by a canonical failure (damaged pipelines first, by the stages
they lost) and renames the cached answer back, so on the healthy 2,048-worker Llama 3 plan
every single failure is one of 16 cached problems instead of 2,048. With one worker per
node the whole state has a canonical form (:func:`interchangeable_form`). Answers are
renamed back by ``renaming.py``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, chain, count, filterfalse, repeat
from operator import attrgetter
from typing import Any

from chameleon_ft.perf import Topology
from chameleon_ft.plan import ExecutionPlan, Pipeline, Reroute, Stage
from chameleon_ft.policy.renaming import _Inverse, _Known, rename_candidate
from chameleon_ft.recovery.types import Candidate


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
    where = _named_once(plan, rows, everyone, own)
    if where is None:
        return None  # a worker named twice, or outside the cluster: not a valid plan
    live, rerouted = where
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
    form = _numbered(plan, rows, order, where, everyone, alive, dead, status)
    # the form names the reroutes' workers of the canonical plan
    return replace(form, plan=_canonical_plan(plan, form, shapes, order))


def _named_once(plan: ExecutionPlan, rows: list[tuple[int, ...]], everyone: frozenset[int],
                own: bool) -> _Named | None:
    """Where ``plan`` names each worker: its live stages' table (kept with the plan: the
    engine and the estimator read it too) and its rerouted stages' dead workers, which
    together name every worker the plan names; ``None`` when a worker is named twice or
    (unless the plan is the caller's ``own``) one is outside the cluster."""
    live = plan.stage_of_worker
    rerouted = {plan.pipelines[r.pipeline].stages[r.stage].worker: (r.pipeline, r.stage)
                for r in plan.reroutes}
    twice = (len(live) + len(rerouted) != sum(map(len, rows))
             or not rerouted.keys().isdisjoint(live.keys()))
    outside = not own and (not live.keys() <= everyone or not rerouted.keys() <= everyone)
    return None if twice or outside else (live, rerouted)


def _numbered(plan: ExecutionPlan, rows: list[tuple[int, ...]], order: list[int],
              where: _Named, everyone: frozenset[int], alive: frozenset[int],
              dead: frozenset[int], status: Callable[[int], tuple[bool, ...]]
              ) -> CanonicalForm:
    """The form's numbering of the cluster: workers pipeline by pipeline in canonical
    ``order``, then the ones the plan does not name, by status (its plan still ``plan``)."""
    live, rerouted = where
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
    return CanonicalForm(plan=plan, back=(*back, *rest), order=tuple(order), _named=where,
                         _start=start, _idle=dict(zip(rest, count(len(back)))),
                         _everyone=everyone, _alive=alive, _dead=frozenset(dead))


def _canonical_plan(plan: ExecutionPlan, form: CanonicalForm, shapes: _Shapes,
                    order: list[int]) -> ExecutionPlan:
    """``plan`` in the form's names: its pipelines in canonical ``order`` on their
    canonical workers, its reroutes' peers renamed."""
    position = {p: k for k, p in enumerate(order)}
    reroutes = tuple(sorted(
        (Reroute(position[r.pipeline], r.stage, tuple((form[w], n) for w, n in r.shares))
         for r in plan.reroutes), key=lambda r: (r.pipeline, r.stage)))
    return ExecutionPlan(
        num_layers=plan.num_layers,
        pipelines=shapes.canonical(order, list(map(plan.pipelines.__getitem__, order))),
        reroutes=reroutes, micro_batch=plan.micro_batch, schedule=plan.schedule,
        defer_weight_grad=plan.defer_weight_grad)
