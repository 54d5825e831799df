"""Schedules as data: the per-worker order of forward and backward operations of a plan.

One function, :func:`simulate`, turns a plan into a timed schedule by list scheduling
over the dependency graph of DESIGN.md section 3.1:

- F(p, s, j) after F(p, s-1, j) plus the activation transfer between their workers;
- B(p, s, j) after F(p, s, j), and after B(p, s+1, j) plus the gradient transfer;
- each (pipeline, stage) is a *stream* of operations in schedule order (1F1B: ``S - s``
  forwards, then alternate one backward and one forward, then the remaining backwards;
  GPipe: every forward, then every backward). A stream runs its operations in order.

A worker normally runs one stream, so its order is exactly 1F1B and the step time is the
longest path of the graph (paper Eq. 11). A worker that also runs a rerouted stage's
micro-batches runs several streams; when it is free it starts one of the stream heads
that are ready, chosen by a priority rule, so the merge never deadlocks (list scheduling
of a DAG) and never idles while work is ready. :func:`best_timeline` tries every rule
and keeps the fastest; serving rerouted work first keeps a rerouted step within Eq. 13
computed with whole micro-batches. The resulting per-worker op lists are what the runtime
executes, so the runtime runs exactly the schedule the estimator timed.

Backward operations are fused (input gradient and weight gradient back to back), so
Eq. 9 holds exactly for uniform stages.
"""

from __future__ import annotations

import heapq
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


def stream_order(num_stages: int, stage: int, num_microbatches: int,
                 schedule: str = "1f1b") -> list[tuple[OpKind, int]]:
    """The schedule's op order for one stage: ``(kind, micro-batch)`` pairs.

    1F1B keeps at most ``num_stages - stage`` micro-batches in flight on the stage.
    """
    m = num_microbatches
    if schedule == "gpipe":
        return [(OpKind.F, j) for j in range(m)] + [(OpKind.B, j) for j in range(m)]
    warm = min(num_stages - stage, m)
    order = [(OpKind.F, j) for j in range(warm)]
    for k in range(m):
        order.append((OpKind.B, k))
        if k + warm < m:
            order.append((OpKind.F, k + warm))
    return order


def _rerouted_first(ready_s: float, op: Op, rerouted: bool) -> tuple[float, ...]:
    # The dead pipeline waits on its peers while a peer's own pipeline can absorb a delay
    # in its bubble, so serving rerouted work first keeps the step within Eq. 13.
    return (0 if rerouted else 1, 0 if op.kind is OpKind.B else 1, op.microbatch, ready_s,
            op.pipeline, op.stage)


def _backward_first(ready_s: float, op: Op, rerouted: bool) -> tuple[float, ...]:
    return (0 if op.kind is OpKind.B else 1, op.microbatch, ready_s, op.pipeline, op.stage)


def _ready_first(ready_s: float, op: Op, rerouted: bool) -> tuple[float, ...]:
    return (ready_s, 0 if op.kind is OpKind.B else 1, op.microbatch, op.pipeline, op.stage)


PRIORITIES = {"rerouted-first": _rerouted_first, "backward-first": _backward_first,
              "ready-first": _ready_first}
"""How a worker running several streams picks among operations that are ready now.
A worker with one stream has no choice: it runs its 1F1B order."""


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
    chosen = list(range(plan.num_pipelines)) if pipelines is None else list(pipelines)
    costs = costs if costs is not None else _stage_costs(plan, profile)
    speed = speeds or {}

    # ---- build the graph: arrays indexed by op id
    op_list: list[Op] = []
    op_worker: list[int] = []
    op_dur: list[float] = []
    op_act: list[float] = []
    succs: list[list[tuple[int, float]]] = []
    pending: list[int] = []
    ready: list[float] = []
    index: dict[tuple[OpKind, int, int, int], int] = {}
    streams: list[list[int]] = []  # op ids in order
    stream_of_worker: dict[int, list[int]] = {}

    for p in chosen:
        pipe = plan.pipelines[p]
        num_stages, m = pipe.num_stages, pipe.num_microbatches
        for s in range(num_stages):
            cost = costs[(p, s)]
            executors = plan.executor(p, s)
            order = stream_order(num_stages, s, m, plan.schedule)
            by_worker: dict[int, list[int]] = {}
            for kind, j in order:
                w = executors[j]
                rate = speed.get(w, 1.0)
                dur = (cost.fwd_s if kind is OpKind.F else cost.bwd_s) / rate
                op_id = len(op_list)
                op_list.append(Op(kind, p, s, j))
                op_worker.append(w)
                op_dur.append(dur)
                op_act.append(cost.activation_bytes)
                succs.append([])
                pending.append(0)
                ready.append(0.0)
                index[(kind, p, s, j)] = op_id
                by_worker.setdefault(w, []).append(op_id)
            for w, ids in by_worker.items():
                stream_of_worker.setdefault(w, []).append(len(streams))
                streams.append(ids)

    def edge(src: int, dst: int, num_bytes: float) -> None:
        delay = topology.p2p_s(op_worker[src], op_worker[dst], num_bytes)
        succs[src].append((dst, delay))
        pending[dst] += 1

    for p in chosen:
        pipe = plan.pipelines[p]
        last = pipe.num_stages - 1
        for s in range(pipe.num_stages):
            out_bytes = costs[(p, s)].output_bytes
            for j in range(pipe.num_microbatches):
                f = index[(OpKind.F, p, s, j)]
                b = index[(OpKind.B, p, s, j)]
                edge(f, b, 0.0)
                if s < last:
                    edge(f, index[(OpKind.F, p, s + 1, j)], out_bytes)
                    edge(index[(OpKind.B, p, s + 1, j)], b, out_bytes)

    # ---- list scheduling
    priority = PRIORITIES[rule]
    rerouted = set(plan.reroute_map)
    num_ops = len(op_list)
    stream_id = [0] * num_ops
    next_in_stream = [-1] * num_ops
    for sid, ids in enumerate(streams):
        for k, op_id in enumerate(ids):
            stream_id[op_id] = sid
            if k + 1 < len(ids):
                next_in_stream[op_id] = ids[k + 1]
    head = [ids[0] for ids in streams]
    start = [0.0] * num_ops
    end = [0.0] * num_ops
    # Why each op started when it did: the predecessor that released it last, with the
    # transfer delay, or the previous op on the same worker; used to walk the critical path.
    cause_op = [-1] * num_ops
    cause_delay = [0.0] * num_ops
    ready_cause = [-1] * num_ops
    ready_delay = [0.0] * num_ops
    busy_until: dict[int, float] = {w: 0.0 for w in stream_of_worker}
    last_op: dict[int, int] = {w: -1 for w in stream_of_worker}
    running: dict[int, bool] = {w: False for w in stream_of_worker}
    wake_at: dict[int, float] = {}
    events: list[tuple[float, int, int, int]] = []  # (time, seq, kind 0=done 1=wake, payload)
    seq = 0
    worker_ops: dict[int, list[Op]] = {w: [] for w in stream_of_worker}
    busy_s: dict[int, float] = {w: 0.0 for w in stream_of_worker}
    act_now: dict[int, float] = {w: 0.0 for w in stream_of_worker}
    act_peak: dict[int, float] = {w: 0.0 for w in stream_of_worker}

    def try_start(w: int, now: float) -> None:
        nonlocal seq
        if running[w]:
            return
        best = -1
        best_key: tuple[float, ...] | None = None
        wait = float("inf")
        for sid in stream_of_worker[w]:
            op_id = head[sid]
            if op_id < 0 or pending[op_id]:
                continue
            if ready[op_id] > now + 1e-12:
                wait = min(wait, ready[op_id])
                continue
            op = op_list[op_id]
            key = priority(ready[op_id], op, (op.pipeline, op.stage) in rerouted)
            if best_key is None or key < best_key:
                best, best_key = op_id, key
        if best < 0:
            if wait < float("inf") and wake_at.get(w, float("inf")) > wait:
                wake_at[w] = wait
                heapq.heappush(events, (wait, seq, 1, w))
                seq += 1
            return
        t0 = max(now, busy_until[w])
        start[best] = t0
        if ready_cause[best] >= 0 and ready[best] >= busy_until[w]:
            cause_op[best], cause_delay[best] = ready_cause[best], ready_delay[best]
        else:
            cause_op[best], cause_delay[best] = last_op[w], 0.0
        t1 = t0 + op_dur[best]
        end[best] = t1
        running[w] = True
        head[stream_id[best]] = next_in_stream[best]
        op = op_list[best]
        worker_ops[w].append(op)
        busy_s[w] += op_dur[best]
        if op.kind is OpKind.F:
            act_now[w] += op_act[best]
            if act_now[w] > act_peak[w]:
                act_peak[w] = act_now[w]
        else:
            act_now[w] -= op_act[best]
        heapq.heappush(events, (t1, seq, 0, best))
        seq += 1

    for w in stream_of_worker:
        try_start(w, 0.0)
    while events:
        t, _, event, payload = heapq.heappop(events)
        if event == 1:
            if wake_at.get(payload) == t:
                del wake_at[payload]
            try_start(payload, t)
            continue
        op_id = payload
        w = op_worker[op_id]
        running[w] = False
        busy_until[w] = t
        last_op[w] = op_id
        touched = {w}
        for dst, delay in succs[op_id]:
            arrival = t + delay
            if arrival >= ready[dst]:
                ready[dst] = arrival
                ready_cause[dst], ready_delay[dst] = op_id, delay
            pending[dst] -= 1
            if pending[dst] == 0:
                touched.add(op_worker[dst])
        for u in sorted(touched):
            try_start(u, t)

    unfinished = [op_list[i] for i in range(num_ops) if head[stream_id[i]] != -1]
    if unfinished:  # pragma: no cover - list scheduling of a DAG cannot deadlock
        raise RuntimeError(f"schedule deadlocked with {len(unfinished)} operations left")

    timeline = Timeline(ops=worker_ops, busy_s=busy_s, peak_activation_bytes=act_peak)
    for w in stream_of_worker:
        timeline.finish_s[w] = busy_until[w]
    if num_ops:
        last = max(range(num_ops), key=lambda i: (end[i], -i))
        timeline.makespan_s = end[last]
        node = last
        compute = p2p = 0.0
        while node >= 0:
            compute += op_dur[node]
            p2p += cause_delay[node]
            node = cause_op[node]
        timeline.critical_compute_s = compute
        timeline.critical_p2p_s = max(0.0, timeline.makespan_s - compute)
    return timeline


@dataclass(frozen=True)
class Schedule:
    """What each worker executes in one step, in order: the runtime's contract."""

    ops: Mapping[int, tuple[Op, ...]]
    """Per live worker, forward and (fused) backward operations in execution order."""
    sync_rounds: tuple[tuple[Bucket, ...], ...]
    """Gradient all-reduce rounds; the buckets of one round share no worker."""


def best_timeline(
    plan: ExecutionPlan,
    profile: Profile,
    topology: Topology,
    pipelines: Sequence[int] | None = None,
    speeds: Mapping[int, float] | None = None,
    costs: Mapping[tuple[int, int], LayerCost] | None = None,
) -> Timeline:
    """:func:`simulate` with every priority rule; the fastest timeline (first on ties).

    Only workers that run several streams (rerouted peers) depend on the rule, so plans
    without reroutes are simulated once.
    """
    chosen = list(range(plan.num_pipelines)) if pipelines is None else list(pipelines)
    rules = list(PRIORITIES)
    if not any(r.pipeline in chosen for r in plan.reroutes):
        rules = rules[:1]
    best: Timeline | None = None
    for rule in rules:
        timeline = simulate(plan, profile, topology, chosen, speeds, costs, rule)
        if best is None or timeline.makespan_s < best.makespan_s - 1e-12:
            best = timeline
    assert best is not None
    return best
