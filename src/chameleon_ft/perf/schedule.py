"""Schedules as data: the per-worker order of forward and backward operations of a plan.

One function, :func:`simulate`, turns a plan into a timed schedule by list scheduling
over the dependency graph of docs/design.md section 3.1. Every schedule uses the same
graph and the same scheduler; they differ only in each stage's operation order:

- an operation is F (forward), B (backward) or W (weight gradient) of one micro-batch on
  one model chunk of one (pipeline, stage). B is the fused backward (input gradient then
  weight gradient) unless the schedule splits it, then B is the input gradient alone and
  W the weight gradient, which nothing downstream waits for;
- F(p, s, r, j) after F(p, s-1, r, j), and the first stage's chunk r after the last
  stage's chunk r-1, plus the activation transfer between their workers; B(p, s, r, j)
  after F(p, s, r, j) and after the next chunk's B plus the gradient transfer; W after
  its B;
- each (pipeline, stage) is a *stream* of operations in the schedule's order
  (:func:`stage_order`): ``1f1b``, ``gpipe``, ``interleaved`` (v chunks per worker,
  Narayanan et al. 2021) and ``zero-bubble`` (ZB-H1, Qi et al. 2024). A stream runs its
  operations in order.

A worker normally runs one stream, so its order is exactly the schedule's and the step
time is the longest path of the graph (paper Eq. 11). A worker that also runs a rerouted
stage's micro-batches runs several streams; when it is free it starts one of the stream
heads that are ready, chosen by a priority rule, so the merge never deadlocks (list
scheduling of a DAG) and never idles while work is ready. When its backward is split
(``zero-bubble`` plans, or any plan with ``defer_weight_grad``), its W operations form
streams of their own that run only when no F or B is ready: weight gradients deferred
into the worker's bubbles, as ReCycle does on rerouted peers. :func:`best_timeline` tries
two rules and keeps the faster; serving rerouted work first keeps a rerouted step within
Eq. 13 computed with whole micro-batches. The resulting per-worker op lists are what the
runtime executes (``1f1b`` and ``gpipe`` only, fused backward, one chunk), so the runtime
runs exactly the schedule the estimator timed.

With the fused backward Eq. 9 holds exactly for uniform 1F1B stages, and interleaving v
chunks gives ``(m + (S - 1) / v) (t_f + t_b)`` for ``m >= S``
(:mod:`chameleon_ft.perf.closed_form`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from chameleon_ft.perf.network import Topology
from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.profile.profile import LayerCost, Profile, chunk_sums
from chameleon_ft.spec.job import Schedule as ScheduleName

try:  # the compiled list scheduler (setup.py; optional: Python is the reference)
    from chameleon_ft.perf import _listsched
except ImportError:  # pragma: no cover - built wherever a C compiler was found
    _listsched = None  # type: ignore[assignment]

COMPILED = _listsched is not None and os.environ.get("CHAMELEON_SCHEDULER") != "python"
"""Whether :func:`simulate` and :func:`best_timeline` run the compiled list scheduler:
where it is built, unless ``CHAMELEON_SCHEDULER=python`` asks for the Python reference
(bit-identical timelines, about 30 times slower on large graphs)."""


class OpKind(StrEnum):
    """Operation kinds: forward; backward (fused input and weight gradient, or the input
    gradient alone when the schedule splits it); weight gradient."""

    F = "F"
    B = "B"
    W = "W"


_F, _B, _W = 0, 1, 2
_KINDS = (OpKind.F, OpKind.B, OpKind.W)


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of one micro-batch of one (pipeline, stage), on one model chunk."""

    kind: OpKind
    pipeline: int
    stage: int
    microbatch: int
    chunk: int = 0
    """The model chunk (0 .. virtual_stages - 1); always 0 outside ``interleaved``."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """Layers whose gradients are all-reduced together over the same set of workers."""

    workers: tuple[int, ...]
    layers: tuple[int, ...]


SPLIT_SCHEDULES = frozenset({ScheduleName.ZERO_BUBBLE.value})
"""Schedules whose every stage splits the backward into B and W."""


def zero_bubble_lags(num_stages: int, stage: int) -> tuple[int, ...]:
    """How many micro-batches stage ``stage`` defers its W behind its B, per variant tried.

    ZB-H1 (Qi et al. 2024) delays W on stage ``s`` by ``s`` micro-batches, so every stage
    holds at most ``S`` micro-batches (stage 0's 1F1B peak) while the deferred W's fill the
    drain; lag 0 (W right after its B) is 1F1B with the input gradient sent upstream
    before the weight gradient runs, never slower than 1F1B. The estimator keeps the
    faster of the two.
    """
    return (stage, 0) if stage else (0,)


@functools.lru_cache(maxsize=8192)
def stage_order(num_stages: int, stage: int, num_microbatches: int,
                schedule: str = "1f1b", virtual_stages: int = 1,
                lag: int | None = None,
                padded: bool = False) -> tuple[tuple[OpKind, int, int], ...]:
    """The schedule's op order for one stage: ``(kind, chunk, micro-batch)`` triples.

    - ``1f1b``: ``S - s`` forwards, then one backward one forward, then the remaining
      backwards; at most ``S - s`` micro-batches in flight.
    - ``gpipe``: every forward, then every backward.
    - ``interleaved``: Megatron's depth-first interleaving: micro-batches in groups of
      ``N >= S`` (:func:`_groups`), each group through chunk 0, then chunk 1, ...;
      backwards in the reverse chunk order; ``2 (S - s - 1) + (v - 1) N + 1`` forwards
      before the first backward, then one backward one forward. ``padded``: groups of
      exactly ``S``, the order of the next multiple of ``S`` without the missing
      micro-batches (``1f1b``'s memory, more bubble). With ``v = 1`` it is ``1f1b``.
    - ``zero-bubble``: ``1f1b``'s F and B (B the input gradient alone), W of micro-batch
      ``j`` right after B of ``j + lag`` (default ``lag = s``, ZB-H1), the rest at the end.

    Args:
        num_stages: S, stages of the pipeline.
        stage: s, 0-based.
        num_microbatches: m, micro-batches of the pipeline.
        schedule: a :class:`~chameleon_ft.spec.job.Schedule` value.
        virtual_stages: v, chunks per stage (``interleaved`` only).
        lag: ``zero-bubble`` only: how far W trails its B (see :func:`zero_bubble_lags`).
        padded: ``interleaved`` only: groups of exactly ``S`` (see above).

    Raises:
        ValueError: for an unknown schedule, or chunks with a schedule other than
            ``interleaved``.
    """
    m, v = num_microbatches, virtual_stages
    if v > 1 and schedule != ScheduleName.INTERLEAVED:
        raise ValueError(f"virtual_stages: {v} chunks per stage need the interleaved "
                         f"schedule, got {schedule!r}")
    if schedule == ScheduleName.GPIPE:
        return tuple([(OpKind.F, 0, j) for j in range(m)] + [(OpKind.B, 0, j) for j in range(m)])
    if schedule == ScheduleName.INTERLEAVED and v > 1:
        groups = _groups(num_stages, max(m, -(-m // num_stages) * num_stages)
                         if padded else m)
        forwards = [(OpKind.F, r, j) for g in groups for r in range(v) for j in g]
        backwards = [(OpKind.B, r, j) for g in groups for r in reversed(range(v)) for j in g]
        warm = 2 * (num_stages - stage - 1) + (v - 1) * len(groups[0]) + 1
        full = _one_forward_one_backward(forwards, backwards, warm)
        return full if len(forwards) == m * v else tuple(op for op in full if op[2] < m)
    if schedule not in (ScheduleName.ONE_F_ONE_B, ScheduleName.INTERLEAVED,
                        ScheduleName.ZERO_BUBBLE):
        raise ValueError(f"schedule: unknown schedule {schedule!r}")
    forwards = [(OpKind.F, 0, j) for j in range(m)]
    backwards = [(OpKind.B, 0, j) for j in range(m)]
    order = _one_forward_one_backward(forwards, backwards, num_stages - stage)
    if schedule != ScheduleName.ZERO_BUBBLE:
        return order
    delay = stage if lag is None else lag
    out: list[tuple[OpKind, int, int]] = []
    done = 0  # W's placed so far, in micro-batch order
    for kind, r, j in order:
        out.append((kind, r, j))
        if kind is OpKind.B and j - delay >= done:
            out.append((OpKind.W, 0, done))
            done += 1
    out.extend((OpKind.W, 0, k) for k in range(done, m))
    return tuple(out)


def _groups(num_stages: int, num_microbatches: int) -> list[range]:
    """The interleaved order's groups of micro-batches (each runs through chunk 0, then
    chunk 1, ...).

    ``m >= S``: ``m // S`` groups of at least ``S``, sizes as even as possible (Megatron's
    groups of ``S`` when ``m`` is a multiple of it; Llama 3's tunable group size
    otherwise): a chunk's round trip through the ``S`` stages never outlasts a group, so
    no stage waits between chunks, but a group of ``N > S`` keeps ``(v - 1)(N - S)`` more
    chunks in flight. ``m < S``: one group of ``S`` whose missing micro-batches the caller
    drops (removing operations from deadlock-free fixed orders cannot create a cycle).
    """
    if num_microbatches < num_stages:
        return [range(num_stages)]
    count = num_microbatches // num_stages
    base, extra = divmod(num_microbatches, count)
    out, lo = [], 0
    for i in range(count):
        hi = lo + base + (1 if i < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


def peak_activation(activation_bytes: Sequence[float], num_stages: int, stage: int,
                    num_microbatches: int, schedule: str = "1f1b",
                    padded: bool = False) -> float:
    """The most activation bytes one stage holds running its order alone, without building
    the order: the bytes of the first ``w`` forwards, then after each backward-forward pair
    of the steady state (fused backward; for ``zero-bubble`` the order with each W right
    after its B, which holds the same). ``activation_bytes`` has one entry per chunk.

    Args:
        activation_bytes: per model chunk, the bytes one micro-batch keeps.
        num_stages: S.
        stage: s.
        num_microbatches: m.
        schedule: a :class:`~chameleon_ft.spec.job.Schedule` value.
        padded: ``interleaved`` only: the padded variant (:func:`stage_order`).

    Returns:
        Bytes.
    """
    m, v = num_microbatches, len(activation_bytes)
    if schedule == ScheduleName.GPIPE:
        return m * activation_bytes[0]
    if schedule != ScheduleName.INTERLEAVED or v == 1:
        return min(num_stages - stage, m) * activation_bytes[0]
    if padded:
        groups = _groups(num_stages, -(-m // num_stages) * num_stages)
    else:
        groups = _groups(num_stages, m)
    forwards: list[float] = []
    backwards: list[float] = []
    for group in groups:
        real = sum(1 for j in group if j < m)  # missing micro-batches hold nothing
        for r in range(v):
            forwards.extend([activation_bytes[r]] * real + [0.0] * (len(group) - real))
        for r in reversed(range(v)):
            backwards.extend([activation_bytes[r]] * real + [0.0] * (len(group) - real))
    held = list(itertools.accumulate(forwards, initial=0.0))
    freed = list(itertools.accumulate(backwards, initial=0.0))
    warm = min(2 * (num_stages - stage - 1) + (v - 1) * len(groups[0]) + 1, len(forwards))
    steady = map(operator.sub, held[warm + 1:], freed[1:len(forwards) - warm + 1])
    return max(held[warm], max(steady, default=0.0))


def _one_forward_one_backward(forwards: list[tuple[OpKind, int, int]],
                              backwards: list[tuple[OpKind, int, int]],
                              warm: int) -> tuple[tuple[OpKind, int, int], ...]:
    """``warm`` forwards, then alternately one backward and one forward, then the rest."""
    warm = min(warm, len(forwards))
    order = forwards[:warm]
    nxt = warm
    for op in backwards:
        order.append(op)
        if nxt < len(forwards):
            order.append(forwards[nxt])
            nxt += 1
    return tuple(order)


@functools.lru_cache(maxsize=4096)
def stream_order(num_stages: int, stage: int, num_microbatches: int,
                 schedule: str = "1f1b") -> tuple[tuple[OpKind, int], ...]:
    """The op order of one stage of a one-chunk schedule: ``(kind, micro-batch)`` pairs
    (:func:`stage_order` without the chunk).

    1F1B keeps at most ``num_stages - stage`` micro-batches in flight on the stage.
    """
    return tuple((kind, j) for kind, _, j in
                 stage_order(num_stages, stage, num_microbatches, schedule))


# A rule maps (ready time, kind, micro-batch, pipeline's rank in component_order, stage,
# rerouted, chunk) to a key; the smallest key runs first. Every rule puts W last: a weight
# gradient runs only when no forward or input gradient is ready (deferred into the
# worker's idle time).
def _rerouted_first(ready_s: float, kind: int, microbatch: int, pipeline: int, stage: int,
                    rerouted: bool, chunk: int) -> tuple[float, ...]:
    # The dead pipeline waits on its peers while a peer's own pipeline can absorb a delay
    # in its bubble, so serving rerouted work first keeps the step within Eq. 13.
    return (kind == _W, not rerouted, kind != _B, microbatch, ready_s, pipeline, stage, chunk)


def _backward_first(ready_s: float, kind: int, microbatch: int, pipeline: int, stage: int,
                    rerouted: bool, chunk: int) -> tuple[float, ...]:
    return (kind == _W, kind != _B, microbatch, ready_s, pipeline, stage, chunk)


def _ready_first(ready_s: float, kind: int, microbatch: int, pipeline: int, stage: int,
                 rerouted: bool, chunk: int) -> tuple[float, ...]:
    return (kind == _W, ready_s, kind != _B, microbatch, pipeline, stage, chunk)


PRIORITIES = {"rerouted-first": _rerouted_first, "backward-first": _backward_first,
              "ready-first": _ready_first}
_RULE_CODES = {"rerouted-first": 0, "backward-first": 1, "ready-first": 2}
"""Each rule's number in the compiled kernel."""
"""How a worker running several streams picks among operations that are ready now.
A worker with one stream has no choice: it runs its schedule's order."""

DEFAULT_RULES = ("rerouted-first", "ready-first")
"""The rules :func:`best_timeline` tries. On 600 random rerouted plans this pair came within
0.11% (mean) of the best of all three rules, at two thirds of the cost."""

SECOND_RULE_MAX_OPS = 20_000
"""Graphs with more operations are merged by the first rule alone: on the 16,384-GPU
interleaved job (70,000 operations per rerouted component) the second rule was faster on
8 of 78 rerouted components from random failures, by at most 0.7% (the first was 0.37%
faster on average; benchmarks/schedules.py), and it doubles the cost of the simulator's
most expensive step."""


@dataclass
class Timeline:
    """The result of simulating some pipelines of a plan (one connected component)."""

    ops: dict[int, list[Op]] = field(default_factory=dict)
    """Per worker, operations in execution order."""
    finish_s: dict[int, float] = field(default_factory=dict)
    """Per worker, when its last operation ends."""
    busy_s: dict[int, float] = field(default_factory=dict)
    """Per worker, seconds spent computing."""
    peak_activation_bytes: dict[int, float] = field(default_factory=dict)
    """Per worker, the most activation bytes held at once."""
    makespan_s: float = 0.0
    """When the last operation of the component ends."""
    critical_compute_s: float = 0.0
    """Computation on the critical path (the rest of the makespan is transfers)."""
    critical_p2p_s: float = 0.0
    """Transfers on the critical path."""


ChunkCosts = tuple[LayerCost, ...]
"""The costs of each model chunk of one stage (one entry unless the job interleaves)."""


def _stage_costs(plan: ExecutionPlan, profile: Profile) -> dict[tuple[int, int], ChunkCosts]:
    """Each stage's per-chunk costs: one object per distinct layer range (stages of one
    range share it, so :func:`build_graph` can copy pipelines alike)."""
    by_range: dict[tuple[int, int], ChunkCosts] = {}
    out = {}
    for p, s, st in plan.iter_stages():
        key = (st.first_layer, st.end_layer)
        cost = by_range.get(key)
        if cost is None:
            cost = by_range[key] = chunk_sums(profile, *key)
        out[(p, s)] = cost
    return out


def splits_backward(plan: ExecutionPlan) -> bool:
    """Whether some worker of ``plan`` runs B and W as separate operations."""
    return plan.schedule in SPLIT_SCHEDULES or (plan.defer_weight_grad and bool(plan.reroutes))


FUSED_VARIANT = 2
"""The ``zero-bubble`` variant that runs the plan as ``1f1b`` (fused backward)."""


def schedule_variants(plan: ExecutionPlan, pipelines: Sequence[int] | None = None,
                      virtual_stages: int = 1) -> tuple[int, ...]:
    """The order variants :func:`best_timeline` tries (the fastest that fits memory wins).

    ``zero-bubble``: 0 and 1 index :func:`zero_bubble_lags` (ZB-H1's lag, then W right
    after its B); with reroutes also :data:`FUSED_VARIANT`, because the greedy merge on
    rerouted peers has no ordering guarantee: a zero-bubble plan is never estimated
    slower than the same plan under 1F1B. ``interleaved`` with a pipeline whose
    micro-batches are more than ``S`` and not a multiple of it: 0 (groups of at least
    ``S``: least bubble) and, only when that does not fit memory, 1 (padded groups of
    ``S``: least memory), the choice Llama 3 tunes by hand. One variant otherwise.
    """
    if plan.schedule == ScheduleName.INTERLEAVED and virtual_stages > 1:
        chosen = range(plan.num_pipelines) if pipelines is None else pipelines
        uneven = any(p.num_microbatches > p.num_stages and p.num_microbatches % p.num_stages
                     for p in (plan.pipelines[i] for i in chosen))
        return (0, 1) if uneven else (0,)
    if plan.schedule not in SPLIT_SCHEDULES:
        return (0,)
    return (0, 1, FUSED_VARIANT) if plan.reroutes else (0, 1)


@dataclass
class _Graph:
    """The operation graph of some pipelines, as flat arrays indexed by op id."""

    op_kind: list[int]
    """Each op's kind: 0 F, 1 B, 2 W."""
    op_pipeline: list[int]
    op_stage: list[int]
    op_mb: list[int]
    op_chunk: list[int]
    op_worker: list[int]
    op_dur: list[float]
    op_act: list[float]
    """Activation bytes each op adds (F) or frees (a negative number: B, or W when split)."""
    op_foreign: list[bool]
    edge_src: list[int]
    edge_dst: list[int]
    edge_delay: list[float]
    """The dependencies ``src -> dst`` with their transfer delays, in the order they were
    added: an op releases its successors in that order (what :attr:`succs` lists)."""
    streams: list[list[int]]
    stream_of_worker: dict[int, list[int]]
    pipeline_rank: dict[int, int]
    """Each pipeline's position in :func:`component_order`: what the priority rules break
    ties by, so that a simulation depends on the component's shape, not on its indices."""

    @functools.cached_property
    def succs(self) -> list[list[tuple[int, float]]]:
        """Each op's ``(successor, delay)`` pairs, in the order the edges were added."""
        succs: list[list[tuple[int, float]]] = [[] for _ in self.op_kind]
        for src, dst, delay in zip(self.edge_src, self.edge_dst, self.edge_delay,
                                   strict=True):
            succs[src].append((dst, delay))
        return succs

    @functools.cached_property
    def pending(self) -> list[int]:
        """Each op's number of predecessors."""
        pending = [0] * len(self.op_kind)
        for dst in self.edge_dst:
            pending[dst] += 1
        return pending

    def op(self, op_id: int) -> Op:
        """The op ``op_id`` as a value."""
        return Op(_KINDS[self.op_kind[op_id]], self.op_pipeline[op_id], self.op_stage[op_id],
                  self.op_mb[op_id], self.op_chunk[op_id])

    @functools.cached_property
    def workers(self) -> tuple[list[int], list[list[int]]]:
        """The workers in order (their dense index ``wi`` is the position) and each one's
        streams."""
        workers = list(self.stream_of_worker)
        return workers, [self.stream_of_worker[w] for w in workers]

    @functools.cached_property
    def layout(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """What every rule's Python run needs and none changes, computed once per graph:
        each op's dense worker index, its stream, the op after it in its stream (-1 at the
        end) and the op before it (the number of ops at the start: :class:`_ListRun` keeps
        a zero there). The compiled kernel derives them from the streams itself."""
        workers, _ = self.workers
        index = {w: i for i, w in enumerate(workers)}
        op_wi = [index[w] for w in self.op_worker]
        num_ops = len(self.op_kind)
        stream_id = [0] * num_ops
        next_in_stream = [-1] * num_ops
        prev_in_stream = [num_ops] * num_ops
        for sid, ids in enumerate(self.streams):
            first, last = ids[0], ids[-1]
            if last - first == len(ids) - 1:
                # a whole stage's stream: consecutive ids, set in bulk
                stream_id[first:last + 1] = [sid] * len(ids)
                next_in_stream[first:last] = range(first + 1, last + 1)
                prev_in_stream[first + 1:last + 1] = range(first, last)
                continue
            for op_id in ids:
                stream_id[op_id] = sid
            for a, b in itertools.pairwise(ids):
                next_in_stream[a] = b
                prev_in_stream[b] = a
        return op_wi, stream_id, next_in_stream, prev_in_stream

    @functools.cached_property
    def stream_totals(self) -> tuple[list[float], list[float]]:
        """Per stream, run alone in its order: the seconds of its ops and the most
        activation bytes held at once (what a worker running one stream accounts, in
        the same order of additions)."""
        if COMPILED:
            return _listsched.stream_totals(self.op_dur, self.op_act, self.streams)
        return self.stream_totals_python()

    def stream_totals_python(self) -> tuple[list[float], list[float]]:
        """:attr:`stream_totals` computed in Python (the reference)."""
        op_dur, op_act = self.op_dur, self.op_act
        busy = [functools.reduce(operator.add, [op_dur[i] for i in ids], 0.0)
                for ids in self.streams]
        peak = [max(itertools.accumulate([op_act[i] for i in ids], initial=0.0))
                for ids in self.streams]
        return busy, peak


@functools.lru_cache(maxsize=8192)
def _stream_layout(num_stages: int, stage: int, num_microbatches: int, schedule: str,
                   virtual_stages: int, split: int, variant: int
                   ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...],
                              tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A stage's stream as arrays: kind, chunk and micro-batch of each position, and the
    position of each ``(chunk, micro-batch)``'s F, B and W (index ``chunk * m + j``; -1
    when there is none).

    ``split``: 0 fused backward; 1 B and W in the schedule's own order (``zero-bubble``);
    2 B in the order and every W right after its B (the caller moves the W's to a stream
    of their own: deferred into idle time).
    """
    m = num_microbatches
    if split == 1:
        lags = zero_bubble_lags(num_stages, stage)
        order = stage_order(num_stages, stage, m, schedule, virtual_stages,
                            lags[min(variant, len(lags) - 1)])
    else:
        base = ScheduleName.ONE_F_ONE_B.value if schedule in SPLIT_SCHEDULES else schedule
        order = stage_order(num_stages, stage, m, base, virtual_stages,
                            padded=variant == 1 and base == ScheduleName.INTERLEAVED)
        if split == 2:
            order = tuple(op for kind, r, j in order
                          for op in (((kind, r, j), (OpKind.W, r, j)) if kind is OpKind.B
                                     else ((kind, r, j),)))
    size = virtual_stages * m
    fpos, bpos, wpos = [-1] * size, [-1] * size, [-1] * size
    kinds, chunks, mbs = [], [], []
    for i, (kind, r, j) in enumerate(order):
        code = _KINDS.index(kind)
        kinds.append(code)
        chunks.append(r)
        mbs.append(j)
        (fpos, bpos, wpos)[code][r * m + j] = i
    return tuple(kinds), tuple(chunks), tuple(mbs), tuple(fpos), tuple(bpos), tuple(wpos)


def component_order(plan: ExecutionPlan, pipelines: Iterable[int]) -> list[int]:
    """``pipelines`` in the order a simulation builds and ranks them: each rerouted one (by
    pipeline, then stage) followed by its peers' pipelines in the order of its shares,
    then the rest as given. Every index-dependent choice of the simulation (op ids, the
    priority rules' last tie-break, the order of simultaneous events) follows this order,
    so the same damage elsewhere in the cluster simulates identically.
    """
    given = list(pipelines)
    members = set(given)
    where = plan.stage_of_worker
    local: dict[int, int] = {}
    for r in sorted((r for r in plan.reroutes if r.pipeline in members),
                    key=lambda r: (r.pipeline, r.stage)):
        local.setdefault(r.pipeline, len(local))
        for w, _ in r.shares:
            if where[w][0] in members:
                local.setdefault(where[w][0], len(local))
    for p in given:
        local.setdefault(p, len(local))
    return sorted(local, key=local.__getitem__)


def _shifted_python(ids: list[int], lo: int, hi: int, delta: int) -> list[int]:
    """``[i + delta for i in ids[lo:hi]]`` (``_listsched.shifted`` where it is built)."""
    return list(map(delta.__add__, ids[lo:hi]))


_shifted = getattr(_listsched, "shifted", _shifted_python)


class _GraphBuilder:
    """The flat arrays of a :class:`_Graph`, filled stage stream by stage stream (the hot
    path of every estimate: a rerouted stage of the 16k job is 70,000 operations)."""

    def __init__(self, plan: ExecutionPlan, topology: Topology, chosen: list[int],
                 speeds: Mapping[int, float], variant: int) -> None:
        self.plan = plan
        self.topology = topology
        self.chosen = chosen
        self.speed = speeds
        self.variant = variant
        self.schedule = (ScheduleName.ONE_F_ONE_B.value if variant == FUSED_VARIANT
                         else plan.schedule)
        self.split_all = self.schedule in SPLIT_SCHEDULES
        # Workers that run several streams: rerouted peers. Their W's, when split, become
        # streams of their own that run only in idle time.
        members = set(chosen)
        self.peers = {w for r in plan.reroutes if r.pipeline in members for w, _ in r.shares}
        self.defer = self.split_all or (plan.defer_weight_grad and variant != FUSED_VARIANT)
        self.op_kind: list[int] = []
        self.op_pipeline: list[int] = []
        self.op_stage: list[int] = []
        self.op_mb: list[int] = []
        self.op_chunk: list[int] = []
        self.op_worker: list[int] = []
        self.op_dur: list[float] = []
        self.op_act: list[float] = []
        self.op_foreign: list[bool] = []
        self.streams: list[list[int]] = []  # op ids in order
        self.stream_worker: list[int] = []  # each stream's worker
        self.stream_of_worker: dict[int, list[int]] = {}
        self.fwd_id: dict[tuple[int, int], list[int]] = {}
        self.bwd_id: dict[tuple[int, int], list[int]] = {}
        self.wgt_id: dict[tuple[int, int], list[int]] = {}
        self.edge_src: list[int] = []
        self.edge_dst: list[int] = []
        self.edge_delay: list[float] = []
        self._delays: dict[tuple[int, int, float], float] = {}
        self.deltas: dict[int, int] = {}
        """Each copied pipeline's op ids minus those of the pipeline it copies."""

    def _split(self, p: int, s: int, worker: int) -> int:
        """How stage ``s`` of pipeline ``p`` runs its backward (:func:`_stream_layout`)."""
        if (p, s) in self.plan.reroute_map or (self.defer and worker in self.peers):
            return 2 if self.defer else 0
        return 1 if self.split_all else 0

    def _new_stream(self, worker: int, ids: list[int]) -> None:
        self.stream_of_worker.setdefault(worker, []).append(len(self.streams))
        self.streams.append(ids)
        self.stream_worker.append(worker)

    def intact_key(self, p: int, costs: Mapping[tuple[int, int], ChunkCosts]
                   ) -> tuple[Any, ...] | None:
        """What the operations and edges of pipeline ``p`` depend on besides its workers and
        its op ids, when no stage of it is rerouted (else ``None``): its micro-batches,
        each stage's cost object (alive while the graph is built), how it runs its
        backward, its speed, and the kind of each link it sends over."""
        pipe = self.plan.pipelines[p]
        workers = pipe.workers
        if any((p, s) in self.plan.reroute_map for s in range(len(workers))):
            return None
        node_of = self.topology.node_of
        return (pipe.num_microbatches,
                tuple([id(costs[(p, s)]) for s in range(len(workers))]),
                tuple([self._split(p, s, w) for s, w in enumerate(workers)]),
                tuple([self.speed.get(w, 1.0) for w in workers]) if self.speed else (),
                tuple([(a == b, node_of(a) == node_of(b))
                       for a, b in zip(workers, workers[1:] + workers[:1], strict=True)]))

    def add_like(self, p: int, block: _Block) -> None:
        """Pipeline ``p``'s operations and streams as a copy of ``block``'s (a pipeline
        with the same :meth:`intact_key`): the same arrays, its own workers and ids."""
        lo, hi = block.ops
        delta = len(self.op_kind) - lo
        self.deltas[p] = delta
        self.op_kind += self.op_kind[lo:hi]
        self.op_pipeline += [p] * (hi - lo)
        self.op_stage += self.op_stage[lo:hi]
        self.op_mb += self.op_mb[lo:hi]
        self.op_chunk += self.op_chunk[lo:hi]
        self.op_dur += self.op_dur[lo:hi]
        self.op_act += self.op_act[lo:hi]
        self.op_foreign += self.op_foreign[lo:hi]
        rename = dict(zip(self.plan.pipelines[block.source].workers,
                          self.plan.pipelines[p].workers, strict=True)).__getitem__
        self.op_worker += map(rename, self.op_worker[lo:hi])
        for k in range(*block.streams):
            ids = self.streams[k]
            self._new_stream(rename(self.stream_worker[k]), _shifted(ids, 0, len(ids), delta))

    def link_like(self, p: int, block: _Block) -> None:
        """Pipeline ``p``'s edges as a copy of ``block``'s (after :meth:`add_like`)."""
        lo, hi = block.edges
        delta = self.deltas[p]
        self.edge_src += _shifted(self.edge_src, lo, hi, delta)
        self.edge_dst += _shifted(self.edge_dst, lo, hi, delta)
        self.edge_delay += self.edge_delay[lo:hi]

    def add_stage(self, p: int, s: int, chunks: ChunkCosts) -> None:
        """The operations of stage ``s`` of pipeline ``p``, as one or more streams."""
        pipe = self.plan.pipelines[p]
        w0 = pipe.stages[s].worker
        split = self._split(p, s, w0)
        base = len(self.op_worker)
        kinds, rounds, mbs, fpos, bpos, wpos = _stream_layout(
            pipe.num_stages, s, pipe.num_microbatches, self.schedule, len(chunks), split,
            self.variant)
        n = len(kinds)
        shift = base.__add__  # op ids of the stream's positions (at C speed)
        self.fwd_id[(p, s)] = list(map(shift, fpos))
        self.bwd_id[(p, s)] = list(map(shift, bpos))
        if split:
            self.wgt_id[(p, s)] = list(map(shift, wpos))
        self.op_kind += kinds
        self.op_pipeline += [p] * n
        self.op_stage += [s] * n
        self.op_mb += mbs
        self.op_chunk += rounds
        durs, acts = _stream_cells(chunks, kinds, rounds, split)
        self.op_act += acts
        reroute = self.plan.reroute_map.get((p, s))
        if reroute is None:
            # One worker runs the whole stream, in order (its W's in a stream of their
            # own when it defers them).
            sp = self.speed.get(w0, 1.0)
            self.op_worker += [w0] * n
            self.op_dur += [d / sp for d in durs] if sp != 1.0 else durs
            self.op_foreign += [False] * n
            if split == 2:
                self._new_stream(w0, [base + i for i in range(n) if kinds[i] != _W])
                self._new_stream(w0, [base + i for i in range(n) if kinds[i] == _W])
            else:
                self._new_stream(w0, list(range(base, base + n)))
            return
        executors = self.plan.executor(p, s)
        by_worker: dict[tuple[int, bool], list[int]] = {}
        for i, (k, j) in enumerate(zip(kinds, mbs, strict=True)):
            w = executors[j]
            self.op_worker.append(w)
            self.op_dur.append(durs[i] / self.speed.get(w, 1.0))
            self.op_foreign.append(True)
            by_worker.setdefault((w, k == _W), []).append(base + i)
        for (w, _), ids in by_worker.items():
            self._new_stream(w, ids)

    def _link(self, src: int, dst: int, num_bytes: float, back: int, front: int) -> None:
        """Activation ``src -> dst``; its gradient ``back -> front`` (same bytes)."""
        op_worker, delays = self.op_worker, self._delays
        a, b = op_worker[src], op_worker[dst]
        delay = delays.get((a, b, num_bytes))
        if delay is None:
            delay = delays[(a, b, num_bytes)] = self.topology.p2p_s(a, b, num_bytes)
        rev = delays.get((b, a, num_bytes))
        if rev is None:
            rev = delays[(b, a, num_bytes)] = self.topology.p2p_s(b, a, num_bytes)
        self.edge_src += (src, back)
        self.edge_dst += (dst, front)
        self.edge_delay += (delay, rev)

    def link_stage(self, p: int, s: int, chunks: ChunkCosts) -> None:
        """Stage ``s``'s own edges (F before B before W) and those to the next stage (or,
        from the last stage, to the first stage's next chunk).

        Edges are added a block at a time (each op is the source of at most one edge per
        block), so every op's successors keep the order of the blocks."""
        src, dst, delay = self.edge_src, self.edge_dst, self.edge_delay
        fids, bids = self.fwd_id[(p, s)], self.bwd_id[(p, s)]
        src += fids
        dst += bids
        delay += [0.0] * len(fids)
        wids = self.wgt_id.get((p, s))
        if wids is not None:
            src += bids
            dst += wids
            delay += [0.0] * len(bids)
        pipe = self.plan.pipelines[p]
        m = pipe.num_microbatches
        if s + 1 < pipe.num_stages:
            next_f, next_b = self.fwd_id[(p, s + 1)], self.bwd_id[(p, s + 1)]
            if (p, s) in self.plan.reroute_map or (p, s + 1) in self.plan.reroute_map:
                for r, c in enumerate(chunks):
                    for x in range(r * m, (r + 1) * m):
                        self._link(fids[x], next_f[x], c.output_bytes, next_b[x], bids[x])
                return
            # One worker on each side: one transfer time per chunk, each way.
            a, b = pipe.stages[s].worker, pipe.stages[s + 1].worker
            for r, c in enumerate(chunks):
                ahead = self.topology.p2p_s(a, b, c.output_bytes)
                back = self.topology.p2p_s(b, a, c.output_bytes)
                lo, hi = r * m, (r + 1) * m
                src += fids[lo:hi]
                dst += next_f[lo:hi]
                delay += [ahead] * m
                src += next_b[lo:hi]
                dst += bids[lo:hi]
                delay += [back] * m
        elif len(chunks) > 1:
            # The last stage's chunk r feeds the first stage's chunk r + 1.
            first_f, first_b = self.fwd_id[(p, 0)], self.bwd_id[(p, 0)]
            for r in range(len(chunks) - 1):
                for j in range(m):
                    x, y = r * m + j, (r + 1) * m + j
                    self._link(fids[x], first_f[y], chunks[r].output_bytes, first_b[y],
                               bids[x])

    def graph(self) -> _Graph:
        """The graph built (after :meth:`add_stage` and :meth:`link_stage`)."""
        return _Graph(self.op_kind, self.op_pipeline, self.op_stage, self.op_mb, self.op_chunk,
                      self.op_worker, self.op_dur, self.op_act, self.op_foreign,
                      self.edge_src, self.edge_dst, self.edge_delay, self.streams,
                      self.stream_of_worker, {p: i for i, p in enumerate(self.chosen)})


_CELLS: dict[tuple[int, int, int, int], tuple[tuple[object, ...], tuple[float, ...],
                                             tuple[float, ...]]] = {}
""":func:`_stream_cells` by the identity of its arguments (which the entry keeps alive, so
an id is never reused while its entry stands): an estimate passes the same cost objects
and layouts for every stage of a shape. Cleared when it reaches :data:`_CELLS_SIZE`."""
_CELLS_SIZE = 4096


def _stream_cells(chunks: ChunkCosts, kinds: tuple[int, ...], rounds: tuple[int, ...],
                  split: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Duration (at unit speed) and activation bytes of each operation of a stream."""
    key = (id(chunks), id(kinds), id(rounds), split)
    hit = _CELLS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], (chunks, kinds, rounds),
                                                        strict=True)):
        return hit[1], hit[2]
    table: list[tuple[tuple[float, float], ...]] = []
    for c in chunks:
        if split:
            table.append(((c.fwd_s, c.activation_bytes), (c.bwd_input_s, 0.0),
                          (c.bwd_weight_s, -c.activation_bytes)))
        else:
            table.append(((c.fwd_s, c.activation_bytes), (c.bwd_s, -c.activation_bytes)))
    cells = [table[r][k] for k, r in zip(kinds, rounds, strict=True)]
    durs, acts = tuple(d for d, _ in cells), tuple(a for _, a in cells)
    if len(_CELLS) >= _CELLS_SIZE:
        _CELLS.clear()
    _CELLS[key] = ((chunks, kinds, rounds), durs, acts)
    return durs, acts


def build_graph(
    plan: ExecutionPlan,
    profile: Profile,
    topology: Topology,
    pipelines: Sequence[int] | None = None,
    speeds: Mapping[int, float] | None = None,
    costs: Mapping[tuple[int, int], ChunkCosts] | None = None,
    variant: int = 0,
    copy_intact: bool = True,
) -> _Graph:
    """The operation graph of ``pipelines`` (default: all) of ``plan``.

    ``costs`` gives each (pipeline, stage)'s per-chunk costs (:func:`chunk_sums`);
    ``variant`` picks the order variant of :func:`schedule_variants`. ``copy_intact=False``
    builds every pipeline stage by stage (the reference the copies are tested against).
    """
    chosen = component_order(
        plan, range(plan.num_pipelines) if pipelines is None else pipelines)
    costs = costs if costs is not None else _stage_costs(plan, profile)
    builder = _GraphBuilder(plan, topology, chosen, speeds or {}, variant)
    # An intact pipeline like one built before (most peers of a rerouted stage) copies its
    # arrays: the same operations and edges, stage by stage, as building it would add.
    blocks: dict[tuple[Any, ...], _Block] = {}
    like: dict[int, _Block] = {}  # pipeline -> the block it copies
    origin: dict[int, _Block] = {}  # pipeline -> the block it is the source of
    for p in chosen:
        key = builder.intact_key(p, costs) if copy_intact else None
        block = blocks.get(key) if key is not None else None
        if block is not None:
            builder.add_like(p, block)
            like[p] = block
            continue
        ops, streams = len(builder.op_kind), len(builder.streams)
        for s in range(plan.pipelines[p].num_stages):
            builder.add_stage(p, s, costs[(p, s)])
        if key is not None:
            blocks[key] = origin[p] = _Block(p, (ops, len(builder.op_kind)),
                                             (streams, len(builder.streams)))
    for p in chosen:
        block = like.get(p)
        if block is not None:
            builder.link_like(p, block)
            continue
        edges = len(builder.edge_src)
        for s in range(plan.pipelines[p].num_stages):
            builder.link_stage(p, s, costs[(p, s)])
        if p in origin:
            origin[p].edges = (edges, len(builder.edge_src))
    return builder.graph()


@dataclass
class _Block:
    """Where an intact pipeline's operations, streams and edges sit in a graph being built:
    what :meth:`_GraphBuilder.add_like` copies."""

    source: int
    ops: tuple[int, int]
    streams: tuple[int, int]
    edges: tuple[int, int] = (0, 0)


class _ListRun:
    """One run of the list scheduler over a graph with one priority rule.

    Workers are renumbered densely (``wi``) so the hot loops index lists, not dicts. A
    worker running one stream has no choice to make: its next op starts as soon as the op
    is released and the worker is free, so such ops are timed eagerly, in dependency
    order, without events (:meth:`drain`). Only workers merging several streams (rerouted
    peers) go through the event queue, where the priority rule picks among the ops ready
    "now" (:meth:`try_start`). Eager ops release their successors early, but with their
    true ready times, so a merging worker sees exactly the ops ready at its decision time.

    A one-stream worker runs its stream in order, so what it accounts (its ops, busy
    seconds and activation peak) is the stream's own (:attr:`_Graph.stream_totals`), and
    it is free when the op before in the stream ends: the eager loop only times ops.
    ``end`` is -1 until an op starts; its extra last slot, 0, is where every stream's
    first op finds its worker free.
    """

    def __init__(self, graph: _Graph, rule: str, with_ops: bool) -> None:
        self.graph = graph
        self.rule = rule
        self.priority = PRIORITIES[rule]
        self.with_ops = with_ops
        self.workers, self.wi_streams = graph.workers
        self.single = [len(ws) == 1 for ws in self.wi_streams]
        # What a run gives the timeline (both runs set them).
        self.stream_end: list[float] = []
        """When each stream's last op ends."""
        self.busy_until: list[float] = []
        self.busy_s: list[float] = []
        self.act_peak: list[float] = []
        self.order: list[list[int]] | None = None
        self.makespan = 0.0
        self.critical_compute = 0.0

    def _start(self) -> None:
        """The Python run's state."""
        graph = self.graph
        num_ops, num_workers = len(graph.op_kind), len(self.workers)
        self.op_wi, self.stream_id, self.next_in_stream, self.prev_in_stream = graph.layout
        self.pending = list(graph.pending)
        self.ready = [0.0] * num_ops
        self.head = [ids[0] for ids in graph.streams]
        """Each stream's next op to start (-1: done); kept for merging workers' streams."""
        self.end = [-1.0] * num_ops + [0.0]
        # Why each op started when it did: the predecessor that released it last, with the
        # transfer delay, or the previous op on the same worker (the critical path's walk).
        self.cause_op = [-1] * num_ops
        self.ready_cause = [-1] * num_ops
        self.busy_until = [0.0] * num_workers
        self.last_op = [-1] * num_workers
        self.running = [False] * num_workers
        self.wake_at = [math.inf] * num_workers
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, 0 done | 1 wake, op or worker)
        self.seq = 0
        self.started: list[list[int]] = [[] for _ in range(num_workers)]
        self.busy_s = [0.0] * num_workers
        self.act_now = [0.0] * num_workers
        self.act_peak = [0.0] * num_workers
        self.stack: list[int] = []  # eager ops released and at the head of their stream
        self.touched: list[int] = []  # merging workers with an op released

    def release(self, op_id: int, t1: float) -> None:
        """``op_id`` ended at ``t1``: its successors' ready times and counts."""
        ready, ready_cause, pending, op_wi = (self.ready, self.ready_cause, self.pending,
                                              self.op_wi)
        end, prev_in_stream = self.end, self.prev_in_stream
        for dst, delay in self.graph.succs[op_id]:
            arrival = t1 + delay
            if arrival >= ready[dst]:
                ready[dst] = arrival
                ready_cause[dst] = op_id
            pending[dst] -= 1
            if pending[dst] == 0:
                u = op_wi[dst]
                if not self.single[u]:
                    self.touched.append(u)
                elif end[prev_in_stream[dst]] >= 0.0:  # the head of its stream
                    self.stack.append(dst)

    def drain(self) -> None:
        """Time every eager op that can run now, and what they release (the hot loop:
        the bookkeeping of :meth:`release` written out)."""
        stack, touched, single = self.stack, self.touched, self.single
        op_wi, op_dur = self.op_wi, self.graph.op_dur
        succs, pending, ready, ready_cause = (self.graph.succs, self.pending, self.ready,
                                              self.ready_cause)
        cause_op, end = self.cause_op, self.end
        next_in_stream, prev_in_stream = self.next_in_stream, self.prev_in_stream
        while stack:
            op_id = stack.pop()
            before = prev_in_stream[op_id]
            free = end[before]  # the worker is free when its stream's previous op ends
            r = ready[op_id]
            if r >= free:
                t1 = r + op_dur[op_id]
                rc = ready_cause[op_id]
                cause_op[op_id] = rc if rc >= 0 else before
            else:
                t1 = free + op_dur[op_id]
                cause_op[op_id] = before
            # Release before ending the op: the stream's own next op is pushed below.
            for dst, delay in succs[op_id]:
                arrival = t1 + delay
                if arrival >= ready[dst]:
                    ready[dst] = arrival
                    ready_cause[dst] = op_id
                left = pending[dst] - 1
                pending[dst] = left
                if left == 0:
                    u = op_wi[dst]
                    if not single[u]:
                        touched.append(u)
                    elif end[prev_in_stream[dst]] >= 0.0:
                        stack.append(dst)
            end[op_id] = t1
            nxt = next_in_stream[op_id]
            if nxt >= 0 and pending[nxt] == 0:
                stack.append(nxt)

    def _account(self, w: int, op_id: int) -> None:
        self.started[w].append(op_id)
        self.busy_s[w] += self.graph.op_dur[op_id]
        act = self.act_now[w] + self.graph.op_act[op_id]
        self.act_now[w] = act
        if act > self.act_peak[w]:
            self.act_peak[w] = act

    def _choice(self, w: int, now: float) -> tuple[int, float]:
        """The ready stream head of merging worker ``w`` the rule picks at ``now`` (-1:
        none), and when the next one becomes ready (infinity: none known)."""
        head, pending, ready = self.head, self.pending, self.ready
        graph = self.graph
        op_kind, op_pipeline, op_stage, op_mb, op_chunk, op_foreign, rank = (
            graph.op_kind, graph.op_pipeline, graph.op_stage, graph.op_mb, graph.op_chunk,
            graph.op_foreign, graph.pipeline_rank)
        best = -1
        best_key: tuple[float, ...] | None = None
        wait = math.inf
        for sid in self.wi_streams[w]:
            op_id = head[sid]
            if op_id < 0 or pending[op_id]:
                continue
            r = ready[op_id]
            if r > now + 1e-12:
                if r < wait:
                    wait = r
                continue
            key = self.priority(r, op_kind[op_id], op_mb[op_id], rank[op_pipeline[op_id]],
                                op_stage[op_id], op_foreign[op_id], op_chunk[op_id])
            if best_key is None or key < best_key:
                best, best_key = op_id, key
        return best, wait

    def try_start(self, w: int, now: float) -> None:
        """Start merging worker ``w``'s next op at ``now`` if it is idle and one is ready;
        else wake it when the next one is."""
        if self.running[w]:
            return
        best, wait = self._choice(w, now)
        if best < 0:
            if wait < self.wake_at[w]:
                self.wake_at[w] = wait
                heapq.heappush(self.events, (wait, self.seq, 1, w))
                self.seq += 1
            return
        free = self.busy_until[w]
        t0 = now if now > free else free
        cause = self.ready_cause[best]
        self.cause_op[best] = cause if (cause >= 0 and self.ready[best] >= free) \
            else self.last_op[w]
        t1 = t0 + self.graph.op_dur[best]
        self.end[best] = t1
        self.running[w] = True
        self.head[self.stream_id[best]] = self.next_in_stream[best]
        self._account(w, best)
        heapq.heappush(self.events, (t1, self.seq, 0, best))
        self.seq += 1

    def run(self) -> None:
        """Every op timed: the eager ones first, then event by event.

        Raises:
            RuntimeError: when the fixed orders deadlock.
        """
        self._start()
        for w in range(len(self.workers)):
            if self.single[w]:
                first = self.head[self.wi_streams[w][0]]
                if first >= 0 and self.pending[first] == 0:
                    self.stack.append(first)
        self.drain()
        for w in range(len(self.workers)):
            if not self.single[w]:
                self.try_start(w, 0.0)
        self.touched.clear()
        events = self.events
        op_wi, running, busy_until, last_op, wake_at = (self.op_wi, self.running,
                                                        self.busy_until, self.last_op,
                                                        self.wake_at)
        stack, touched, try_start = self.stack, self.touched, self.try_start
        while events:
            t, _, event, payload = heapq.heappop(events)
            if event == 1:
                if wake_at[payload] == t:
                    wake_at[payload] = math.inf
                try_start(payload, t)
                continue
            op_id = payload
            w = op_wi[op_id]
            running[w] = False
            busy_until[w] = t
            last_op[w] = op_id
            # Release the successors first, so the worker's next choice sees all of them.
            self.release(op_id, t)
            if stack:
                self.drain()
            try_start(w, t)
            while touched:
                try_start(touched.pop(), t)
        if min(self.end) < 0.0:
            # A fixed per-stage order that waits on an op queued behind it on another
            # worker; the orders of stage_order never do (tests cover random shapes).
            raise RuntimeError("schedule deadlocked")
        self._summarise()

    def _summarise(self) -> None:
        """The stream ends, the makespan and the critical path's computation."""
        self.order = self.started
        num_ops = len(self.graph.op_kind)
        end = self.end[:num_ops]
        self.stream_end = [end[ids[-1]] for ids in self.graph.streams]
        if end:
            makespan = max(end)
            node = end.index(makespan)  # the first op ending last
            compute = 0.0
            while 0 <= node < num_ops:  # a stream's first op may name the slot past the end
                compute += self.graph.op_dur[node]
                node = self.cause_op[node]
            self.makespan, self.critical_compute = makespan, compute

    def run_compiled(self) -> None:
        """:meth:`run` in the compiled kernel (``_listsched.run``): the same operations in
        the same order, so the same end times, causes and per-worker figures, bit for bit.

        Raises:
            RuntimeError: when the fixed orders deadlock, or when the kernel is not built.
        """
        if _listsched is None:
            raise RuntimeError("the compiled list scheduler is not built (reinstall the "
                               "package with a C compiler)")
        graph = self.graph
        ranks = [0] * (max(graph.pipeline_rank, default=-1) + 1)
        for p, rank in graph.pipeline_rank.items():
            ranks[p] = rank
        (self.stream_end, self.busy_until, self.busy_s, self.act_peak, self.order,
         self.makespan, self.critical_compute) = _listsched.run(
            graph.op_dur, graph.op_act, graph.edge_src, graph.edge_dst, graph.edge_delay,
            self.wi_streams, graph.streams, graph.op_kind, graph.op_pipeline,
            graph.op_stage, graph.op_mb, graph.op_chunk, graph.op_foreign, ranks,
            _RULE_CODES[self.rule], self.with_ops)

    def timeline(self) -> Timeline:
        """The timed schedule, with the critical path split into compute and transfers."""
        timeline = Timeline()
        streams = self.graph.streams
        stream_busy, stream_peak = self.graph.stream_totals
        for i, w in enumerate(self.workers):
            if self.single[i]:
                (sid,) = self.wi_streams[i]
                order = streams[sid]
                timeline.finish_s[w] = self.stream_end[sid]
                timeline.busy_s[w] = stream_busy[sid]
                timeline.peak_activation_bytes[w] = stream_peak[sid]
            else:
                order = self.order[i] if self.order is not None else []
                timeline.finish_s[w] = self.busy_until[i]
                timeline.busy_s[w] = self.busy_s[i]
                timeline.peak_activation_bytes[w] = self.act_peak[i]
            if self.with_ops:
                timeline.ops[w] = [self.graph.op(op_id) for op_id in order]
        if self.graph.op_kind:
            timeline.makespan_s = self.makespan
            timeline.critical_compute_s = self.critical_compute
            timeline.critical_p2p_s = max(0.0, self.makespan - self.critical_compute)
        return timeline


def _list_schedule(graph: _Graph, rule: str, with_ops: bool = True,
                   compiled: bool | None = None) -> Timeline:
    """Run the list scheduler over ``graph`` with one priority rule (:class:`_ListRun`):
    the compiled kernel where it is built (``compiled`` None or True), else, or with
    ``compiled=False``, the Python reference. Both give the same timeline, bit for bit."""
    run = _ListRun(graph, rule, with_ops)
    if compiled is None:
        compiled = COMPILED
    if compiled:
        run.run_compiled()
    else:
        run.run()
    return run.timeline()


def simulate(
    plan: ExecutionPlan,
    profile: Profile,
    topology: Topology,
    pipelines: Sequence[int] | None = None,
    speeds: Mapping[int, float] | None = None,
    costs: Mapping[tuple[int, int], ChunkCosts] | None = None,
    rule: str = "rerouted-first",
    variant: int = 0,
) -> Timeline:
    """List-schedule the operations of ``pipelines`` (default: all) of ``plan``.

    The chosen pipelines must be closed under reroutes: a peer's own pipeline is simulated
    together with every pipeline whose stage it serves.

    Args:
        plan: the execution plan.
        profile: per-layer costs.
        topology: links between workers.
        pipelines: which pipelines to simulate.
        speeds: relative speed of each worker (default 1.0): durations are divided by it.
        costs: precomputed per-(pipeline, stage) chunk costs (an optimisation).
        rule: a key of :data:`PRIORITIES`, for workers that run several streams.
        variant: an index into :func:`schedule_variants` (the order variant).

    Returns:
        The timed per-worker schedule.

    Raises:
        RuntimeError: if the fixed orders deadlock (a bug: the schedules here never do).
    """
    graph = build_graph(plan, profile, topology, pipelines, speeds, costs, variant)
    return _list_schedule(graph, rule)


def best_timeline(
    plan: ExecutionPlan,
    profile: Profile,
    topology: Topology,
    pipelines: Sequence[int] | None = None,
    speeds: Mapping[int, float] | None = None,
    costs: Mapping[tuple[int, int], ChunkCosts] | None = None,
    with_ops: bool = True,
    lower_bound_s: float = 0.0,
) -> Timeline:
    """:func:`simulate` with each order variant and each of :data:`DEFAULT_RULES`; the
    fastest timeline (first on ties), among those that fit device memory when some do
    (interleaved: the padded variant only when the first does not fit).

    Without ``with_ops`` the timeline's per-worker op lists are left empty (timings only).
    ``lower_bound_s`` is a makespan no timeline can beat (the estimator passes the slowest
    failure-free makespan of the component's intact pipelines when no worker splits its
    backward: their operations, links and stream orders are all still there): once a
    timeline reaches it the others are skipped, which changes nothing (the first of equal
    timelines is kept).

    Only workers that run several streams (rerouted peers) depend on the rule, so plans
    without reroutes are simulated with one rule, and so are graphs above
    :data:`SECOND_RULE_MAX_OPS` operations; only ``zero-bubble`` has several variants.
    """
    chosen = list(range(plan.num_pipelines)) if pipelines is None else list(pipelines)
    rules = list(DEFAULT_RULES)
    if not any(r.pipeline in chosen for r in plan.reroutes):
        rules = rules[:1]
    costs = costs if costs is not None else _stage_costs(plan, profile)
    variants = schedule_variants(plan, chosen, max(len(c) for c in costs.values()))
    static: dict[int, float] = {}
    if len(variants) > 1:
        # Variants trade bubble for memory: the fastest one that fits wins.
        for p in chosen:
            for s, st in enumerate(plan.pipelines[p].stages):
                if (p, s) not in plan.reroute_map:
                    static[st.worker] = sum(c.static_bytes for c in costs[(p, s)])
    capacity = topology.memory_capacity_bytes
    best: Timeline | None = None
    best_fits = False
    for variant in variants:
        graph = build_graph(plan, profile, topology, chosen, speeds, costs, variant)
        for rule in rules if len(graph.op_kind) <= SECOND_RULE_MAX_OPS else rules[:1]:
            timeline = _list_schedule(graph, rule, with_ops)
            fits = all(static.get(w, 0.0) + peak <= capacity
                       for w, peak in timeline.peak_activation_bytes.items())
            if (best is None or (fits and not best_fits)
                    or (fits == best_fits and timeline.makespan_s < best.makespan_s - 1e-12)):
                best, best_fits = timeline, fits
            if best_fits and best.makespan_s <= lower_bound_s + 1e-12:
                return best
        if best_fits and plan.schedule == ScheduleName.INTERLEAVED:
            break  # the larger groups fit: padding would only add bubble
    assert best is not None
    return best


@dataclass(frozen=True)
class Schedule:
    """What each worker executes in one step, in order: the runtime's contract."""

    ops: Mapping[int, tuple[Op, ...]]
    """Per live worker, its operations in execution order: F and fused B for ``1f1b`` and
    ``gpipe`` (what the runtime executes); chunks and W operations for the others."""
    sync_rounds: tuple[tuple[Bucket, ...], ...]
    """Gradient all-reduce rounds; the buckets of one round share no worker."""
