"""A generation's process groups: built eagerly from the store under the generation's
prefix, warmed up, and torn down at once when the generation ends.

Gloo note: ``ProcessGroupGloo.abort()`` does not wake operations already waiting, but a
receive that times out closes its pair, and the peer's pending operations on that pair
then fail at once. :func:`break_connections` uses that to tear a generation down.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.placement import Place, device_index
from chameleon_ft.runtime.worker.comm import Comm, CommError

BREAK_TAG = 2_000_000_000
"""Tag of the throw-away receive that closes a pair (never sent by anyone)."""
WARMUP_TAG = 1_500_000_000


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
               timeout_s: float, address: str) -> dist.ProcessGroup:
    """A process group built directly from the store under ``prefix`` (eager connection).

    Args:
        store: the coordinator's store (a client connection).
        prefix: unique per generation and group, so old and new groups never meet.
        rank: this worker's rank inside the group.
        size: members.
        backend: ``gloo`` or ``nccl``.
        timeout_s: deadline of every operation of the group.
        address: the interface gloo listens on (workers reach each other over TCP only).
    """
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":  # pragma: no cover - needs GPUs
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = timedelta(seconds=timeout_s)
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(prefixed, rank, size, gloo)


def break_connections(group: dist.ProcessGroup, rank: int, size: int) -> None:
    """Close every pair of ``group`` so that peers blocked on this worker fail now.

    A receive that times out makes gloo close the pair; the peer sees "connection closed"
    on whatever it is waiting for over that pair.
    """
    if group.name() == "nccl":  # pragma: no cover - needs GPUs; NCCL's abort wakes waiters
        with contextlib.suppress(Exception):
            group.abort()
        return
    for r in range(size):
        if r == rank:
            continue
        with contextlib.suppress(Exception):
            group.recv([torch.zeros(1)], r, BREAK_TAG).wait(timedelta(milliseconds=1))


class Generation:
    """The process groups of one generation, and a flag saying it was torn down."""

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.groups: list[tuple[dist.ProcessGroup, int, int]] = []
        self.broken = False
        self.lock = threading.Lock()

    def add(self, group: dist.ProcessGroup, rank: int, size: int) -> None:
        """Track a group (torn down at once if the generation already ended)."""
        with self.lock:
            self.groups.append((group, rank, size))
            broken = self.broken
        if broken:
            break_connections(group, rank, size)

    def break_all(self) -> None:
        """Close every pair of every group: peers blocked on this worker fail now."""
        with self.lock:
            if self.broken:
                return
            self.broken = True
            groups = list(self.groups)
        for group, rank, size in groups:
            break_connections(group, rank, size)

    def close(self) -> None:
        """Tear the groups down and drop them: their sockets and threads go away."""
        self.break_all()
        with self.lock:
            groups, self.groups = self.groups, []
        for group, _, _ in groups:
            with contextlib.suppress(Exception):
                group.shutdown()
        del groups


def close_later(generation: Generation) -> None:
    """Close an old generation's groups off the training thread (breaking a pair waits
    a millisecond per peer)."""
    threading.Thread(target=generation.close, daemon=True, name=f"close-gen{generation.gen}"
                     ).start()


def build(store: dist.Store, generation: Generation, me: int, world: list[int],
          rounds: list[list[list[list[int]]]], *, backend: str, timeout_s: float,
          address: str, device: torch.device,
          extra: list[tuple[int, ...]] | None = None) -> Comm:
    """Build a generation's groups (the world group, then one per all-reduce bucket and
    per ``extra`` member set this worker belongs to, one group per distinct member set, in
    one global order so no two workers wait on each other in opposite orders), and warm
    every pair up.

    ``extra``: the members of the step's other reductions (tied pairs, the norm:
    ``runtime.step_sync.extra_groups``).

    Raises:
        CommError: when a group cannot be built or warmed up.
    """
    gen = generation.gen
    try:
        world_group = make_group(store, proto.world_prefix(gen), world.index(me), len(world),
                                 backend=backend, timeout_s=timeout_s, address=address)
        generation.add(world_group, world.index(me), len(world))
        members = sorted({tuple(b[0]) for rnd in rounds for b in rnd
                          if me in b[0] and len(b[0]) > 1}
                         | {m for m in extra or () if me in m and len(m) > 1})
        buckets: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for m in members:
            group = make_group(store, proto.bucket_prefix(gen, m), m.index(me), len(m),
                               backend=backend, timeout_s=timeout_s, address=address)
            generation.add(group, m.index(me), len(m))
            buckets[m] = group
    except (RuntimeError, dist.DistError) as exc:
        raise CommError(f"building the groups of generation {gen} failed: "
                        f"{str(exc).splitlines()[0][:200]}", None) from None
    comm = Comm(me, world_group, {w: i for i, w in enumerate(world)}, buckets,
                stage=backend == "gloo" and device.type == "cuda")
    warm_up(comm, world, device)
    return comm


def warm_up(comm: Comm, world: list[int], device: torch.device) -> None:
    """Exchange one tiny message with every peer in both directions.

    Gloo's first transfer on each direction of a pair is slow (hundreds of ms on a loaded
    2-core machine); paying it here keeps it out of the first step.
    """
    works = []
    for peer in world:
        if peer == comm.me:
            continue
        out, into = torch.zeros(1, device=device), torch.zeros(1, device=device)
        works.append((comm.send(out, peer, WARMUP_TAG), peer, out))
        works.append((comm.post_recv(into, peer, WARMUP_TAG, "warm-up"), peer, into))
    for work, peer, _ in works:
        comm.wait(work, peer, "warm-up")
