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
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

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
from chameleon_ft.runtime.worker.unit import UnitWatch

__all__ = ["WAIT_SLICE_S", "Liveness", "client", "refused"]


def refused(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port`` any more (a definite answer, unlike a
    timeout)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A store connection of the helper threads: connecting may take long on a loaded host
    (it is no sign of a dead coordinator), each request then ``timeout_s``."""
    store = dist.TCPStore(host, port, is_master=False,
                          timeout=timedelta(seconds=max(timeout_s, 10.0)))
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


class Liveness:
    """The heartbeat, the watchdog and the abort watcher of one worker process.

    Args:
        worker: the worker id.
        incarnation: this process's incarnation.
        host: the coordinator's host.
        port: the store port.
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

    def __init__(self, worker: int, incarnation: str, host: str, port: int, *,
                 heartbeat_s: float, hang_s: float,
                 current: Callable[[], Generation | None],
                 changed: threading.Condition, link: Callable[[Any], Channel],
                 watch: DeviceWatch | None = None,
                 device: torch.device | None = None, member: bool = True,
                 unit: UnitWatch | None = None, start_s: float = 30.0) -> None:
        self.worker, self.incarnation = worker, incarnation
        self.member, self.unit = member, unit
        self.start_s = start_s
        self.link = link
        self.device = device or torch.device("cpu")
        self.watch = watch or DeviceWatch(self.device)
        self.host, self.port = host, port
        self.heartbeat_s, self.hang_s = heartbeat_s, hang_s
        self.current, self.changed = current, changed
        self.last_ok = time.monotonic()
        self.gone = (f"chameleon worker {worker}: the coordinator at {host}:{port} stopped "
                     "answering; exiting")

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
                with contextlib.suppress(Exception):
                    self.link(client(self.host, self.port, max(self.hang_s / 2, 0.2))
                              ).report(gen.gen, report)
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

    def _beat(self) -> None:
        """Beat every interval while the device completes its work; a refused connection
        means the coordinator is gone. A slow answer under load is not a death: a beat may
        time out, only the watchdog decides."""
        chan = None
        if self.member:
            try:
                chan = self.link(client(self.host, self.port, max(self.hang_s / 2, 0.2)))
            except Exception:
                exit_now(EXIT_COORDINATOR_GONE, self.gone)
        count = 0
        while True:
            if self.watch.pending_s() > self.stall_limit_s():
                self._stalled(chan)
            if chan is None:
                time.sleep(self.heartbeat_s)
                continue
            count += 1
            try:
                chan.beat(count)  # numbered: a beat replayed later is refused
                self.last_ok = time.monotonic()
            except Exception:
                if refused(self.host, self.port):
                    exit_now(EXIT_COORDINATOR_GONE, self.gone)
            time.sleep(self.heartbeat_s)

    def _watchdog(self) -> None:
        """Exit once the coordinator took no beat for the hang deadline (it died, is
        stopped or cut off; a worker that was itself stopped and continued finds out at
        its next look)."""
        while True:
            time.sleep(min(self.heartbeat_s, self.hang_s / 4))
            if time.monotonic() - self.last_ok > self.hang_s:
                exit_now(EXIT_COORDINATOR_GONE, self.gone)

    def _watch_aborts(self) -> None:
        """Break a generation's connections as soon as the coordinator aborts it.

        Waits on the abort key of the current generation in short slices and re-reads
        which generation is current after each, so it follows the worker from generation
        to generation whatever way the previous one ended. A forged abort is waited past.
        """
        chan = self.link(client(self.host, self.port, max(self.hang_s / 2, 0.2)))
        while True:
            with self.changed:
                self.changed.wait_for(lambda: (g := self.current()) is not None
                                      and not g.broken, timeout=WAIT_SLICE_S)
                gen = self.current()
            if gen is None or gen.broken:
                continue
            try:
                if not chan.aborted(gen.gen):
                    continue  # not aborted yet (or the store is slow): look again
            except Exception:
                time.sleep(WAIT_SLICE_S)  # the watchdog decides whether the coordinator died
                continue
            gen.break_all()
