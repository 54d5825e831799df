"""A step's point-to-point traffic, as data (pure: a plan and action lists in, values out).

NCCL, unlike gloo, ignores tags: it matches a pair's sends and receives in the order each
side issues them, and runs all of one communicator's operations between a pair on one
stream, both directions on it, each one waiting until its peer's matching operation runs.
So the runtime's point-to-point traffic is correct by construction (docs/design.md
section 4, "Point-to-point traffic"):

- **one direction per communicator**: a message from worker ``a`` to worker ``b`` goes
  on the generation's *up* group when ``a < b``, on its *down* group otherwise
  (:func:`channel_of`), so a pair's stream on a communicator carries one direction only
  and a send can never wait behind a receive of the same stream;
- **receives posted in the sender's order**: when a worker needs the ``k``-th message
  of a sender, it first posts every receive of that sender's messages up to ``k`` that it
  has not posted yet, in the order the sender sends them (:class:`_Posting`), into
  buffers of the shape the message has; later actions take the buffer already posted.
  What a pair's ``k``-th receive gets is then the ``k``-th send, whatever the tags.

The worker's programs built here (:func:`step_program`, :func:`migration_program`,
:func:`warm_up_program`) are lists of :class:`Instruction`: the executor
(``worker.executor``), the migration (``worker.migration``) and the group warm-up
(``worker.groups``) perform them in order, and the checker
(:mod:`chameleon_ft.runtime.nccl_model`) runs the very same lists on a model of NCCL.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from chameleon_ft.plan.plan import ExecutionPlan

UP, DOWN = 0, 1
"""Channels: the group that carries messages to a higher worker id, and to a lower one."""

Action = tuple[str, int, int, int]
"""``(kind, pipeline, stage, micro-batch)``: ``F`` or ``B`` of one micro-batch, as the
directive's ``ops`` carry it."""

Boundaries = Sequence[Sequence[Any]]
"""``[shape, dtype]`` of every layer's output for one micro-batch (the job's
``boundaries``): what a stage boundary carries."""


class Kind(StrEnum):
    """What a message carries."""

    ACTIVATION = "activation"
    """A stage's output, to the next stage."""
    GRADIENT = "gradient"
    """The gradient of a stage's input, to the previous stage."""
    STATE_SIZE = "state-size"
    """Migration: the byte length of a layer's packed state."""
    STATE_BYTES = "state-bytes"
    """Migration: one slice of a layer's packed state."""
    WARM_UP = "warm-up"
    """The one-element message that opens a pair of a new group."""


@dataclass(frozen=True, slots=True)
class Message:
    """One tensor one worker sends another."""

    kind: Kind
    src: int
    dst: int
    key: tuple[int, int, int] = (0, 0, 0)
    """Which one of its kind: ``(pipeline, receiving stage, micro-batch)`` for activations
    and gradients, ``(transfer index, layer, part)`` for migration."""
    layer: int = -1
    """Activations and gradients: the layer whose input the message is (the receiver's
    buffer is the output of ``layer - 1``)."""
    shape: tuple[int, ...] | None = None
    """Where known (boundaries given; a migration's size)."""
    dtype: str | None = None

    def __str__(self) -> str:
        shape = "" if self.shape is None and self.dtype is None else \
            f" {list(self.shape) if self.shape is not None else '?'} {self.dtype or '?'}"
        return f"{self.kind} {self.key} {self.src}->{self.dst}{shape}"


class Do(StrEnum):
    """What one instruction of a worker's program does."""

    POST_RECV = "post-recv"
    """Post a receive (returns at once)."""
    WAIT_RECV = "wait-recv"
    """Block until a posted receive has its data."""
    COMPUTE = "compute"
    """Run an action (its input taken, its output to be sent by the next instruction)."""
    POST_SEND = "post-send"
    """Post a send (returns at once; it completes when the receiver has posted its
    receive)."""
    WAIT_ALL = "wait-all"
    """Block until every operation this worker posted has completed."""


@dataclass(frozen=True, slots=True)
class Instruction:
    """One step of a worker's program."""

    do: Do
    message: Message | None = None
    action: Action | None = None


def channel_of(src: int, dst: int) -> int:
    """The group a message from ``src`` to ``dst`` travels on: :data:`UP` or :data:`DOWN`."""
    return UP if src < dst else DOWN


# ---------------------------------------------------------------------- directive forms
def directive_ops(schedule_ops: Mapping[int, Sequence[Any]]) -> dict[str, list[list[Any]]]:
    """A schedule's per-worker operations (``perf.Schedule.ops``) as the directive carries
    them: ``{"worker": [[kind, pipeline, stage, micro-batch], ...]}``."""
    return {str(w): [[str(op.kind), op.pipeline, op.stage, op.microbatch] for op in seq]
            for w, seq in schedule_ops.items()}


def actions_of(ops: Mapping[str, Sequence[Sequence[Any]]]) -> dict[int, tuple[Action, ...]]:
    """The directive's ``ops`` as actions, by worker.

    Raises:
        ValueError: for an operation the runtime does not execute (only ``F`` and the
            fused ``B``).
    """
    out: dict[int, tuple[Action, ...]] = {}
    for worker, seq in ops.items():
        actions = []
        for kind, p, s, m in seq:
            if kind not in ("F", "B"):
                raise ValueError(f"ops: worker {worker} has a {kind!r} operation; the runtime "
                                 "executes F and fused B only")
            actions.append((str(kind), int(p), int(s), int(m)))
        out[int(worker)] = tuple(actions)
    return out


# ---------------------------------------------------------------------- a step's messages
def _boundary(plan: ExecutionPlan, pipeline: int, stage: int, kind: Kind, src: int,
              dst: int, microbatch: int, receiving: int,
              boundaries: Boundaries | None) -> Message:
    """The message across the boundary in front of ``stage`` of ``pipeline`` (its first
    layer's input), received by stage ``receiving``."""
    layer = plan.pipelines[pipeline].stages[stage].first_layer
    shape = dtype = None
    if boundaries is not None:
        shape = tuple(int(n) for n in boundaries[layer - 1][0])
        dtype = str(boundaries[layer - 1][1])
    return Message(kind, src, dst, (pipeline, receiving, microbatch), layer, shape, dtype)


def received(plan: ExecutionPlan, worker: int, action: Action,
             boundaries: Boundaries | None = None) -> Message | None:
    """What ``action`` on ``worker`` waits for: a forward's activation (not on the first
    stage), a backward's gradient (not on the last stage); None otherwise."""
    kind, p, s, m = action
    if kind == "F":
        if s == 0:
            return None
        src = plan.executor(p, s - 1)[m]
        return _boundary(plan, p, s, Kind.ACTIVATION, src, worker, m, s, boundaries)
    if s == plan.pipelines[p].num_stages - 1:
        return None
    src = plan.executor(p, s + 1)[m]
    return _boundary(plan, p, s + 1, Kind.GRADIENT, src, worker, m, s, boundaries)


def sent(plan: ExecutionPlan, worker: int, action: Action,
         boundaries: Boundaries | None = None) -> Message | None:
    """What ``action`` on ``worker`` sends once it has computed: a forward's output (not
    on the last stage), a backward's input gradient (not on the first stage)."""
    kind, p, s, m = action
    if kind == "F":
        if s == plan.pipelines[p].num_stages - 1:
            return None
        dst = plan.executor(p, s + 1)[m]
        return _boundary(plan, p, s + 1, Kind.ACTIVATION, worker, dst, m, s + 1, boundaries)
    if s == 0:
        return None
    dst = plan.executor(p, s - 1)[m]
    return _boundary(plan, p, s, Kind.GRADIENT, worker, dst, m, s - 1, boundaries)


def send_order(plan: ExecutionPlan, worker: int, actions: Iterable[Action],
               boundaries: Boundaries | None = None) -> list[Message]:
    """Every message ``worker`` sends in a step, in the order it sends them."""
    out = []
    for action in actions:
        message = sent(plan, worker, action, boundaries)
        if message is not None:
            out.append(message)
    return out


class _Posting:
    """Receives posted in each sender's order: :meth:`up_to` posts, before a worker waits
    for a message, every not yet posted message of its sender up to that one."""

    def __init__(self, me: int, incoming: Mapping[int, Sequence[Message]]) -> None:
        self.me = me
        self.incoming = incoming
        """Per sender, what it sends this worker, in its order."""
        self.index = {msg: i for seq in incoming.values() for i, msg in enumerate(seq)}
        self.posted = dict.fromkeys(incoming, 0)
        """Per sender, how many of its messages have a receive posted."""

    def up_to(self, message: Message) -> list[Instruction]:
        """The receives to post so that ``message``'s is posted (none when it is).

        Raises:
            ValueError: when its sender never sends it.
        """
        k = self.index.get(message)
        if k is None:
            raise ValueError(f"ops: worker {self.me} waits for {message}, which worker "
                             f"{message.src} never sends")
        first = self.posted[message.src]
        self.posted[message.src] = max(first, k + 1)
        return [Instruction(Do.POST_RECV, msg) for msg in self.incoming[message.src][first:k + 1]]

    def check_all_posted(self) -> None:
        """Every message sent to this worker has its receive (a message never received
        would keep its sender waiting for ever under NCCL).

        Raises:
            ValueError: naming the first message left over.
        """
        for src, seq in self.incoming.items():
            if self.posted[src] < len(seq):
                raise ValueError(f"ops: worker {src} sends {seq[self.posted[src]]}, which "
                                 f"worker {self.me} never takes")


def step_program(plan: ExecutionPlan, actions: Mapping[int, Sequence[Action]], worker: int,
                 boundaries: Boundaries | None = None) -> tuple[Instruction, ...]:
    """What ``worker`` does in one step, in order: for each of its actions, the receives to
    post (in each sender's order, :class:`_Posting`), the wait for its input, the action,
    the send of its output; then a wait for every send.

    Args:
        plan: the generation's plan.
        actions: every worker's actions (the directive's ``ops``, :func:`actions_of`).
        worker: the worker.
        boundaries: the job's boundary shapes and dtypes, to put into the messages.

    Raises:
        ValueError: when the actions disagree: a message waited for that its sender never
            sends, or one sent to ``worker`` that it never takes.
    """
    mine = actions.get(worker, ())
    needs = [received(plan, worker, a, boundaries) for a in mine]
    senders = sorted({msg.src for msg in needs if msg is not None})
    incoming = {src: [msg for msg in send_order(plan, src, actions.get(src, ()), boundaries)
                      if msg.dst == worker] for src in senders}
    posting = _Posting(worker, incoming)
    program: list[Instruction] = []
    for action, need in zip(mine, needs, strict=True):
        if need is not None:
            program += posting.up_to(need)
            program.append(Instruction(Do.WAIT_RECV, need))
        program.append(Instruction(Do.COMPUTE, action=action))
        out = sent(plan, worker, action, boundaries)
        if out is not None:
            program.append(Instruction(Do.POST_SEND, out))
    posting.check_all_posted()
    program.append(Instruction(Do.WAIT_ALL))
    return tuple(program)


# ---------------------------------------------------------------------- migration
Transfer = Sequence[int]
"""``[layer, src, dst, part, num_parts]`` (the directive's ``migration.transfers``)."""

SIZE_SHAPE = (1,)
SIZE_DTYPE = "int64"
BYTES_DTYPE = "uint8"


def state_messages(index: int, transfer: Transfer) -> tuple[Message, Message]:
    """A transfer's two messages: the packed state's total length, then its slice (whose
    length the receiver learns from the first)."""
    layer, src, dst, part, _ = transfer
    key = (index, layer, part)
    return (Message(Kind.STATE_SIZE, src, dst, key, layer, SIZE_SHAPE, SIZE_DTYPE),
            Message(Kind.STATE_BYTES, src, dst, key, layer, None, BYTES_DTYPE))


def migration_program(transfers: Sequence[Transfer], rounds: Sequence[Sequence[int]],
                      worker: int) -> tuple[tuple[Instruction, ...], ...]:
    """What ``worker`` does in each migration round: its transfers in the round's order,
    a sender posting both messages, a receiver posting and waiting for the length (to
    size the slice's buffer), then posting the slice; then a wait for everything.

    Every worker walks the same rounds in the same order, so a receiver posts a sender's
    messages in the order the sender sends them (checked as the step's are).

    Raises:
        ValueError: when a transfer's messages would be received out of its sender's order.
    """
    incoming: dict[int, list[Message]] = {}
    for rnd in rounds:
        for index in rnd:
            if transfers[index][2] == worker:
                incoming.setdefault(transfers[index][1], []).extend(
                    state_messages(index, transfers[index]))
    posting = _Posting(worker, incoming)
    out = []
    for rnd in rounds:
        program: list[Instruction] = []
        for index in rnd:
            size, data = state_messages(index, transfers[index])
            if size.src == worker:
                program += [Instruction(Do.POST_SEND, size), Instruction(Do.POST_SEND, data)]
            elif size.dst == worker:
                program += posting.up_to(size)
                program.append(Instruction(Do.WAIT_RECV, size))
                program += posting.up_to(data)
        program.append(Instruction(Do.WAIT_ALL))
        out.append(tuple(program))
    posting.check_all_posted()
    return tuple(out)


# ---------------------------------------------------------------------- group warm-up
def peers_of(plan: ExecutionPlan, actions: Mapping[int, Sequence[Action]],
             transfers: Sequence[Transfer], worker: int) -> frozenset[int]:
    """The workers ``worker`` exchanges any message with in a generation: the senders and
    receivers of its step's messages and the other ends of its migration's transfers (the
    relation is symmetric: whoever sends to a worker is among that worker's peers)."""
    peers: set[int] = set()
    for action in actions.get(worker, ()):
        into, out = received(plan, worker, action), sent(plan, worker, action)
        peers.update(m.src for m in (into,) if m is not None)
        peers.update(m.dst for m in (out,) if m is not None)
    for _, src, dst, _, _ in transfers:
        if worker in (src, dst):
            peers.add(dst if src == worker else src)
    peers.discard(worker)
    return frozenset(peers)


def warm_up_program(world: Sequence[int], worker: int,
                    peers: Iterable[int] | None = None) -> tuple[Instruction, ...]:
    """One message to every peer on the channel that carries ``worker``'s messages to it
    and one from every peer on the channel that carries the peer's: each group's every
    pair that carries traffic opened in the one direction it is used in.

    NCCL creates a pair's communicator at the pair's first operation on a group, both
    sides blocking until the other arrives: each worker opens its pairs in increasing
    peer id, and each pair on the up group before the down group (the lower worker sends
    first, the higher receives first), so no two workers wait for each other in a cycle.

    Args:
        world: the generation's members.
        worker: this worker.
        peers: the workers it exchanges messages with (:func:`peers_of`; default every
            other member). Only those pairs are opened: a pipeline's traffic connects a
            worker with a few others, and every pair of a large world would be
            quadratically many NCCL communicators.
    """
    wanted = set(world) if peers is None else set(peers) & set(world)
    program = []
    for peer in sorted(wanted):
        if peer == worker:
            continue
        out = Instruction(Do.POST_SEND, Message(Kind.WARM_UP, worker, peer))
        into = Instruction(Do.POST_RECV, Message(Kind.WARM_UP, peer, worker))
        program += [out, into] if channel_of(worker, peer) == UP else [into, out]
    program.append(Instruction(Do.WAIT_ALL))
    return tuple(program)
