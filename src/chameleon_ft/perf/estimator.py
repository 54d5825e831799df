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
   after the rounds sums the two copies' gradients over the holders of either layer;
3. the step commit (every worker has reduced: a barrier plus the profile's measured
   control time), then the optimizer step of each worker, in proportion to the
   parameters it holds.

Symmetry: pipelines untouched by reroutes are independent, and pipelines with the same
stage layout, speeds and link pattern have identical timelines, so each distinct one is
simulated once. A 16,384-device failure-free plan costs one pipeline's simulation.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from chameleon_ft.perf.coloring import rounds
from chameleon_ft.perf.gcpause import gc_paused
from chameleon_ft.perf.graph import component_order, splits_backward
from chameleon_ft.perf.list_scheduler import Timeline
from chameleon_ft.perf.network import Topology
from chameleon_ft.perf.orders import Op
from chameleon_ft.perf.schedule import Bucket
from chameleon_ft.perf.timeline import best_timeline
from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.profile.profile import Profile, chunk_sums

_WORKERS_OF = operator.attrgetter("workers")
_RANGES_OF = operator.attrgetter("layer_ranges")
_ITEM_0, _ITEM_1, _ITEM_2 = map(operator.itemgetter, range(3))
_MICROBATCHES = operator.attrgetter("num_microbatches")
_LAYOUT_OF = operator.attrgetter("layout")


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


def sync_buckets(plan: ExecutionPlan, profile: Profile) -> list[tuple[Bucket, float]]:
    """Group layers by the set of live workers holding them, with each bucket's bytes.

    Returns:
        ``(bucket, gradient bytes per device)`` pairs, in layer order.
    """
    out = []
    for holders, layers in plan.layers_by_holders.items():
        grad_bytes = sum(profile.layers[i].param_bytes for i in layers)
        out.append((Bucket(holders, tuple(layers)), grad_bytes))
    return out


def sync_rounds(plan: ExecutionPlan, profile: Profile) -> tuple[tuple[Bucket, ...], ...]:
    """The gradient all-reduce rounds of ``plan`` (buckets with more than one worker).

    Each bucket's members hold its layers, as the runtime's all-reduce needs; the tied
    copies' sum, over workers that hold one of the two layers only, is not a bucket: it
    follows the rounds (:func:`tie_members`).
    """
    buckets = [b for b, _ in sync_buckets(plan, profile) if len(b.workers) > 1]
    groups = rounds([b.workers for b in buckets])
    return tuple(tuple(buckets[i] for i in group) for group in groups)


def tie_members(plan: ExecutionPlan, profile: Profile) -> tuple[int, ...]:
    """The workers that all-reduce the tied copies' gradients: the holders of either tied
    layer (:attr:`Profile.tied_layers`), sorted, as the runtime's
    ``step_sync.tie_reductions`` forms the group.

    Returns:
        Empty when the profile has no tie, or when every holder of one layer holds the
        other and only they do (each then sums its two copies locally).
    """
    if profile.tied_bytes <= 0:
        return ()
    first, last = profile.tied_layers
    a, b = plan.holders(first), plan.holders(last)
    if a == b:
        return ()
    return tuple(sorted({*a, *b}))


def _bucket_conflicts(plan: ExecutionPlan, buckets: list[tuple[Bucket, float]]
                      ) -> list[tuple[int, int]]:
    """Pairs of buckets that share a worker (the conflict graph of the all-reduce rounds).

    A bucket holds every live holder of its layers, so two buckets share a worker exactly
    when some worker's layer range meets both: one pass over the few distinct ranges
    instead of over every worker.
    """
    return _conflicts(_buckets_met(plan.layers_by_worker.values(), buckets).values())


def _buckets_met(ranges: Iterable[range], buckets: list[tuple[Bucket, float]]
                 ) -> dict[range, list[int]]:
    """The buckets each distinct layer range meets (their indices, sorted), in the order
    ``ranges`` first names them: a worker holding the range is a member of exactly those
    buckets (a bucket holds every live holder of its layers)."""
    bucket_of_layer = {layer: i for i, (b, _) in enumerate(buckets) for layer in b.layers}
    return {layers: sorted({bucket_of_layer[layer] for layer in layers
                            if layer in bucket_of_layer})
            for layers in dict.fromkeys(ranges)}


def _conflicts(met: Iterable[list[int]]) -> list[tuple[int, int]]:
    """Pairs of buckets met by one range (each list sorted), sorted."""
    return sorted({pair for ids in met for pair in itertools.combinations(ids, 2)})


def _components(plan: ExecutionPlan) -> list[tuple[list[int], bool]]:
    """Pipelines that must be simulated together: linked by reroutes (union-find), each
    group with whether it is a lone pipeline without reroutes (shared by its look-alikes),
    in the order of their first pipelines. Only the few pipelines that reroutes touch are
    joined; every other one is a group of its own."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for r in plan.reroutes:
        find(r.pipeline)
        for worker, _ in r.shares:
            q, _ = plan.stage_of_worker[worker]
            a, b = find(r.pipeline), find(q)
            if a != b:
                parent[a] = b
    joined: dict[int, list[int]] = {}
    for p in sorted(parent):
        joined.setdefault(find(p), []).append(p)
    lead = {group[0]: group for group in joined.values()}  # by its first pipeline
    rerouted = {r.pipeline for r in plan.reroutes}
    out: list[tuple[list[int], bool]] = []
    for p in range(plan.num_pipelines):
        if p not in parent:
            out.append(([p], True))  # untouched by any reroute
        elif p in lead:
            out.append((lead[p], len(lead[p]) == 1 and p not in rerouted))
    return out


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
        # The simulation builds and ranks the pipelines in this order, never by index, so
        # a shared simulation is exactly the one this component would get.
        order = component_order(plan, group)
        key, worker_ids = self._component_key(plan, order, speeds)
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

    def _component_key(self, plan: ExecutionPlan, order: list[int],
                       speeds: Mapping[int, float]) -> tuple[tuple[Any, ...], dict[int, int]]:
        """The shape of the component of pipelines ``order`` (:meth:`_component`), and its
        workers' names in it.

        Workers and nodes are named by first appearance, pipeline by pipeline. With one
        worker per node, all at unit speed, and every worker named once, the names are
        positions, so a pipeline is its micro-batches and layout (the names read at C
        speed); otherwise each stage is named with its node and speed."""
        members = set(order)
        local = {p: i for i, p in enumerate(order)}
        pipes = list(map(plan.pipelines.__getitem__, order))
        rows = list(map(_WORKERS_OF, pipes))
        worker_ids = dict(zip(itertools.chain.from_iterable(rows), itertools.count()))
        shape: list[Any]
        if (self.topology.workers_per_node == 1 and not speeds
                and len(worker_ids) == sum(map(len, rows))):
            shape = ["by position", plan.schedule, plan.defer_weight_grad,
                     *zip(map(_MICROBATCHES, pipes), map(_LAYOUT_OF, pipes), strict=True)]
            shape.append(tuple(sorted(
                (local[r.pipeline], r.stage, tuple((worker_ids[w], n) for w, n in r.shares))
                for r in plan.reroutes if r.pipeline in members)))
            return tuple(shape), worker_ids
        worker_ids = {}
        node_ids: dict[int, int] = {}
        node_of = self.topology.node_of
        shape = [plan.schedule, plan.defer_weight_grad]
        for pipe in pipes:
            names = []
            for st in pipe.stages:
                w = st.worker
                names.append((worker_ids.setdefault(w, len(worker_ids)),
                              node_ids.setdefault(node_of(w), len(node_ids)),
                              st.first_layer, st.end_layer, speeds.get(w, 1.0)))
            shape.append((pipe.num_microbatches, tuple(names)))
        shape.append(tuple(sorted(
            (local[r.pipeline], r.stage,
             tuple((worker_ids[w], node_ids[node_of(w)], n) for w, n in r.shares))
            for r in plan.reroutes if r.pipeline in members)))
        return tuple(shape), worker_ids

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
        carried over from the same plan in other worker names (``policy/symmetry.py``)."""
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
        reduced_s, sync_s, sync_rounds, tie = self._synchronise(
            plan, _ready_by_range(rows), latest)
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

    def _synchronise(self, plan: ExecutionPlan, ready: dict[range, float],
                     latest_finish: float,
                     ) -> tuple[float, dict[range, float],
                                tuple[tuple[Bucket, ...], ...], tuple[int, ...]]:
        """Gradient synchronisation after each worker's backward ends: all-reduce rounds
        of the buckets with more than one member, then a tied pair's sum. ``ready`` holds
        each live layer range's latest finish (updated to its last end), ``latest_finish``
        the latest finish of any simulated worker. Returns when the last worker is done
        reducing, the time spent reducing by the workers of each layer range, the rounds'
        buckets and the tied pair's group.

        The workers holding one layer range are in the same buckets (a bucket holds every
        live holder of its layers), so they are tracked as one: a bucket starts at the
        latest of its classes and sets all of them to its end, and each class adds up
        its buckets' times in their order (the same maxima and sums as worker by worker).
        """
        profile, topo = self.profile, self.topology
        buckets = [(b, n) for b, n in sync_buckets(plan, profile) if len(b.workers) > 1]
        met = _buckets_met(ready, buckets)
        groups = rounds([b.workers for b, _ in buckets], edges=_conflicts(met.values()))
        sync_s = dict.fromkeys(ready, 0.0)
        classes: list[list[range]] = [[] for _ in buckets]
        for layers, ids in met.items():
            for i in ids:
                classes[i].append(layers)

        def reduce(members: tuple[int, ...], ranges: list[range], num_bytes: float) -> None:
            t = topo.allreduce_s(members, num_bytes)
            done = max(map(ready.__getitem__, ranges)) + t
            for layers in ranges:
                ready[layers] = done
                sync_s[layers] += t

        for group in groups:
            for i in group:
                reduce(buckets[i][0].workers, classes[i], buckets[i][1])
        # A tied model sums the copies after every round of its members (the runtime's
        # order), so it waits for, and delays, any bucket sharing a worker with it.
        tie = tie_members(plan, profile)
        if tie:
            first, last = profile.tied_layers
            reduce(tie, [r for r in ready if first in r or last in r], profile.tied_bytes)
        # a reduction ends no earlier than its members finished: the latest end is the
        # latest of the classes' ends and of every finish (workers outside the plan's
        # live table included)
        return (max(latest_finish, max(ready.values(), default=-math.inf)), sync_s,
                tuple(tuple(buckets[i][0] for i in group) for group in groups), tie)


class _Row(NamedTuple):
    """One pipeline's live stages in an estimate, in stage order, with their simulated
    figures. Lone pipelines that share a timeline and a layout share a ``key`` (and every
    figure but their workers): what depends only on the stages is computed once per key."""

    pipeline: int
    key: tuple[int, int] | None
    """(timeline, layout) identity of a lone pipeline; ``None`` for a rerouted component's."""
    timeline: Timeline
    """The timeline the figures come from, kept with the row so that the identity in
    ``key`` stays unique while rows live (a brute-force estimate keeps no timeline)."""
    workers: tuple[int, ...]
    ranges: tuple[range, ...]
    finish: tuple[float, ...]
    busy: tuple[float, ...]
    activation: tuple[float, ...]


def _per_key(keys: list[tuple[int, int] | None], figure: Callable[[int], tuple[float, ...]]
             ) -> list[tuple[float, ...]]:
    """``figure(i)`` for every row ``i``, computed once per shared key (``None``: never
    shared)."""
    known: dict[tuple[int, int], tuple[float, ...]] = {}
    out = []
    for i, key in enumerate(keys):
        if key is None:
            out.append(figure(i))
            continue
        found = known.get(key)
        if found is None:
            found = known[key] = figure(i)
        out.append(found)
    return out


def _ready_by_range(rows: list[_Row]) -> dict[range, float]:
    """Each live layer range's latest finish, ranges in order of first appearance."""
    ready: dict[range, float] = {}
    seen: set[tuple[int, int]] = set()
    for row in rows:
        if row.key is not None:
            if row.key in seen:
                continue
            seen.add(row.key)
        for layers, done in zip(row.ranges, row.finish, strict=True):
            latest = ready.get(layers)
            if latest is None or done > latest:
                ready[layers] = done
    return ready


def _optimizer_rows(rows: list[_Row], costs: Mapping[range, tuple[float, float, float]],
                    speeds: Mapping[int, float]) -> list[tuple[float, ...]]:
    """Each stage's optimizer step in seconds, at its worker's speed."""
    def opts(i: int) -> tuple[float, ...]:
        row = rows[i]
        if not speeds:
            return tuple([costs[layers][0] for layers in row.ranges])
        return tuple([costs[layers][0] / speeds[w] if w in speeds else costs[layers][0]
                      for w, layers in zip(row.workers, row.ranges, strict=True)])

    return _per_key([None if speeds else row.key for row in rows], opts)


def _peak_rows(rows: list[_Row], costs: Mapping[range, tuple[float, float, float]]
               ) -> list[tuple[float, ...]]:
    """Each stage's peak bytes per device: parameters, gradients and optimizer state of
    the layers held, plus the activations of the micro-batches in flight at the worst
    moment, plus one layer's backward workspace (recomputed activations)."""
    def peaks(i: int) -> tuple[float, ...]:
        row = rows[i]
        return tuple([costs[layers][1] + act + costs[layers][2]
                      for layers, act in zip(row.ranges, row.activation, strict=True)])

    return _per_key([row.key for row in rows], peaks)


def _idle_sum(rows: list[_Row], opt_rows: list[tuple[float, ...]],
              sync_s: Mapping[range, float], step_s: float, control_s: float,
              shared: bool) -> float:
    """Summed over live workers in the plan's order: step - busy - reducing - optimizer -
    control (each stage's term computed once per shared key when the optimizer rows are
    ``shared`` by key, then summed at C speed in the same order)."""
    def terms(i: int) -> tuple[float, ...]:
        row = rows[i]
        return tuple([step_s - busy - sync_s[layers] - opt - control_s
                      for busy, layers, opt in zip(row.busy, row.ranges, opt_rows[i],
                                                   strict=True)])

    keys = [row.key if shared else None for row in rows]
    return sum(itertools.chain.from_iterable(_per_key(keys, terms)))


def _relabel(tl: Timeline, mapping: Mapping[int, int], pipeline: int | None = None,
             keep_ops: bool = True) -> Timeline:
    """Rename a timeline's workers (and optionally its ops' pipeline index; the op lists are
    dropped unless ``keep_ops``)."""
    def ops(seq: list[Op]) -> list[Op]:
        if pipeline is None:
            return seq
        return [Op(op.kind, pipeline, op.stage, op.microbatch, op.chunk) for op in seq]

    def renamed(table: dict[int, Any]) -> dict[int, Any]:
        return dict(zip(map(mapping.__getitem__, table), table.values(), strict=True))

    return Timeline(
        ops={mapping[w]: ops(v) for w, v in tl.ops.items()} if keep_ops else {},
        finish_s=renamed(tl.finish_s),
        busy_s=renamed(tl.busy_s),
        peak_activation_bytes=renamed(tl.peak_activation_bytes),
        makespan_s=tl.makespan_s,
        critical_compute_s=tl.critical_compute_s,
        critical_p2p_s=tl.critical_p2p_s,
    )


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


def estimate(plan: ExecutionPlan, profile: Profile, topology: Topology, *,
             speeds: Mapping[int, float] | None = None, brute_force: bool = False) -> Estimate:
    """Estimate the step time and per-device memory of ``plan``.

    Args:
        plan: any valid plan: failure-free, rerouted or heterogeneous.
        profile: per-layer costs.
        topology: workers, nodes and links (``Topology.from_config(config)``).
        speeds: relative speed per worker (default 1.0).
        brute_force: skip the symmetry shortcut and caches (for tests).

    Returns:
        An :class:`Estimate`.

    Raises:
        ValueError: when a worker of the plan does not exist in the topology.
    """
    for w in plan.workers:
        if not 0 <= w < topology.num_workers:
            raise ValueError(f"plan: worker {w} is outside the cluster's "
                             f"{topology.num_workers} workers")
    return estimator_for(profile, topology).estimate(plan, speeds, brute_force)
