"""``dynamic``: re-form the survivors into pipelines of possibly different lengths.

The survivors are every live worker, idle ones included, but a plan uses at most the job's
layout's workers (``RecoveryState.num_usable``: warm spares replace lost workers, they add
no pipelines); the restorer's matching picks which of them fill the slots. The search
(paper Algorithm 1 and Oobleck's templates, generalised):

1. **Lengths.** A pipeline of ``l`` stages uses the job's template for ``l`` (a min-max
   balanced layer split over the profile's per-layer costs, memory-checked; for jobs of
   at most 8 layers and 16 micro-batches the fastest of every split; see
   ``templates.py``). Lengths where nothing fits are never used.
2. **Partitions of the survivors into pipeline lengths.**
   - Up to ``recovery.search_exhaustive_workers`` survivors (8): every multiset of
     feasible lengths whose sum is at most the number of survivors (idle survivors
     allowed, since a shorter pipeline may not fit memory or a pipeline may not pay off).
   - Above it the space is astronomically large (2,047 survivors in pipelines of 14-18
     stages), so it is restricted, and the restriction is: lengths within
     ``[shortest feasible, max(job pp, longest current pipeline) + search_extra_stages]``;
     at most two distinct lengths per plan; the pipeline counts are set by the survivors
     (for each pair of lengths and each count of the second length, as many pipelines of
     the first length as fit, leaving fewer idle survivors than the first length). The
     partitions are ranked by a continuous relaxation (each length's step time fitted as
     ``a + b m``), and the best ``_EXACT_PARTITIONS`` get the exact micro-batch split,
     together with the partitions that keep every intact pipeline and form the freed
     survivors into pipelines of one length (Oobleck's re-instantiation) and the
     homogeneous ones. Ties in step time (common, since micro-batches are whole) go to
     the partition that rebuilds the fewest pipelines, then to fewer distinct lengths.
3. **Micro-batch split.** In proportion to each pipeline's speed, then refined to the
   exact min-max split over one-pipeline estimates (``templates.allocate``).
4. **Refinement.** The best ``_FULL_ESTIMATES`` partitions become real plans: survivors
   are matched to slots by the restorer (fewest bytes moved), the whole plan is priced by
   the estimator (per-layer gradient all-reduce, real placement), and the fastest wins
   (ties: fewer bytes moved). Plans over device memory are dropped. Small searches also
   price a few other combinations of equally fast layer splits (``_alternatives``).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import NamedTuple

from chameleon_ft.perf import Estimate
from chameleon_ft.plan.pipeline import placeholder_pipeline
from chameleon_ft.plan.plan import ExecutionPlan, sharing_stages
from chameleon_ft.recovery.allocation import allocate
from chameleon_ft.recovery.restorer import (
    assign_workers,
    fatal_nodes,
    pack_stage_major,
    schedule_migration,
)
from chameleon_ft.recovery.templates import Layout, Templates
from chameleon_ft.recovery.transition import migration_s, recovery_terms
from chameleon_ft.recovery.types import (
    Candidate,
    Migration,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)

_EXACT_PARTITIONS = 12
"""Large searches: partitions (ranked by the relaxation) that get the exact batch split."""
_FULL_ESTIMATES = 3
"""Partitions (ranked by the exact split) priced as whole plans by the estimator."""
_SMALL_COMBOS = 48
"""Small searches: layout combinations per partition priced as whole plans (see below)."""


@dataclass(frozen=True)
class SearchResult:
    """The best dynamic plan found, with what the search cost."""

    plan: ExecutionPlan
    estimate: Estimate
    migration: Migration
    lengths: tuple[int, ...]
    num_partitions: int
    search_s: float


def partitions_all(total: int, lengths: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every non-empty multiset of ``lengths`` summing to at most ``total`` (descending)."""
    ordered = sorted(set(lengths), reverse=True)

    def rec(start: int, left: int, acc: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if acc:
            yield acc
        for i in range(start, len(ordered)):
            length = ordered[i]
            if length <= left:
                yield from rec(i, left - length, (*acc, length))

    yield from rec(0, total, ())


def partitions_two_lengths(total: int, lengths: Sequence[int]) -> list[tuple[tuple[int, int], ...]]:
    """Partitions with at most two distinct lengths that leave fewer idle survivors than
    the primary length (see the module docstring), as ``((length, count), ...)``."""
    ordered = sorted(set(lengths))
    seen: set[tuple[tuple[int, int], ...]] = set()
    for primary in ordered:
        for secondary in [0, *ordered]:
            if secondary == primary:
                continue
            max_second = 0 if secondary == 0 else total // secondary
            for num_second in range(max_second + 1):
                num_primary = (total - num_second * secondary) // primary
                if num_primary == 0 and num_second > 0:
                    continue  # the single-length case with ``secondary`` as primary
                groups = [(n, c) for n, c in ((primary, num_primary), (secondary, num_second))
                          if n and c]
                if groups:
                    seen.add(tuple(sorted(groups, reverse=True)))
    return sorted(seen, reverse=True)


def _expand(groups: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    return tuple(n for n, c in groups for _ in range(c))


def _relaxed_step_s(groups: tuple[tuple[int, int], ...], num_microbatches: int,
                    fits: dict[int, tuple[float, float]]) -> float:
    """Continuous relaxation: with ``T_l(m) ~ a_l + b_l m`` the equal-finish time ``tau``
    solves ``sum_j (tau - a_j) / b_j = M``."""
    num = float(num_microbatches)
    den = 0.0
    for length, count in groups:
        a, b = fits[length]
        if not math.isfinite(a) or b <= 0:
            return math.inf
        num += count * a / b
        den += count / b
    return num / den


def _affine_fit(templates: Templates, length: int, m: int) -> tuple[float, float]:
    t0, t1 = templates.length_step_s(length, m), templates.length_step_s(length, m + 1)
    b = t1 - t0
    return t0 - b * m, b


def _intact_lengths(state: RecoveryState) -> dict[int, int]:
    """Pipelines of the current plan that lost nothing, counted by length."""
    plan = state.plan
    where = plan.stage_of_worker
    # damaged: rerouted, or naming a worker not alive (a rerouted stage's is rerouted)
    damaged = {p for p, _ in plan.reroute_map}
    damaged.update(where[w][0] for w in state.named_dead() if w in where)
    lengths = list(map(len, plan.worker_rows()))
    for p in damaged:
        lengths[p] = 0
    counts = Counter(lengths)  # at C speed, lengths in order of first intact pipeline
    counts.pop(0, None)
    return dict(counts)


def _anchored(intact: dict[int, int], num_alive: int,
              lengths: Sequence[int]) -> list[tuple[int, ...]]:
    """Keep every intact pipeline; form the freed survivors into pipelines of one length."""
    kept = [n for n, c in intact.items() for _ in range(c) if n in lengths]
    free = num_alive - sum(kept)
    out = [tuple(sorted(kept, reverse=True))]
    for length in lengths:
        if length <= free:
            out.append(tuple(sorted(kept + [length] * (free // length), reverse=True)))
    return out


def _rebuilt(intact: dict[int, int], by_length: Mapping[int, int]) -> int:
    """Pipelines of a partition (``by_length``: its pipelines of each length) that cannot
    reuse an intact pipeline of the same length."""
    return sum(max(0, c - intact.get(n, 0)) for n, c in by_length.items())


def _rounded(step_s: float) -> float:
    """Step times equal up to float noise compare equal (so tie-breaks apply)."""
    return float(f"{step_s:.9g}") if math.isfinite(step_s) else step_s


def skeleton(templates: Templates, lengths: Sequence[int], counts: Sequence[int],
             micro_batch: int, schedule: str,
             layouts: Sequence[Layout] | None = None) -> ExecutionPlan:
    """A plan of the given pipeline lengths and micro-batch counts with placeholder workers
    (``-1 - slot``); the restorer puts real survivors in. Each pipeline takes the best
    layout for its length and micro-batch count unless ``layouts`` names them."""
    pipelines = []
    slot = 0
    for j, (length, m) in enumerate(zip(lengths, counts, strict=True)):
        layout = layouts[j] if layouts is not None else templates.best(length, m)[1]
        assert layout is not None  # allocate only returns counts that fit
        pipelines.append(placeholder_pipeline(layout, m, slot))
        slot += len(layout)
    return ExecutionPlan(num_layers=templates.num_layers, pipelines=tuple(pipelines),
                         micro_batch=micro_batch, schedule=schedule)


def _alternatives(templates: Templates, tau: float, lengths: Sequence[int],
                  counts: Sequence[int]) -> list[tuple[Layout, ...]]:
    """Small searches: other layer splits that keep every pipeline within ``tau``.

    Alone, a pipeline's best split is the fastest one; in a whole plan the per-layer
    gradient all-reduce is a barrier between the holders of a layer, so which layers share
    a worker with the slowest pipeline's workers (and how long their optimizer steps are)
    can make another split of equal isolated speed faster. Per pipeline, the (at most four)
    splits within ``tau`` that share the most stage boundaries with the slowest pipeline
    are kept, and up to ``_SMALL_COMBOS`` combinations are tried (each returned as one
    layout per pipeline, for :func:`skeleton`).
    """
    chosen = [templates.best(length, m) for length, m in zip(lengths, counts, strict=True)]
    critical = max(range(len(chosen)), key=lambda j: chosen[j][0])
    critical_layout = chosen[critical][1]
    assert critical_layout is not None
    critical_cuts = {hi for _, hi in critical_layout}

    def shared(layout: Layout) -> int:
        # cuts in common with the slowest pipeline: its layers' all-reduce groups then
        # match stage for stage, so fewer workers wait on the slowest one
        return len(critical_cuts & {hi for _, hi in layout})

    options: list[list[Layout]] = []
    for length, m in zip(lengths, counts, strict=True):
        ranked = sorted((-shared(lay), templates.step_s(lay, m), lay)
                        for lay in templates.candidate_layouts(length))
        fitting = [lay for _, step, lay in ranked if step <= tau * (1 + 1e-12)][:4]
        options.append(fitting or [templates.best(length, m)[1] or ranked[0][2]])
    return list(itertools.islice(itertools.product(*options), _SMALL_COMBOS))


def _in_id_order(shape: ExecutionPlan, held: Mapping[int, Collection[int]]) -> ExecutionPlan:
    """``shape`` with its slots filled by the live workers in id order."""
    workers = iter(sorted(held))
    return replace(shape, pipelines=tuple(
        pipe.on_workers(next(workers) for _ in pipe.stages) for pipe in shape.pipelines))


def _ranked_partitions(templates: Templates, num_alive: int, lengths: tuple[int, ...],
                       num_microbatches: int) -> tuple[list[tuple[int, ...]], int]:
    """The ``_EXACT_PARTITIONS`` two-length partitions of ``num_alive`` survivors best by
    the continuous relaxation, and how many there were (kept per templates: the same
    survivor count comes back at every failure of the same size)."""
    key = ("ranked-partitions", num_alive, lengths, num_microbatches)
    found = templates.memo.get(key)
    if found is None:
        groups = [g for g in partitions_two_lengths(num_alive, lengths)
                  if sum(c for _, c in g) <= num_microbatches]
        fits: dict[int, tuple[float, float]] = {}
        for length in lengths:
            share = max(1, round(num_microbatches * length / num_alive))
            fits[length] = _affine_fit(templates, length, share)
        groups.sort(key=lambda g: (_relaxed_step_s(g, num_microbatches, fits),
                                   -sum(c for _, c in g)))
        found = ([_expand(g) for g in groups[:_EXACT_PARTITIONS]], len(groups))
        templates.memo[key] = found
    pool, count = found
    return list(pool), count


def _allocated(templates: Templates, lengths: tuple[int, ...], num_microbatches: int
               ) -> tuple[float, list[int], Mapping[int, int]]:
    """:func:`allocate` over pipelines of ``lengths``, remembered per templates: the split
    depends on nothing else, and the same partitions come back at every failure that
    leaves the same number of survivors. With it, the partition's pipelines of each
    length (counted once, not at every search that shortlists it)."""
    key = ("allocate", lengths, num_microbatches)
    found = templates.memo.get(key)
    if found is None:
        step_s, counts = allocate(list(lengths), num_microbatches, templates.length_step_s,
                                  known=templates.priced_steps)
        found = templates.memo[key] = (step_s, tuple(counts),
                                       MappingProxyType(Counter(lengths)))
    return found[0], list(found[1]), found[2]


def max_length(state: RecoveryState) -> int:
    """The longest pipeline the searches consider over ``state.alive`` (module docstring)."""
    spec = state.config.recovery
    longest = min(state.num_usable, state.templates.num_layers)
    if state.num_usable > spec.search_exhaustive_workers:
        current = max(p.num_stages for p in state.plan.pipelines)
        longest = min(longest, max(state.config.job.pp, current) + spec.search_extra_stages)
    return longest


class _Split(NamedTuple):
    """One shortlisted partition with its exact micro-batch split (:func:`allocate`)."""

    step_s: float
    rebuilt: int
    """Pipelines it cannot take over intact (:func:`_rebuilt`)."""
    num_lengths: int
    busy: int
    """Workers it keeps busy."""
    lengths: tuple[int, ...]
    counts: list[int]

    def rank(self) -> tuple[float, int, int, int]:
        """Ties (common: micro-batches are whole) go to the partition that rebuilds the
        fewest pipelines (least migration), then fewer distinct lengths (fewer all-reduce
        buckets), then fewer busy workers."""
        return (_rounded(self.step_s), self.rebuilt, self.num_lengths, self.busy)


def _shortlist(state: RecoveryState, lengths: list[int],
               intact: dict[int, int]) -> tuple[list[tuple[int, ...]], int]:
    """The partitions of the survivors into pipeline lengths to split exactly, and how
    many partitions the search considered (module docstring, step 2)."""
    num_alive = state.num_usable
    num_microbatches = state.plan.num_microbatches
    if num_alive <= state.config.recovery.search_exhaustive_workers:
        pool = list(partitions_all(num_alive, lengths))
        return pool, len(pool)
    ranked, num_partitions = _ranked_partitions(state.templates, num_alive, tuple(lengths),
                                                num_microbatches)
    # The relaxation ignores that micro-batches are whole, so near-ties abound; the
    # partitions that keep the intact pipelines (Oobleck's re-instantiation) and the
    # homogeneous ones are always priced exactly as well.
    shortlisted = list(dict.fromkeys(
        [*ranked, *_anchored(intact, num_alive, lengths),
         *(tuple([n] * (num_alive // n)) for n in lengths)]))
    return [p for p in shortlisted if 0 < len(p) <= num_microbatches], num_partitions


def _exact_splits(templates: Templates, shortlisted: Sequence[tuple[int, ...]],
                  num_microbatches: int, intact: dict[int, int]) -> list[_Split]:
    """Each shortlisted partition with its exact micro-batch split (:func:`_allocated`),
    in shortlist order; partitions that cannot split the micro-batches are left out."""
    out = []
    for lengths in shortlisted:
        step_s, counts, by_length = _allocated(templates, lengths, num_microbatches)
        if counts:
            out.append(_Split(step_s, _rebuilt(intact, by_length), len(by_length),
                              sum(lengths), lengths, counts))
    return out


def _to_price(exact: list[_Split]) -> list[_Split]:
    """The splits priced as whole plans: the ``_FULL_ESTIMATES`` best and the best uniform
    ones.

    One-pipeline templates do not see the gradient all-reduce that couples pipelines,
    which grows with the number of pipelines and of distinct layer splits; so the best
    uniform partitions by the same ranking restart uses (the layouts a restart picks
    from) are priced as whole plans too, and a dynamic plan is not slower than
    restarting on the same survivors.
    """
    ranked = sorted(exact, key=_Split.rank)
    priced = ranked[:_FULL_ESTIMATES]
    uniform = [split for split in ranked if split.num_lengths == 1][:_FULL_ESTIMATES]
    return priced + [split for split in uniform if split not in priced]


def _shape_layouts(state: RecoveryState, split: _Split) -> list[tuple[Layout, ...] | None]:
    """The layouts (one per pipeline; ``None``: each pipeline's best, :func:`skeleton`) a
    split is priced with: its best layouts, and for small searches other combinations of
    equally fast layer splits."""
    templates = state.templates
    shapes: list[tuple[Layout, ...] | None] = [None]
    if state.num_usable <= state.config.recovery.search_exhaustive_workers and (
            templates.exhaustive):
        shapes.extend(_alternatives(templates, split.step_s, split.lengths, split.counts))
    return shapes


def _shape(state: RecoveryState, split: _Split,
           layouts: tuple[Layout, ...] | None) -> ExecutionPlan:
    """The plan with placeholder workers of ``split`` with ``layouts``."""
    plan = state.plan
    return skeleton(state.templates, split.lengths, split.counts, plan.micro_batch,
                    plan.schedule, layouts=layouts)


def _filled_in_id_order(state: RecoveryState, split: _Split,
                        layouts: tuple[Layout, ...] | None,
                        holdings: Callable[[], Mapping[int, Collection[int]]]
                        ) -> ExecutionPlan:
    """The shape of ``split`` with ``layouts`` filled with the live workers in id order
    (``holdings()``: every live worker's layers)."""
    return _in_id_order(_shape(state, split, layouts), holdings())


def _runs(lengths: Sequence[int], counts: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """``(length, micro-batches, how many in a row)`` of consecutive equal pipelines: a
    split's pipelines in order, compactly (a cache key)."""
    return tuple((length, m, len(list(run)))  # each run counted at C speed
                 for (length, m), run in itertools.groupby(zip(lengths, counts, strict=True)))


def placement_free_price(state: RecoveryState, lengths: Sequence[int],
                         counts: Sequence[int], layouts: tuple[Layout, ...] | None,
                         filled: Callable[[], ExecutionPlan]) -> tuple[float, bool]:
    """Step seconds and memory verdict of a plan of pipelines of ``lengths`` stages with
    ``counts`` micro-batches and ``layouts`` (``None``: each pipeline's best template,
    :func:`skeleton`), no reroutes, on a topology where placement cannot change an
    estimate; remembered per templates.

    ``filled`` builds the shape with live workers, priced when the shape is new; any other
    filling of it, by any survivors, is the same plan up to renaming the workers, which
    changes neither the step time nor the memory verdict there (one link type, no
    speeds), so every search that meets the same shape again reads the price back.
    """
    plan = state.plan
    key = ("placement-free-price", plan.micro_batch, plan.schedule, _runs(lengths, counts),
           layouts)
    found = state.templates.memo.get(key)
    if found is None:
        est = state.estimate(filled())
        found = state.templates.memo[key] = (est.step_s, est.memory_fits)
    return found


def _placements(state: RecoveryState, shape: ExecutionPlan,
                held: Mapping[int, Collection[int]],
                layer_bytes: Sequence[float]) -> list[tuple[ExecutionPlan, float]]:
    """Survivors put into ``shape``: the fewest bytes moved, and for a shape whose pipelines
    share one layout also stage-major.

    The fewest bytes moved can scatter a stage's replicas over nodes; the stage-major
    packing keeps each stage's all-reduce on as few nodes as it can, at the price of a
    larger migration: both are priced, the packing only when it leaves no more nodes
    whose loss would be fatal (a node holding every replica of a stage can only be
    followed by a restart).
    """
    placements = [assign_workers(shape, held, layer_bytes, state.plan)]
    if len({tuple((st.first_layer, st.end_layer) for st in pipe.stages)
            for pipe in shape.pipelines}) == 1:
        packed = pack_stage_major(shape, held, layer_bytes)
        if (len(fatal_nodes(packed[0], state.topology))
                <= len(fatal_nodes(placements[0][0], state.topology))):
            placements.append(packed)
    return placements


_Best = tuple[float, float, ExecutionPlan, Estimate, tuple[int, ...]]
"""(step seconds, bytes moved, plan, its estimate, its pipeline lengths)."""


Beaten = Callable[[float], bool]
"""Whether a plan of a given step time cannot beat a candidate already priced."""

BEATEN = "beaten"
"""What :func:`search` returns when its fastest shape cannot beat a candidate already
priced (its ``beaten`` test)."""


def _fastest_plan(state: RecoveryState, priced: list[_Split],
                  holdings: Callable[[], Mapping[int, Collection[int]]],
                  layer_bytes: Sequence[float],
                  beaten: Beaten | None = None) -> _Best | str | None:
    """The fastest whole plan over the priced splits' shapes that fits memory (ties: fewer
    bytes moved); ``None`` when none fits.

    Placement matters to an estimate only through which links a transfer crosses; with
    one worker per node, one node, or free links, every filling of a shape prices the
    same (:func:`placement_free_price`), so the Hungarian matching runs only for the
    shapes that win. There, a fastest step that ``beaten`` rejects ends the search before
    any matching (:data:`BEATEN`).
    """
    placement_free = state.topology.placement_free
    best: _Best | None = None
    unmatched: list[tuple[float, _Split, tuple[Layout, ...] | None]] = []
    for split in priced:
        for layouts in _shape_layouts(state, split):
            if placement_free:
                step_s, fits = placement_free_price(
                    state, split.lengths, split.counts, layouts,
                    functools.partial(_filled_in_id_order, state, split, layouts, holdings))
                if fits:
                    unmatched.append((_rounded(step_s), split, layouts))
                continue
            for new_plan, moved in _placements(state, _shape(state, split, layouts), holdings(),
                                               layer_bytes):
                new_plan.validate()
                est = state.estimate(new_plan)
                if not est.memory_fits:
                    continue
                key = (_rounded(est.step_s), moved)
                if best is None or key < (_rounded(best[0]), best[1]):
                    best = (est.step_s, moved, new_plan, est, split.lengths)
    if unmatched:
        fastest = min(step for step, _, _ in unmatched)
        if best is None and beaten is not None and beaten(fastest):
            return BEATEN
        for step, split, layouts in unmatched:
            if step != fastest:
                continue
            new_plan, moved = assign_workers(_shape(state, split, layouts), holdings(),
                                             layer_bytes, state.plan)
            new_plan.validate()
            if best is None or moved < best[1]:
                best = (step, moved, new_plan, state.estimate(new_plan), split.lengths)
    return best


def search(state: RecoveryState, beaten: Beaten | None = None
           ) -> SearchResult | str | None:
    """The best dynamic plan over ``state.alive``; ``None`` when nothing fits;
    :data:`BEATEN` when ``beaten`` (a test of a step time) rejects the fastest shape's step
    before any survivor is matched to it (one worker per node, or free links only).

    The survivors must hold every layer between them (checked by :func:`candidates`).
    """
    start = time.perf_counter()
    templates = state.templates
    lengths = templates.feasible_lengths(max_length(state))
    if not lengths:
        return None
    intact = _intact_lengths(state)
    shortlisted, num_partitions = _shortlist(state, lengths, intact)
    exact = _exact_splits(templates, shortlisted, state.plan.num_microbatches, intact)
    if not exact:
        return None
    by_worker = state.plan.layers_by_worker

    @functools.cache
    def holdings() -> Mapping[int, Collection[int]]:
        """Every live worker's layers (read only once a shape is matched)."""
        return dict(zip(state.alive, map(by_worker.get, state.alive, itertools.repeat(range(0))),
                        strict=True))

    layer_bytes = [layer.state_bytes for layer in state.profile.layers]
    best = _fastest_plan(state, _to_price(exact), holdings, layer_bytes, beaten)
    if best is None or isinstance(best, str):
        return best
    _, _, new_plan, est, lengths_of_plan = best
    new_plan = sharing_stages(new_plan, state.plan)
    migration = schedule_migration(new_plan, holdings(), state.profile, state.topology,
                                   max_parts=state.config.recovery.migration_max_parts)
    return SearchResult(plan=new_plan, estimate=est, migration=migration,
                        lengths=lengths_of_plan, num_partitions=num_partitions,
                        search_s=time.perf_counter() - start)


def candidates(state: RecoveryState, failed: frozenset[int], *,
               failure: bool = True, beaten: Beaten | None = None
               ) -> list[Candidate]:
    """The best dynamic plan, priced, or why there is none.

    Args:
        state: the job and the current plan; ``state.alive`` excludes ``failed``.
        failed: the newly failed workers.
        failure: answering a failure rather than a re-join (see :func:`dynamic_candidate`).
        beaten: whether a plan of a given step time cannot beat a candidate already priced
            (:meth:`Planner.decide`): such a search stops before matching survivors, and
            the candidate is infeasible, beaten.

    Returns:
        One candidate (feasible or not).
    """
    missing = state.missing_layers()
    if missing:
        return [infeasible(Strategy.DYNAMIC, f"layer {missing[0]} has no live replica")]
    result = search(state, beaten)
    if result is None:
        return [infeasible(Strategy.DYNAMIC,
                           f"no arrangement of the {len(state.alive)} survivors into pipelines "
                           "fits device memory")]
    if isinstance(result, str):
        return [infeasible(Strategy.DYNAMIC, "its fastest plan is too slow to beat a "
                           "candidate already priced, whatever its transition")]
    return [dynamic_candidate(state, result, failure=failure)]


def dynamic_candidate(state: RecoveryState, result: SearchResult, *,
                      failure: bool = True) -> Candidate:
    """Price a search result: the rebuild of what changes (``transition.recovery_terms``),
    the measured search time (the policy zeroes it when the decision came from the
    precomputed cache) and the migration.

    Args:
        state: the job and the plan before the change.
        result: the search's plan and migration.
        failure: answering a failure (detection and the lost step are paid) rather than a
            re-join.

    Returns:
        The candidate.
    """
    spec = state.config.recovery
    terms = recovery_terms(state, result.plan, result.estimate.step_s, failure=failure)
    terms["search_s"] = result.search_s
    terms["migrate_s"] = migration_s(result.migration.time_s, spec)
    lengths = result.lengths
    shape = "+".join(f"{lengths.count(n)}x{n}" for n in sorted(set(lengths), reverse=True))
    idle = len(state.alive) - sum(lengths)
    reason = (f"{shape} stages, {idle} idle; moves {result.migration.moved_bytes / 2**30:.2f} GiB"
              f" in {len(result.migration.rounds)} round(s)")
    return candidate_from_estimate(
        Strategy.DYNAMIC, result.plan, result.estimate, terms, reason,
        migration=result.migration,
        extra={"pipeline_lengths": list(lengths), "num_partitions": result.num_partitions,
               "search_s": result.search_s, "idle_workers": idle})
