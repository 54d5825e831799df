"""The unified performance model: step time and per-device memory of ANY plan.

``estimate(plan, profile, topology)`` prices failure-free, rerouted and heterogeneous plans
with one ruler (docs/design.md section 3):

1. the compute phase: the dependency graph of every pipeline's forward and backward
   operations, list-scheduled per worker (:mod:`chameleon_ft.perf.timeline`), with P2P
   transfers by link type;
2. gradient synchronisation: one ring all-reduce per *bucket* of layers held by the same
   set of workers (a layer's gradient is reduced over every live worker holding it);
   buckets sharing a worker cannot run together, so they are grouped into rounds by DSATUR
   colouring; a bucket starts when all its workers are done with compute and with their
   earlier rounds; for a model whose head is tied to its embedding, one more all-reduce
   after the rounds sums the two copies' gradients over the holders of either layer
   (:mod:`chameleon_ft.perf.sync`);
3. the step commit (every worker has reduced: a barrier plus the profile's measured
   control time), then the optimizer step of each worker, in proportion to the
   parameters it holds.

Symmetry: pipelines untouched by reroutes are independent, and pipelines with the same
stage layout, speeds and link pattern have identical timelines, so each distinct one is
simulated once. A 16,384-device failure-free plan costs one pipeline's simulation;
pipelines linked by reroutes are simulated together, once per shape
(:mod:`chameleon_ft.perf.components`). The estimate reads the timelines as rows, one per
pipeline (:mod:`chameleon_ft.perf.rows`).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.perf.components import _components, _relabel, component_key
from chameleon_ft.perf.gcpause import gc_paused
from chameleon_ft.perf.graph import component_order, splits_backward
from chameleon_ft.perf.list_scheduler import Timeline
from chameleon_ft.perf.network import Topology
from chameleon_ft.perf.rows import _idle_sum, _optimizer_rows, _peak_rows, _ready_by_range, _Row
from chameleon_ft.perf.sync import Bucket, synchronise
from chameleon_ft.perf.timeline import best_timeline
from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.profile.profile import Profile, chunk_sums

_WORKERS_OF = operator.attrgetter("workers")
_RANGES_OF = operator.attrgetter("layer_ranges")
_ITEM_0, _ITEM_1, _ITEM_2 = map(operator.itemgetter, range(3))
_MICROBATCHES = operator.attrgetter("num_microbatches")


@dataclass(frozen=True)
class Breakdown:
    """Where the step's time goes, along its critical path.

    ``compute_s + p2p_s + allreduce_s + control_s + optimizer_s == step_s``: the compute
    phase's critical path split into operation time and transfer time (transfers include
    any wait that is not computation), then the gradient synchronisation until the last
    worker is done, the step commit, and the slowest optimizer step. ``idle_s`` is
    separate: the mean time a worker spends neither computing, reducing nor stepping
    (the pipeline bubble).
    """

    compute_s: float
    p2p_s: float
    allreduce_s: float
    optimizer_s: float
    idle_s: float
    control_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return {"compute_s": self.compute_s, "p2p_s": self.p2p_s,
                "allreduce_s": self.allreduce_s, "control_s": self.control_s,
                "optimizer_s": self.optimizer_s, "idle_s": self.idle_s}


@dataclass(frozen=True)
class Estimate:
    """The estimator's answer for one plan."""

    step_s: float
    """Seconds per optimizer step."""
    throughput_samples_s: float
    """Samples per second: global batch / step_s."""
    throughput_tokens_s: float
    """Tokens per second (0 when the profile does not know the sequence length)."""
    bubble_fraction: float
    """Mean idle share of a worker's step."""
    peak_memory_bytes: Mapping[int, float]
    """Per live worker, the peak bytes on each of its devices."""
    max_memory_bytes: float
    """The largest of ``peak_memory_bytes``."""
    memory_capacity_bytes: float
    """One device's memory (infinite when unknown)."""
    memory_fits: bool
    """Whether every worker fits in its devices' memory."""
    breakdown: Breakdown
    sync_rounds: tuple[tuple[Bucket, ...], ...] = field(repr=False, default=())
    """The gradient all-reduce rounds."""
    tie_workers: tuple[int, ...] = ()
    """The workers of the tied copies' all-reduce after the rounds (:func:`tie_members`);
    empty when the model is untied or the sum is local."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (memory capacity ``null`` when unknown)."""
        cap = self.memory_capacity_bytes
        return {
            "step_s": self.step_s,
            "throughput_samples_s": self.throughput_samples_s,
            "throughput_tokens_s": self.throughput_tokens_s,
            "bubble_fraction": self.bubble_fraction,
            "memory_fits": self.memory_fits,
            "peak_memory_bytes": self.max_memory_bytes,
            "memory_capacity_bytes": None if math.isinf(cap) else cap,
            "breakdown": self.breakdown.to_dict(),
        }


CACHED_PLAN_WORKERS = 2 ** 21
"""Bound on the whole-plan estimates kept, counted in workers: a kept estimate holds its
plan and a per-worker memory table (about 0.3 MB per 1,000 workers with the plan's own
tables), so the cache keeps 4,096 estimates of jobs up to 512 workers, 1,024 of 2,048 and
256 of 8,192 workers: a few hundred MB at any scale (issue 19). Eviction only costs time:
an estimate is a pure function of its plan."""


def default_cache_size(num_workers: int) -> int:
    """Whole-plan estimates an :class:`Estimator` keeps for a cluster of ``num_workers``."""
    return max(64, min(4096, CACHED_PLAN_WORKERS // max(1, num_workers)))


_PlanKey = tuple[ExecutionPlan, tuple[tuple[int, float], ...]]
"""A whole-plan estimate's key: the plan and the workers' speeds (none: unit speed)."""


class Estimator:
    """Estimates plans for one profile and topology, memoising identical pipelines.

    Args:
        profile: per-layer costs.
        topology: workers, nodes and links.
        cache_size: how many whole-plan estimates (and component timelines) to keep;
            default :func:`default_cache_size` of the topology's workers.
    """

    def __init__(self, profile: Profile, topology: Topology,
                 cache_size: int | None = None) -> None:
        if cache_size is None:
            cache_size = default_cache_size(topology.num_workers)
        self.profile = profile
        self.topology = topology
        self._held: tuple[ExecutionPlan, Estimate] | None = None
        self._plans: OrderedDict[_PlanKey, tuple[_PlanKey, Estimate]] = OrderedDict()
        """Whole-plan estimates, least recently used first, each kept with its own key: an
        equal plan built anew finds it with one comparison of thousands of pipelines, and
        the move to the end looks the kept key up, itself, at once."""
        self._pipelines: dict[tuple[Any, ...], Timeline] = {}
        self._pipeline_keys: dict[int, tuple[Any, str, tuple[Any, ...]]] = {}
        self._components: OrderedDict[tuple[Any, ...], Timeline] = OrderedDict()
        self._stage: dict[tuple[int, int], Any] = {}
        self._ranges: dict[tuple[int, int], tuple[float, float, float]] = {}
        self._cache_size = cache_size

    def _range_cost(self, layers: range) -> tuple[float, float, float]:
        """What a worker holding ``layers`` costs besides its operations: its optimizer
        step's seconds (at unit speed), its resident bytes (parameters, gradients,
        optimizer state) and one layer's backward workspace (the largest)."""
        key = (layers.start, layers.stop)
        value = self._ranges.get(key)
        if value is None:
            profile = self.profile
            value = self._ranges[key] = (
                profile.optimizer_s(layers),
                sum(profile.layers[i].static_bytes for i in layers),
                max((profile.layers[i].workspace_bytes for i in layers), default=0.0))
        return value

    def _stage_cost(self, lo: int, hi: int) -> Any:
        """The per-chunk costs of a stage holding layers (columns) ``[lo, hi)``."""
        key = (lo, hi)
        cost = self._stage.get(key)
        if cost is None:
            cost = chunk_sums(self.profile, lo, hi)
            self._stage[key] = cost
        return cost

    def _pipeline_key(self, plan: ExecutionPlan, p: int,
                      speeds: Mapping[int, float]) -> tuple[Any, ...]:
        """What a lone pipeline's timeline depends on: layout, speeds, links, schedule."""
        pipe = plan.pipelines[p]
        if not speeds:
            # Plans share pipeline objects: remember each one's key by identity.
            known = self._pipeline_keys.get(id(pipe))
            if known is not None and known[0] is pipe and known[1] == plan.schedule:
                return known[2]
        node_of = self.topology.node_of
        # which neighbouring stages share a node (with one worker per node, none can)
        links: tuple[bool, ...] | bool = (
            False if self.topology.workers_per_node == 1
            else tuple(node_of(a) == node_of(b) for a, b in itertools.pairwise(pipe.workers)))
        if speeds:
            return (plan.schedule, pipe.num_microbatches,
                    tuple((st.first_layer, st.end_layer, speeds.get(st.worker, 1.0))
                          for st in pipe.stages),
                    links)
        # every stage at unit speed: the layout (kept with the pipeline) says it all
        key = (plan.schedule, pipe.num_microbatches, pipe.layout, links)
        if len(self._pipeline_keys) > 16 * self._cache_size:
            # the entries hold their pipelines alive: forget them all now and then
            self._pipeline_keys.clear()
        self._pipeline_keys[id(pipe)] = (pipe, plan.schedule, key)
        return key

    def _canonical_pipeline(self, plan: ExecutionPlan, p: int, speeds: Mapping[int, float],
                            brute_force: bool, with_ops: bool = False) -> Timeline:
        """Timeline of a pipeline without reroutes on workers ``0..S-1`` (stage indices),
        shared by all identical pipelines. Its op lists are built only when asked for
        (estimates need the timings alone), then kept."""
        if speeds and not brute_force:
            # a pipeline none of whose workers is slow is its unit-speed self, exactly
            speeds = _own_speeds(speeds, plan.pipelines[p].workers)
        key = None if brute_force else self._pipeline_key(plan, p, speeds)
        cached = None if key is None else self._pipelines.get(key)
        if cached is None or (with_ops and not cached.ops):
            # Simulate on canonical workers 0..S-1 of one plan holding only this pipeline;
            # the link pattern is part of the key, so reuse is exact.
            pipe = plan.pipelines[p]
            costs = {(p, s): self._stage_cost(st.first_layer, st.end_layer)
                     for s, st in enumerate(pipe.stages)}
            cached = best_timeline(plan, self.profile, self.topology, [p], speeds, costs,
                                   with_ops=with_ops)
            cached = _relabel(cached, {st.worker: s for s, st in enumerate(pipe.stages)},
                              keep_ops=with_ops)
            if key is not None:
                self._pipelines[key] = cached
        return cached

    def _single_pipeline(self, plan: ExecutionPlan, p: int, speeds: Mapping[int, float],
                         brute_force: bool, with_ops: bool) -> Timeline:
        """Timeline of a pipeline without reroutes, shared by all identical pipelines."""
        cached = self._canonical_pipeline(plan, p, speeds, brute_force, with_ops)
        workers = [st.worker for st in plan.pipelines[p].stages]
        return _relabel(cached, dict(enumerate(workers)), pipeline=p, keep_ops=with_ops)

    def timelines(self, plan: ExecutionPlan, speeds: Mapping[int, float] | None = None,
                  brute_force: bool = False, with_ops: bool = True) -> list[Timeline]:
        """Simulate the compute phase, one timeline per connected group of pipelines.

        With ``with_ops`` false the per-worker operation lists of shared (symmetric)
        pipelines may be left empty: the estimate only needs the timings.
        """
        speeds = speeds or {}
        out = []
        for group, lone in _components(plan):
            if lone:
                out.append(self._single_pipeline(plan, group[0], speeds, brute_force,
                                                 with_ops))
            else:
                out.append(self._component(plan, group, speeds, brute_force, with_ops))
        return out

    def _component(self, plan: ExecutionPlan, group: list[int], speeds: Mapping[int, float],
                   brute_force: bool, with_ops: bool) -> Timeline:
        """Timeline of pipelines linked by reroutes, shared by every component of the same
        shape.

        The shape names pipelines, workers and nodes by first appearance, walking from the
        rerouted pipelines through the peers in their share order, so the same damage
        elsewhere in the cluster (or next to other, unrelated damage) is one simulation.
        """
        def costs() -> dict[tuple[int, int], Any]:
            return {(p, s): self._stage_cost(st.first_layer, st.end_layer)
                    for p in group for s, st in enumerate(plan.pipelines[p].stages)}

        if brute_force or with_ops:
            return best_timeline(plan, self.profile, self.topology, group, speeds, costs())
        if speeds:
            # only its own workers' speeds shape a component: without a slow one it is
            # its unit-speed self (and shares that simulation)
            speeds = _own_speeds(speeds, itertools.chain.from_iterable(
                plan.pipelines[p].workers for p in group))
        # The simulation builds and ranks the pipelines in this order, never by index, so
        # a shared simulation is exactly the one this component would get.
        order = component_order(plan, group)
        key, worker_ids = component_key(plan, order, speeds, self.topology)
        cached = self._components.get(key)
        if cached is None:
            # With fused backwards the intact pipelines of the component keep every
            # operation, link and stream order they had alone, so none can finish before
            # its failure-free makespan. A peer that splits its backward (deferred weight
            # gradients) sends input gradients upstream sooner than its fused self and can
            # finish earlier: then there is no such bound.
            bound = 0.0
            if not splits_backward(plan):
                rerouted = {r.pipeline for r in plan.reroutes}
                bound = max((self._canonical_pipeline(plan, p, speeds, False).makespan_s
                             for p in group if p not in rerouted), default=0.0)
            timeline = best_timeline(plan, self.profile, self.topology, group, speeds, costs(),
                                     with_ops=False, lower_bound_s=bound)
            cached = _relabel(timeline, worker_ids, keep_ops=False)
            self._components[key] = cached
            if len(self._components) > self._cache_size:
                self._components.popitem(last=False)
        else:
            self._components.move_to_end(key)
        return _relabel(cached, dict(zip(worker_ids.values(), worker_ids, strict=True)),
                        keep_ops=False)

    def estimate(self, plan: ExecutionPlan, speeds: Mapping[int, float] | None = None,
                 brute_force: bool = False) -> Estimate:
        """Estimate ``plan``.

        Args:
            plan: a valid plan.
            speeds: relative speed per worker (default 1.0).
            brute_force: simulate every pipeline, without the symmetry shortcut or caches
                (for tests).

        Returns:
            Step time, throughput, memory and breakdown.
        """
        speeds = dict(speeds or {})
        key = (plan, tuple(sorted(speeds.items())))
        if not brute_force:
            hit = self._plans.get(key)
            if hit is not None:
                self._plans.move_to_end(hit[0])
                return hit[1]
        with gc_paused():  # see gcpause.py: the graphs are many small containers
            result = self._estimate(plan, speeds, brute_force)
        if not brute_force:
            self._keep(key, result)
        return result

    def _keep(self, key: _PlanKey, estimate: Estimate) -> None:
        """Keep a whole-plan estimate, dropping the oldest beyond the cache size."""
        self._plans[key] = (key, estimate)
        if len(self._plans) > self._cache_size:
            self._plans.popitem(last=False)

    def known(self, plan: ExecutionPlan) -> Estimate | None:
        """``plan``'s kept estimate at unit speed (the one :meth:`hold` holds for it, else
        the cache's), ``None`` when none is kept."""
        held = self._held
        if held is not None and held[0] is plan:
            return held[1]
        found = self._plans.get((plan, ()))
        return found[1] if found is not None else None

    def hold(self, plan: ExecutionPlan, estimate: Estimate) -> None:
        """Hold ``estimate`` as ``plan``'s for :meth:`known`, by identity, until the next
        hold: a decision's winner, which the next event asks for as it is (a plan of
        thousands of pipelines is not hashed to be kept in the cache)."""
        self._held = (plan, estimate)

    def remember(self, plan: ExecutionPlan, estimate: Estimate) -> None:
        """Keep ``estimate`` as ``plan``'s at unit speed, unless one is kept already: one
        carried over from the same plan in other worker names (``policy/renaming.py``)."""
        key = (plan, ())
        if key not in self._plans:
            self._keep(key, estimate)

    def uncached(self, plan: ExecutionPlan) -> Estimate:
        """``plan``'s estimate at unit speed computed now, whatever is kept for it (its
        pipelines' timelines are still looked up)."""
        with gc_paused():
            return self._estimate(plan, {}, False)

    def _rows(self, plan: ExecutionPlan, speeds: Mapping[int, float], brute_force: bool
              ) -> tuple[list[_Row], float, tuple[float, float, float]]:
        """Each pipeline's live stages with their simulated figures (:class:`_Row`), in
        pipeline order; the latest finish of any simulated worker; and the critical
        component's (makespan, compute, transfers)."""
        rows: list[_Row] = []
        components = _components(plan)
        latest, ending = self._lone_rows(plan, [group[0] for group, lone in components if lone],
                                         speeds, brute_force, rows)
        for group, lone in components:
            if lone:
                continue
            tl = self._component(plan, group, speeds, brute_force, with_ops=False)
            latest = max(latest, max(tl.finish_s.values(), default=latest))
            dead = plan.reroute_map
            for p in group:
                pipe = plan.pipelines[p]
                live = [s for s in range(len(pipe.stages)) if (p, s) not in dead]
                workers = tuple([pipe.workers[s] for s in live])
                rows.append(_Row(
                    p, None, tl, workers, tuple([pipe.layer_ranges[s] for s in live]),
                    tuple(map(tl.finish_s.__getitem__, workers)),
                    tuple([tl.busy_s.get(w, 0.0) for w in workers]),
                    tuple([tl.peak_activation_bytes.get(w, 0.0) for w in workers])))
            # the critical component: the last, in pipeline order, with the longest makespan
            if ending is None or (tl.makespan_s, group[0]) >= (ending[1].makespan_s, ending[0]):
                ending = (group[0], tl)
        critical = (0.0, 0.0, 0.0)
        if ending is not None:
            tl = ending[1]
            critical = (tl.makespan_s, tl.critical_compute_s, tl.critical_p2p_s)
        rows.sort(key=lambda row: row.pipeline)
        return rows, latest, critical

    def _lone_rows(self, plan: ExecutionPlan, lone: list[int], speeds: Mapping[int, float],
                   brute_force: bool, rows: list[_Row]
                   ) -> tuple[float, tuple[int, Timeline] | None]:
        """The rows of the lone pipelines ``lone`` (pipelines without reroutes, in order),
        appended to ``rows``: each pipeline's shared timeline, read by stage once per
        timeline, the rows built at C speed. At unit speed with one worker per node a
        timeline depends only on the layout and micro-batches, so it is looked up once per
        shared (range row, micro-batches). Returns the latest finish of those timelines and
        the last of the pipelines with the longest makespan, with its timeline."""
        if not lone:
            return -math.inf, None
        pipelines = plan.pipelines
        pipes = list(map(pipelines.__getitem__, lone))
        ranges = list(map(_RANGES_OF, pipes))
        if not speeds and not brute_force and self.topology.workers_per_node == 1:
            shapes = list(zip(map(id, ranges), map(_MICROBATCHES, pipes), strict=True))
            first = dict(zip(reversed(shapes), reversed(lone), strict=True))  # lowest index
            of_shape = {shape: self._canonical_pipeline(plan, p, speeds, brute_force)
                        for shape, p in first.items()}
            timelines = list(map(of_shape.__getitem__, shapes))
        else:
            timelines = [self._canonical_pipeline(plan, p, speeds, brute_force) for p in lone]
        ids = list(map(id, timelines))  # every timeline is kept by its rows
        figures: dict[int, tuple[tuple[float, ...], ...]] = {}
        latest = -math.inf
        for key, (tl, pipe) in dict(zip(ids, zip(timelines, pipes, strict=True), strict=True)).items():
            stages = range(len(pipe.stages))
            found = figures[key] = tuple(tuple(map(by_stage.__getitem__, stages))
                                         for by_stage in (tl.finish_s, tl.busy_s,
                                                          tl.peak_activation_bytes))
            latest = max(latest, max(found[0], default=latest))
        looked_up = list(map(figures.__getitem__, ids))
        rows.extend(map(_Row, lone, zip(ids, map(id, ranges), strict=True), timelines,
                        map(_WORKERS_OF, pipes), ranges, map(_ITEM_0, looked_up),
                        map(_ITEM_1, looked_up), map(_ITEM_2, looked_up)))
        longest = max(tl.makespan_s for tl in timelines)
        last = max(p for p, tl in zip(lone, timelines, strict=True) if tl.makespan_s == longest)
        return latest, (last, timelines[lone.index(last)])

    def _estimate(self, plan: ExecutionPlan, speeds: Mapping[int, float],
                  brute_force: bool) -> Estimate:
        profile, topo = self.profile, self.topology
        rows, latest, (makespan, critical_compute, critical_p2p) = self._rows(
            plan, speeds, brute_force)
        reduced_s, sync_s, sync_rounds, tie = synchronise(
            plan, profile, topo, _ready_by_range(rows), latest)
        # The step commits once every worker has reduced (a barrier, plus the control
        # plane's own time); only then does any worker step its optimizer.
        commit_s = reduced_s + profile.control_s
        costs = {layers: self._range_cost(layers) for layers in sync_s}
        opt_rows = _optimizer_rows(rows, costs, speeds)
        optimizer = max(itertools.chain.from_iterable(opt_rows))
        step_s = commit_s + optimizer
        allreduce = commit_s - profile.control_s - makespan
        capacity = topo.memory_capacity_bytes
        peak_rows = _peak_rows(rows, costs)
        max_memory = max(itertools.chain.from_iterable(peak_rows), default=0.0)
        num_live = sum(len(row.workers) for row in rows)
        idle_s = max(0.0, _idle_sum(rows, opt_rows, sync_s, step_s, profile.control_s,
                                    shared=not speeds) / num_live)
        samples_s = plan.global_batch / step_s if step_s > 0 else math.inf
        return Estimate(
            step_s=step_s,
            throughput_samples_s=samples_s,
            throughput_tokens_s=samples_s * profile.tokens_per_sample,
            bubble_fraction=idle_s / step_s if step_s > 0 else 0.0,
            peak_memory_bytes=dict(zip(
                itertools.chain.from_iterable(row.workers for row in rows),
                itertools.chain.from_iterable(peak_rows), strict=True)),
            max_memory_bytes=max_memory,
            memory_capacity_bytes=capacity,
            memory_fits=max_memory <= capacity,
            breakdown=Breakdown(compute_s=critical_compute, p2p_s=critical_p2p,
                                allreduce_s=allreduce, control_s=profile.control_s,
                                optimizer_s=optimizer, idle_s=idle_s),
            sync_rounds=sync_rounds,
            tie_workers=tie,
        )

def _own_speeds(speeds: Mapping[int, float], workers: Iterable[int]) -> dict[int, float]:
    """The speeds of ``workers`` among ``speeds`` (a timeline depends on its own workers'
    speeds alone: every other worker's is not read)."""
    return {w: speeds[w] for w in workers if w in speeds}


_ESTIMATORS: OrderedDict[tuple[int, int], Estimator] = OrderedDict()


def estimator_for(profile: Profile, topology: Topology) -> Estimator:
    """A shared :class:`Estimator` for this (profile, topology) pair (kept for reuse)."""
    key = (id(profile), id(topology))
    est = _ESTIMATORS.get(key)
    if est is None or est.profile is not profile or est.topology is not topology:
        est = Estimator(profile, topology)
        _ESTIMATORS[key] = est
        if len(_ESTIMATORS) > 8:
            _ESTIMATORS.popitem(last=False)
    return est


def speeds_from_factors(factors: Mapping[int, float],
                        workers: Container[int] | None = None) -> dict[int, float]:
    """The relative speeds the estimator divides each operation's duration by, from
    slowdown factors: a worker at factor ``F`` computes ``F`` times slower (speed ``1/F``);
    its transfers and all-reduces are not slowed (a fail-slow of a GPU or its host; a slow
    link is the network's, and the model keeps links uniform).

    Args:
        factors: worker -> slowdown factor (>= 1).
        workers: keep only these workers (a plan's): others change no estimate, and the
            estimate's cache key names only what matters.

    Returns:
        Worker -> speed for every factor above 1, in worker order: a factor of 1 leaves
        the worker out, so its estimate is the unit-speed one, exactly.

    Raises:
        ValueError: for a factor that is not a finite number >= 1.
    """
    out: dict[int, float] = {}
    for worker in sorted(factors):
        factor = factors[worker]
        if isinstance(factor, bool) or not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"slow: worker {worker}'s factor must be a finite number >= 1, "
                             f"got {factor!r}")
        if factor > 1.0 and (workers is None or worker in workers):
            out[worker] = 1.0 / factor
    return out


def estimate(plan: ExecutionPlan, profile: Profile, topology: Topology, *,
             speeds: Mapping[int, float] | None = None, brute_force: bool = False,
             slow: Mapping[int, float] | None = None) -> Estimate:
    """Estimate the step time and per-device memory of ``plan``.

    Args:
        plan: any valid plan: failure-free, rerouted or heterogeneous.
        profile: per-layer costs.
        topology: workers, nodes and links (``Topology.from_config(config)``).
        speeds: relative speed per worker (default 1.0).
        brute_force: skip the symmetry shortcut and caches (for tests).
        slow: slowdown factor per worker (:func:`speeds_from_factors`), instead of
            ``speeds``.

    Returns:
        An :class:`Estimate`.

    Raises:
        ValueError: when a worker of the plan does not exist in the topology, for a bad
            factor, or when both ``speeds`` and ``slow`` are given.
    """
    for w in plan.workers:
        if not 0 <= w < topology.num_workers:
            raise ValueError(f"plan: worker {w} is outside the cluster's "
                             f"{topology.num_workers} workers")
    if slow is not None:
        if speeds is not None:
            raise ValueError("estimate: give speeds or slow factors, not both")
        speeds = speeds_from_factors(slow, plan.stage_of_worker)
    return estimator_for(profile, topology).estimate(plan, speeds, brute_force)
