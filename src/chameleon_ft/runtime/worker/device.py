"""The worker's device as its threads see it: which device a thread works on, whether
the work given to the device completes, and how long that work took.

On a GPU the CPU only *enqueues* work: a kernel that never finishes leaves every thread of
the process free (the heartbeat keeps beating), and a wall-clock reading around a call
measures its launch. So:

- every thread of a worker that may touch CUDA starts with :func:`use_device` (a thread
  that does not works on GPU 0 and opens a context there: memory another worker needed);
- :class:`DeviceWatch` records an event after each piece of work the training thread
  enqueues, and the heartbeat thread asks it how long the oldest unfinished piece has
  been pending (``worker.liveness``): a hung kernel is seen within the hang deadline;
- :class:`StepTimer` times compute with events, resolved once the step's work completed.

On the CPU the training thread computes itself: the watch reports how long the compute in
progress has run, and the timer reads the clock.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

STALL_CYCLES = 1 << 62
"""Cycles of the kernel an injected ``stall`` fault enqueues (``torch.cuda._sleep``):
longer than any run."""
MAX_MARKS = 4096
"""Events kept at most (the oldest completed ones are dropped as new ones come)."""


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (no-op on the CPU)."""
    if device.type == "cuda":  # pragma: no cover - needs GPUs
        torch.cuda.set_device(device)


def thread(target: Callable[..., Any], device: torch.device, name: str,
           args: tuple[Any, ...] = ()) -> threading.Thread:
    """A daemon thread that works on ``device`` before it runs ``target(*args)``."""
    def run() -> None:
        use_device(device)
        target(*args)

    return threading.Thread(target=run, daemon=True, name=name)


def stream_point(device: torch.device) -> Any:
    """An event recorded now on the calling thread's current stream (None on the CPU):
    what a copy on another stream must wait for (the optimizer step that just ended)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # pragma: no cover - needs GPUs
    event.record()  # pragma: no cover
    return event  # pragma: no cover


@contextmanager
def side_stream(device: torch.device, after: Any) -> Iterator[bool]:
    """Run the body's copies on a stream of their own, after the event ``after``, and wait
    for them at the end: a snapshot's device-to-host copy then overlaps the next forward
    instead of queueing behind it on the default stream. Yields whether copies may be
    enqueued without blocking (CUDA)."""
    if device.type != "cuda":
        yield False
        return
    stream = torch.cuda.Stream(device)  # pragma: no cover - needs GPUs
    if after is not None:  # pragma: no cover
        stream.wait_event(after)
    with torch.cuda.stream(stream):  # pragma: no cover
        yield True
    stream.synchronize()  # pragma: no cover


def memory(device: torch.device) -> dict[str, int]:
    """The device memory this process holds now, in its caching allocator, and what the
    whole device has in use (communicators' buffers included), reported with each step's
    timings so that growth across generations shows in ``op_times.jsonl``; empty on the
    CPU."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)  # pragma: no cover - needs GPUs
    return {"device_bytes": int(torch.cuda.memory_allocated(device)),  # pragma: no cover
            "device_reserved_bytes": int(torch.cuda.memory_reserved(device)),
            "device_used_bytes": int(total - free)}


class DeviceWatch:
    """Whether the work given to the device completes.

    Args:
        device: the worker's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._marks: collections.deque[tuple[Any, float]] = collections.deque()
        """CUDA: ``(event, enqueued at)``, oldest first."""
        self._computing_since: float | None = None
        """CPU: when the compute in progress began."""

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Around compute the training thread runs (CPU) or enqueues (CUDA)."""
        if not self.cuda:
            self._computing_since = time.monotonic()
            try:
                yield
            finally:
                self._computing_since = None
            return
        yield  # pragma: no cover - needs GPUs
        self.enqueued()  # pragma: no cover

    def enqueued(self) -> None:
        """Mark the work enqueued so far on the current stream (CUDA)."""
        if not self.cuda:
            return
        event = torch.cuda.Event()  # pragma: no cover - needs GPUs
        event.record()  # pragma: no cover
        self._marks.append((event, time.monotonic()))  # pragma: no cover
        while len(self._marks) > MAX_MARKS and self._marks[0][0].query():  # pragma: no cover
            self._marks.popleft()

    def pending_s(self) -> float:
        """How long the oldest unfinished work has been pending (0: none)."""
        now = time.monotonic()
        if not self.cuda:
            since = self._computing_since
            return 0.0 if since is None else now - since
        marks = self._marks  # pragma: no cover - needs GPUs
        while marks and marks[0][0].query():  # pragma: no cover
            marks.popleft()
        return now - marks[0][1] if marks else 0.0  # pragma: no cover

    def stall(self) -> None:
        """An injected ``stall``: give the device work that never completes and wait for
        it, as a worker does at its next synchronisation. Never returns (the heartbeat
        thread ends the process)."""
        if self.cuda:  # pragma: no cover - needs GPUs
            torch.cuda._sleep(STALL_CYCLES)
            self.enqueued()
            torch.cuda.current_stream().synchronize()
        with self.computing():
            while True:
                time.sleep(1.0)


class StepTimer:
    """Compute times of one step's actions, read once the step's work completed.

    Args:
        device: the worker's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: list[tuple[Any, Any, list[float]]] = []

    @contextmanager
    def time(self, into: list[float], stretch: float = 1.0) -> Iterator[None]:
        """Time the body; the seconds are appended to ``into`` (on CUDA, by
        :meth:`resolve`). ``stretch`` > 1 (an injected slowdown) makes the body last that
        many times its own duration: it waits ``stretch - 1`` times what the body took
        (on CUDA the device's time, read once the body's work completed, with the device
        left idle meanwhile), inside the timing."""
        if not self.cuda:
            start = time.perf_counter()
            yield
            if stretch > 1.0:
                time.sleep((stretch - 1.0) * (time.perf_counter() - start))
            into.append(time.perf_counter() - start)
            return
        begin = torch.cuda.Event(enable_timing=True)  # pragma: no cover - needs GPUs
        end = torch.cuda.Event(enable_timing=True)  # pragma: no cover
        begin.record()  # pragma: no cover
        yield  # pragma: no cover
        if stretch > 1.0:  # pragma: no cover
            body = torch.cuda.Event(enable_timing=True)
            body.record()
            body.synchronize()
            time.sleep((stretch - 1.0) * begin.elapsed_time(body) / 1e3)
        end.record()  # pragma: no cover
        self._open.append((begin, end, into))  # pragma: no cover

    def resolve(self) -> None:
        """Fill in the times taken on the device (waits for the last timed work)."""
        if not self._open:
            return
        self._open[-1][1].synchronize()  # pragma: no cover - needs GPUs
        for begin, end, into in self._open:  # pragma: no cover
            into.append(begin.elapsed_time(end) / 1e3)
        self._open = []  # pragma: no cover
