"""Transition costs: what a recovery redoes before training resumes (docs/design.md 3.3).

Every term is named; the constants come from :class:`~chameleon_ft.spec.recovery.RecoverySpec`
(whose docstrings cite the published figures) and the rest is computed from the plans:

- ``detect_s``: the failure is noticed (not paid by an announced re-join);
- ``comm_s``: communicators created. A plan communicates over one group per pipeline (the
  workers running its stages, hosts of its rerouted stages included: its point-to-point
  traffic) and one group per all-reduce bucket of two or more workers. Only groups the
  old plan did not have (same members) are created; each costs ``comm_init_s +
  comm_per_rank_s * ranks`` to every member. A worker creates its groups one after the
  other and workers run in parallel, so the term is the busiest worker's sum. A
  stop-the-world reconfiguration creates every group plus a world group over all the
  plan's devices; ``rebuild_all_groups`` describes this project's runtime (see
  :func:`comm_s`);
- ``build_s``: layers re-instantiated on the workers that receive them (``layer_build_s``
  per layer plus its parameters, gradients and optimizer state at
  ``layer_build_gb_per_s``), the busiest worker's sum;
- ``warmup_s``: ``warmup_steps`` of the new plan's step when some worker built layers;
- ``migrate_s``, ``search_s``: computed per decision (the restorer, the search);
- ``lost_step_s``: the step in flight when the failure hit, half the failed plan's step on
  average (the simulator charges the exact partial step instead);
- restart: ``restart_s + load_s + lost_s`` (``lost_s`` the progress since the last
  checkpoint, which includes the step in flight). With checkpoints in memory
  (``memory_checkpoint``) a reload reads every worker's state from another host's memory
  (:func:`memory_load_s`) and loses the work since the last copy there, unless some layer
  had every copy on hosts that died too (:func:`layers_lost_from_memory`): then it reads
  storage (:func:`reload_terms`).

Rerouting touches only the groups of the damaged stage and of the pipeline whose work
moves; re-forming pipelines creates the groups of every pipeline it changes, builds the
layers its workers lack and warms up. With the ``rebuild_s`` shorthand set, ``comm_s``,
``build_s`` and ``warmup_s`` are replaced by that one flat term (the model before this one).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.profile import Profile
from chameleon_ft.recovery.types import CheckpointSource
from chameleon_ft.spec.recovery import RecoverySpec

if TYPE_CHECKING:
    from chameleon_ft.perf.network import Topology
    from chameleon_ft.recovery.types import RecoveryState

Group = frozenset[int]
"""The workers of one communicator."""


_GROUPS: dict[int, tuple[tuple[int, ...], Group]] = {}
"""An intact pipeline's group by the identity of its workers tuple (kept with the entry:
plans share pipelines, and a frozen set keeps its hash, so the groups of a plan that keeps
most pipelines cost a lookup each). Cleared at :data:`_GROUPS_MAX` entries."""
_GROUPS_MAX = 1 << 16


def _intact_group(workers: tuple[int, ...]) -> Group:
    """``frozenset(workers)``, the same object for the same tuple."""
    found = _GROUPS.get(id(workers))
    if found is not None and found[0] is workers:
        return found[1]
    if len(_GROUPS) >= _GROUPS_MAX:
        _GROUPS.clear()
    group = frozenset(workers)
    _GROUPS[id(workers)] = (workers, group)
    return group


def pipeline_groups(plan: ExecutionPlan) -> list[Group]:
    """One group per pipeline of two or more workers: the workers running its stages, the
    hosts of its rerouted stages included (its point-to-point traffic)."""
    out: list[Group] = []
    dead = plan.reroute_map
    rerouted = {p for p, _ in dead}
    for p, pipe in enumerate(plan.pipelines):
        if p not in rerouted:  # its own stage workers (distinct in a valid plan)
            workers = _intact_group(pipe.workers)
            if len(workers) > 1:
                out.append(workers)
            continue
        members: set[int] = set()
        for s, st in enumerate(pipe.stages):
            reroute = dead.get((p, s)) if dead else None
            if reroute is None:
                members.add(st.worker)
            else:
                members.update(w for w, _ in reroute.shares)
        if len(members) > 1:
            out.append(frozenset(members))
    return out


@functools.lru_cache(maxsize=64)
def plan_groups(plan: ExecutionPlan) -> frozenset[Group]:
    """The communicators ``plan`` needs: one per pipeline (:func:`pipeline_groups`) and one
    per all-reduce bucket (the live workers holding the same layers), each with two or
    more workers.

    Args:
        plan: the plan (hashable; results are cached per plan).

    Returns:
        The groups' member sets.
    """
    # Few distinct holder sets, so this stays cheap on thousands of workers (each distinct
    # tuple is hashed once, for the estimator's buckets too).
    buckets = {frozenset(h) for h in plan.layers_by_holders if len(h) > 1}
    return frozenset(pipeline_groups(plan)) | buckets


def comm_s(old: ExecutionPlan | None, new: ExecutionPlan, spec: RecoverySpec, *, tp: int,
           everything: bool = False, per_layer: bool = False) -> float:
    """Seconds until every worker has created the communicators ``new`` needs.

    A group of ``k`` ranks costs each member ``comm_init_s + comm_per_rank_s * k``. Three
    ways to rebuild:

    - by default only the groups ``old`` did not have (same members) are created;
    - ``everything`` (a stop-the-world reconfiguration): a world group over every device
      of ``new`` and every group, whatever ``old`` had;
    - ``spec.rebuild_all_groups`` (this project's runtime): a world group over the plan's
      workers that carries the point-to-point traffic and exchanges a first message
      between every pair at once (the full cost), and a group per bucket that is only
      formed (``comm_init_s``), its first exchange happening in the first step.

    Args:
        old: the plan before the change; ``None``: nothing is kept.
        new: the plan after it.
        spec: ``comm_init_s``, ``comm_per_rank_s`` and ``rebuild_all_groups``.
        tp: devices per worker; one communicator per tensor-parallel shard is created in
            parallel for a worker group, and a world group spans every device.
        everything: rebuild everything (see above).
        per_layer: one all-reduce group per layer (each layer's holders, counted once per
            layer even when several layers share holders) instead of one per bucket.

    Returns:
        The busiest worker's sum of its new groups' creation times.
    """
    return _comm_s(old, new, spec, tp, everything, per_layer)


@functools.lru_cache(maxsize=128)
def _comm_s(old: ExecutionPlan | None, new: ExecutionPlan, spec: RecoverySpec, tp: int,
            everything: bool, per_layer: bool) -> float:
    # Memoised: the same pair of plans comes back at every equivalent event.
    if per_layer and (everything or (old is None and not spec.rebuild_all_groups)):
        fresh = _fresh_comm_s(new, spec, tp, everything)
        if fresh is not None:
            return fresh
    busy: dict[int, float] = {}

    def charge(group: Collection[int], ranks: int, *, first_exchange: bool = True) -> None:
        cost = spec.comm_init_s + (spec.comm_per_rank_s * ranks if first_exchange else 0.0)
        # each member's sum grows by cost, in charge order (at C speed)
        busy.update(zip(group, map(operator.add, map(busy.get, group, itertools.repeat(0.0)),
                                   itertools.repeat(cost)), strict=True))

    runtime = spec.rebuild_all_groups and not everything
    if everything or runtime:
        workers = new.workers
        if len(workers) * tp > 1:
            charge(workers, len(workers) * tp)
    if per_layer:
        # a holder set shared by several layers is one group per layer
        distinct = [h for h in new.holders_by_layer if len(h) > 1]
    else:
        # the distinct tuples (each hashed once) added in first-layer order, one by one
        # (not as a dict, which sizes the set at once), make the very set, in the very
        # order, of every layer's tuple added: a repeated insertion changes nothing
        distinct = [h for h in set(list(new.layers_by_holders)) if len(h) > 1]
    buckets = list(map(frozenset, distinct))
    if runtime:
        for group in buckets:
            charge(group, len(group), first_exchange=False)
        return max(busy.values(), default=0.0)
    kept = plan_groups(old) if old is not None and not everything else frozenset()
    for group in pipeline_groups(new):
        if group not in kept:
            charge(group, len(group))
    if per_layer:
        for group in buckets:
            if group not in kept:
                charge(group, len(group))
        return max(busy.values(), default=0.0)
    changed = [(holders, spec.comm_init_s + spec.comm_per_rank_s * len(group))
               for holders, group in zip(distinct, buckets, strict=True) if group not in kept]
    return _busiest(new, busy, changed)


def _busiest(new: ExecutionPlan, busy: Mapping[int, float],
             changed: list[tuple[tuple[int, ...], float]]) -> float:
    """The busiest worker's sum once the ``changed`` all-reduce buckets (holders, cost) are
    charged in order after the pipeline groups (``busy``: each charged worker's sum so
    far). A bucket's members are the live workers whose layer range meets its layers, so
    the workers of one range pay the same bucket costs: they are added up once per range
    (in charge order, the same additions as worker by worker), then once more for each
    worker a pipeline group charged (a larger start gives no smaller sum). On the 65k job
    a re-plan's changed buckets hold thousands of workers and its changed pipelines a few
    dozen."""
    if not changed:
        return max(busy.values(), default=0.0)
    layers_of = new.layers_by_holders  # each bucket's layers
    by_range: dict[int, range] = {}  # the live stages' ranges, each object once
    rows = new.range_rows()
    dead = new.reroute_map
    rerouted = {p for p, _ in dead}
    intact = [row for p, row in enumerate(rows) if p not in rerouted] if dead else rows
    for row in dict(zip(map(id, intact), intact, strict=True)).values():  # few row objects
        by_range.update(zip(map(id, row), row, strict=True))
    for p in rerouted:
        by_range.update((id(r), r) for s, r in enumerate(rows[p]) if (p, s) not in dead)
    costs = {key: [cost for holders, cost in changed
                   if any(map(layers.__contains__, layers_of[holders]))]
             for key, layers in by_range.items()}
    best = 0.0
    for paid in costs.values():
        total = 0.0
        for cost in paid:
            total += cost
        best = max(best, total)
    by_worker = new.layers_by_worker
    for worker, total in busy.items():
        for cost in costs[id(by_worker[worker])]:
            total += cost
        best = max(best, total)
    return best


def _fresh_comm_s(new: ExecutionPlan, spec: RecoverySpec, tp: int, world: bool
                  ) -> float | None:
    """:func:`comm_s` of creating every group of ``new``, one all-reduce group per layer,
    for a plan without reroutes whose workers run one stage each (else ``None``).

    A worker's groups are then the world group (with ``world``), its pipeline's, and
    those of the layers of its range held by two or more workers, charged in that order:
    the workers of pipelines of one length holding one range pay the same sum, so it is
    added up once per such class (the same additions, in the same order, as charging
    worker by worker)."""
    rows = [(pipe.workers, pipe.layer_ranges) for pipe in new.pipelines]
    num_workers = len(new.layers_by_worker)  # the live workers, as many as new.workers
    if new.reroutes or num_workers != sum(len(row) for row, _ in rows):
        return None
    init, per_rank = spec.comm_init_s, spec.comm_per_rank_s
    layer_cost = [init + per_rank * len(h) if len(h) > 1 else None
                  for h in new.holders_by_layer]
    devices = num_workers * tp
    first = init + per_rank * devices if world and devices > 1 else None
    busy: dict[tuple[int, int, int], float | None] = {}
    for row, ranges in rows:
        n = len(row)
        for layers in ranges:
            key = (n, layers.start, layers.stop)
            if key in busy:
                continue
            total, charged = 0.0, first is not None
            if first is not None:
                total += first
            if n > 1:
                total += init + per_rank * n
                charged = True
            for layer in layers:
                cost = layer_cost[layer]
                if cost is not None:
                    total += cost
                    charged = True
            busy[key] = total if charged else None
    return max((t for t in busy.values() if t is not None), default=0.0)


@functools.lru_cache(maxsize=16)
def _build_prefix(profile: Profile, layer_build_s: float, rate: float) -> tuple[float, ...]:
    """Prefix sums of each layer's re-instantiation seconds (cached per profile)."""
    out = [0.0]
    for layer in profile.layers:
        out.append(out[-1] + layer_build_s + layer.static_bytes / rate)
    return tuple(out)


def build_s(new: ExecutionPlan, held: Mapping[int, Collection[int]], profile: Profile,
            spec: RecoverySpec, old: ExecutionPlan | None = None) -> float:
    """Seconds until every worker of ``new`` has built the layers it did not hold.

    Args:
        new: the plan after the change (rerouted stages build nothing).
        held: the layers each live worker holds now (absent: none; pass ``{}`` for a
            reconfiguration that re-instantiates every layer).
        profile: each layer's static bytes.
        spec: ``layer_build_s`` and ``layer_build_gb_per_s``.
        old: the plan before the change, whose live stages' workers hold their layers:
            a pipeline ``new`` keeps from it whole (the same stages, none rerouted in
            ``old``) builds nothing and is not looked at.

    Returns:
        The busiest worker's build time.
    """
    prefix = _build_prefix(profile, spec.layer_build_s, spec.layer_build_gb_per_s * 1e9)
    busiest = 0.0
    if not held:
        # every worker builds its whole range: the busiest holds the costliest range
        for wanted in set(new.layers_by_worker.values()):
            busiest = max(busiest, prefix[wanted.stop] - prefix[wanted.start])
        return busiest
    for have, wanted in _changed_stages(new, held, old):
        if have == wanted:
            continue
        total = prefix[wanted.stop] - prefix[wanted.start]
        if isinstance(have, range):
            # layer ranges are contiguous: subtract the overlap at once
            lo, hi = max(have.start, wanted.start), min(have.stop, wanted.stop)
            if lo < hi:
                total -= prefix[hi] - prefix[lo]
        else:
            total -= sum(prefix[i + 1] - prefix[i] for i in wanted if i in have)
        busiest = max(busiest, total)
    return busiest


def _whole_pipelines(plan: ExecutionPlan) -> frozenset[tuple[int, int]]:
    """The pipelines of ``plan`` without a rerouted stage, each as the ids of its row of
    workers and its row of ranges (objects it keeps alive); the last plan's are kept (a
    decision prices every candidate from one plan)."""
    last = _LAST_WHOLE[0]
    if last is not None and last[0] is plan:
        return last[1]
    gone = {r.pipeline for r in plan.reroutes}
    whole = frozenset(pair for p, pair in enumerate(zip(map(id, plan.worker_rows()),
                                                        map(id, plan.range_rows()), strict=True))
                      if p not in gone)
    _LAST_WHOLE[0] = (plan, whole)
    return whole


_LAST_WHOLE: list[tuple[ExecutionPlan, frozenset[tuple[int, int]]] | None] = [None]
"""The last plan :func:`_whole_pipelines` read, with its answer, replaced whole."""


def _changed_stages(new: ExecutionPlan, held: Mapping[int, Collection[int]],
                    old: ExecutionPlan | None) -> Iterator[tuple[Collection[int], range]]:
    """``(held, wanted)`` of every live stage of ``new`` whose worker may lack layers: not
    holding the very range object it wants (plans share them), and outside the pipelines
    ``new`` keeps whole from ``old`` (:func:`build_s`), those told by their rows' identity."""
    if old is None:
        by_worker = new.layers_by_worker
        workers: Iterable[int] = by_worker
        wants: Iterable[range] = by_worker.values()
    else:
        kept = _whole_pipelines(old)
        rows = list(zip(new.worker_rows(), new.range_rows(), strict=True))
        changed = [p for p, (w, r) in enumerate(rows) if (id(w), id(r)) not in kept]
        dead = new.reroute_map
        stages = [(w, want) for p in changed
                  for s, (w, want) in enumerate(zip(*rows[p], strict=True))
                  if (p, s) not in dead]
        workers = [w for w, _ in stages]
        wants = [want for _, want in stages]
    haves = list(map(held.get, workers, itertools.repeat(())))
    return itertools.compress(zip(haves, wants, strict=True),
                              map(operator.is_not, haves, wants))


def rebuild_terms(spec: RecoverySpec, *, old: ExecutionPlan | None, new: ExecutionPlan,
                  held: Mapping[int, Collection[int]], profile: Profile, tp: int,
                  new_step_s: float, everything: bool = False, per_layer: bool = False,
                  build_in_background: bool = False) -> dict[str, float]:
    """``comm_s``, ``build_s`` and ``warmup_s`` of moving from ``old`` to ``new``.

    Args:
        spec: the recovery settings (with ``rebuild_s`` set: that one flat term).
        old: the plan before the change, or ``None`` when nothing is kept.
        new: the plan after it.
        held: the layers each live worker holds before the change.
        profile: per-layer bytes.
        tp: devices per worker.
        new_step_s: the new plan's step time (the warm-up is a multiple of it).
        everything: a stop-the-world reconfiguration: every group and every layer is
            rebuilt (``held`` is ignored).
        per_layer: all-reduce groups per layer rather than per bucket (see :func:`comm_s`).
        build_in_background: layers are built while training goes on (two-phase
            recoveries): ``build_s`` is not paid here; the warm-up still is.

    Returns:
        The terms, zeros included (reports show what the model considered).
    """
    if spec.rebuild_s is not None:
        return {"rebuild_s": spec.rebuild_s}
    build = build_s(new, {} if everything else held, profile, spec, old)
    return {"comm_s": comm_s(old, new, spec, tp=tp, everything=everything,
                             per_layer=per_layer),
            "build_s": 0.0 if build_in_background else build,
            "warmup_s": spec.warmup_steps * new_step_s if build > 0 else 0.0}


def recovery_terms(state: RecoveryState, new: ExecutionPlan, new_step_s: float, *,
                   failure: bool = True, everything: bool = False,
                   build_in_background: bool = False) -> dict[str, float]:
    """The terms of moving from ``state.plan`` to ``new`` (migration and search excluded).

    Args:
        state: the job, the plan before the change and the live workers.
        new: the plan after the change.
        new_step_s: its step time.
        failure: a failure (``detect_s`` and ``lost_step_s`` are paid) rather than an
            announced change (a re-join).
        everything: a stop-the-world reconfiguration (see :func:`rebuild_terms`).
        build_in_background: see :func:`rebuild_terms`.

    Returns:
        ``detect_s`` (failure), ``comm_s``, ``build_s``, ``warmup_s`` (or ``rebuild_s``),
        ``lost_step_s`` (failure).
    """
    spec = state.config.recovery
    terms = {"detect_s": spec.detect_s} if failure else {}
    terms.update(rebuild_terms(spec, old=state.plan, new=new, held=state.held_layers(),
                               profile=state.profile, tp=state.config.job.tp,
                               new_step_s=new_step_s, everything=everything,
                               build_in_background=build_in_background))
    if failure:
        terms["lost_step_s"] = lost_step_s(state.estimate(state.plan).step_s)
    return terms


def lost_step_s(failed_plan_step_s: float) -> float:
    """The expected work lost with the step in flight: half a step of the failed plan
    (a failure strikes uniformly within a step)."""
    return 0.5 * failed_plan_step_s


def lost_progress_s(spec: RecoverySpec, since_checkpoint_s: float | None) -> float:
    """Work lost by a restart: the exact time since the checkpoint, or half the interval.

    Raises:
        ValueError: for a negative ``since_checkpoint_s``.
    """
    if since_checkpoint_s is None:
        return spec.checkpoint_interval_s / 2
    if since_checkpoint_s < 0:
        raise ValueError(f"since_checkpoint_s: must be >= 0, got {since_checkpoint_s}")
    return float(since_checkpoint_s)


def restart_terms(spec: RecoverySpec, since_checkpoint_s: float | None) -> dict[str, float]:
    """Terms of a checkpoint restart: detection, process restart, load and lost work."""
    return {"detect_s": spec.detect_s, "restart_s": spec.restart_s,
            "load_s": spec.checkpoint_load_s,
            "lost_s": lost_progress_s(spec, since_checkpoint_s)}


def migration_s(time_at_full_bandwidth_s: float, spec: RecoverySpec, *,
                background: bool = False) -> float:
    """Migration seconds given the schedule's time at the links' full bandwidth.

    The schedule's time is divided by ``migration_efficiency`` (what migration achieves of
    the link) and, in the background, also by ``background_share`` (what training leaves).
    """
    share = spec.migration_efficiency * (spec.background_share if background else 1.0)
    return time_at_full_bandwidth_s / share


@functools.lru_cache(maxsize=16)
def _state_prefix(profile: Profile) -> tuple[float, ...]:
    """Prefix sums of each layer's checkpointed bytes (parameters and optimizer state)."""
    out = [0.0]
    for layer in profile.layers:
        out.append(out[-1] + layer.state_bytes)
    return tuple(out)


def memory_load_s(plan: ExecutionPlan, profile: Profile, topology: Topology,
                  spec: RecoverySpec) -> float:
    """Seconds until every worker of ``plan`` has read its layers' checkpointed state
    (parameters and optimizer state) from the memory of a host on another node.

    Each worker reads its own stage's bytes over one inter-node link at
    ``migration_efficiency``, all workers at once; the busiest one decides. Contention at
    a host serving several readers is not modelled (the copies are spread over the nodes).

    Args:
        plan: the plan every worker reloads (its rerouted stages read nothing).
        profile: each layer's bytes.
        topology: the inter-node link.
        spec: ``migration_efficiency``.

    Returns:
        The busiest worker's read time; 0 for free links.
    """
    if topology.cluster.ideal_network:
        return 0.0
    prefix = _state_prefix(profile)
    largest = max((prefix[r.stop] - prefix[r.start]
                   for r in set(plan.layers_by_worker.values())), default=0.0)
    latency_s, bandwidth = topology.cluster.link(False)
    return latency_s + largest / (bandwidth * spec.migration_efficiency)


def layers_lost_from_memory(state: RecoveryState) -> list[int]:
    """Layers of ``state.plan`` with no copy in memory left (``memory_checkpoint``).

    Each worker of the plan keeps its copy in its own host's memory and in that of the
    next node (in id order, cyclic) that was up when the failure struck (a node with a
    live worker or a worker of the plan), as Gemini keeps local and peer copies; a copy is
    lost when both hosts are down now (a host is up while one of its workers is alive). A
    layer is lost when every worker holding it lost its copies: then a reload reads
    storage.

    Args:
        state: the plan that ran and who is alive after the failure.

    Returns:
        The lost layers, ascending (empty when everything can come from memory).
    """
    topology = state.topology
    node_of = topology.node_of
    plan = state.plan
    up_now = {node_of(w) for w in state.alive}
    up_before = sorted(up_now | {node_of(w) for w in plan.stage_of_worker})
    following = {n: up_before[(i + 1) % len(up_before)] for i, n in enumerate(up_before)}
    kept: dict[tuple[int, int], bool] = {}
    for worker, layers in plan.layers_by_worker.items():
        key = (layers.start, layers.stop)
        if kept.get(key):
            continue
        node = node_of(worker)
        kept[key] = node in up_now or following[node] in up_now
    covered = [False] * plan.num_layers
    for (lo, hi), ok in kept.items():
        if ok:
            for layer in range(lo, hi):
                covered[layer] = True
    return [layer for layer, ok in enumerate(covered) if not ok]


def memory_lost_progress_s(spec: RecoverySpec, failed_plan_step_s: float,
                           since_memory_checkpoint_s: float | None = None) -> float:
    """Work lost by a reload from memory: the exact time since the last copy, or half the
    interval between copies (``memory_checkpoint_every`` steps of the failed plan).

    Raises:
        ValueError: for a negative ``since_memory_checkpoint_s``.
    """
    if since_memory_checkpoint_s is None:
        return 0.5 * spec.memory_checkpoint_every * failed_plan_step_s
    if since_memory_checkpoint_s < 0:
        raise ValueError(f"since_memory_checkpoint_s: must be >= 0, got "
                         f"{since_memory_checkpoint_s}")
    return float(since_memory_checkpoint_s)


def reload_terms(state: RecoveryState, new: ExecutionPlan
                 ) -> tuple[dict[str, float], CheckpointSource]:
    """``load_s`` and ``lost_s`` of reloading the last checkpoint onto ``new``, and where it
    is read from: memory when ``memory_checkpoint`` is on and every layer kept a copy
    there (:func:`layers_lost_from_memory`), else storage.

    Args:
        state: the plan that ran, who is alive, the exact time since the last checkpoint
            on storage when known (``since_checkpoint_s``).
        new: the plan every worker reloads.

    Returns:
        ``{"load_s": ..., "lost_s": ...}`` and the source.
    """
    spec = state.config.recovery
    if spec.memory_checkpoint and not layers_lost_from_memory(state):
        step_s = state.estimate(state.plan).step_s
        return ({"load_s": memory_load_s(new, state.profile, state.topology, spec),
                 "lost_s": memory_lost_progress_s(spec, step_s)}, CheckpointSource.MEMORY)
    return ({"load_s": spec.checkpoint_load_s,
             "lost_s": lost_progress_s(spec, state.since_checkpoint_s)},
            CheckpointSource.STORAGE)
