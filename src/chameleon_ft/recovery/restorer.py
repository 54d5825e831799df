"""The restorer: which survivor takes which slot of a new plan, and how its state arrives.

Two steps (docs/design.md section 3.3, the paper's Restorer and Figure 3):

1. :func:`match_workers` assigns survivors to the new plan's slots so that the fewest
   bytes of parameters and optimizer state move (Hungarian assignment,
   ``scipy.optimize.linear_sum_assignment``). The cost of putting survivor ``i`` on slot
   ``j`` is the bytes of the layers slot ``j`` wants that ``i`` does not hold.
2. :func:`schedule_migration` pulls every missing layer from live replicas, split across
   up to ``migration_max_parts`` of them, and groups the transfers into rounds where no
   worker sends or receives twice (DSATUR colouring from ``perf.coloring``); the time is
   the sum over rounds of each round's slowest transfer.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections import defaultdict, deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from chameleon_ft.perf.coloring import pair_rounds
from chameleon_ft.perf.network import Topology
from chameleon_ft.plan import ExecutionPlan, Pipeline
from chameleon_ft.plan.tables import indices_by_object
from chameleon_ft.profile import Profile
from chameleon_ft.recovery.transition import migration_s, recovery_terms
from chameleon_ft.recovery.types import (
    Candidate,
    LazyFields,
    Migration,
    RecoveryState,
    Strategy,
    Transfer,
    candidate_from_estimate,
    infeasible,
)


@dataclass(frozen=True)
class Matching:
    """The result of :func:`match_workers`."""

    assignment: dict[int, int]
    """``held index -> wanted index`` for every slot; unassigned survivors are absent."""
    moved_bytes: float
    """Bytes that must move: per slot, the wanted layers its survivor lacks."""


def _missing_bytes(have: Collection[int], want: Collection[int],
                   layer_bytes: Sequence[float]) -> float:
    return float(sum(layer_bytes[layer] for layer in want if layer not in have))


def load_matching() -> tuple[Any, Any]:
    """``numpy`` and ``scipy.optimize.linear_sum_assignment``, imported on first use.

    They take about as long to load as a cold decision on 2,048 workers takes, and a
    decision whose survivors keep their stages (most single failures of a large job) never
    needs them; a job where placement matters loads them with its planner
    (``Planner.__init__``), so that no decision pays for it.
    """
    import numpy
    from scipy.optimize import linear_sum_assignment

    return numpy, linear_sum_assignment


def match_workers(held: Sequence[Collection[int]], wanted: Sequence[Collection[int]],
                  layer_bytes: Sequence[float]) -> Matching:
    """Assign survivors (``held``: the layers each holds) to slots (``wanted``) moving the
    fewest bytes.

    A survivor whose held set equals a slot's wanted set is matched to it first: by the
    triangle inequality of set difference (``A\\C`` is inside ``(A\\B) | (B\\C)``) an exact
    match never costs an optimal solution anything, and it keeps the Hungarian problem
    small when most survivors keep their stage (thousands of workers, one failure).

    Args:
        held: per survivor, the layers it holds (a set, a range: any collection; empty for
            a new or idle worker); survivors (and slots) may share one object, read once.
        wanted: per slot, the layers the slot needs.
        layer_bytes: bytes per layer (parameters plus optimizer state).

    Returns:
        The assignment (survivor index -> slot index) and the bytes it moves.

    Raises:
        ValueError: when there are more slots than survivors or a layer index is unknown.
    """
    return _match(held, wanted, layer_bytes,
                  (indices_by_object(held), indices_by_object(wanted)))


def _match(held: Sequence[Collection[int]], wanted: Sequence[Collection[int]],
           layer_bytes: Sequence[float], groups: tuple[dict[int, list[int]], ...]
           ) -> Matching:
    """:func:`match_workers` with the indices of each distinct object of ``held`` and of
    ``wanted`` (:func:`indices_by_object`) given."""
    if len(wanted) > len(held):
        raise ValueError(f"wanted: {len(wanted)} slots but only {len(held)} workers to fill "
                         "them")
    num_layers = len(layer_bytes)
    for name, sets, by_object in (("held", held, groups[0]), ("wanted", wanted, groups[1])):
        for indices in by_object.values():  # each object once
            layers = sets[indices[0]]
            if layers and (min(layers) < 0 or max(layers) >= num_layers):
                layer = next(x for x in layers if not 0 <= x < num_layers)
                raise ValueError(f"{name}[{indices[0]}]: layer {layer} is not in "
                                 f"0..{num_layers - 1}")
    slot_of = [-1] * len(held)  # survivor index -> slot index
    # Exact matches, class by class (one class per distinct set): the k-th slot wanting a
    # set, in slot order, takes the k-th survivor holding it, in index order (the same
    # pairs as slot by slot, each taking the lowest free index); what is left of a class
    # goes to the Hungarian problem.
    survivors = _by_set(held, groups[0])
    rest_rows: list[int] = []
    rest_cols: list[int] = []
    for want, cols in _by_set(wanted, groups[1]).items():
        rows = survivors.pop(want, [])
        deque(map(slot_of.__setitem__, rows, cols), maxlen=0)  # at C speed
        rest_rows += rows[len(cols):]
        rest_cols += cols[len(rows):]
    for rows in survivors.values():
        rest_rows += rows
    moved = 0.0
    if rest_cols:
        np, linear_sum_assignment = load_matching()
        rest_rows.sort()
        rest_cols.sort()
        sizes = np.asarray(layer_bytes, dtype=float)
        have = np.zeros((len(rest_rows), num_layers))
        for r, i in enumerate(rest_rows):
            have[r, list(held[i])] = 1.0
        want_bytes = np.zeros((len(rest_cols), num_layers))
        for c, j in enumerate(rest_cols):
            idx = list(wanted[j])
            want_bytes[c, idx] = sizes[idx]
        # cost[r, c] = bytes slot c wants minus those survivor r already holds
        cost = want_bytes.sum(axis=1)[None, :] - have @ want_bytes.T
        rows_found, cols_found = linear_sum_assignment(cost)
        for r, c in zip(rows_found, cols_found, strict=True):
            i, j = rest_rows[int(r)], rest_cols[int(c)]
            slot_of[i] = j
            moved += _missing_bytes(held[i], wanted[j], layer_bytes)
    return Matching(assignment=dict(itertools.compress(  # the matched, at C speed
        enumerate(slot_of), map(operator.ge, slot_of, itertools.repeat(0)))),
                    moved_bytes=moved)


def _by_rows(rows: Sequence[Sequence[Collection[int]]]) -> dict[int, list[int]]:
    """:func:`indices_by_object` of the rows chained (each row one pipeline's stage ranges):
    runs of pipelines sharing one row object are added stage by stage, every
    ``len(row)``-th index at once."""
    by_object: dict[int, list[int]] = defaultdict(list)
    slot = 0
    for _, run in itertools.groupby(rows, key=id):
        count = len(run_rows := list(run))
        row = run_rows[0]
        length = len(row)
        if len(set(map(id, row))) != length:  # an object twice in a row: index by index
            return indices_by_object(list(itertools.chain.from_iterable(rows)))
        for s, obj in enumerate(row):
            by_object[id(obj)].extend(range(slot + s, slot + length * count, length))
        slot += length * count
    return by_object


def _by_set(sets: Sequence[Collection[int]], by_object: dict[int, list[int]]
            ) -> dict[frozenset[int], list[int]]:
    """The indices of each distinct set (:func:`indices_by_object` merged by value),
    increasing."""
    out: dict[frozenset[int], list[int]] = {}
    for indices in by_object.values():
        found = out.setdefault(frozenset(sets[indices[0]]), indices)
        if found is not indices:  # equal sets in different objects
            found += indices
            found.sort()
    return out


def assign_workers(skeleton: ExecutionPlan, held: Mapping[int, Collection[int]],
                   layer_bytes: Sequence[float], source: ExecutionPlan | None = None
                   ) -> tuple[ExecutionPlan, float]:
    """Put real workers into a plan whose stage workers are placeholders.

    Args:
        skeleton: the new plan's shape (pipelines, layer ranges, micro-batches); its worker
            ids are ignored. It must have no reroutes.
        held: every live worker (idle ones too) and the layers it holds now.
        layer_bytes: bytes per layer that move when a layer migrates.
        source: the plan the survivors run now: a new pipeline equal to one of its
            pipelines (the same workers, layout and micro-batches: most of them, after a
            few failures of a large job) is that very pipeline object, not a copy.

    Returns:
        The plan with survivors matched to slots, and the bytes that must move.
    """
    workers = sorted(held)
    # The holdings and stage ranges as they are (a plan's table shares its range objects):
    # the matching reads each distinct object once, as a set, and no worker's one by one.
    rows = [pipe.layer_ranges for pipe in skeleton.pipelines]
    wanted = list(itertools.chain.from_iterable(rows))
    holdings = list(map(held.__getitem__, workers))
    matching = _match(holdings, wanted, layer_bytes,
                      (indices_by_object(holdings), _by_rows(rows)))
    worker_of_slot = [0] * len(wanted)  # the matching fills every slot
    assignment = matching.assignment
    deque(map(worker_of_slot.__setitem__, assignment.values(),
              map(workers.__getitem__, assignment)), maxlen=0)
    plan = ExecutionPlan(num_layers=skeleton.num_layers,
                         pipelines=_filled(skeleton, worker_of_slot, source),
                         micro_batch=skeleton.micro_batch, schedule=skeleton.schedule)
    return plan, matching.moved_bytes


def _filled(skeleton: ExecutionPlan, worker_of_slot: list[int],
            source: ExecutionPlan | None) -> tuple[Pipeline, ...]:
    """The skeleton's pipelines on the workers of their slots (in slot order); a pipeline
    of ``source`` that equals one of them is taken as it is (:func:`assign_workers`)."""
    where = source.stage_of_worker if source is not None else {}
    pipelines = []
    slot = 0
    for pipe in skeleton.pipelines:
        end = slot + len(pipe.stages)
        row = tuple(worker_of_slot[slot:end])
        slot = end
        found = where.get(row[0]) if row else None
        if found is not None and found[1] == 0 and source is not None:
            old = source.pipelines[found[0]]
            if (old.num_microbatches == pipe.num_microbatches and old.workers == row
                    and (old.layer_ranges is pipe.layer_ranges or old.layout == pipe.layout)):
                pipelines.append(old)
                continue
        pipelines.append(pipe.on_workers(row))
    return tuple(pipelines)


def fatal_nodes(plan: ExecutionPlan, topology: Topology) -> frozenset[int]:
    """Nodes whose loss leaves some layer of ``plan`` without a live replica (the single
    node holding every replica of a layer; :meth:`ExecutionPlan.fatal_nodes`)."""
    return plan.fatal_nodes(topology.workers_per_node)


def pack_stage_major(skeleton: ExecutionPlan, held: Mapping[int, Collection[int]],
                     layer_bytes: Sequence[float]) -> tuple[ExecutionPlan, float]:
    """Put real workers into a plan whose pipelines all share one layout the way a
    stage-major job is laid out: the live workers in id order, stage ``s`` of pipeline
    ``p`` on the ``s * dp + p``-th, so the replicas of a stage sit side by side (on as few
    nodes as possible) and its gradient all-reduce crosses as few nodes as it can. The
    alternative to :func:`assign_workers`' fewest bytes moved when a re-plan keeps running
    for long: a placement whose every all-reduce crosses nodes stays slower at every step.

    Args:
        skeleton: the new plan's shape; its worker ids are ignored. Every pipeline has the
            same stage bounds; no reroutes.
        held: every live worker (idle ones too) and the layers it holds now.
        layer_bytes: bytes per layer that move when a layer migrates.

    Returns:
        The plan and the bytes that must move.
    """
    workers = sorted(held)
    dp = skeleton.num_pipelines
    pipelines = []
    moved = 0.0
    for p, pipe in enumerate(skeleton.pipelines):
        row = []
        for s, st in enumerate(pipe.stages):
            w = workers[s * dp + p]
            moved += _missing_bytes(held[w], st.layers, layer_bytes)
            row.append(w)
        pipelines.append(pipe.on_workers(row))
    plan = ExecutionPlan(num_layers=skeleton.num_layers, pipelines=tuple(pipelines),
                         micro_batch=skeleton.micro_batch, schedule=skeleton.schedule)
    return plan, moved


class _LayerHolders:
    """Each layer's live holders, in worker order, gathered when the layer is first asked
    for: a migration asks for the few layers some worker lacks, not for all of them (on
    the 65k job each of 126 layers has about 500 holders). Workers holding the same layers
    are grouped first (few distinct holdings on thousands of workers)."""

    def __init__(self, held: Mapping[int, Collection[int]]) -> None:
        self._held = held
        self._by_holding = _workers_by_holding(held)
        self._known: dict[int, list[int]] = {}

    def get(self, layer: int, default: list[int]) -> list[int]:
        """``layer``'s holders, increasing (``default`` when none)."""
        found = self._known.get(layer)
        if found is None:
            if self._by_holding is None:  # unhashable layer collections: one at a time
                found = [w for w in sorted(self._held) if layer in self._held[w]]
            else:
                found = []
                for layers, workers in self._by_holding.items():
                    if layer in layers:
                        found.extend(workers)
                found.sort()
            self._known[layer] = found
        return found or default


def _workers_by_holding(held: Mapping[int, Collection[int]]
                        ) -> dict[Collection[int], list[int]] | None:
    """The workers of each distinct holding, in ``held``'s order; ``None`` when a holding
    is not hashable.

    The last answer for a read-only ``held`` is kept (a decision's candidates migrate from
    one state's holdings)."""
    last = _LAST_BY_HOLDING[0]
    if last is not None and last[0] is held:
        return last[1]
    by_holding: dict[Collection[int], list[int]] = defaultdict(list)
    try:
        for worker, layers in held.items():
            by_holding[layers].append(worker)  # TypeError for an unhashable holding
    except TypeError:
        return None
    if isinstance(held, MappingProxyType):
        _LAST_BY_HOLDING[0] = (held, by_holding)
    return by_holding


_LAST_BY_HOLDING: list[tuple[Mapping[int, Collection[int]],
                             dict[Collection[int], list[int]]] | None] = [None]
"""The last read-only holdings :func:`_workers_by_holding` grouped, with the grouping
(whose lists no reader changes), replaced whole."""


def _first_holders(held: Mapping[int, Collection[int]]) -> dict[int, list[int]]:
    """Each layer's first live holder (the lowest id), as the one-worker list that
    :class:`_LayerHolders` starts with: Oobleck copies from it alone, so the other
    holders are not gathered and sorted."""
    by_holding = _workers_by_holding(held)
    if by_holding is None:
        holders = _LayerHolders(held)
        return {layer: holders.get(layer, [])[:1]
                for layer in sorted({x for layers in held.values() for x in layers})}
    first: dict[int, int] = {}
    for layers, workers in by_holding.items():
        lowest = min(workers)
        for layer in layers:
            known = first.get(layer)
            if known is None or lowest < known:
                first[layer] = lowest
    return {layer: [worker] for layer, worker in first.items()}


def _slots(plan: ExecutionPlan) -> tuple[tuple[int, int, int], ...]:
    """Every live slot ``(worker, pipeline, stage)`` of ``plan`` in order (a rerouted
    stage's worker is dead: nothing moves to it), from the plan's own table at C speed."""
    where = plan.stage_of_worker  # the live slots, pipeline by pipeline, in stage order
    return tuple(zip(where, map(_PIPELINE, where.values()), map(_STAGE, where.values()),
                     strict=True))


def _lacking(plan: ExecutionPlan, held: Mapping[int, Collection[int]]
             ) -> list[tuple[int, range, Collection[int]]]:
    """``(worker, layers, held layers)`` of each live slot of ``plan`` whose worker lacks
    some layer of its stage, in slot order. Most workers keep their stage, and the plans
    share range objects, so only workers that do not hold their stage's very range object
    are looked at one by one."""
    stage_layers = plan.layers_by_worker  # the live slots' workers, in slot order
    held_by = held.get
    lacking: list[tuple[int, range, Collection[int]]] = []
    for worker in itertools.compress(stage_layers, map(operator.is_not,
                                                       map(held_by, stage_layers),
                                                       stage_layers.values())):
        layers = stage_layers[worker]
        have = held_by(worker, ())
        if not (isinstance(have, range) and have.step == 1
                and have.start <= layers.start and layers.stop <= have.stop):
            lacking.append((worker, layers, have))
    return lacking


class PlannedMigration(LazyFields, Migration):
    """A :class:`Migration` whose ``slots`` (every live slot of the new plan: 8,192 on the
    65k job, read by reports and the runtime, never by a decision) are listed from the plan
    when first read. Compares and hashes as a :class:`Migration` with the same fields."""

    _base = Migration
    _lazy_fields = ("slots",)

    @classmethod
    def of(cls, plan: ExecutionPlan, moved_bytes: float, transfers: tuple[Transfer, ...],
           rounds: tuple[tuple[int, ...], ...], time_s: float) -> PlannedMigration:
        """The migration into ``plan`` with these figures."""
        return cls.lazily(  # type: ignore[no-any-return]
            {"moved_bytes": moved_bytes, "transfers": transfers, "rounds": rounds,
             "time_s": time_s}, plan)

    def _fill(self, *args: Any) -> dict[str, Any]:
        return {"slots": _slots(*args)}


_PIPELINE = operator.itemgetter(0)
_STAGE = operator.itemgetter(1)


def schedule_migration(plan: ExecutionPlan, held: Mapping[int, Collection[int]],
                       profile: Profile, topology: Topology, *,
                       max_parts: int = 4, first_source: bool = False,
                       parameters_only: bool = False) -> Migration:
    """Transfers that bring every worker of ``plan`` the layers it lacks, in rounds.

    Each missing layer is split into ``k = min(max_parts, replicas)`` equal slices pulled
    from ``k`` distinct live replicas, preferring replicas on the receiver's node, then
    those that have sent the fewest bytes so far (so no sender becomes the bottleneck).

    Args:
        plan: the new plan with real workers (rerouted stages are skipped).
        held: live workers before the change and the layers they hold.
        profile: gives each layer's parameter plus optimizer-state bytes.
        topology: link costs.
        max_parts: most replicas one layer is split across.
        first_source: every copy of a layer comes whole from its first live replica
            (lowest worker id), as Oobleck copies (no balancing, no splitting).
        parameters_only: move parameters only (Oobleck's SOSP-era code re-creates the
            optimizer instead of moving its state).

    Returns:
        The migration: slots, transfers, DSATUR rounds, time at full link bandwidth.

    Raises:
        ValueError: when a needed layer has no live replica.
    """
    holders: _LayerHolders | dict[int, list[int]] = (
        _first_holders(held) if first_source else _LayerHolders(held))
    sent_bytes: dict[int, float] = {}
    transfers: list[Transfer] = []
    moved = 0.0
    for worker, layers, have in _lacking(plan, held):
        dst_node = topology.node_of(worker)
        for layer in layers:
            if layer in have:
                continue
            sources = holders.get(layer, [])
            if not sources:
                raise ValueError(f"plan: layer {layer} has no live replica to migrate from")
            cost = profile.layers[layer]
            size = cost.param_bytes if parameters_only else cost.state_bytes
            moved += size
            if first_source:
                parts, chosen = 1, sources[:1]
            else:
                parts = min(max_parts, len(sources))
                chosen = _first_sources(sources, parts, dst_node, sent_bytes, topology)
            for part, src in enumerate(chosen):
                sent_bytes[src] = sent_bytes.get(src, 0.0) + size / parts
                transfers.append(Transfer(layer=layer, src=src, dst=worker, part=part,
                                          num_parts=parts, num_bytes=size / parts))
    round_lists = pair_rounds([(t.src, t.dst) for t in transfers]) if transfers else []
    time_s = 0.0
    for members in round_lists:
        time_s += max(topology.p2p_s(transfers[i].src, transfers[i].dst, transfers[i].num_bytes)
                      for i in members)
    return PlannedMigration.of(plan, moved, tuple(transfers),
                               tuple(tuple(r) for r in round_lists), time_s)


def _first_sources(sources: list[int], parts: int, dst_node: int,
                   sent_bytes: Mapping[int, float], topology: Topology) -> list[int]:
    """The first ``parts`` of ``sources`` (increasing worker ids) ranked by (on another
    node than the receiver, bytes sent so far, worker id): ranked from the few that can
    come first, not all of them (hundreds of replicas per layer on the 65k job). Those
    are the sources on the receiver's node, those that have sent bytes, and the first
    ``parts`` of the others in id order (the others tie on the first two keys)."""
    def key(w: int) -> tuple[bool, float, int]:
        return (topology.node_of(w) != dst_node, sent_bytes.get(w, 0.0), w)

    def among(workers: Iterable[int]) -> Iterator[int]:  # those of ``sources``, by bisection
        for w in workers:
            i = bisect.bisect_left(sources, w)
            if i < len(sources) and sources[i] == w:
                yield w

    special = set(among(topology.workers_of_node(dst_node)))
    special.update(among(w for w, sent in sent_bytes.items() if sent != 0.0))
    plain = itertools.islice((w for w in sources if w not in special), parts)
    return sorted([*special, *plain], key=key)[:parts]


def copy_in(state: RecoveryState, strategy: Strategy, new_plan: ExecutionPlan,
            reason: str) -> Candidate:
    """A re-join's candidate: move to ``new_plan`` by copying what its workers lack from
    live replicas, then rebuild the communicators (nothing to detect: the return is
    announced).

    Args:
        state: the job and the current plan; ``state.alive`` includes the returned workers.
        strategy: the strategy the candidate stands for.
        new_plan: the plan to move to (validated by the caller).
        reason: what the candidate does, for reports.

    Returns:
        The candidate with its migration and rebuild terms (no detection, no lost
        step: the return is announced); infeasible when some layer of ``new_plan`` has no
        live replica to copy from.
    """
    spec = state.config.recovery
    try:
        migration = schedule_migration(new_plan, state.held_layers(), state.profile,
                                       state.topology, max_parts=spec.migration_max_parts)
    except ValueError as exc:
        return infeasible(strategy, str(exc).removeprefix("plan: "))
    est = state.estimate(new_plan)
    terms = recovery_terms(state, new_plan, est.step_s, failure=False)
    terms["migrate_s"] = migration_s(migration.time_s, spec)
    return candidate_from_estimate(strategy, new_plan, est, terms, reason, migration=migration)
