"""Rerouting as a plan transformation: dead stage replicas hand their micro-batches to
live workers holding the same layers in other pipelines (docs/design.md section 2)."""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import operator
from collections import defaultdict
from collections.abc import Iterable, Mapping

from chameleon_ft.plan.plan import ExecutionPlan, Reroute
from chameleon_ft.plan.tables import indices_by_object


def dead_stages(plan: ExecutionPlan, dead: Iterable[int]) -> list[tuple[int, int]]:
    """``(pipeline, stage)`` of every stage whose worker is in ``dead``.

    A stage rerouted before whose worker is not in ``dead`` (it came back) is live again.
    """
    dead_set = set(dead)
    rows = plan.worker_rows()
    out: list[tuple[int, int]] = []
    # the few pipelines with a dead worker found at C speed
    for p in itertools.compress(range(len(rows)), map(operator.not_,
                                                      map(dead_set.isdisjoint, rows))):
        out.extend((p, s) for s, w in enumerate(rows[p]) if w in dead_set)
    return out


def _live_peers(plan: ExecutionPlan, wanted: set[tuple[int, int]], skip: set[tuple[int, int]]
                ) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """For each layer range in ``wanted``, the live stages holding exactly it (except those
    in ``skip``), as ``(pipeline, worker)`` in pipeline order. Pipelines of one layout share
    a row of range objects: where a range sits in a row is looked up once per row."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {bounds: [] for bounds in wanted}
    rows, workers = plan.range_rows(), plan.worker_rows()
    merged: set[tuple[int, int]] = set()
    # the pipelines of each row object, in order: a wanted range sits at one position of
    # a row, so its holders in those pipelines are read at once
    for group in indices_by_object(rows).values():
        where = {(r.start, r.stop): s for s, r in enumerate(rows[group[0]])}
        for bounds in wanted:
            s = where.get(bounds)
            if s is None:
                continue
            found = list(zip(group, map(operator.itemgetter(s),
                                        map(workers.__getitem__, group)), strict=True))
            for p in sorted((q for q, t in skip if t == s), reverse=True):
                i = bisect.bisect_left(group, p)
                if i < len(group) and group[i] == p:
                    del found[i]
            if out[bounds]:
                merged.add(bounds)
            out[bounds] += found
    for bounds in merged:
        out[bounds].sort()  # in pipeline order (one entry per pipeline)
    return out


def reroute_plan(
    plan: ExecutionPlan,
    dead: Iterable[int],
    headroom: Mapping[int, float] | None = None,
) -> ExecutionPlan:
    """Reroute every stage whose worker is in ``dead``, rebuilding all reroutes so the extra
    work stays balanced. Pass every dead worker, old and new: a stage rerouted before whose
    worker is not in ``dead`` takes its micro-batches back (a repaired worker rejoining).

    Without ``headroom`` each micro-batch of a dead stage goes to the same-range peer with
    the least work so far (its own pipeline's micro-batches plus what it already took), so
    a peer shared by two dead stages is not overloaded. With ``headroom`` (free bytes per
    worker), peers without free memory are skipped and the rest take micro-batches in
    proportion to their free bytes. Among equally good peers, the one whose pipeline has
    taken the fewest foreign micro-batches at any stage (and has no dead stage of its
    own) comes first: each extra micro-batch delays every later stage of the pipeline
    that runs it, so two dead stages rerouted into the same peer pipelines would slow
    those twice, where disjoint peer pipelines are each slowed once (and the estimator
    prices the two as separate, smaller components).

    Raises:
        ValueError: when a dead stage has no live replica in another pipeline (rerouting is
            infeasible); the message says which.
    """
    dead_set = set(dead)
    dead_list = dead_stages(plan, dead_set)
    skip = set(dead_list)
    peers_of_range = _live_peers(plan, {plan.pipelines[p].layout[s] for p, s in dead_list},
                                 skip)
    load, pipeline_of = _peer_loads(plan, peers_of_range)
    extra: dict[int, int] = defaultdict(int)
    # Foreign micro-batches per pipeline; a pipeline with a dead stage of its own already
    # waits on peers, so it counts as having taken all of its micro-batches.
    taken: dict[int, int] = defaultdict(int)
    for p, _ in dead_list:
        taken[p] = plan.pipelines[p].num_microbatches
    reroutes = []
    for p, s in dead_list:
        peers = _stage_peers(plan, p, s, peers_of_range, headroom)
        shares = _spread(plan.pipelines[p].num_microbatches, peers, load, pipeline_of,
                         extra, taken, headroom)
        reroutes.append(Reroute(p, s, tuple(sorted(shares.items()))))
    new = dataclasses.replace(plan, reroutes=tuple(reroutes))
    new.validate()
    return new


def _peer_loads(plan: ExecutionPlan,
                peers_of_range: Mapping[tuple[int, int], list[tuple[int, int]]]
                ) -> tuple[dict[int, float], dict[int, int]]:
    """Each peer's work so far (its own pipeline's micro-batches) and its pipeline: only
    the peers are ever looked up, not every live worker."""
    load: dict[int, float] = {}
    pipeline_of: dict[int, int] = {}
    for holders in peers_of_range.values():
        pipeline_of.update((w, q) for q, w in holders)
        load.update((w, float(plan.pipelines[q].num_microbatches)) for q, w in holders)
    return load, pipeline_of


def _stage_peers(plan: ExecutionPlan, p: int, s: int,
                 peers_of_range: Mapping[tuple[int, int], list[tuple[int, int]]],
                 headroom: Mapping[int, float] | None) -> list[int]:
    """The live workers of other pipelines that can take dead stage ``s`` of pipeline
    ``p``'s micro-batches (with free memory, given ``headroom``), in pipeline order.

    Raises:
        ValueError: when there is none.
    """
    st = plan.pipelines[p].stages[s]
    peers = [w for q, w in peers_of_range.get((st.first_layer, st.end_layer), []) if q != p]
    if headroom is not None:
        peers = [w for w in peers if headroom.get(w, 0.0) > 0]
    if not peers:
        raise ValueError(
            f"reroute: stage {s} of pipeline {p} (layers {st.first_layer}.."
            f"{st.end_layer - 1}) has no live replica in another pipeline"
            + (" with free memory" if headroom is not None else ""))
    return peers


def _spread(num_microbatches: int, peers: list[int], load: dict[int, float],
            pipeline_of: Mapping[int, int], extra: dict[int, int], taken: dict[int, int],
            headroom: Mapping[int, float] | None) -> dict[int, int]:
    """A dead stage's micro-batches over ``peers``, one at a time to the best by
    :func:`reroute_plan`'s rule; the peers' ``load``, ``extra`` and their pipelines'
    ``taken`` counts are updated as they take them. Returns each peer's share."""
    shares: dict[int, int] = defaultdict(int)

    def key(w: int) -> tuple[float, int]:
        # A dead stage's peers sit in distinct pipelines, so taking a micro-batch
        # changes only the taker's own key: the heap never holds a stale entry.
        first = load[w] if headroom is None else (extra[w] + 1) / headroom[w]
        return first, taken[pipeline_of[w]]

    if headroom is None:  # the first keys read at C speed
        firsts = zip(map(load.__getitem__, peers),
                     map(taken.__getitem__, map(pipeline_of.__getitem__, peers)), strict=True)
        heap = list(zip(firsts, peers, strict=True))
    else:
        heap = [(key(w), w) for w in peers]
    heapq.heapify(heap)
    for _ in range(num_microbatches):
        _, w = heapq.heappop(heap)
        shares[w] += 1
        extra[w] += 1
        load[w] += 1.0
        taken[pipeline_of[w]] += 1
        heapq.heappush(heap, (key(w), w))
    return shares
