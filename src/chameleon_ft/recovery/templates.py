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

The micro-batches of a plan's pipelines are split over them by ``allocation.allocate``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

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
        every stage's order and frees no memory): ``allocation.allocate`` is exact under
        that assumption (tests/unit/test_recovery_templates.py checks it on the examples).
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
