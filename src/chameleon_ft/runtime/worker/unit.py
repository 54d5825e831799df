"""A worker of ``[job] tp = k`` is k processes on one host (design 4.11): how they keep an
eye on each other without the store.

The launcher that starts the k processes as one unit gives them :class:`UnitBeats`, one
slot per rank in shared memory. Each rank writes the host's monotonic clock into its slot
every beat interval while its device completes its work (the rule of 4.3), and marks it
failed when it leaves on an error. Rank 0, the worker in the control plane, reads its
siblings' slots: a sibling silent for the hang deadline (stopped, hung, its device stalled)
or failed is its worker's failure, so rank 0 writes a fatal error report (the coordinator
sees one worker death at once, also for a remote worker) and leaves; the launcher then
stops the rest. A sibling reads rank 0's slot and leaves when it went silent: no rank
outlives a dead leader, even without its launcher. No store traffic: the coordinator
hears only rank 0's heartbeat.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from chameleon_ft.runtime.worker.device import thread, use_device

FAILED = -1.0
"""A slot's value once its rank left on an error."""
NEVER = 0.0
"""A slot's value until its rank first beats (it is still starting)."""
BEAT_S = 0.05
"""How often a rank writes its slot (far below any hang deadline)."""


class UnitBeats:
    """The shared heartbeat slots of one worker's k processes.

    Args:
        slots: a shared array of k doubles (``multiprocessing`` ``RawArray('d', k)``),
            created by the launcher, every slot :data:`NEVER`.
    """

    def __init__(self, slots: Any) -> None:
        self.slots = slots

    @classmethod
    def create(cls, ctx: Any, size: int) -> UnitBeats:
        """Slots for ``size`` ranks in memory the unit's processes share (``ctx``: the
        multiprocessing context that starts them)."""
        slots = ctx.RawArray("d", size)
        for rank in range(size):
            slots[rank] = NEVER
        return cls(slots)

    @property
    def size(self) -> int:
        """Ranks in the unit."""
        return len(self.slots)

    def beat(self, rank: int) -> None:
        """Rank ``rank`` is alive now (``time.monotonic`` is the host's clock, shared by
        its processes)."""
        if self.slots[rank] != FAILED:
            self.slots[rank] = time.monotonic()

    def fail(self, rank: int) -> None:
        """Rank ``rank`` leaves on an error."""
        self.slots[rank] = FAILED

    def silent(self, rank: int, limit_s: float, since: float) -> str | None:
        """Why rank ``rank`` counts as gone (failed, or silent longer than ``limit_s``;
        one that never beat, counted from ``since``), or None while it beats."""
        value = float(self.slots[rank])
        if value == FAILED:
            return f"rank {rank} of the worker failed"
        quiet_s = time.monotonic() - (since if value == NEVER else value)
        if quiet_s > limit_s:
            return f"rank {rank} of the worker was silent for {quiet_s:.1f} s"
        return None


class UnitWatch:
    """One rank's side of :class:`UnitBeats`: a thread that beats this rank's slot and
    watches the others' (rank 0 all siblings, a sibling rank 0).

    Started as soon as the process starts (before it builds anything: the slower ranks of
    a loaded host must not look silent); the watching starts once :meth:`arm` gives it
    the hang deadline.

    Args:
        beats: the unit's slots.
        rank: this process's rank in the unit.
        device: the worker's device (the thread works on it).
    """

    def __init__(self, beats: UnitBeats, rank: int, device: torch.device) -> None:
        self.beats, self.rank, self.device = beats, rank, device
        self.limit_s: float | None = None
        self.healthy: Callable[[], bool] = lambda: True
        self.on_gone: Callable[[str], None] = lambda _why: None
        self.since = 0.0
        """Where a watched rank that never beat is counted silent from."""
        self.lock = threading.Lock()

    def start(self) -> None:
        """Start beating (a daemon thread: it dies with the process)."""
        thread(self._run, self.device, f"unit-{self.rank}").start()

    def arm(self, limit_s: float, start_s: float, healthy: Callable[[], bool],
            on_gone: Callable[[str], None], device: torch.device | None = None) -> None:
        """Watch the others from now on.

        Args:
            limit_s: the hang deadline.
            start_s: how long a rank that never beat may take to start, from now (on a
                loaded host the ranks of a unit start seconds apart; a rank that dies
                starting is seen by its launcher).
            healthy: whether this rank's device completes its work (it beats only then).
            on_gone: called once with the reason when a watched rank is gone (it leaves
                the process).
            device: the worker's device, known by now (``healthy`` may ask it about its
                work: the thread makes it its own first, 4.3's CUDA hygiene).
        """
        with self.lock:
            self.device = device or self.device
            self.limit_s, self.healthy, self.on_gone = limit_s, healthy, on_gone
            self.since = time.monotonic() + max(0.0, start_s - limit_s)

    def fail(self) -> None:
        """This rank leaves on an error: the others see it at once."""
        with contextlib.suppress(Exception):
            self.beats.fail(self.rank)

    def watched(self) -> list[int]:
        """The ranks this one watches."""
        return list(range(1, self.beats.size)) if self.rank == 0 else [0]

    def _run(self) -> None:
        current = self.device
        while True:
            with self.lock:
                limit_s, healthy, on_gone = self.limit_s, self.healthy, self.on_gone
                since, device = self.since, self.device
            if device != current:  # armed with the worker's device: work on it
                use_device(device)
                current = device
            if healthy():
                self.beats.beat(self.rank)
            if limit_s is not None:
                for other in self.watched():
                    why = self.beats.silent(other, limit_s, since)
                    if why is not None:
                        on_gone(why)
                        return
            time.sleep(BEAT_S)
