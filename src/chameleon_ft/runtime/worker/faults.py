"""Injected faults, on the worker's side: armed through the store, fired once.

A fault ``(rank, step, kind, phase)`` fires the first time the process holding the rank
reaches the phase at a step at or after ``step``; a sealed claim decides who fires it, so
a fault on a rank that was repaired fires in the replacement (docs/design.md 4.3). The
list is sealed too: a stranger can neither arm a fault nor claim one first.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable

from chameleon_ft.runtime.worker.channel import Channel
from chameleon_ft.runtime.worker.comm import CommError

DISK_ERRNO = {"disk-full": errno.ENOSPC, "disk-error": errno.EIO, "read-only": errno.EROFS}
"""The error each disk fault makes a checkpoint write fail with."""


class InjectedError(RuntimeError):
    """The ``error`` kind of injected fault."""


class Faults:
    """The armed faults of one rank."""

    def __init__(self, chan: Channel, worker: int, incarnation: str,
                 stall: Callable[[], None] | None = None, active: bool = True) -> None:
        self.chan, self.worker, self.incarnation = chan, worker, incarnation
        self.active = active
        """Whether faults fire here: in a worker of several processes only rank 0 arms
        them (it is the worker the fault names; its end is the worker's)."""
        self.stall = stall
        """Hangs the worker's device (the ``stall`` kind; never returns)."""
        self.armed: list[tuple[int, int, str, str]] = []
        """``(index, step, kind, phase)``."""
        self.slowdowns: dict[int, tuple[float, int]] = {}
        """Armed ``slow`` faults: index -> (factor, steps)."""
        self.version = -1

    def refresh(self) -> None:
        """Re-read the fault list if it changed."""
        if not self.active:
            return
        version = self.chan.faults_version()  # a hint: the list itself is sealed
        if version == self.version:
            return
        self.version = version
        armed, self.slowdowns = [], {}
        for index, (rank, step, kind, phase, *more) in enumerate(self.chan.faults()):
            if rank != self.worker:
                continue
            armed.append((index, int(step), str(kind), str(phase)))
            if kind == "slow" and len(more) == 2:
                self.slowdowns[index] = (float(more[0]), int(more[1]))
        self.armed = armed

    def _claim(self, index: int, step: int, gen: int, **extra: object) -> dict[str, object] | None:
        """Claim fault ``index`` and record that it fires now (None: another process of
        this rank fired it already)."""
        if not self.chan.claim_fault(index, os.getpid()):
            return None
        doc = {"time": time.time(), "step": step, "gen": gen, "worker": self.worker,
               "incarnation": self.incarnation, "pid": os.getpid(), **extra}
        self.chan.fired(index, doc)
        return doc

    def slow_from(self, step: int, gen: int) -> tuple[int, float, int, dict[str, object]] | None:
        """Fire the ``slow`` fault due at the start of ``step``, if any.

        Returns:
            Its index, factor, the first step at full speed again and its fired record
            (re-written when the slowdown ends).
        """
        for fault in list(self.armed):
            index, fstep, kind, _ = fault
            if kind != "slow" or step < fstep or index not in self.slowdowns:
                continue
            self.armed.remove(fault)
            factor, steps = self.slowdowns[index]
            doc = self._claim(index, step, gen, factor=factor, until_step=step + steps)
            if doc is not None:
                return index, factor, step + steps, doc
        return None

    def slow_ended(self, index: int, doc: dict[str, object], step: int) -> None:
        """Record that slowdown ``index`` ended at ``step`` (the job's)."""
        self.chan.fired(index, {**doc, "ended": time.time(), "ended_step": step})

    def maybe_fire(self, step: int, phase: str, gen: int) -> OSError | None:
        """Fire the faults due at this phase of this step (kill, hang, stall, glitch,
        error).

        Returns:
            For a disk fault, the error the checkpoint write must fail with.

        Raises:
            CommError: for a glitch (a transient communication failure).
            InjectedError: for an error (the worker exits).
        """
        for fault in list(self.armed):
            index, fstep, kind, fphase = fault
            if fphase != phase or step < fstep or kind == "slow":
                continue
            self.armed.remove(fault)
            if self._claim(index, step, gen) is None:
                continue  # another process of this rank fired it already
            if kind in DISK_ERRNO:
                code = DISK_ERRNO[kind]
                return OSError(code, f"{os.strerror(code)} (injected)")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "stall" and self.stall is not None:
                self.stall()
            elif kind == "glitch":
                raise CommError(f"worker {self.worker}: injected glitch at step {step} "
                                f"({phase})", None)
            else:
                raise InjectedError(f"injected error on worker {self.worker} at step {step} "
                                    f"({phase})")
        return None
