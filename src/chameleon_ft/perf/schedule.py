"""Schedules as data: the per-worker order of forward and backward operations of a plan.

One function, :func:`simulate`, turns a plan into a timed schedule by list scheduling
over the dependency graph of docs/design.md section 3.1:

- F(p, s, j) after F(p, s-1, j) plus the activation transfer between their workers;
- B(p, s, j) after F(p, s, j), and after B(p, s+1, j) plus the gradient transfer;
- each (pipeline, stage) is a *stream* of operations in schedule order (1F1B: ``S - s``
  forwards, then alternate one backward and one forward, then the remaining backwards;
  GPipe: every forward, then every backward). A stream runs its operations in order.

A worker normally runs one stream, so its order is exactly 1F1B and the step time is the
longest path of the graph (paper Eq. 11). A worker that also runs a rerouted stage's
micro-batches runs several streams; when it is free it starts one of the stream heads
that are ready, chosen by a priority rule, so the merge never deadlocks (list scheduling
of a DAG) and never idles while work is ready. :func:`best_timeline` tries two rules
and keeps the faster; serving rerouted work first keeps a rerouted step within Eq. 13
computed with whole micro-batches. The resulting per-worker op lists are what the runtime
executes, so the runtime runs exactly the schedule the estimator timed.

Backward operations are fused (input gradient and weight gradient back to back), so
Eq. 9 holds exactly for uniform stages.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from chameleon_ft.perf.network import Topology
from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.profile.profile import LayerCost, Profile, stage_sums


class OpKind(StrEnum):
    """Operation kinds: forward, and fused backward (input gradient + weight gradient)."""

    F = "F"
    B = "B"


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of one micro-batch of one (pipeline, stage)."""

    kind: OpKind
    pipeline: int
    stage: int
    microbatch: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """Layers whose gradients are all-reduced together over the same set of workers."""

    workers: tuple[int, ...]
    layers: tuple[int, ...]


@functools.lru_cache(maxsize=4096)
def stream_order(num_stages: int, stage: int, num_microbatches: int,
                 schedule: str = "1f1b") -> tuple[tuple[OpKind, int], ...]:
    """The schedule's op order for one stage: ``(kind, micro-batch)`` pairs.

    1F1B keeps at most ``num_stages - stage`` micro-batches in flight on the stage.
    """
    m = num_microbatches
    if schedule == "gpipe":
        return tuple([(OpKind.F, j) for j in range(m)] + [(OpKind.B, j) for j in range(m)])
    warm = min(num_stages - stage, m)
    order = [(OpKind.F, j) for j in range(warm)]
    for k in range(m):
        order.append((OpKind.B, k))
        if k + warm < m:
            order.append((OpKind.F, k + warm))
    return tuple(order)


# A rule maps (ready time, is backward, micro-batch, pipeline, stage, rerouted) to a key;
# the smallest key runs first.
def _rerouted_first(ready_s: float, backward: bool, microbatch: int, pipeline: int, stage: int,
                    rerouted: bool) -> tuple[float, ...]:
    # The dead pipeline waits on its peers while a peer's own pipeline can absorb a delay
    # in its bubble, so serving rerouted work first keeps the step within Eq. 13.
    return (not rerouted, not backward, microbatch, ready_s, pipeline, stage)


def _backward_first(ready_s: float, backward: bool, microbatch: int, pipeline: int, stage: int,
                    rerouted: bool) -> tuple[float, ...]:
    return (not backward, microbatch, ready_s, pipeline, stage)


def _ready_first(ready_s: float, backward: bool, microbatch: int, pipeline: int, stage: int,
                 rerouted: bool) -> tuple[float, ...]:
    return (ready_s, not backward, microbatch, pipeline, stage)


PRIORITIES = {"rerouted-first": _rerouted_first, "backward-first": _backward_first,
              "ready-first": _ready_first}
"""How a worker running several streams picks among operations that are ready now.
A worker with one stream has no choice: it runs its 1F1B order."""

DEFAULT_RULES = ("rerouted-first", "ready-first")
"""The rules :func:`best_timeline` tries. On 600 random rerouted plans this pair came within
0.11% (mean) of the best of all three rules, at two thirds of the cost."""


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


def _stage_costs(plan: ExecutionPlan, profile: Profile) -> dict[tuple[int, int], LayerCost]:
    return {(p, s): stage_sums(profile, st.layers) for p, s, st in plan.iter_stages()}


@dataclass
class _Graph:
    """The operation graph of some pipelines, as flat arrays indexed by op id."""

    op_meta: list[tuple[bool, int, int, int]]
    """``(is backward, pipeline, stage, micro-batch)`` of each op."""
    op_worker: list[int]
    op_dur: list[float]
    op_act: list[float]
    op_foreign: list[bool]
    succs: list[list[tuple[int, float]]]
    streams: list[list[int]]
    stream_of_worker: dict[int, list[int]]
    pending: list[int]

    def op(self, op_id: int) -> Op:
        """The op ``op_id`` as a value."""
        backward, p, s, j = self.op_meta[op_id]
        return Op(OpKind.B if backward else OpKind.F, p, s, j)


@functools.lru_cache(maxsize=4096)
def _stream_layout(num_stages: int, stage: int, num_microbatches: int, schedule: str
                   ) -> tuple[tuple[bool, ...], tuple[int, ...], tuple[int, ...]]:
    """For a stage's stream: whether each position is a backward, and the position of each
    micro-batch's forward and backward."""
    order = stream_order(num_stages, stage, num_microbatches, schedule)
    fpos = [0] * num_microbatches
    bpos = [0] * num_microbatches
    for i, (kind, j) in enumerate(order):
        if kind is OpKind.F:
            fpos[j] = i
        else:
            bpos[j] = i
    return tuple(kind is OpKind.B for kind, _ in order), tuple(fpos), tuple(bpos)


def build_graph(
    plan: ExecutionPlan,
    profile: Profile,
    topology: Topology,
    pipelines: Sequence[int] | None = None,
    speeds: Mapping[int, float] | None = None,
    costs: Mapping[tuple[int, int], LayerCost] | None = None,
) -> _Graph:
    """The operation graph of ``pipelines`` (default: all) of ``plan``."""
    chosen = list(range(plan.num_pipelines)) if pipelines is None else list(pipelines)
    costs = costs if costs is not None else _stage_costs(plan, profile)
    speed = speeds or {}
    rerouted = set(plan.reroute_map)

    # ---- the graph, as flat arrays indexed by op id (this loop is the hot path)
    op_meta: list[tuple[bool, int, int, int]] = []
    op_worker: list[int] = []
    op_dur: list[float] = []
    op_act: list[float] = []
    op_foreign: list[bool] = []
    streams: list[list[int]] = []  # op ids in order
    stream_of_worker: dict[int, list[int]] = {}
    fwd_id: dict[tuple[int, int], list[int]] = {}
    bwd_id: dict[tuple[int, int], list[int]] = {}

    for p in chosen:
        pipe = plan.pipelines[p]
        num_stages, m = pipe.num_stages, pipe.num_microbatches
        for s in range(num_stages):
            cost = costs[(p, s)]
            base = len(op_worker)
            backward, fpos, bpos = _stream_layout(num_stages, s, m, plan.schedule)
            fwd_id[(p, s)] = [base + i for i in fpos]
            bwd_id[(p, s)] = [base + i for i in bpos]
            op_meta.extend([(is_b, p, s, j) for is_b, (_, j)
                            in zip(backward, stream_order(num_stages, s, m, plan.schedule),
                                   strict=True)])
            op_act.extend([cost.activation_bytes] * (2 * m))
            if (p, s) not in rerouted:
                # One worker runs the whole stream, in order.
                w = pipe.stages[s].worker
                sp = speed.get(w, 1.0)
                fwd, bwd = cost.fwd_s / sp, cost.bwd_s / sp
                op_worker.extend([w] * (2 * m))
                op_dur.extend([bwd if is_b else fwd for is_b in backward])
                op_foreign.extend([False] * (2 * m))
                stream_of_worker.setdefault(w, []).append(len(streams))
                streams.append(list(range(base, base + 2 * m)))
                continue
            executors = plan.executor(p, s)
            by_worker: dict[int, list[int]] = {}
            for i, ((_, j), is_b) in enumerate(
                    zip(stream_order(num_stages, s, m, plan.schedule), backward, strict=True)):
                w = executors[j]
                op_worker.append(w)
                op_dur.append((cost.bwd_s if is_b else cost.fwd_s) / speed.get(w, 1.0))
                op_foreign.append(True)
                by_worker.setdefault(w, []).append(base + i)
            for w, ids in by_worker.items():
                stream_of_worker.setdefault(w, []).append(len(streams))
                streams.append(ids)

    num_ops = len(op_worker)
    succs: list[list[tuple[int, float]]] = [[] for _ in range(num_ops)]
    pending = [0] * num_ops
    delays: dict[tuple[int, int], float] = {}
    for p in chosen:
        pipe = plan.pipelines[p]
        for s in range(pipe.num_stages):
            fids, bids = fwd_id[(p, s)], bwd_id[(p, s)]
            for f, b in zip(fids, bids, strict=True):
                succs[f].append((b, 0.0))
                pending[b] += 1
            if s + 1 == pipe.num_stages:
                continue
            out_bytes = costs[(p, s)].output_bytes
            next_f, next_b = fwd_id[(p, s + 1)], bwd_id[(p, s + 1)]
            for j in range(pipe.num_microbatches):
                a, b = op_worker[fids[j]], op_worker[next_f[j]]
                delay = delays.get((a, b))
                if delay is None:
                    delay = delays[(a, b)] = topology.p2p_s(a, b, out_bytes)
                # activation forward, gradient of the same size backward
                succs[fids[j]].append((next_f[j], delay))
                pending[next_f[j]] += 1
                back = delays.get((b, a))
                if back is None:
                    back = delays[(b, a)] = topology.p2p_s(b, a, out_bytes)
                succs[next_b[j]].append((bids[j], back))
                pending[bids[j]] += 1
        delays.clear()  # the output size differs per pipeline stage

    return _Graph(op_meta, op_worker, op_dur, op_act, op_foreign, succs, streams,
                  stream_of_worker, pending)


def _list_schedule(graph: _Graph, rule: str, with_ops: bool = True) -> Timeline:
    """Run the list scheduler over ``graph`` with one priority rule.

    Workers are renumbered densely (``wi``) so the hot loop indexes lists, not dicts.
    """
    priority = PRIORITIES[rule]
    op_meta, op_dur = graph.op_meta, graph.op_dur
    op_act, op_foreign, succs = graph.op_act, graph.op_foreign, graph.succs
    streams = graph.streams
    workers = list(graph.stream_of_worker)
    index = {w: i for i, w in enumerate(workers)}
    op_wi = [index[w] for w in graph.op_worker]
    wi_streams = [graph.stream_of_worker[w] for w in workers]
    num_ops, num_workers = len(op_meta), len(workers)
    pending = list(graph.pending)
    ready = [0.0] * num_ops
    stream_id = [0] * num_ops
    next_in_stream = [-1] * num_ops
    for sid, ids in enumerate(streams):
        for k, op_id in enumerate(ids):
            stream_id[op_id] = sid
            if k + 1 < len(ids):
                next_in_stream[op_id] = ids[k + 1]
    head = [ids[0] for ids in streams]
    end = [0.0] * num_ops
    # Why each op started when it did: the predecessor that released it last, with the
    # transfer delay, or the previous op on the same worker; used to walk the critical path.
    cause_op = [-1] * num_ops
    ready_cause = [-1] * num_ops
    busy_until = [0.0] * num_workers
    last_op = [-1] * num_workers
    running = [False] * num_workers
    wake_at = [math.inf] * num_workers
    events: list[tuple[float, int, int, int]] = []  # (time, seq, 0 done | 1 wake, payload)
    seq = 0
    order: list[list[int]] = [[] for _ in range(num_workers)]
    busy_s = [0.0] * num_workers
    act_now = [0.0] * num_workers
    act_peak = [0.0] * num_workers
    is_fwd = [not meta[0] for meta in op_meta]

    # A worker running one stream has no choice to make: its next op starts as soon as the
    # op is released and the worker is free, so such ops are timed eagerly, in dependency
    # order, without events. Only workers merging several streams (rerouted peers) go
    # through the event queue, where the priority rule picks among the ops ready "now".
    # Eager ops release their successors early, but with their true ready times, so a
    # merging worker sees exactly the ops ready at its decision time.
    single = [len(ws) == 1 for ws in wi_streams]
    stack: list[int] = []
    touched: list[int] = []

    def release(op_id: int, t1: float) -> None:
        for dst, delay in succs[op_id]:
            arrival = t1 + delay
            if arrival >= ready[dst]:
                ready[dst] = arrival
                ready_cause[dst] = op_id
            pending[dst] -= 1
            if pending[dst] == 0:
                u = op_wi[dst]
                if not single[u]:
                    touched.append(u)
                elif head[stream_id[dst]] == dst:
                    stack.append(dst)

    def account(w: int, op_id: int) -> None:
        order[w].append(op_id)
        busy_s[w] += op_dur[op_id]
        if is_fwd[op_id]:
            act_now[w] += op_act[op_id]
            if act_now[w] > act_peak[w]:
                act_peak[w] = act_now[w]
        else:
            act_now[w] -= op_act[op_id]

    def drain() -> None:
        """Time every eager op that can run now, and what they release (the hot loop:
        ``account`` and ``release`` written out)."""
        while stack:
            op_id = stack.pop()
            w = op_wi[op_id]
            free = busy_until[w]
            r = ready[op_id]
            rc = ready_cause[op_id]
            cause_op[op_id] = rc if (rc >= 0 and r >= free) else last_op[w]
            dur = op_dur[op_id]
            t1 = (r if r > free else free) + dur
            end[op_id] = t1
            busy_until[w] = t1
            last_op[w] = op_id
            if with_ops:
                order[w].append(op_id)
            busy_s[w] += dur
            if is_fwd[op_id]:
                act = act_now[w] + op_act[op_id]
                act_now[w] = act
                if act > act_peak[w]:
                    act_peak[w] = act
            else:
                act_now[w] -= op_act[op_id]
            # Release before moving the head: the stream's own next op is pushed below.
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
                    elif head[stream_id[dst]] == dst:
                        stack.append(dst)
            nxt = next_in_stream[op_id]
            head[stream_id[op_id]] = nxt
            if nxt >= 0 and pending[nxt] == 0:
                stack.append(nxt)

    def try_start(w: int, now: float) -> None:
        nonlocal seq
        if running[w]:
            return
        best = -1
        best_key: tuple[float, ...] | None = None
        wait = math.inf
        for sid in wi_streams[w]:
            op_id = head[sid]
            if op_id < 0 or pending[op_id]:
                continue
            r = ready[op_id]
            if r > now + 1e-12:
                if r < wait:
                    wait = r
                continue
            backward, p, s, j = op_meta[op_id]
            key = priority(r, backward, j, p, s, op_foreign[op_id])
            if best_key is None or key < best_key:
                best, best_key = op_id, key
        if best < 0:
            if wait < wake_at[w]:
                wake_at[w] = wait
                heapq.heappush(events, (wait, seq, 1, w))
                seq += 1
            return
        free = busy_until[w]
        t0 = now if now > free else free
        cause_op[best] = ready_cause[best] if (ready_cause[best] >= 0 and ready[best] >= free) \
            else last_op[w]
        t1 = t0 + op_dur[best]
        end[best] = t1
        running[w] = True
        head[stream_id[best]] = next_in_stream[best]
        account(w, best)
        heapq.heappush(events, (t1, seq, 0, best))
        seq += 1

    def start_touched(now: float) -> None:
        while touched:
            try_start(touched.pop(), now)

    for w in range(num_workers):
        if single[w]:
            first = head[wi_streams[w][0]]
            if first >= 0 and pending[first] == 0:
                stack.append(first)
    drain()
    for w in range(num_workers):
        if not single[w]:
            try_start(w, 0.0)
    touched.clear()
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
        release(op_id, t)
        drain()
        try_start(w, t)
        start_touched(t)

    if any(h != -1 for h in head):  # pragma: no cover - list scheduling of a DAG cannot deadlock
        raise RuntimeError("schedule deadlocked")

    timeline = Timeline()
    for i, w in enumerate(workers):
        if with_ops:
            timeline.ops[w] = [graph.op(op_id) for op_id in order[i]]
        timeline.finish_s[w] = busy_until[i]
        timeline.busy_s[w] = busy_s[i]
        timeline.peak_activation_bytes[w] = act_peak[i]
    if num_ops:
        last = max(range(num_ops), key=lambda i: (end[i], -i))
        timeline.makespan_s = end[last]
        node = last
        compute = 0.0
        while node >= 0:
            compute += op_dur[node]
            node = cause_op[node]
        timeline.critical_compute_s = compute
        timeline.critical_p2p_s = max(0.0, timeline.makespan_s - compute)
    return timeline


def simulate(
    plan: ExecutionPlan,
    profile: Profile,
    topology: Topology,
    pipelines: Sequence[int] | None = None,
    speeds: Mapping[int, float] | None = None,
    costs: Mapping[tuple[int, int], LayerCost] | None = None,
    rule: str = "rerouted-first",
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
        costs: precomputed per-(pipeline, stage) sums (an optimisation).
        rule: a key of :data:`PRIORITIES`, for workers that run several streams.

    Returns:
        The timed per-worker schedule.
    """
    graph = build_graph(plan, profile, topology, pipelines, speeds, costs)
    return _list_schedule(graph, rule)


def best_timeline(
    plan: ExecutionPlan,
    profile: Profile,
    topology: Topology,
    pipelines: Sequence[int] | None = None,
    speeds: Mapping[int, float] | None = None,
    costs: Mapping[tuple[int, int], LayerCost] | None = None,
    with_ops: bool = True,
) -> Timeline:
    """:func:`simulate` with each of :data:`DEFAULT_RULES`; the fastest timeline (first on ties).

    Without ``with_ops`` the timeline's per-worker op lists are left empty (timings only).

    Only workers that run several streams (rerouted peers) depend on the rule, so plans
    without reroutes are simulated once.
    """
    chosen = list(range(plan.num_pipelines)) if pipelines is None else list(pipelines)
    rules = list(DEFAULT_RULES)
    if not any(r.pipeline in chosen for r in plan.reroutes):
        rules = rules[:1]
    graph = build_graph(plan, profile, topology, chosen, speeds, costs)
    best: Timeline | None = None
    for rule in rules:
        timeline = _list_schedule(graph, rule, with_ops)
        if best is None or timeline.makespan_s < best.makespan_s - 1e-12:
            best = timeline
    assert best is not None
    return best


@dataclass(frozen=True)
class Schedule:
    """What each worker executes in one step, in order: the runtime's contract."""

    ops: Mapping[int, tuple[Op, ...]]
    """Per live worker, forward and (fused) backward operations in execution order."""
    sync_rounds: tuple[tuple[Bucket, ...], ...]
    """Gradient all-reduce rounds; the buckets of one round share no worker."""
