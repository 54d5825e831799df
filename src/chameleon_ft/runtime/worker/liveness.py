"""A worker's threads beside training: its heartbeat, the watchdog of its coordinator,
and the watcher that tears a generation down the moment the coordinator aborts it.

The heartbeat beats only while the worker's device completes its work: once work given
to the device has been pending for the hang deadline, or for the generation's collective
deadline where that is longer (a step may legitimately take longer than the hang
deadline, and the collective deadline follows the plan's estimated step), the heartbeat
thread reports the worker failed and ends the process, as the coordinator ends a process
whose heartbeat went silent (nothing in the process can interrupt a hung kernel). On a GPU
the pending work is the device's own: the worker waits for every receive before it
enqueues the compute that needs it, so a slow peer never holds a marked kernel back. On
the CPU, where the training thread computes itself, the compute in progress is watched.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.worker.channel import WAIT_SLICE_S, Channel
from chameleon_ft.runtime.worker.device import DeviceWatch, thread
from chameleon_ft.runtime.worker.exits import (  # noqa: F401 - kept importable from here
    EXIT_COORDINATOR_GONE,
    EXIT_DEVICE_STALLED,
    EXIT_ERROR,
    EXIT_FENCED,
    EXIT_OK,
    EXIT_UNIT_BROKEN,
    exit_now,
)
from chameleon_ft.runtime.worker.groups import Generation
from chameleon_ft.runtime.worker.link import Link, client, refused
from chameleon_ft.runtime.worker.unit import UnitWatch

__all__ = ["WAIT_SLICE_S", "Liveness", "client", "refused"]


class Liveness:
    """The heartbeat, the watchdog and the abort watcher of one worker process.

    Args:
        worker: the worker id.
        incarnation: this process's incarnation.
        coordinator: the worker's tie to its coordinator (lost, found again).
        heartbeat_s: the beat interval.
        hang_s: the hang deadline (also how long the coordinator may stay silent).
        current: returns the generation this worker takes part in now, if any.
        changed: notified whenever ``current`` changes.
        watch: the work given to the worker's device.
        device: the worker's device (the threads work on it).
        link: the process's channel over a store connection of a thread here.
        member: whether this process is its worker in the control plane (rank 0 at
            ``tp > 1``): it beats the store and watches the coordinator. Another rank
            beats only its unit's slot (``worker.unit``) and follows rank 0's.
        unit: this process's watch of its worker's other processes (``tp > 1``).
        start_s: how long another process of the worker may take to start.
    """

    def __init__(self, worker: int, incarnation: str, coordinator: Link, *,
                 heartbeat_s: float, hang_s: float,
                 current: Callable[[], Generation | None],
                 changed: threading.Condition, link: Callable[[Any], Channel],
                 watch: DeviceWatch | None = None,
                 device: torch.device | None = None, member: bool = True,
                 unit: UnitWatch | None = None, start_s: float = 30.0) -> None:
        self.worker, self.incarnation = worker, incarnation
        self.coordinator = coordinator
        self.member, self.unit = member, unit
        self.start_s = start_s
        self.link = link
        self.device = device or torch.device("cpu")
        self.watch = watch or DeviceWatch(self.device)
        self.heartbeat_s, self.hang_s = heartbeat_s, hang_s
        self.current, self.changed = current, changed

    def start(self) -> None:
        """Start the three threads (daemons: they die with the process); a rank of a
        tensor-parallel worker that is not rank 0 has no watchdog (it follows rank 0's
        slot instead), and its heartbeat thread only watches the device."""
        threads = [(self._beat, "heartbeat"), (self._watch_aborts, "abort-watcher")]
        if self.member:
            threads.append((self._watchdog, "watchdog"))
        for target, name in threads:
            # on the worker's device: a CUDA call here must not open a context on GPU 0
            thread(target, self.device, name).start()
        if self.unit is not None:
            self.unit.arm(self.hang_s, self.start_s, self._device_ok, self._unit_broken,
                          self.device)

    def _device_ok(self) -> bool:
        return self.watch.pending_s() <= self.stall_limit_s()

    def _unit_broken(self, why: str) -> None:
        """Another process of this worker is gone: rank 0 reports the worker failed (the
        coordinator sees one death at once) and leaves; another rank just leaves. The
        launcher stops the rest."""
        if self.member:
            gen = self.current()
            if gen is not None:
                report = proto.ErrorReport(worker=self.worker, fatal=True, peer=None,
                                           message=f"worker {self.worker}: {why}")
                chan = self._connected(max(self.hang_s / 2, 0.2))
                if chan is not None:
                    with contextlib.suppress(Exception):
                        chan.report(gen.gen, report)
        exit_now(EXIT_UNIT_BROKEN, f"chameleon worker {self.worker}: {why}; exiting")

    def stall_limit_s(self) -> float:
        """How long device work may stay pending: the hang deadline, or the running
        generation's collective deadline where that is longer (it is at least ten of the
        plan's estimated steps: one action's compute is never that long). In a worker of
        several processes one more collective deadline: the compute holds DTensor's
        collectives, in which a rank may wait for a sibling that itself waits for a plane
        peer's message up to that deadline (design 4.11)."""
        gen = self.current()
        collective_s = gen.abort_s if gen is not None else 0.0
        extra_s = collective_s if self.unit is not None else 0.0
        return max(self.hang_s, collective_s) + extra_s

    def _stalled(self, chan: Channel | None) -> None:
        """The device stopped completing its work: report a fatal error (the coordinator
        sees the death at once, also for a remote worker) and leave."""
        pending = self.watch.pending_s()
        why = (f"worker {self.worker}: work given to its device did not complete within "
               f"{pending:.1f} s (a hung kernel or collective); exiting")
        gen = self.current()
        if gen is not None and chan is not None:
            report = proto.ErrorReport(worker=self.worker, fatal=True, peer=None, message=why)
            with contextlib.suppress(Exception):
                chan.report(gen.gen, report)
        if self.unit is not None:
            self.unit.fail()  # rank 0 sees it at once (and reports the worker failed)
        exit_now(EXIT_DEVICE_STALLED, f"chameleon {why}")

    def _connected(self, timeout_s: float) -> Channel | None:
        """A channel over a new connection to the coordinator (None: none answered; a
        refusal means it is gone)."""
        tie = self.coordinator
        try:
            return self.link(client(tie.host, tie.port, timeout_s))
        except Exception:
            if refused(tie.host, tie.port):
                tie.lose(time.monotonic(), "the coordinator refused connections")
            return None

    def _beat(self) -> None:
        """Beat every interval while the device completes its work, and read the
        coordinator's progress value; a refused connection means the coordinator is gone.
        A rank of a tensor-parallel worker that is not rank 0 only watches its device
        (rank 0 beats for the worker).
        A slow answer under load is not a death: a beat may time out, only the watchdog
        decides. A lost coordinator is still beaten to (one that was only slow takes the
        beats, its progress value moves, and it is no longer lost); once another is
        attached (the training thread found it) the beats go to it over a new
        connection."""
        tie = self.coordinator
        chan: Channel | None = None
        epoch = -1
        count = 0
        # the progress value is read every few beats (it is judged over the hang
        # deadline), and beats keep their interval whatever the reads take
        progress_every = max(1, round(self.hang_s / 8 / self.heartbeat_s))
        due = time.monotonic()
        while True:
            if self.watch.pending_s() > self.stall_limit_s():
                self._stalled(chan)
            if not self.member:
                time.sleep(self.heartbeat_s)
                continue
            if epoch != tie.epoch or chan is None:
                epoch, chan = tie.epoch, self._connected(max(self.hang_s / 2, 0.2))
                if chan is None:
                    time.sleep(self.heartbeat_s)
                    continue
            count += 1
            try:
                chan.beat(count)  # numbered: a beat replayed later is refused
                tie.beat_taken()
                if count % progress_every == 0:
                    tie.progress(chan.progress())
            except Exception:
                if refused(tie.host, tie.port):
                    tie.lose(time.monotonic(), "the coordinator refused connections")
            due = max(due + self.heartbeat_s, time.monotonic())
            time.sleep(max(0.0, due - time.monotonic()))

    def _watchdog(self) -> None:
        """Lose the coordinator once it took no beat, or its loop made no progress, for
        the hang deadline (it died, is stopped, cut off or stuck; a worker that was itself
        stopped and continued finds out at its next look), and exit once no other came
        within the grace."""
        while True:
            time.sleep(min(self.heartbeat_s, self.hang_s / 4))
            self.coordinator.judge()

    def _watch_aborts(self) -> None:
        """Break a generation's connections as soon as the coordinator aborts it.

        Waits on the abort key of the current generation in short slices and re-reads
        which generation is current after each, so it follows the worker from generation
        to generation whatever way the previous one ended. A forged abort is waited past.
        It follows the coordinator attached last (a new connection each time).
        """
        tie = self.coordinator
        chan: Channel | None = None
        epoch = -1
        while True:
            with self.changed:
                self.changed.wait_for(lambda: (g := self.current()) is not None
                                      and not g.broken, timeout=WAIT_SLICE_S)
                gen = self.current()
            if gen is None or gen.broken:
                continue
            if epoch != tie.epoch or chan is None:
                epoch, chan = tie.epoch, self._connected(max(self.hang_s / 2, 0.2))
                if chan is None:
                    time.sleep(WAIT_SLICE_S)
                    continue
            try:
                if not chan.aborted(gen.gen):
                    continue  # not aborted yet (or the store is slow): look again
            except Exception:
                time.sleep(WAIT_SLICE_S)  # the watchdog decides whether the coordinator died
                continue
            gen.break_all()
