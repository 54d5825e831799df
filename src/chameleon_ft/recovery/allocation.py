"""Micro-batches over pipelines: :func:`allocate` splits the global batch's micro-batches
over pipelines of given kinds to minimise the slowest pipeline, exactly, for any step-time
functions that do not decrease with ``m``.

It starts from each pipeline's share in proportion to its speed and moves micro-batches
from a slowest pipeline to the one that would finish soonest with one more
(:func:`allocate_by_moves`); given the step times already priced, the split the optimum
forces is usually found from a few of them (:func:`_forced_split`).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


def proportional_start(layouts: Sequence[K], num_microbatches: int,
                       cost: Callable[[K, int], float]
                       ) -> tuple[list[K], dict[tuple[K, int], int], int]:
    """Where :func:`allocate` starts: each pipeline's share of ``num_microbatches`` in
    proportion to its speed (its marginal seconds per micro-batch near an even split),
    rounded down and lowered to what fits memory (the step functions are non-decreasing).

    Identical layouts are grouped: their pipelines are interchangeable, so only the counts
    of pipelines at each micro-batch count matter.

    Args:
        layouts: the kind of each pipeline (at least one).
        num_microbatches: micro-batches per step over all pipelines.
        cost: one pipeline's step time for ``(kind, m)``.

    Returns:
        The kinds in order of first appearance, ``counts[(kind, m)]`` (pipelines of that
        kind running ``m`` micro-batches) and the micro-batches assigned (the total may
        be over or under ``num_microbatches``).
    """
    k = len(layouts)
    kinds = list(dict.fromkeys(layouts))
    count_of = {kind: 0 for kind in kinds}
    for layout in layouts:
        count_of[layout] += 1
    rate = {}
    for kind in kinds:
        base = max(1, num_microbatches // k)
        marginal = cost(kind, base + 1) - cost(kind, base)
        rate[kind] = 1.0 / marginal if marginal > 0 and math.isfinite(marginal) else 0.0
    total_rate = sum(rate[kind] * count_of[kind] for kind in kinds)
    counts: dict[tuple[K, int], int] = {}
    assigned = 0
    for kind in kinds:
        share = (num_microbatches * rate[kind] / total_rate) if total_rate > 0 else 1.0
        m = _fitting(kind, max(1, math.floor(share)), cost)
        counts[(kind, m)] = counts.get((kind, m), 0) + count_of[kind]
        assigned += m * count_of[kind]
    return kinds, counts, assigned


def allocate(layouts: Sequence[K], num_microbatches: int,
             step_s: Callable[[K, int], float], *,
             known: Callable[[K], Mapping[int, float]] | None = None
             ) -> tuple[float, list[int]]:
    """Split ``num_microbatches`` over pipelines minimising the slowest one's step time.

    The split is the one :func:`allocate_by_moves` reaches (start in proportion to each
    pipeline's speed, then move micro-batches from a slowest pipeline to the one that
    would finish soonest with one more while that lowers the maximum). Most of the time
    that split is forced by the optimum alone, and given ``known`` :func:`_forced_split`
    finds it from a few step times near the optimum (often none not priced before)
    instead of walking there one count at a time: on 2,048 workers, eight 16-stage
    pipelines among 239 of 8 stages start near 188 micro-batches each and the walk down
    prices every count on the way, dozens of them by simulating the pipeline. Exact when
    every ``step_s(layout, m)`` is non-decreasing in ``m`` (see :func:`allocate_by_moves`).

    Args:
        layouts: the kind of each pipeline (a layout, or a length whose best layout
            ``step_s`` picks); pipelines of one kind are interchangeable.
        num_microbatches: micro-batches per step over all pipelines.
        step_s: one pipeline's step time for ``(kind, m)``.
        known: step times already priced per kind (``m -> step_s(kind, m)``), free to
            read: they narrow the search for the optimum. Without it, the moves alone
            (a search from nothing known would price counts the moves never ask for).

    Returns:
        ``(slowest pipeline's step seconds, micro-batches per pipeline)``; infinity when
        there are more pipelines than micro-batches or nothing fits.
    """
    k = len(layouts)
    if k == 0 or num_microbatches < k:
        return math.inf, []
    cost = _remembered(step_s)
    if known is not None:
        forced = _forced_split(layouts, num_microbatches, cost, known)
        if forced is not None:
            return forced
    return allocate_by_moves(layouts, num_microbatches, cost)


def allocate_by_moves(layouts: Sequence[K], num_microbatches: int,
                      step_s: Callable[[K, int], float]) -> tuple[float, list[int]]:
    """:func:`allocate` by local moves.

    Start from the split in proportion to each pipeline's speed (its marginal seconds per
    micro-batch; no more than fits memory, as the step functions are non-decreasing), fill
    the remainder greedily, then move one micro-batch at a time from a
    slowest pipeline to the pipeline that would finish soonest with one more, while that
    lowers the maximum. The result is optimal when every ``step_s(layout, m)`` is
    non-decreasing in ``m``: at the fixed point no pipeline can take one more micro-batch
    and stay below the maximum, so any split with a smaller maximum would have to give
    some pipeline more and exceed it.

    Args and returns: as :func:`allocate`.
    """
    k = len(layouts)
    if k == 0 or num_microbatches < k:
        return math.inf, []
    cost = _remembered(step_s)
    kinds, counts, assigned = proportional_start(layouts, num_microbatches, cost)
    _take_back(counts, assigned - num_microbatches)
    if assigned < num_microbatches and not _fill(kinds, counts,
                                                 num_microbatches - assigned, cost):
        return math.inf, []
    _balance(_Groups(counts), cost)
    return _pipelines(layouts, kinds, counts, cost)


def _remembered(step_s: Callable[[K, int], float]) -> Callable[[K, int], float]:
    """``step_s``, remembered for one allocation."""
    memo: dict[tuple[K, int], float] = {}

    def cost(kind: K, m: int) -> float:
        value = memo.get((kind, m))
        if value is None:
            value = memo[(kind, m)] = step_s(kind, m)
        return value

    return cost


def _take_back(counts: dict[tuple[K, int], int], excess: int) -> None:
    """Never start above the total: take ``excess`` micro-batches back from the largest
    shares first, one at a time from the first group with the most.

    While that group is alone above every other, it keeps being chosen level after level:
    it goes down in one go (through the same keys in the same order, so ties later fall
    the same way).
    """
    while excess > 0:
        levels = [(key, c) for key, c in counts.items() if c and key[1] > 1]
        top = max(key[1] for key, _ in levels)
        (kind, m), group = next((key, c) for key, c in levels if key[1] == top)
        below = max((key[1] for key, _ in levels if key[1] < top), default=1)
        alone = sum(1 for key, _ in levels if key[1] == top) == 1
        steps = min(top - below, excess // group) if alone else 0
        if steps >= 1:
            for level in range(m - 1, m - steps, -1):
                counts.setdefault((kind, level), 0)
            _move(counts, kind, m, m - steps, group)
            excess -= steps * group
            continue
        moved = min(group, excess)  # the group stays first among the largest meanwhile
        _move(counts, kind, m, m - 1, moved)
        excess -= moved


def _fill(kinds: list[K], counts: dict[tuple[K, int], int], missing: int,
          cost: Callable[[K, int], float]) -> bool:
    """Give ``missing`` micro-batches, each to the pipeline that would finish soonest with
    one more; False when none fits one more."""
    # heap entries: (step with one more, kind's index, m); the index keeps kinds comparable
    index = {kind: i for i, kind in enumerate(kinds)}
    heap = [(cost(kind, m + 1), index[kind], m) for (kind, m), c in counts.items() if c]
    heapq.heapify(heap)
    while missing > 0:
        value, i, m = heapq.heappop(heap)
        kind = kinds[i]
        group = counts.get((kind, m), 0)
        if group == 0:
            continue  # stale entry
        if not math.isfinite(value):
            return False
        # The popped entry stays the smallest while its group lasts (every entry pushed
        # after it is at least as large and ties come later), so one pipeline at a time
        # would move the whole group in a row: move it at once.
        moved = min(group, missing)
        _move(counts, kind, m, m + 1, moved)
        missing -= moved
        heapq.heappush(heap, (cost(kind, m + 2), i, m + 1))
        if counts.get((kind, m), 0):
            heapq.heappush(heap, (cost(kind, m + 1), i, m))
    return True


class _Groups(Generic[K]):
    """Pipelines by ``(kind, micro-batches)``, with the order groups first appeared in
    (ties in the slowest and the soonest go to the earliest, as over the whole dict)."""

    def __init__(self, counts: dict[tuple[K, int], int]) -> None:
        self.counts = counts
        self._first_seen = {key: i for i, key in enumerate(counts)}
        self._alive = {key for key, c in counts.items() if c}

    def live(self) -> list[tuple[K, int]]:
        """The groups with pipelines, in the order they first appeared."""
        return sorted(self._alive, key=self._first_seen.__getitem__)

    def shift(self, kind: K, src: int, dst: int, n: int) -> None:
        """Move ``n`` pipelines of ``kind`` from ``src`` micro-batches to ``dst``."""
        _move(self.counts, kind, src, dst, n)
        self._first_seen.setdefault((kind, dst), len(self._first_seen))
        self._alive.add((kind, dst))
        if not self.counts[(kind, src)]:
            self._alive.discard((kind, src))


def _balance(groups: _Groups[K], cost: Callable[[K, int], float]) -> None:
    """Move micro-batches from a slowest pipeline to the one that would finish soonest
    with one more while that lowers the maximum (the fixed point is the optimum)."""
    counts = groups.counts
    while True:
        live = groups.live()
        worst = max(live, key=lambda key: (cost(*key), -key[1]))
        worst_s = cost(*worst)
        if worst[1] <= 1:
            break
        candidates = [key for key in live if key != worst or counts[key] > 1]
        if not candidates:
            break  # a single pipeline takes everything
        best = min(candidates, key=lambda key: (cost(key[0], key[1] + 1), key[1]))
        if not cost(best[0], best[1] + 1) < worst_s:
            break
        if counts[worst] == 1:
            _walk_lone_worst(groups, live, worst, best, cost)
            continue
        # Moving one micro-batch leaves the same worst and best groups (the pipelines
        # moved end strictly between them) while both last, unless the worst kind's next
        # count down ties the worst step: then one move at a time.
        moved = 1
        if cost(worst[0], worst[1] - 1) < worst_s:
            moved = min(counts[worst], counts[best])
        groups.shift(worst[0], worst[1], worst[1] - 1, moved)
        groups.shift(best[0], best[1], best[1] + 1, moved)


def _walk_lone_worst(groups: _Groups[K], live: list[tuple[K, int]], worst: tuple[K, int],
                     best: tuple[K, int], cost: Callable[[K, int], float]) -> None:
    """A lone slowest pipeline gives one micro-batch at a time to the best group; the next
    rounds of :func:`_balance` would pick the same two while it stays strictly the
    slowest, above the best's new step, and the best group lasts: take them here without
    re-ranking (the same moves in the same order)."""
    (wk, wm), (bk, bm) = worst, best
    target = cost(bk, bm + 1)
    rivals = max([(cost(*key), -key[1]) for key in live if key != worst]
                 + [(target, -(bm + 1))])
    steps = 1
    while steps < groups.counts[best] and wm - steps > 1:
        level_s = cost(wk, wm - steps)
        if not (level_s > target and (level_s, -(wm - steps)) > rivals):
            break
        steps += 1
    for i in range(steps):
        groups.shift(wk, wm - i, wm - i - 1, 1)
        groups.shift(bk, bm, bm + 1, 1)


def _pipelines(layouts: Sequence[K], kinds: list[K], counts: dict[tuple[K, int], int],
               cost: Callable[[K, int], float]) -> tuple[float, list[int]]:
    """The slowest step and each pipeline's micro-batches: within a kind, pipelines in
    order take the largest counts first."""
    slowest = max(cost(*key) for key, c in counts.items() if c)
    pools: dict[K, list[int]] = {kind: [] for kind in kinds}
    for (kind, m), c in sorted(counts.items(), key=lambda item: -item[0][1]):
        pools[kind].extend([m] * c)
    taken = {kind: iter(pool) for kind, pool in pools.items()}
    return slowest, [next(taken[layout]) for layout in layouts]


class _Staircase(Generic[K]):
    """One kind's step seconds by micro-batch count, priced on demand: the counts priced
    so far, in order, bracket the others (the steps do not decrease with the count)."""

    def __init__(self, kind: K, cost: Callable[[K, int], float], known: Mapping[int, float],
                 limit: int) -> None:
        self.kind = kind
        self._cost = cost
        self.limit = limit
        """No pipeline runs more micro-batches than this."""
        pairs = sorted((m, v) for m, v in known.items() if 1 <= m <= limit)
        self.counts = [m for m, _ in pairs]
        self.values = [v for _, v in pairs]

    def at(self, m: int) -> float:
        """The step with ``m`` micro-batches."""
        i = bisect.bisect_left(self.counts, m)
        if i < len(self.counts) and self.counts[i] == m:
            return self.values[i]
        value = self._cost(self.kind, m)
        self.counts.insert(i, m)
        self.values.insert(i, value)
        return value

    def most_within(self, limit_s: float) -> tuple[int, int, bool]:
        """``(lo, hi, bounded)``: the most micro-batches whose step is at most ``limit_s``
        lies in ``[lo, hi]`` (0: not even one); ``bounded`` when a priced count above
        ``hi`` exceeds the limit (else ``hi`` is only :attr:`limit`)."""
        i = bisect.bisect_right(self.values, limit_s)
        lo = self.counts[i - 1] if i else 0
        if i < len(self.counts):
            return lo, self.counts[i] - 1, True
        return lo, self.limit, False

    def narrow(self, limit_s: float) -> None:
        """Price one count inside :meth:`most_within`'s range (halving it, or doubling
        ``lo`` while nothing above is known to exceed the limit)."""
        lo, hi, bounded = self.most_within(limit_s)
        assert lo < hi
        self.at((lo + hi + 1) // 2 if bounded else min(hi, max(1, 2 * lo)))

    def most(self, limit_s: float) -> int:
        """The most micro-batches whose step is at most ``limit_s`` (0: not even one)."""
        while True:
            lo, hi, _ = self.most_within(limit_s)
            if lo == hi:
                return lo
            self.narrow(limit_s)


def _fits_within(stairs: list[_Staircase[K]], num_pipelines: list[int], total: int,
                 limit_s: float) -> bool:
    """Whether some split of ``total`` gives every pipeline at least one micro-batch and
    keeps it within ``limit_s`` (pricing only the counts that decide it)."""
    while True:
        ranges = [s.most_within(limit_s) for s in stairs]
        if any(hi < 1 for _, hi, _ in ranges):
            return False
        if sum(n * hi for n, (_, hi, _) in zip(num_pipelines, ranges, strict=True)) < total:
            return False
        if all(lo >= 1 for lo, _, _ in ranges) and sum(
                n * lo for n, (lo, _, _) in zip(num_pipelines, ranges, strict=True)) >= total:
            return True
        widest = max(range(len(stairs)),
                     key=lambda j: num_pipelines[j] * (ranges[j][1] - ranges[j][0]))
        stairs[widest].narrow(limit_s)


def _first_fitting(stair: _Staircase[K], fits: Callable[[float], bool]) -> int | None:
    """The fewest micro-batches ``m`` of ``stair``'s kind with ``fits(stair.at(m))`` (true
    from some count on, as steps do not decrease); ``None`` when not even at the limit."""
    priced = list(stair.counts)
    lo, hi = 0, len(priced)  # over the priced counts first: fits is false below lo
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(stair.at(priced[mid])):
            hi = mid
        else:
            lo = mid + 1
    below = priced[lo - 1] if lo else 0  # does not fit
    above = priced[lo] if lo < len(priced) else None  # fits
    while above is None:
        probe = min(stair.limit, max(below + 1, 2 * below))
        if fits(stair.at(probe)):
            above = probe
        elif probe == stair.limit:
            return None
        else:
            below = probe
    while above - below > 1:
        mid = (below + above) // 2
        if fits(stair.at(mid)):
            above = mid
        else:
            below = mid
    return above


def _forced_split(layouts: Sequence[K], total: int, cost: Callable[[K, int], float],
                  known: Callable[[K], Mapping[int, float]]
                  ) -> tuple[float, list[int]] | None:
    """The split :func:`allocate_by_moves` ends at, when the optimum forces it; else None.

    With non-decreasing steps, the moves stop at the smallest possible maximum ``T``
    with every pipeline within ``T`` and unable to take one more micro-batch below it:
    a pipeline of a kind whose steps never equal ``T`` runs the most micro-batches it
    can within ``T``; when exactly one kind reaches ``T``, from its most micro-batches
    ``b >= 2`` and not already at ``b - 1``, its pipelines run ``b`` or ``b - 1``, and
    how many of each is set by the total. Otherwise (several kinds reach ``T``, a flat
    step at ``T``, nothing fits) None, and the moves decide.
    """
    kinds = list(dict.fromkeys(layouts))
    tally = Counter(layouts)
    num_pipelines = [tally[kind] for kind in kinds]
    limit = total - len(layouts) + 1
    stairs = [_Staircase(kind, cost, known(kind), limit) for kind in kinds]

    def fits(limit_s: float) -> bool:
        return _fits_within(stairs, num_pipelines, total, limit_s)

    optimum = math.inf
    for stair in stairs:
        first = _first_fitting(stair, fits)
        if first is not None:
            optimum = min(optimum, stair.at(first))
    if not math.isfinite(optimum):
        return None
    most = [stair.most(optimum) for stair in stairs]
    reaching = [j for j, stair in enumerate(stairs) if stair.at(most[j]) == optimum]
    if len(reaching) != 1:
        return None
    j = reaching[0]
    if most[j] < 2 or not stairs[j].at(most[j] - 1) < optimum:
        return None
    lowered = sum(n * b for n, b in zip(num_pipelines, most, strict=True)) - total
    if not 0 <= lowered < num_pipelines[j]:
        return None  # pragma: no cover - excluded by the optimum's minimality
    pools = {kind: [b] * n for kind, n, b in zip(kinds, num_pipelines, most, strict=True)}
    pools[kinds[j]][num_pipelines[j] - lowered:] = [most[j] - 1] * lowered
    taken = {kind: iter(pool) for kind, pool in pools.items()}
    return optimum, [next(taken[layout]) for layout in layouts]


def _fitting(kind: K, m: int, cost: Callable[[K, int], float]) -> int:
    """``m``, or the largest count below it whose step is finite (1 at least): a start
    beyond what fits would only be walked back one micro-batch at a time."""
    if math.isfinite(cost(kind, m)) or m <= 1:
        return m
    lo, hi = 1, m  # cost(hi) is infinite; find the largest finite count below it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if math.isfinite(cost(kind, mid)):
            lo = mid
        else:
            hi = mid
    return lo


def _move(counts: dict[tuple[K, int], int], kind: K, src: int, dst: int, n: int = 1) -> None:
    counts[(kind, src)] -= n
    counts[(kind, dst)] = counts.get((kind, dst), 0) + n

