"""The communication a worker's step needs, behind one small interface.

:class:`Comm` is what the schedule executor and the migration see of a generation's
process groups: post a send, receive, wait, all-reduce over a bucket's members. Every
failure is a :class:`CommError` value naming the peer, which the worker reports to the
coordinator; nothing here retries.

Completion follows the backend (docs/design.md 4.3, "Completion on both backends"):

- gloo: ``work.wait()`` blocks until the transfer is done and raises when it failed or
  outlived the group's deadline (a dead peer closes the pair: the survivor raises in
  milliseconds).
- NCCL: ``work.wait()`` returns at once (it only orders the current CUDA stream after the
  operation), a failed transfer never raises there, and a dead peer leaves the operation
  pending for ever. So an operation is *polled*: ``is_completed()`` until it is, its
  ``exception()`` checked, under the generation's collective deadline, and given up at
  once when the generation is aborted (the abort watcher breaks it); only then is
  ``wait()`` called, to order the stream. The multi-process tests run this path on CPU
  through :mod:`~chameleon_ft.runtime.worker.nccl_like`, gloo groups that complete
  operations as NCCL does.

Point-to-point messages travel on two world groups, one per direction (to a higher
worker id on ``world``, to a lower one on ``reverse``: ``runtime.traffic.channel_of``),
so each pair's NCCL stream on a group carries one direction only (docs/design.md
section 4, "Point-to-point traffic").

Every tensor it hands a group lives where that group's backend needs it: on the worker's
device for NCCL; in host memory for gloo, which moves CPU tensors only (a CUDA tensor is
staged: copied to the host before a send or an all-reduce, and back after a receive), so
workers computing on CUDA may talk over gloo and share a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from chameleon_ft.runtime.traffic import UP, channel_of

POLL_SPINS = 64
"""Polls of a pending operation before the poller starts sleeping between looks (most
transfers of a step complete within microseconds of being looked at)."""
POLL_SLEEP_S = 0.0005
"""The longest sleep between two looks at a pending operation: bounds the latency polling
adds to a transfer."""


class CommError(RuntimeError):
    """A send, receive or all-reduce of the current generation failed."""

    def __init__(self, message: str, peer: int | None) -> None:
        super().__init__(message)
        self.peer = peer


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def _never() -> bool:
    return False


class _Staged:
    """A receive into a host buffer, copied to the device tensor when it is waited for."""

    def __init__(self, work: Any, host: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.host, self.target = work, host, target

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def exception(self) -> Any:
        return self.work.exception()

    def wait(self) -> None:
        self.work.wait()
        self.target.copy_(self.host)


class Comm:
    """Point-to-point and all-reduce over one generation's groups, by worker id.

    Args:
        me: this worker's id.
        world: the generation's world group (every member): point-to-point messages to
            a higher worker id (all of them when ``reverse`` is None).
        world_rank: each member's rank in ``world`` and ``reverse``.
        buckets: the all-reduce group of each bucket this worker belongs to, by members.
        stage: move CUDA tensors through host memory (gloo).
        reverse: a second group over the same members: messages to a lower worker id.
        polled: complete operations by polling (NCCL's semantics) instead of a blocking
            ``wait``.
        timeout_s: the deadline of one polled operation (the generation's collective
            deadline; a blocking ``wait`` has its group's own).
        aborted: whether the generation was aborted (a polled wait gives up at once).
        tp: the worker's tensor-parallel group of the generation (design 4.11; None
            without tensor parallelism): DTensor's collectives run on it, and the step's
            few reductions over the worker's ranks.
    """

    def __init__(self, me: int, world: dist.ProcessGroup, world_rank: Mapping[int, int],
                 buckets: Mapping[tuple[int, ...], dist.ProcessGroup],
                 stage: bool = False, reverse: dist.ProcessGroup | None = None, *,
                 polled: bool = False, timeout_s: float = 60.0,
                 aborted: Callable[[], bool] = _never, tp: Any = None) -> None:
        self.me = me
        self.world = world
        self.reverse = reverse
        self.world_rank = dict(world_rank)
        self.buckets = dict(buckets)
        self.stage = stage
        self.polled = polled
        self.timeout_s = timeout_s
        self.aborted = aborted
        self.tp = tp

    def channel(self, src: int, dst: int) -> dist.ProcessGroup:
        """The group a message from ``src`` to ``dst`` travels on."""
        if self.reverse is None or channel_of(src, dst) == UP:
            return self.world
        return self.reverse

    def _out(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.cpu() if self.stage and tensor.is_cuda else tensor

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Post a send (it fails at once on a pair that is already closed)."""
        try:
            return self.channel(self.me, dst).send([self._out(tensor)], self.world_rank[dst],
                                                   tag)
        except RuntimeError as exc:
            raise CommError(f"worker {self.me}: send to worker {dst} failed: "
                            f"{_first_line(exc)}", dst) from None

    def post_recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> Any:
        """Post a receive into ``tensor``; wait for it with :meth:`wait`."""
        host = torch.empty_like(tensor, device="cpu") if self.stage and tensor.is_cuda \
            else tensor
        try:
            work = self.channel(src, self.me).recv([host], self.world_rank[src], tag)
        except RuntimeError as exc:
            raise CommError(f"worker {self.me}: {what} from worker {src} failed: "
                            f"{_first_line(exc)}", src) from None
        return work if host is tensor else _Staged(work, host, tensor)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> None:
        """Receive into ``tensor`` and wait for it."""
        self.wait(self.post_recv(tensor, src, tag, what), src, what)

    def wait(self, work: Any, peer: int | None, what: str) -> None:
        """Wait until a posted operation completed; its result is then in place.

        Raises:
            CommError: the operation failed, outlived its deadline, or the generation was
                aborted meanwhile.
        """
        if self.polled:
            self._poll(work, peer, what)
        try:
            work.wait()
        except RuntimeError as exc:
            raise CommError(f"worker {self.me}: {what} with worker {peer} failed: "
                            f"{_first_line(exc)}", peer) from None

    def _poll(self, work: Any, peer: int | None, what: str) -> None:
        """Look at ``work`` until it completed, its deadline passed or the generation was
        aborted; then raise the error it completed with, if any."""
        deadline = time.monotonic() + self.timeout_s
        looks = 0
        try:
            while not work.is_completed():
                looks += 1
                if self.aborted():
                    raise CommError(f"worker {self.me}: {what} with worker {peer}: the "
                                    "generation was aborted", peer)
                if time.monotonic() > deadline:
                    raise CommError(f"worker {self.me}: {what} with worker {peer} did not "
                                    f"complete within {self.timeout_s:.1f} s", peer)
                time.sleep(0.0 if looks < POLL_SPINS else POLL_SLEEP_S)
            error = work.exception()
        except RuntimeError as exc:
            raise CommError(f"worker {self.me}: {what} with worker {peer} failed: "
                            f"{_first_line(exc)}", peer) from None
        if error is not None:
            raise CommError(f"worker {self.me}: {what} with worker {peer} failed: "
                            f"{_first_line(error)}", peer)

    def all_reduce(self, flat: torch.Tensor, members: tuple[int, ...]) -> None:
        """Sum ``flat`` in place over the bucket's members."""
        what = f"all-reduce over {list(members)}"
        buf = self._out(flat)
        try:
            work = self.buckets[members].allreduce([buf])
        except RuntimeError as exc:
            raise CommError(f"worker {self.me}: {what} failed: {_first_line(exc)}",
                            None) from None
        self.wait(work, None, what)
        if buf is not flat:
            flat.copy_(buf)

    def tp_all_reduce(self, flat: torch.Tensor, what: str) -> None:
        """Sum ``flat`` in place over this worker's tensor-parallel ranks.

        Raises:
            CommError: when a rank of the worker left the generation (its groups broke),
                or the deadline passed.
        """
        try:
            work = self.tp.allreduce([flat])
        except RuntimeError as exc:
            raise CommError(f"worker {self.me}: {what} failed: {_first_line(exc)}",
                            None) from None
        self.wait(work, None, what)


COMM_FAILURE_MARKS = ("gloo", "Connection closed", "Connection reset", "timed out",
                      "Timed out", "NCCL", "aborted")
"""Words of the errors a collective raises when a peer left, its group was broken or
aborted, or it outlived its deadline (torch 2.13, gloo and NCCL)."""


def comm_failure(exc: BaseException, broken: bool) -> CommError | None:
    """``exc``, raised inside a computation whose collectives run on a tensor-parallel
    group (DTensor's, inside autograd's operations, where :meth:`Comm.wait` cannot reach),
    as the :class:`CommError` it stands for; None when it is no communication failure
    (a defect: the worker leaves on it).

    Args:
        exc: what the computation raised.
        broken: whether the generation was torn down meanwhile (then any error is its
            consequence).
    """
    if isinstance(exc, CommError):
        return exc
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if broken or isinstance(exc, dist.DistError) or any(m in text for m in COMM_FAILURE_MARKS):
        return CommError(f"a tensor-parallel collective failed: {_first_line(exc)}", None)
    return None
