"""gloo groups whose operations complete as NCCL's do: the NCCL path, run on CPU.

What the runtime must not rely on, because NCCL does not give it, this wrapper takes
away, so that a test passes only if the worker's completion path (``worker.comm``
``Comm._poll``) would work on NCCL:

- ``wait()`` returns at once, before the transfer completed (NCCL's only orders the
  current CUDA stream after it); a received tensor is written only when the operation is
  seen complete (``is_completed()``), so a worker that used a receive's buffer after a bare
  ``wait()`` would compute on stale numbers;
- a transfer whose peer died never completes and never raises (NCCL's kernels spin on);
  only an abort of the group ends it, and it then completes with an error;
- posting an operation never fails, even on a pair that is already closed.

Each operation's completion is watched by a thread of its own, waiting on the underlying
gloo operation (gloo's ``is_completed()`` is only updated by a wait).
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BREAK_TAG = 2_000_000_001
"""Tag of the throw-away receives that close the underlying gloo pairs on abort."""


class _Work:
    """One operation: complete (its result in place) once its gloo operation is, or with
    an error once the group is aborted."""

    def __init__(self, group: NcclLikeGroup, inner: Any,
                 result: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._group, self._inner, self._result = group, inner, result
        self._done = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._complete, daemon=True, name="nccl-like-op").start()

    def _complete(self) -> None:
        ok = False
        if self._inner is not None:
            with contextlib.suppress(RuntimeError):
                self._inner.wait()
                ok = not self._group.aborted.is_set()
        if ok and self._result is not None:
            staging, target = self._result
            with torch.no_grad():  # the transport writes memory; autograd sees nothing
                target.copy_(staging)
        if not ok:  # a dead peer: pending until the group is aborted, as on NCCL
            self._group.aborted.wait()
            self._error = RuntimeError("NCCL-like: the communicator was aborted")
        self._done.set()

    def is_completed(self) -> bool:
        """Whether the operation ended (successfully or not)."""
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        """The error it ended with (only ever an abort)."""
        return self._error if self._done.is_set() else None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Return at once, as NCCL's ``wait`` does on the CPU."""
        return True


class NcclLikeGroup:
    """A gloo group behind NCCL's completion semantics (send, recv, allreduce, abort).

    Args:
        inner: the gloo group.
        rank: this process's rank in it.
        size: its members.
    """

    def __init__(self, inner: dist.ProcessGroup, rank: int, size: int) -> None:
        self.inner, self.rank_, self.size_ = inner, rank, size
        self.aborted = threading.Event()

    def name(self) -> str:
        """The backend's name, as a process group answers it."""
        return "nccl-like"

    def _post(self, post: Any, result: tuple[torch.Tensor, torch.Tensor] | None) -> _Work:
        inner = None
        if not self.aborted.is_set():
            with contextlib.suppress(RuntimeError):  # a closed pair: pending until abort
                inner = post()
        return _Work(self, inner, result)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        """Post a send of ``tensors[0]`` (read until the operation completes)."""
        return self._post(lambda: self.inner.send(tensors, dst, tag), None)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        """Post a receive; ``tensors[0]`` is written when it is seen complete."""
        staging = torch.empty_like(tensors[0])
        return self._post(lambda: self.inner.recv([staging], src, tag),
                          (staging, tensors[0]))

    def allreduce(self, tensors: list[torch.Tensor]) -> _Work:
        """Post a sum over the group; ``tensors[0]`` holds it when seen complete."""
        staging = tensors[0].clone()
        return self._post(lambda: self.inner.allreduce([staging]), (staging, tensors[0]))

    def abort(self) -> None:
        """End every pending operation with an error, and close the gloo pairs (peers
        blocked on this process fail at once, as an aborted NCCL communicator's do)."""
        self.aborted.set()
        for r in range(self.size_):
            if r != self.rank_:
                with contextlib.suppress(Exception):
                    self.inner.recv([torch.zeros(1)], r, BREAK_TAG).wait(
                        timedelta(milliseconds=1))

    def shutdown(self) -> None:
        """Release the underlying group."""
        self.abort()
        with contextlib.suppress(Exception):
            self.inner.shutdown()
