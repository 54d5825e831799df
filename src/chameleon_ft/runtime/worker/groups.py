"""A generation's process groups: built eagerly from the store under the generation's
prefix, under a deadline, warmed up, and torn down at once when the generation ends.

Gloo note: ``ProcessGroupGloo.abort()`` does not wake operations already waiting, but a
receive that times out closes its pair, and the peer's pending operations on that pair
then fail at once. :func:`break_connections` uses that to tear a generation down.

NCCL note: a communicator is aborted (``abort()``), which ends its pending kernels; an
abort that does not return within its deadline, or raises, leaves the process unable to
trust its device, so the worker exits (``EXIT_ABORT_STUCK``) and is replaced like any
dead worker. Communicators are created non-blocking where the library allows it, so that
an abort also interrupts one still connecting.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.placement import Place, device_index
from chameleon_ft.runtime.traffic import Do, warm_up_program
from chameleon_ft.runtime.worker import device as dev
from chameleon_ft.runtime.worker import tp_group
from chameleon_ft.runtime.worker.comm import Comm, CommError
from chameleon_ft.runtime.worker.exits import EXIT_ABORT_STUCK, exit_now
from chameleon_ft.runtime.worker.nccl_like import NcclLikeGroup

BREAK_TAG = 2_000_000_000
"""Tag of the throw-away receive that closes a pair (never sent by anyone)."""
WARMUP_TAG = 1_500_000_000
CPU = torch.device("cpu")
SETUP_LOOK_S = 0.01
"""How often a set-up in progress is checked for its deadline and an abort."""

NCCL_ENVIRONMENT: Mapping[str, str] = {
    # The watchdog only aborts a communicator that failed or timed out and leaves the
    # process alone (its default, 3, ends the process: one dead peer would end every
    # survivor); the worker sees the failure as the operation's error and recovers.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # wait() stays non-blocking; the worker polls completion under its own deadline.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # The worker bounds its aborts itself (an abort that hangs ends the process, see
    # break_connections); the monitor would kill it on a timer of its own, 8 minutes.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
"""What a worker sets before it creates any NCCL communicator (docs/design.md 4.3)."""


def set_nccl_environment(environ: dict[str, str] | Any = None) -> None:
    """Put :data:`NCCL_ENVIRONMENT` into ``environ`` (the process's, by default).

    Set unconditionally: recovery depends on these values (a user's
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` would turn one failure into every worker's)."""
    target = os.environ if environ is None else environ
    for key, value in NCCL_ENVIRONMENT.items():
        target[key] = value


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when this host has a GPU, else ``cpu``."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_backend(name: str, device: str = "auto") -> str:
    """``auto`` -> ``nccl`` when the workers compute on CUDA, else ``gloo``."""
    if name == "auto":
        return "nccl" if resolve_device(device) == "cuda" else "gloo"
    return name


def worker_device(device: str, place: Place, backend: str,
                  num_visible: int | None = None) -> torch.device:
    """The device of a worker placed at ``place`` on its host (:mod:`~.placement`).

    Args:
        device: ``cpu`` or ``cuda`` (resolved, see :func:`resolve_device`).
        place: the worker's node-local index and its place in its task.
        backend: ``gloo`` or ``nccl``.
        num_visible: GPUs this process sees (default: ``torch.cuda.device_count()``,
            which honours ``CUDA_VISIBLE_DEVICES``).

    Raises:
        ValueError: for CUDA with no GPU visible, or NCCL with a worker whose node-local
            index has no GPU of its own (NCCL cannot put two ranks of a group on one
            device).
    """
    if device != "cuda":
        return torch.device("cpu")
    count = torch.cuda.device_count() if num_visible is None else num_visible
    return torch.device("cuda", device_index(place, count, backend))


def make_group(store: dist.Store, prefix: str, rank: int, size: int, *, backend: str,
               timeout_s: float, address: str, device: torch.device | None = None,
               nccl_like: bool = False) -> Any:
    """A process group built directly from the store under ``prefix`` (eager connection).

    Args:
        store: the coordinator's store (a client connection).
        prefix: unique per generation and group, so old and new groups never meet.
        rank: this worker's rank inside the group.
        size: members.
        backend: ``gloo`` or ``nccl``.
        timeout_s: deadline of every operation of the group.
        address: the interface gloo listens on (workers reach each other over TCP only).
        device: the worker's device (NCCL binds its communicator to it at once).
        nccl_like: wrap the gloo group so that it completes operations as NCCL does
            (:class:`~chameleon_ft.runtime.worker.nccl_like.NcclLikeGroup`, tests).
    """
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":  # pragma: no cover - needs GPUs
        return _nccl_group(prefixed, rank, size, timeout_s, device)
    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = timedelta(seconds=timeout_s)
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    group = dist.ProcessGroupGloo(prefixed, rank, size, gloo)
    return NcclLikeGroup(group, rank, size) if nccl_like else group


def _nccl_group(store: dist.Store, rank: int, size: int, timeout_s: float,
                device: torch.device | None) -> Any:  # pragma: no cover - needs GPUs
    """An NCCL group whose communicator exists when this returns (bound to ``device``),
    created non-blocking where the library has the option (an abort interrupts it)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    with contextlib.suppress(AttributeError):
        opts.config.blocking = 0
    group = dist.ProcessGroupNCCL(store, rank, size, opts)
    if device is not None and device.type == "cuda":
        group.eager_connect_single_device(device)
    return group


def break_connections(group: Any, rank: int, size: int, abort_s: float = 10.0,
                      device: torch.device = CPU) -> None:
    """Close every pair of ``group`` so that peers blocked on this worker fail now.

    gloo: a receive that times out makes gloo close the pair; the peer sees "connection
    closed" on whatever it is waiting for over that pair. NCCL: the communicator is
    aborted within ``abort_s``, or the process exits (``EXIT_ABORT_STUCK``).
    """
    if isinstance(group, NcclLikeGroup):
        group.abort()
        return
    if group.name() == "nccl":  # pragma: no cover - needs GPUs
        abort_within(group, abort_s, device)
        return
    for r in range(size):
        if r == rank:
            continue
        with contextlib.suppress(Exception):
            group.recv([torch.zeros(1)], r, BREAK_TAG).wait(timedelta(milliseconds=1))


def abort_within(group: Any, abort_s: float, device: torch.device = CPU) -> None:
    """``group.abort()`` on a thread of its own; exit the process if it raises or does not
    return within ``abort_s`` (a communicator that cannot be aborted may hold the device
    and its peers for ever; a new process can be trusted, this one cannot)."""
    failed: list[BaseException] = []

    def abort() -> None:
        try:
            group.abort()
        except BaseException as exc:  # reported below: the process then leaves
            failed.append(exc)

    thread = dev.thread(abort, device, "abort")
    thread.start()
    thread.join(abort_s)
    if thread.is_alive() or failed:
        why = f"raised {failed[0]!r}" if failed else f"did not finish within {abort_s:.1f} s"
        exit_now(EXIT_ABORT_STUCK, f"chameleon worker: aborting a communicator {why}; "
                 "exiting (the coordinator replaces this process)")


class Generation:
    """The process groups of one generation, and a flag saying it was torn down."""

    def __init__(self, gen: int, abort_s: float = 10.0, device: torch.device = CPU) -> None:
        self.gen = gen
        self.abort_s = abort_s
        """How long aborting one of its NCCL communicators may take."""
        self.device = device
        """The worker's device (threads that set up, abort or close groups work on it)."""
        self.groups: list[tuple[Any, int, int]] = []
        self.tp_group: Any = None
        """The worker's tensor-parallel group (``worker.tp_group``), when it has one."""
        self.broken = False
        self.closed = False
        self.lock = threading.Lock()

    def add(self, group: Any, rank: int, size: int) -> None:
        """Track a group (torn down at once if the generation already ended)."""
        with self.lock:
            self.groups.append((group, rank, size))
            broken = self.broken
        if broken:
            break_connections(group, rank, size, self.abort_s, self.device)

    def break_all(self) -> None:
        """Close every pair of every group: peers blocked on this worker fail now."""
        with self.lock:
            if self.broken:
                return
            self.broken = True
            groups = list(self.groups)
        for group, rank, size in groups:
            break_connections(group, rank, size, self.abort_s, self.device)

    def close(self) -> None:
        """Tear the groups down and drop them: their sockets and threads go away."""
        self.break_all()
        with self.lock:
            groups, self.groups = self.groups, []
            tp, self.tp_group = self.tp_group, None
            self.closed = True
        for group, _, _ in groups:
            with contextlib.suppress(Exception):
                group.shutdown()
        if tp is not None:
            tp_group.destroy(tp)
        del groups


def close_later(generation: Generation) -> None:
    """Close an old generation's groups off the training thread (breaking a pair waits
    a millisecond per peer)."""
    dev.thread(generation.close, generation.device, f"close-gen{generation.gen}").start()


@dataclass(frozen=True)
class Plane:
    """Where a process of a worker of ``[job] tp = k`` (k > 1) stands: its rank in its
    worker, which is also its plane (design 4.11), and the worker's degree."""

    rank: int
    degree: int


def build(store: dist.Store, generation: Generation, me: int, world: list[int],
          rounds: list[list[list[list[int]]]], *, backend: str, timeout_s: float,
          address: str, device: torch.device,
          extra: list[tuple[int, ...]] | None = None, nccl_like: bool = False,
          peers: Iterable[int] | None = None, tag: str = "",
          plane: Plane | None = None) -> Comm:
    """Build a generation's groups (the two world groups, one per direction of the
    point-to-point messages, then one per all-reduce bucket and per ``extra`` member set
    this worker belongs to, one group per distinct member set, in one global order so no
    two workers wait on each other in opposite orders), and warm every pair and every
    group up: every communicator the generation needs exists when this returns.

    The set-up runs on a thread of its own and is given up when ``timeout_s`` passes or
    the generation is aborted (gloo's connection set-up cannot be interrupted and retries
    for several deadlines when a peer died mid-handshake: a survivor must not sit in a
    superseded generation meanwhile). What the abandoned thread still builds is torn down
    as it arrives (the generation is broken by then).

    ``extra``: the members of the step's other reductions (tied pairs, the norm:
    ``runtime.step_sync.extra_groups``). ``peers``: the workers this one exchanges
    messages with in the generation (``runtime.traffic.peers_of``; default every member):
    only those pairs are warmed up. ``tag``: the hidden part of the generation's
    rendezvous prefixes (``protocol.rendezvous_tag``; ``store`` then seals what the
    rendezvous writes: ``worker.channel.RendezvousStore``). ``plane``: this process's
    tensor-parallel rank ``r``: the groups are plane ``r``'s (``gen<g>/plane<r>/``), and
    then the worker's group over its ranks (``gen<g>/tp<w>/``: design 4.11).

    Raises:
        CommError: when a group cannot be built or warmed up in time, or the generation
            was aborted meanwhile.
    """
    gen = generation.gen
    members = sorted({tuple(b[0]) for rnd in rounds for b in rnd
                      if me in b[0] and len(b[0]) > 1}
                     | {m for m in extra or () if me in m and len(m) > 1})
    built: dict[str, Any] = {}

    def connect() -> None:
        try:
            built["groups"] = _connect(store, generation, me, world, members, tag, plane,
                                       backend=backend, timeout_s=timeout_s, address=address,
                                       device=device, nccl_like=nccl_like)
        except BaseException as exc:  # handed to the waiting thread
            built["error"] = exc

    _within(connect, generation, timeout_s)
    if "error" in built:
        exc = built["error"]
        raise CommError(f"building the groups of generation {gen} failed: "
                        f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}",
                        None)
    worlds, buckets = built["groups"]
    comm = Comm(me, worlds[0], {w: i for i, w in enumerate(world)}, buckets,
                stage=backend == "gloo" and device.type == "cuda", reverse=worlds[1],
                polled=nccl_like or backend == "nccl", timeout_s=timeout_s,
                aborted=lambda: generation.broken, tp=generation.tp_group)
    warm_up(comm, world, device, peers)
    return comm


def _connect(store: dist.Store, generation: Generation, me: int, world: list[int],
             members: list[tuple[int, ...]], tag: str, plane: Plane | None, **options: Any
             ) -> tuple[list[Any], dict[tuple[int, ...], Any]]:
    """The generation's two world groups and its bucket groups (``plane``'s), then the
    worker's tensor-parallel group, each tracked by ``generation`` as soon as it exists
    (``options``: :func:`make_group`'s)."""
    gen, rank, size = generation.gen, world.index(me), len(world)
    index = None if plane is None else plane.rank
    worlds = []
    for prefix in (proto.world_prefix(gen), proto.reverse_world_prefix(gen)):
        group = make_group(store, proto.hidden_prefix(proto.in_plane(prefix, index), tag),
                           rank, size, **options)
        generation.add(group, rank, size)
        worlds.append(group)
    buckets = {}
    for m in members:
        prefix = proto.in_plane(proto.bucket_prefix(gen, m), index)
        group = make_group(store, proto.hidden_prefix(prefix, tag),
                           m.index(me), len(m), **options)
        generation.add(group, m.index(me), len(m))
        buckets[m] = group
    if plane is not None:
        _connect_tp(store, generation, me, tag, backend=options["backend"],
                    timeout_s=options["timeout_s"], address=options["address"],
                    device=options["device"])
    return worlds, buckets


def _connect_tp(store: dist.Store, generation: Generation, me: int, tag: str, *,
                backend: str, timeout_s: float, address: str, device: torch.device) -> None:
    """The worker's tensor-parallel group of the generation (``worker.tp_group``), tracked
    by ``generation`` (its gloo or NCCL group breaks with the others)."""
    prefixed = dist.PrefixStore(proto.hidden_prefix(proto.tp_prefix(generation.gen, me), tag),
                                store)
    group = tp_group.new_group(tp_group.GroupOptions(prefixed, backend, timeout_s, address,
                                                     device))
    with generation.lock:
        closed = generation.closed
        if not closed:
            generation.tp_group = group
    if closed:  # an abandoned set-up finished after its generation was closed
        tp_group.destroy(group)
        return
    underneath = tp_group.backend_of(group, device)
    generation.add(underneath, group.rank(), group.size())


def _within(connect: Any, generation: Generation, timeout_s: float) -> None:
    """Run ``connect`` on a thread; return once it returned, or give it up.

    Raises:
        CommError: the generation was aborted, or ``timeout_s`` passed.
    """
    gen = generation.gen
    thread = dev.thread(connect, generation.device, f"setup-gen{gen}")
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        thread.join(SETUP_LOOK_S)
        if generation.broken and thread.is_alive():
            raise CommError(f"generation {gen} was aborted during its set-up", None)
        if time.monotonic() > deadline and thread.is_alive():
            generation.break_all()
            raise CommError(f"building the groups of generation {gen} did not finish "
                            f"within {timeout_s:.1f} s", None)


def warm_up(comm: Comm, world: list[int], device: torch.device,
            peers: Iterable[int] | None = None) -> None:
    """Exchange one tiny message with every peer on each world group, in the direction
    the group carries (``runtime.traffic.warm_up_program``, checked by the NCCL model),
    then reduce one number over every bucket group, in one global order.

    Gloo's first transfer on each direction of a pair is slow (hundreds of ms on a loaded
    2-core machine); paying it here keeps it out of the first step. NCCL creates a pair's
    communicator at its first operation, and a group's at its first collective: here,
    under the set-up's deadline, in an order that cannot deadlock.
    """
    works = []
    for ins in warm_up_program(world, comm.me, peers):
        message = ins.message
        if ins.do is Do.POST_SEND and message is not None:
            out = torch.zeros(1, device=device)
            works.append((comm.send(out, message.dst, WARMUP_TAG), message.dst, out))
        elif ins.do is Do.POST_RECV and message is not None:
            into = torch.zeros(1, device=device)
            works.append((comm.post_recv(into, message.src, WARMUP_TAG, "warm-up"),
                          message.src, into))
        elif ins.do is Do.WAIT_ALL:
            for work, peer, _ in works:
                comm.wait(work, peer, "warm-up")
    for members in sorted(comm.buckets):
        comm.all_reduce(torch.zeros(1, device=device), members)
    if comm.tp is not None:  # the worker's tensor-parallel group, last
        comm.tp_all_reduce(torch.zeros(1, device=device), "the tensor-parallel warm-up")
