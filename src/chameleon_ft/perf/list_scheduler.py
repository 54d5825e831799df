"""The list scheduler: one run over an operation graph with one priority rule, in Python
(the reference) or in the compiled kernel (``_listsched``, the same timeline bit for bit).

A worker normally runs one stream, so its order is exactly the schedule's and the step
time is the longest path of the graph (paper Eq. 11). A worker that also runs a rerouted
stage's micro-batches runs several streams; when it is free it starts one of the stream
heads that are ready, chosen by a priority rule (:data:`PRIORITIES`), so the merge never
deadlocks (list scheduling of a DAG) and never idles while work is ready. Deferred weight
gradients form streams of their own that run only when no F or B is ready.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from chameleon_ft.perf.graph import _Graph
from chameleon_ft.perf.kernel import COMPILED, _listsched
from chameleon_ft.perf.orders import _B, _W, Op


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
"""How a worker running several streams picks among operations that are ready now.
A worker with one stream has no choice: it runs its schedule's order."""
_RULE_CODES = {"rerouted-first": 0, "backward-first": 1, "ready-first": 2}
"""Each rule's number in the compiled kernel."""


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
