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

import bisect
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from chameleon_ft.perf.closed_form import in_flight
from chameleon_ft.perf.orders import peak_activation
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
    estimator tries (:func:`~chameleon_ft.perf.graph.schedule_variants`): each stage's
    resident bytes plus the activation peak of its operation order
    (:func:`~chameleon_ft.perf.orders.peak_activation`). A lone pipeline's workers run
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
        self._priced: dict[int, dict[int, float]] = {}
        self._steps: dict[tuple[Layout, int], float] = {}
        self._exact_steps: dict[tuple[Layout, int], tuple[float, bool]] = {}
        self._layout_bytes: dict[Layout, list[tuple[float, list[float]]]] = {}
        self.num_estimates = 0
        """How many one-pipeline estimates were run (for benchmarks)."""
        self.memo: dict[tuple[Any, ...], Any] = {}
        """Search results that depend only on these templates (and the job's estimator)
        and the key: the dynamic search's ranked partitions of a survivor count and its
        micro-batch splits, and the prices of whole-plan shapes on a placement-free
        topology (``dynamic.placement_free_price``)."""

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
            self._priced.setdefault(length, {})[num_microbatches] = found[0]
        return found

    def length_step_s(self, length: int, num_microbatches: int) -> float:
        """Step seconds of the best pipeline of ``length`` stages (see :meth:`best`).

        Never decreases with ``num_microbatches`` (one more micro-batch adds operations to
        every stage's order and frees no memory): :func:`allocate` is exact under that
        assumption (tests/unit/test_recovery_templates.py checks it on the examples).
        """
        return self.best(length, num_microbatches)[0]

    def priced_steps(self, length: int) -> dict[int, float]:
        """``m -> step seconds`` of :meth:`length_step_s` for the counts priced so far (a
        copy: the search reads it while it prices more)."""
        return dict(self._priced.get(length, {}))

    def feasible_lengths(self, max_length: int) -> list[int]:
        """Lengths ``1..max_length`` with a layout that fits memory with one micro-batch
        (the least memory a pipeline can need)."""
        return [length for length in range(1, max_length + 1)
                if math.isfinite(self.length_step_s(length, 1))]

    def warm(self, num_workers: int, longest: int, num_microbatches: int,
             workers_per_node: int) -> None:
        """Time every feasible length up to ``longest`` at the micro-batch counts a
        re-plan after losing one worker or one node of ``num_workers`` asks for (its share
        of ``num_microbatches`` and the counts around it), so that a decision only prices
        whole plans."""
        total = num_microbatches
        for length in self.feasible_lengths(longest):
            for lost in sorted({1, workers_per_node}):
                survivors = num_workers - lost
                if survivors < length:
                    continue
                share = total * length / survivors
                wanted = set(range(max(1, math.floor(share) - 1), math.ceil(share) + 3))
                base = max(1, total // max(1, survivors // length))
                wanted.update((base, base + 1))
                for m in sorted(wanted):
                    self.length_step_s(length, m)


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
