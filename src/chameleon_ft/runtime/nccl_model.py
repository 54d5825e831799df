"""The checker of the runtime's point-to-point traffic: an executable model of NCCL's
semantics run over the very programs the workers perform (pure: no torch, no process).

Two checks, over every worker's program from :mod:`chameleon_ft.runtime.traffic` (the
functions the executor, the migration and the warm-up take their order from):

1. **pairs**: for every ordered pair ``src -> dst``, the messages ``src`` sends, in its
   order, equal the receives ``dst`` posts from ``src``, in its order: identity, shape
   and dtype (what in-order matching needs);
2. **the model** (:class:`NcclModel`): each worker issues its program's instructions in
   order; posting returns at once, a wait blocks until what it waits for completed. Each
   communicator (the channel a message's direction picks) has, per pair, one stream on
   each side that runs that side's operations with the peer in the order they were
   posted, both directions on it; a stream's head operation completes only together with
   the peer stream's head when one is a send and the other a receive (a send completes
   only when matched, the strictest of NCCL's behaviours: a small message NCCL buffers
   completes earlier, which can only remove waits), and tags play no part. Optionally
   (``open_pairs=False``) a pair's communicator does not exist yet: a worker's first
   operation on it blocks until the peer reaches its own first one (how NCCL creates a
   pair's communicator: the warm-up). The model reports every receive that got another
   message than the one it was posted for, and a deadlock (workers blocked for ever)
   with where each one stands.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.runtime.traffic import (
    Boundaries,
    Do,
    Instruction,
    Message,
    actions_of,
    channel_of,
    migration_program,
    peers_of,
    step_program,
    warm_up_program,
)

Programs = Mapping[int, Sequence[Instruction]]
Channel = Callable[[int, int], int]
"""``(src, dst) -> communicator``: which group a message travels on."""


# ---------------------------------------------------------------------- 1. the pairs
def pair_sequences(programs: Programs) -> tuple[dict[tuple[int, int], list[Message]],
                                                dict[tuple[int, int], list[Message]]]:
    """Per ordered pair ``(src, dst)``: what ``src`` sends, in its order, and what ``dst``
    posts receives for, in its order."""
    sends: dict[tuple[int, int], list[Message]] = {}
    posts: dict[tuple[int, int], list[Message]] = {}
    for worker, program in programs.items():
        for ins in program:
            if ins.do is Do.POST_SEND and ins.message is not None:
                if ins.message.src != worker:
                    raise ValueError(f"worker {worker} sends {ins.message} as another worker")
                sends.setdefault((worker, ins.message.dst), []).append(ins.message)
            elif ins.do is Do.POST_RECV and ins.message is not None:
                if ins.message.dst != worker:
                    raise ValueError(f"worker {worker} receives {ins.message} for another "
                                     "worker")
                posts.setdefault((ins.message.src, worker), []).append(ins.message)
    return sends, posts


def compare_pairs(programs: Programs) -> list[str]:
    """Every ordered pair whose send sequence differs from its receive-posting sequence,
    at the first difference."""
    sends, posts = pair_sequences(programs)
    out = []
    for pair in sorted(set(sends) | set(posts)):
        sent, taken = sends.get(pair, []), posts.get(pair, [])
        if sent == taken:
            continue
        k = next((i for i, (a, b) in enumerate(zip(sent, taken, strict=False)) if a != b),
                 min(len(sent), len(taken)))
        send = sent[k] if k < len(sent) else "nothing"
        recv = taken[k] if k < len(taken) else "nothing"
        out.append(f"pair {pair[0]}->{pair[1]}: message #{k} sent is {send}, the receive "
                   f"posted is for {recv}")
    return out


# ---------------------------------------------------------------------- 2. the model
@dataclass
class _Op:
    worker: int
    send: bool
    message: Message
    done: bool = False
    got: Message | None = None
    """A receive: the message it was matched with."""


@dataclass
class _Worker:
    program: Sequence[Instruction]
    pc: int = 0
    ops: list[int] = field(default_factory=list)
    """Every operation this worker posted (indices into the model's table)."""
    recv_of: dict[Message, int] = field(default_factory=dict)
    """The receive this worker posted for each message."""

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.program)


class NcclModel:
    """The programs run to the end, or to a deadlock, under NCCL's semantics (module doc).

    Args:
        programs: each worker's program.
        channel: the communicator a message ``src -> dst`` travels on.
        open_pairs: whether every pair's communicator exists already (after the warm-up);
            False: a pair's first operation on a communicator waits for the peer's.
    """

    def __init__(self, programs: Programs, channel: Channel = channel_of,
                 open_pairs: bool = True) -> None:
        self.workers = {w: _Worker(list(p)) for w, p in programs.items()}
        self.channel = channel
        self.ops: list[_Op] = []
        self.streams: dict[tuple[int, int, int], deque[int]] = {}
        """``(communicator, worker, peer)`` -> the worker's pending operations with the
        peer on that communicator, in posting order."""
        self.open_pairs = open_pairs
        self.arrived: dict[tuple[int, int, int], set[int]] = {}
        """Closed communicators ``(channel, low, high)``: who reached its first operation."""
        self.findings: list[str] = []

    # -------------------------------------------------------------- running
    def run(self) -> list[str]:
        """Run every program as far as it goes; returns the findings (empty: every
        receive got its own message and every worker finished)."""
        dirty = deque(sorted(self.workers))
        queued = set(dirty)
        while dirty:
            worker = dirty.popleft()
            queued.discard(worker)
            for woken in self._advance(worker):
                if woken not in queued:
                    queued.add(woken)
                    dirty.append(woken)
        stuck = {w: x for w, x in self.workers.items() if not x.finished}
        if stuck:
            self.findings.append("deadlock: " + "; ".join(
                self._where(w, x) for w, x in sorted(stuck.items())))
        return self.findings

    def _advance(self, worker: int) -> set[int]:
        """Issue ``worker``'s instructions until one blocks; returns the workers whose
        operations completed meanwhile (they may go on)."""
        me = self.workers[worker]
        woken: set[int] = set()
        while not me.finished:
            ins = me.program[me.pc]
            if ins.do in (Do.POST_SEND, Do.POST_RECV):
                assert ins.message is not None
                if not self._opened(worker, ins.message, woken):
                    break
                woken |= self._post(worker, ins.do is Do.POST_SEND, ins.message)
            elif ins.do is Do.WAIT_RECV:
                assert ins.message is not None
                op = me.recv_of.get(ins.message)
                if op is None:
                    self.findings.append(f"worker {worker} waits for {ins.message} without "
                                         "posting its receive")
                    me.pc = len(me.program)
                    break
                if not self.ops[op].done:
                    break
            elif ins.do is Do.WAIT_ALL and not all(self.ops[i].done for i in me.ops):
                break
            me.pc += 1
        woken.discard(worker)
        return woken

    def _opened(self, worker: int, message: Message, woken: set[int]) -> bool:
        """Whether the communicator of ``message`` between its two workers exists (with
        ``open_pairs`` False: once both have reached their first operation on it)."""
        if self.open_pairs:
            return True
        low, high = sorted((message.src, message.dst))
        key = (self.channel(message.src, message.dst), low, high)
        here = self.arrived.setdefault(key, set())
        if len(here) == 2:
            return True
        here.add(worker)
        if len(here) == 2:
            woken.add(high if worker == low else low)
            return True
        return False

    def _post(self, worker: int, send: bool, message: Message) -> set[int]:
        me = self.workers[worker]
        peer = message.dst if send else message.src
        index = len(self.ops)
        self.ops.append(_Op(worker, send, message))
        me.ops.append(index)
        if not send:
            if message in me.recv_of:
                self.findings.append(f"worker {worker} posts a second receive for {message}")
            me.recv_of[message] = index
        comm = self.channel(message.src, message.dst)
        self.streams.setdefault((comm, worker, peer), deque()).append(index)
        return self._match(comm, worker, peer)

    def _match(self, comm: int, a: int, b: int) -> set[int]:
        """Complete the heads of the pair's two streams while they are a send and a
        receive; returns the workers whose operations completed."""
        mine = self.streams.setdefault((comm, a, b), deque())
        theirs = self.streams.setdefault((comm, b, a), deque())
        woken: set[int] = set()
        while mine and theirs:
            x, y = self.ops[mine[0]], self.ops[theirs[0]]
            if x.send == y.send:
                break  # two sends or two receives at the heads: each waits for the other
            send, recv = (x, y) if x.send else (y, x)
            if send.message != recv.message:
                self.findings.append(f"worker {recv.worker}'s receive posted for "
                                     f"{recv.message} got {send.message}")
            send.done = recv.done = True
            recv.got = send.message
            mine.popleft()
            theirs.popleft()
            woken |= {a, b}
        return woken

    def _where(self, worker: int, state: _Worker) -> str:
        ins = state.program[state.pc]
        what = f"{ins.do}" + (f" {ins.message}" if ins.message is not None else "")
        heads = [f"{'send' if self.ops[q[0]].send else 'recv'} {self.ops[q[0]].message} "
                 f"on channel {c}" for (c, w, _), q in sorted(self.streams.items())
                 if w == worker and q]
        return f"worker {worker} at #{state.pc} {what} (stream heads: {', '.join(heads)})"


# ---------------------------------------------------------------------- the checks
def check_programs(programs: Programs, *, channel: Channel = channel_of,
                   open_pairs: bool = True) -> list[str]:
    """Both checks over ``programs``: the pairs' sequences, then the model."""
    try:
        findings = compare_pairs(programs)
    except ValueError as exc:
        return [str(exc)]
    return findings + NcclModel(programs, channel, open_pairs).run()


def step_programs(plan: ExecutionPlan, actions: Mapping[int, Sequence[Any]],
                  boundaries: Boundaries | None = None) -> dict[int, tuple[Instruction, ...]]:
    """Every worker's step program (:func:`~chameleon_ft.runtime.traffic.step_program`,
    what its executor performs)."""
    workers = sorted(set(actions) | set(plan.workers))
    return {w: step_program(plan, actions, w, boundaries) for w in workers}


def migration_programs(transfers: Sequence[Sequence[int]], rounds: Sequence[Sequence[int]]
                       ) -> dict[int, tuple[Instruction, ...]]:
    """Every involved worker's whole migration (its rounds one after the other, as
    ``worker.migration`` performs them)."""
    workers = sorted({t[1] for t in transfers} | {t[2] for t in transfers})
    return {w: tuple(ins for rnd in migration_program(transfers, rounds, w) for ins in rnd)
            for w in workers}


def check_step(plan: ExecutionPlan, actions: Mapping[int, Sequence[Any]],
               boundaries: Boundaries | None = None) -> list[str]:
    """The findings on one step of ``plan`` with every worker's ``actions``."""
    try:
        programs = step_programs(plan, actions, boundaries)
    except ValueError as exc:
        return [str(exc)]
    return check_programs(programs)


def check_migration(transfers: Sequence[Sequence[int]],
                    rounds: Sequence[Sequence[int]]) -> list[str]:
    """The findings on a migration's rounds."""
    try:
        programs = migration_programs(transfers, rounds)
    except ValueError as exc:
        return [str(exc)]
    return check_programs(programs)


def check_warm_up(world: Sequence[int],
                  peers: Mapping[int, Iterable[int]] | None = None) -> list[str]:
    """The findings on the warm-up of a generation's groups over ``world`` (the pairs'
    communicators created by it), each worker opening its pairs with ``peers[worker]``
    (default: every other member)."""
    return check_programs({w: warm_up_program(world, w, None if peers is None else peers[w])
                           for w in world}, open_pairs=False)


def check_directive(directive: Mapping[str, Any],
                    boundaries: Boundaries | None = None) -> list[str]:
    """Every check on one published directive: the warm-up of its world, its migration,
    its step."""
    plan = ExecutionPlan.from_dict(directive["plan"])
    try:
        actions = actions_of(directive["ops"])
    except ValueError as exc:
        return [str(exc)]
    migration = directive.get("migration")
    transfers = migration["transfers"] if migration else []
    findings = check_warm_up(directive["world"],
                             {w: peers_of(plan, actions, transfers, w)
                              for w in directive["world"]})
    if migration:
        findings += check_migration(migration["transfers"], migration["rounds"])
    return findings + check_step(plan, actions, boundaries)
