"""Pipeline templates: one balanced layer split per pipeline length, timed per micro-batch
count, computed once per job (they do not depend on which worker failed).

A template for length ``l`` is the min-max balanced split of the profile's per-layer
costs (``plan.balanced_bounds``); when it does not fit device memory (early stages keep
more micro-batches in flight under 1F1B), a memory-constrained min-max split is used
instead. The step time of one pipeline of a given layout running ``m`` micro-batches comes
from the estimator on a one-pipeline plan and is memoised, so a search asks the estimator
about each ``(layout, m)`` once per job.

Small jobs are searched exactly: with at most ``EXHAUSTIVE_MAX_LAYERS`` layers and
``EXHAUSTIVE_MAX_MICROBATCHES`` micro-batches per step, every layer split is tried and
each ``(length, m)`` uses the fastest one (with few micro-batches the balanced split is
not always best: the fill and drain and the per-stage optimizer step weigh more than the
slowest stage). Larger models use the template alone.

:func:`allocate` splits the global batch's micro-batches over pipelines to minimise the
slowest pipeline, exactly, for any step-time functions that do not decrease with ``m``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from chameleon_ft.perf.closed_form import in_flight
from chameleon_ft.perf.schedule import peak_activation
from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage, balanced_bounds, layer_costs
from chameleon_ft.plan.partition import bounds_from_cuts
from chameleon_ft.profile import Profile, chunk_sums

Layout = tuple[tuple[int, int], ...]
"""Layer bounds ``(first, end)`` of each stage of a pipeline."""

EXHAUSTIVE_MAX_LAYERS = 8
"""Models with more layers use the template alone."""
EXACT_MAX_OPS = 8_000
"""One-pipeline estimates with more operations (2 x chunks x micro-batches x stages) are
extrapolated from the steady state (:meth:`Templates.step_s`)."""
EXHAUSTIVE_MAX_MICROBATCHES = 16
"""Jobs with more micro-batches per step use the template alone (each ``(length, m)``
would price every split of every length)."""

K = TypeVar("K", bound=Hashable)

PipelineEstimate = Callable[[ExecutionPlan], tuple[float, bool]]
"""``one-pipeline plan -> (step_s, memory fits)``."""


def stage_memory_bytes(profile: Profile, lo: int, hi: int, held: float) -> float:
    """Eq. 14 for one stage: static bytes plus ``held`` micro-batches of activations."""
    layers = profile.layers[lo:hi]
    return sum(c.static_bytes + held * c.activation_bytes for c in layers)


def memory_bounds(profile: Profile, num_stages: int, capacity_bytes: float,
                  schedule: str = "1f1b") -> Layout | None:
    """Min-max balanced split subject to Eq. 14 memory per stage; ``None`` when none fits.

    Stage ``i`` keeps ``num_stages - i`` micro-batches in flight under 1F1B (all of them
    under GPipe, bounded here by ``num_stages`` as a conservative cap); the other
    schedules and interleaved chunks per :func:`chameleon_ft.perf.closed_form.in_flight`.
    """
    costs = layer_costs(profile)
    n = len(costs)
    prefix = [0.0]
    static = [0.0]
    act = [0.0]
    for c, layer in zip(costs, profile.layers, strict=True):
        prefix.append(prefix[-1] + c)
        static.append(static[-1] + layer.static_bytes)
        act.append(act[-1] + layer.activation_bytes)
    # Some stage holds at least the average static bytes: no split can fit below that.
    if static[n] / num_stages > capacity_bytes:
        return None
    inf = math.inf
    # best[k][i]: smallest max stage cost placing layers [0, i) in stages 0..k-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        held = in_flight(schedule, num_stages, k - 1, profile.virtual_stages)
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(i - 1, k - 2, -1):
                # memory grows as the stage start j moves left: stop at the first overflow
                if (static[i] - static[j]) + held * (act[i] - act[j]) > capacity_bytes:
                    break
                if best[k - 1][j] == inf:
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    if best[num_stages][n] == inf:
        return None
    return tuple(bounds_from_cuts(cut, n, num_stages))


def order_fits(profile: Profile, layout: Layout, num_microbatches: int, schedule: str,
               capacity_bytes: float, padded: bool | None = None,
               stage_bytes: Sequence[tuple[float, list[float]]] | None = None) -> bool:
    """Whether one pipeline of ``layout`` fits device memory under some order variant the
    estimator tries (:func:`~chameleon_ft.perf.schedule.schedule_variants`): each stage's
    resident bytes plus the activation peak of its operation order
    (:func:`~chameleon_ft.perf.schedule.peak_activation`). A lone pipeline's workers run
    their orders as they are, so the peak does not depend on timing, and the estimator
    keeps a variant that fits whenever one does: the estimator's verdict. ``padded``
    asks about one interleaved variant only; ``stage_bytes`` (each stage's resident bytes
    and per-chunk activations, :func:`layout_bytes`) saves recomputing them."""
    stages = len(layout)
    padding = ((False, True) if schedule == "interleaved" and profile.virtual_stages > 1
               else (False,))
    if padded is not None:
        padding = (padded,)
    sizes = stage_bytes if stage_bytes is not None else layout_bytes(profile, layout)
    for padded in padding:
        for s, (static, acts) in enumerate(sizes):
            if static + peak_activation(acts, stages, s, num_microbatches, schedule,
                                        padded) > capacity_bytes:
                break
        else:
            return True
    return False


def layout_bytes(profile: Profile, layout: Layout) -> list[tuple[float, list[float]]]:
    """Per stage of ``layout``: its resident bytes and each chunk's activation bytes."""
    return [(sum(layer.static_bytes for layer in profile.layers[lo:hi]),
             [c.activation_bytes for c in chunk_sums(profile, lo, hi)])
            for lo, hi in layout]


class Templates:
    """Per-length layouts and memoised one-pipeline step times for one job."""

    def __init__(self, profile: Profile, *, capacity_bytes: float, micro_batch: int,
                 schedule: str, num_workers: int, workers_per_node: int,
                 pipeline_estimate: PipelineEstimate, num_microbatches: int = 1) -> None:
        """Args:
            profile: per-layer costs.
            capacity_bytes: one device's memory.
            micro_batch: samples per micro-batch of the job.
            schedule: the job's schedule (its plans keep it).
            num_workers: workers in the cluster (placeholder ids stay within it).
            workers_per_node: to place a template's stages on distinct nodes.
            pipeline_estimate: prices a one-pipeline plan.
            num_microbatches: micro-batches per step of the job (decides whether every
                layer split is tried).
        """
        self.profile = profile
        self.capacity_bytes = capacity_bytes
        self.micro_batch = micro_batch
        self.schedule = schedule
        self.num_workers = num_workers
        self.workers_per_node = workers_per_node
        self._pipeline_estimate = pipeline_estimate
        self.exhaustive = (profile.num_layers <= EXHAUSTIVE_MAX_LAYERS
                           and num_microbatches <= EXHAUSTIVE_MAX_MICROBATCHES)
        """Whether every layer split is tried (small jobs)."""
        self._layouts: dict[int, Layout | None] = {}
        self._candidates: dict[int, list[Layout]] = {}
        self._best: dict[tuple[int, int], tuple[float, Layout | None]] = {}
        self._steps: dict[tuple[Layout, int], float] = {}
        self._exact_steps: dict[tuple[Layout, int], tuple[float, bool]] = {}
        self._layout_bytes: dict[Layout, list[tuple[float, list[float]]]] = {}
        self.num_estimates = 0
        self.memo: dict[tuple[Any, ...], Any] = {}
        """Search results that depend only on these templates and the key (the dynamic
        search's ranked partitions of a survivor count, and its micro-batch splits)."""
        """How many one-pipeline estimates were run (for benchmarks)."""

    @property
    def num_layers(self) -> int:
        """Layers of the model."""
        return self.profile.num_layers

    def _placeholders(self, length: int) -> list[int]:
        # Spread stages over nodes as a stage-major job does, so P2P is priced over the
        # inter-node link (the conservative case); ids stay inside the cluster.
        num_nodes = max(1, self.num_workers // self.workers_per_node)
        return [(i % num_nodes) * self.workers_per_node + i // num_nodes for i in range(length)]

    def one_pipeline(self, layout: Layout, num_microbatches: int) -> ExecutionPlan:
        """A plan of one pipeline with ``layout`` (placeholder workers)."""
        workers = self._placeholders(len(layout))
        stages = tuple(Stage(w, lo, hi) for w, (lo, hi) in zip(workers, layout, strict=True))
        return ExecutionPlan(num_layers=self.num_layers,
                             pipelines=(Pipeline(stages, num_microbatches),),
                             micro_batch=self.micro_batch, schedule=self.schedule)

    def step_s(self, layout: Layout, num_microbatches: int) -> float:
        """Step seconds of one pipeline with ``layout`` running ``num_microbatches``;
        infinity when it does not fit memory.

        Above :data:`EXACT_MAX_OPS` operations per step the pipeline is in its steady
        state: each micro-batch adds what one added between the last two multiples of
        ``S`` (``S`` = stages) in the exact range, the interleaved order's groups of at
        least ``S`` keep the step linear (the closed form holds for every count), and a
        count only the padded order fits is priced as the next multiple of ``S``
        (benchmarks/schedules.py, 16k job: within 0.5% of the exact figure where the
        larger groups fit, 7% where only padded ones do). Whether it
        fits is exact: a lone pipeline's activation peak follows from its stages' orders
        alone (:func:`order_fits`). The searches price their final plans with the
        estimator itself.
        """
        key = (layout, num_microbatches)
        value = self._steps.get(key)
        if value is None:
            stages = len(layout)
            limit = max(3 * stages, EXACT_MAX_OPS // (2 * self.profile.virtual_stages * stages))
            if num_microbatches > limit:
                # From the last two multiples of S in the exact range: their orders are
                # whole groups of S, a step of S micro-batches costs what they differ by.
                base = limit // stages * stages
                last, _ = self._exact(layout, base)
                before, _ = self._exact(layout, base - stages)
                per_mb = (last - before) / stages
                sizes = self._layout_bytes.get(layout)
                if sizes is None:
                    sizes = self._layout_bytes[layout] = layout_bytes(self.profile, layout)
                fits = order_fits(self.profile, layout, num_microbatches, self.schedule,
                                  self.capacity_bytes, padded=False, stage_bytes=sizes)
                count = num_microbatches
                if not fits and self.schedule == "interleaved" and order_fits(
                        self.profile, layout, num_microbatches, self.schedule,
                        self.capacity_bytes, padded=True, stage_bytes=sizes):
                    # padded groups: the next multiple of S, its missing micro-batches
                    # leaving their slots idle
                    fits, count = True, -(-num_microbatches // stages) * stages
                step = last + (count - base) * per_mb
            else:
                step, fits = self._exact(layout, num_microbatches)
            value = step if fits else math.inf
            self._steps[key] = value
        return value

    def _exact(self, layout: Layout, num_microbatches: int) -> tuple[float, bool]:
        """The estimator's step and memory verdict for one pipeline, memoised."""
        key = (layout, num_microbatches)
        found = self._exact_steps.get(key)
        if found is None:
            self.num_estimates += 1
            found = self._pipeline_estimate(self.one_pipeline(layout, num_microbatches))
            self._exact_steps[key] = found
        return found

    def layout(self, length: int) -> Layout | None:
        """The template of ``length`` stages, or ``None`` when no split fits memory."""
        if length in self._layouts:
            return self._layouts[length]
        result: Layout | None = None
        if 1 <= length <= self.num_layers and length <= self.num_workers:
            costs = layer_costs(self.profile)
            if any(costs):
                balanced: Layout = tuple(balanced_bounds(costs, length))
            else:
                base, extra = divmod(self.num_layers, length)
                bounds, lo = [], 0
                for s in range(length):
                    hi = lo + base + (1 if s >= length - extra else 0)
                    bounds.append((lo, hi))
                    lo = hi
                balanced = tuple(bounds)
            # Full in-flight depth is reached at ``length`` micro-batches under 1F1B.
            if math.isfinite(self.step_s(balanced, length)):
                result = balanced
            else:
                alternative = memory_bounds(self.profile, length, self.capacity_bytes,
                                            self.schedule)
                if alternative is not None and math.isfinite(self.step_s(alternative, length)):
                    result = alternative
        self._layouts[length] = result
        return result

    def candidate_layouts(self, length: int) -> list[Layout]:
        """Every layer split of ``length`` stages for small jobs, else the template."""
        found = self._candidates.get(length)
        if found is not None:
            return found
        out: list[Layout] = []
        if 1 <= length <= min(self.num_layers, self.num_workers):
            if self.exhaustive:
                for cuts in itertools.combinations(range(1, self.num_layers), length - 1):
                    bounds = (0, *cuts, self.num_layers)
                    out.append(tuple(itertools.pairwise(bounds)))
            else:
                template = self.layout(length)
                if template is not None:
                    out.append(template)
        self._candidates[length] = out
        return out

    def best(self, length: int, num_microbatches: int) -> tuple[float, Layout | None]:
        """The fastest candidate layout of ``length`` stages at ``num_microbatches`` and its
        step seconds (infinity and ``None`` when nothing fits)."""
        key = (length, num_microbatches)
        found = self._best.get(key)
        if found is None:
            found = (math.inf, None)
            for layout in self.candidate_layouts(length):
                step = self.step_s(layout, num_microbatches)
                if step < found[0]:
                    found = (step, layout)
            self._best[key] = found
        return found

    def length_step_s(self, length: int, num_microbatches: int) -> float:
        """Step seconds of the best pipeline of ``length`` stages (see :meth:`best`)."""
        return self.best(length, num_microbatches)[0]

    def feasible_lengths(self, max_length: int) -> list[int]:
        """Lengths ``1..max_length`` with a layout that fits memory with one micro-batch
        (the least memory a pipeline can need)."""
        return [length for length in range(1, max_length + 1)
                if math.isfinite(self.length_step_s(length, 1))]


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
             step_s: Callable[[K, int], float]) -> tuple[float, list[int]]:
    """Split ``num_microbatches`` over pipelines minimising the slowest one's step time.

    Start from the split in proportion to each pipeline's speed (its marginal seconds per
    micro-batch; no more than fits memory, as the step functions are non-decreasing), fill
    the remainder greedily, then move one micro-batch at a time from a
    slowest pipeline to the pipeline that would finish soonest with one more, while that
    lowers the maximum. The result is optimal when every ``step_s(layout, m)`` is
    non-decreasing in ``m``: at the fixed point no pipeline can take one more micro-batch
    and stay below the maximum, so any split with a smaller maximum would have to give
    some pipeline more and exceed it.

    Args:
        layouts: the kind of each pipeline (a layout, or a length whose best layout
            ``step_s`` picks); pipelines of one kind are interchangeable.
        num_microbatches: micro-batches per step over all pipelines.
        step_s: one pipeline's step time for ``(kind, m)``.

    Returns:
        ``(slowest pipeline's step seconds, micro-batches per pipeline)``; infinity when
        there are more pipelines than micro-batches or nothing fits.
    """
    k = len(layouts)
    if k == 0 or num_microbatches < k:
        return math.inf, []
    memo: dict[tuple[K, int], float] = {}

    def cost(kind: K, m: int) -> float:  # the caller's step_s, remembered for this call
        value = memo.get((kind, m))
        if value is None:
            value = memo[(kind, m)] = step_s(kind, m)
        return value

    kinds, counts, assigned = proportional_start(layouts, num_microbatches, cost)
    # Never start above the total: take back from the largest shares first, one
    # micro-batch at a time from the first group with the most. While that group is alone
    # above every other, it keeps being chosen level after level: it goes down in one go
    # (through the same keys in the same order, so ties later fall the same way).
    while assigned > num_microbatches:
        levels = [(key, c) for key, c in counts.items() if c and key[1] > 1]
        top = max(key[1] for key, _ in levels)
        (kind, m), group = next((key, c) for key, c in levels if key[1] == top)
        below = max((key[1] for key, _ in levels if key[1] < top), default=1)
        alone = sum(1 for key, _ in levels if key[1] == top) == 1
        excess = assigned - num_microbatches
        steps = min(top - below, excess // group) if alone else 0
        if steps >= 1:
            for level in range(m - 1, m - steps, -1):
                counts.setdefault((kind, level), 0)
            _move(counts, kind, m, m - steps, group)
            assigned -= steps * group
            continue
        moved = min(group, excess)  # the group stays first among the largest meanwhile
        _move(counts, kind, m, m - 1, moved)
        assigned -= moved
    # heap entries: (step with one more, kind's index, m); the index keeps kinds comparable
    index = {kind: i for i, kind in enumerate(kinds)}
    heap = [(cost(kind, m + 1), index[kind], m) for (kind, m), c in counts.items() if c]
    heapq.heapify(heap)
    while assigned < num_microbatches:
        value, i, m = heapq.heappop(heap)
        kind = kinds[i]
        group = counts.get((kind, m), 0)
        if group == 0:
            continue  # stale entry
        if not math.isfinite(value):
            return math.inf, []
        # The popped entry stays the smallest while its group lasts (every entry pushed
        # after it is at least as large and ties come later), so one pipeline at a time
        # would move the whole group in a row: move it at once.
        moved = min(group, num_microbatches - assigned)
        _move(counts, kind, m, m + 1, moved)
        assigned += moved
        heapq.heappush(heap, (cost(kind, m + 2), i, m + 1))
        if counts.get((kind, m), 0):
            heapq.heappush(heap, (cost(kind, m + 1), i, m))
    # The groups with pipelines, in the order they first appeared (ties in max and min go
    # to the earliest, as over the whole dict).
    first_seen = {key: i for i, key in enumerate(counts)}
    alive = {key for key, c in counts.items() if c}

    def shift(kind: K, src: int, dst: int, n: int) -> None:
        _move(counts, kind, src, dst, n)
        first_seen.setdefault((kind, dst), len(first_seen))
        alive.add((kind, dst))
        if not counts[(kind, src)]:
            alive.discard((kind, src))

    while True:
        live = sorted(alive, key=first_seen.__getitem__)
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
        # Moving one micro-batch leaves the same worst and best groups (the pipelines
        # moved end strictly between them) while both last, unless the worst kind's next
        # count down ties the worst step: then one move at a time.
        moved = 1
        if cost(worst[0], worst[1] - 1) < worst_s:
            moved = min(counts[worst], counts[best])
        if counts[worst] == 1:
            # A lone slowest pipeline gives one micro-batch at a time to the best group;
            # the next iterations would pick the same two while it stays strictly the
            # slowest, above the best's new step, and the best group lasts: take them
            # here without re-ranking (the same moves in the same order).
            (wk, wm), (bk, bm) = worst, best
            target = cost(bk, bm + 1)
            rivals = max([(cost(*key), -key[1]) for key in live if key != worst]
                         + [(target, -(bm + 1))])
            steps = 1
            while steps < counts[best] and wm - steps > 1:
                level_s = cost(wk, wm - steps)
                if not (level_s > target and (level_s, -(wm - steps)) > rivals):
                    break
                steps += 1
            for i in range(steps):
                shift(wk, wm - i, wm - i - 1, 1)
                shift(bk, bm, bm + 1, 1)
            continue
        shift(worst[0], worst[1], worst[1] - 1, moved)
        shift(best[0], best[1], best[1] + 1, moved)
    slowest = max(cost(*key) for key, c in counts.items() if c)
    pools: dict[K, list[int]] = {kind: [] for kind in kinds}
    for (kind, m), c in sorted(counts.items(), key=lambda item: -item[0][1]):
        pools[kind].extend([m] * c)
    out = [pools[layout].pop(0) for layout in layouts]
    return slowest, out


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
