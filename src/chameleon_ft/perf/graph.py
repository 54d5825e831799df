"""The operation graph of some pipelines of a plan: what the list scheduler times
(docs/design.md section 3.1).

- F(p, s, r, j) after F(p, s-1, r, j), and the first stage's chunk r after the last
  stage's chunk r-1, plus the activation transfer between their workers; B(p, s, r, j)
  after F(p, s, r, j) and after the next chunk's B plus the gradient transfer; W after
  its B;
- each (pipeline, stage) is a *stream* of operations in the schedule's order
  (:func:`~chameleon_ft.perf.orders.stage_order`), run in order by its worker; a rerouted
  stage's stream is split over the peers that run its micro-batches, and a worker that
  defers its weight gradients runs its W's as a stream of their own.

The graph is flat arrays indexed by op id (:class:`_Graph`), filled stage stream by stage
stream (:class:`_GraphBuilder`); an intact pipeline like one built before copies its
arrays (:func:`build_graph`).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chameleon_ft.perf.kernel import COMPILED, _listsched, _shifted
from chameleon_ft.perf.network import Topology
from chameleon_ft.perf.orders import (
    _KINDS,
    _W,
    SPLIT_SCHEDULES,
    Op,
    OpKind,
    stage_order,
    zero_bubble_lags,
)
from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.profile.profile import LayerCost, Profile, chunk_sums
from chameleon_ft.spec.job import Schedule as ScheduleName

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
