"""The communication a worker's step needs, behind one small interface.

:class:`Comm` is what the schedule executor and the migration see of a generation's
process groups: post a send, receive, wait, all-reduce over a bucket's members. Every
failure is a :class:`CommError` value naming the peer, which the worker reports to the
coordinator; nothing here retries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist


class CommError(RuntimeError):
    """A send, receive or all-reduce of the current generation failed."""

    def __init__(self, message: str, peer: int | None) -> None:
        super().__init__(message)
        self.peer = peer


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


class Comm:
    """Point-to-point and all-reduce over one generation's groups, by worker id.

    Args:
        me: this worker's id.
        world: the generation's world group (every member: point-to-point traffic).
        world_rank: each member's rank in ``world``.
        buckets: the all-reduce group of each bucket this worker belongs to, by members.
    """

    def __init__(self, me: int, world: dist.ProcessGroup, world_rank: Mapping[int, int],
                 buckets: Mapping[tuple[int, ...], dist.ProcessGroup]) -> None:
        self.me = me
        self.world = world
        self.world_rank = dict(world_rank)
        self.buckets = dict(buckets)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Post a send (it fails at once on a pair that is already closed)."""
        try:
            return self.world.send([tensor], self.world_rank[dst], tag)
        except RuntimeError as exc:
            raise CommError(f"worker {self.me}: send to worker {dst} failed: "
                            f"{_first_line(exc)}", dst) from None

    def post_recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> Any:
        """Post a receive into ``tensor``; wait for it with :meth:`wait`."""
        try:
            return self.world.recv([tensor], self.world_rank[src], tag)
        except RuntimeError as exc:
            raise CommError(f"worker {self.me}: {what} from worker {src} failed: "
                            f"{_first_line(exc)}", src) from None

    def recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> None:
        """Receive into ``tensor`` and wait for it."""
        self.wait(self.post_recv(tensor, src, tag, what), src, what)

    def wait(self, work: Any, peer: int | None, what: str) -> None:
        """Wait for a posted operation."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise CommError(f"worker {self.me}: {what} with worker {peer} failed: "
                            f"{_first_line(exc)}", peer) from None

    def all_reduce(self, flat: torch.Tensor, members: tuple[int, ...]) -> None:
        """Sum ``flat`` in place over the bucket's members."""
        what = f"all-reduce over {list(members)}"
        try:
            work = self.buckets[members].allreduce([flat])
        except RuntimeError as exc:
            raise CommError(f"worker {self.me}: {what} failed: {_first_line(exc)}",
                            None) from None
        self.wait(work, None, what)
