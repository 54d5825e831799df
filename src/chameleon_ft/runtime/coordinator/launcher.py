"""Worker processes launched here: starting, killing, watching their exits, reaping.

This is a handle on processes, not a decision maker: which workers to launch, relaunch or
fence is decided by the control plane (``runtime.control``); the limits on repairs live
there too (``control.members``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from chameleon_ft import logs
from chameleon_ft.runtime import auth
from chameleon_ft.runtime.coordinator.forkserver import forkserver_context
from chameleon_ft.runtime.placement import Place
from chameleon_ft.runtime.worker.link import process_start

POLL_S = 0.002
"""Coordinator poll interval: bounds the commit latency it adds to every step."""
REAP_S = 5.0
"""How long the end of a run waits for its processes before killing them."""
PIDS_KEPT = 4096
"""Pids of launched processes remembered (the newest)."""


class ChildError(RuntimeError):
    """A function run by :func:`run_in_child` raised, died or did not answer in time."""


def _child_main(fn: Callable[..., Any], args: tuple[Any, ...], conn: Any) -> None:
    """Entry point of :func:`run_in_child`'s process: ``("ok", value)`` or
    ``("error", one line)`` on ``conn``."""
    import torch

    torch.set_num_threads(1)
    try:
        conn.send(("ok", fn(*args)))
    except Exception as exc:  # reported to the caller in one line
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_in_child(fn: Callable[..., Any], args: tuple[Any, ...], *, limit_s: float,
                 name: str, preload: Iterable[str] = ()) -> Any:
    """``fn(*args)`` in a process forked from the workers' server, and its value.

    The coordinator keeps its memory to itself: what it asks of a model (building layers
    to learn the stage boundaries' shapes, exporting the parameters) or of matplotlib
    (the report's plot) is done by a child, whose imports and allocations end with it.
    The child is never left behind: killed after ``limit_s`` without an answer.

    Raises:
        ChildError: ``fn`` raised (its one-line message), the child died, or it did not
            answer within ``limit_s``.
    """
    ctx = forkserver_context(preload)
    here, there = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(fn, args, there), name=name)
    proc.start()
    there.close()
    answer: Any = ("error", f"{name} did not answer within {limit_s:.0f} s")
    try:
        if here.poll(limit_s):
            answer = here.recv()
    except EOFError:
        answer = None  # it died without answering: its status once reaped
    finally:
        here.close()
        proc.join(REAP_S)
        if proc.exitcode is None:
            proc.kill()
            proc.join(REAP_S)
    if answer is None:
        raise ChildError(f"{name} died (status {proc.exitcode})")
    if answer[0] != "ok":
        raise ChildError(answer[1])
    return answer[1]


class Adopted:
    """A process of this host that this coordinator did not start (a worker of the run's
    previous coordinator, re-attached), held by a pid file descriptor: its exit is seen at
    once and a signal can never reach another process that took its pid. Its exit status
    is not this coordinator's to read (it is not its child): -1.

    Raises:
        ProcessLookupError: when no process ``pid`` started at ``started`` runs.
    """

    def __init__(self, pid: int, started: int) -> None:
        self.pid = pid
        self.fd = -1
        fd = os.pidfd_open(pid)
        if process_start(pid) != started:
            os.close(fd)
            raise ProcessLookupError(pid)
        self.fd = fd

    @property
    def sentinel(self) -> int:
        """Readable once the process exited (``multiprocessing.connection.wait``)."""
        return self.fd

    @property
    def exitcode(self) -> int | None:
        """None while it runs, then -1."""
        readable, _, _ = select.select([self.fd], [], [], 0)
        return -1 if readable else None

    def join(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout``) for it to exit."""
        select.select([self.fd], [], [], timeout)

    def kill(self) -> None:
        """SIGKILL it (nothing when it is gone)."""
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(self.fd, signal.SIGKILL)

    def __del__(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


class Unit:
    """A worker's processes, started as one (design 4.11): one per tensor-parallel rank,
    rank 0 first; to its launcher it looks like one process.

    Any rank's end that is not a clean one (an exit with a non-zero status, a kill),
    and rank 0's end whatever its status, ends the unit: the first look at
    :attr:`exitcode` that finds it kills the other ranks (SIGKILL, by pid) and reports one
    status, rank 0's when it ended, else the failed rank's. A sibling that exits 0 only
    finished (after the final checkpoint) ahead of rank 0.

    Args:
        procs: the started processes, by rank.
        beats: their shared heartbeat slots (``worker.unit.UnitBeats``), or None at tp 1.
    """

    def __init__(self, procs: Sequence[Any], beats: Any = None) -> None:
        self.procs = list(procs)
        self.beats = beats

    @property
    def pid(self) -> int | None:
        """Rank 0's pid."""
        pid: int | None = self.procs[0].pid
        return pid

    @property
    def pids(self) -> list[int]:
        """Every rank's pid."""
        return [p.pid for p in self.procs if p.pid is not None]

    @property
    def sentinels(self) -> list[Any]:
        """What ``multiprocessing.connection.wait`` waits on: every rank's end."""
        return [p.sentinel for p in self.procs]

    @property
    def exitcode(self) -> int | None:
        """The unit's status once it ended (None while it runs); ending it at the first
        look (see the class)."""
        codes = [p.exitcode for p in self.procs]
        failed = next((c for c in codes[1:] if c not in (None, 0)), None)
        if codes[0] is None and failed is None:
            return None
        if any(c is None for c in codes):
            self.kill()
        code: int | None = codes[0] if codes[0] is not None else failed
        return code

    def is_alive(self) -> bool:
        """Whether any rank still runs."""
        return any(p.exitcode is None for p in self.procs)

    def kill(self) -> None:
        """SIGKILL every rank still running (each by its own handle: an adopted one's
        pid file descriptor)."""
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait (at most ``timeout_s`` in all) for every rank to end."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for p in self.procs:
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def start_unit(ctx: Any, target: Callable[..., Any], head: tuple[Any, ...], place: Place,
               tail: tuple[Any, ...], *, tp: int, name: str) -> Unit:
    """Start a worker's ``tp`` processes: ``target(*head, place_r, *tail, r, beats)`` for
    each rank ``r``, rank 0 first, ``place_r`` its own device's place
    (``placement.rank_place`` of the worker's ``place``), ``beats`` the heartbeat slots
    they share (``worker.unit.UnitBeats``; None at ``tp = 1``).

    Raises:
        OSError: when the OS refuses a process (those already started are killed).
    """
    from chameleon_ft.runtime.placement import rank_place
    from chameleon_ft.runtime.worker.unit import UnitBeats

    beats = UnitBeats.create(ctx, tp) if tp > 1 else None
    procs: list[Any] = []
    try:
        for rank in range(tp):
            rank_args = (*head, rank_place(place, tp, rank), *tail, rank, beats)
            proc = ctx.Process(target=target, args=rank_args, daemon=False,
                               name=name if rank == 0 else f"{name}-tp{rank}")
            proc.start()
            procs.append(proc)
    except BaseException:
        Unit(procs).kill()
        raise
    return Unit(procs, beats)


@dataclass
class Proc:
    """The process currently holding a worker id (``process`` None: a remote worker)."""

    worker: int
    incarnation: str
    process: Any = None
    host: str = ""
    """The host it runs on ("": this one)."""
    local_index: int = 0
    """Its node-local index among this job's workers on its host (which GPU it computes
    on: ``runtime.placement``)."""


def free_index(taken: Iterable[int]) -> int:
    """The lowest node-local index not in ``taken``."""
    held = set(taken)
    return next(i for i in range(len(held) + 1) if i not in held)


class Launcher:
    """Starts local worker processes and keeps a handle on every one of them."""

    def __init__(self, host: str, port: int, secret: bytes, preload: Iterable[str] = (),
                 num_local: int = 0, tp: int = 1) -> None:
        self.host, self.port, self.secret = host, port, secret
        self.num_local = num_local
        """Workers this coordinator runs on its host (its task's workers)."""
        self.tp = tp
        """Processes per worker (``[job] tp``): each worker is a :class:`Unit`."""
        self.preload = tuple(preload)
        """Modules the workers' forkserver imports once (see :func:`forkserver_context`)."""
        self.procs: dict[int, Proc] = {}
        """The current process of each worker id (local or remote)."""
        self.all_procs: list[Any] = []
        """The local processes launched that have not been reaped: the current ones, and
        replaced ones until they exit (each launch reaps those that did)."""
        self.launched_pids: deque[int] = deque(maxlen=PIDS_KEPT)
        """The pids of the newest local processes launched (for harnesses that check none
        is left behind)."""

    def launch(self, ids: Iterable[int], *, replacement: bool) -> dict[int, str]:
        """Start a process for each worker id; returns their incarnations."""
        from chameleon_ft.runtime.worker.process import worker_main

        ctx = forkserver_context(self.preload)
        address = auth.advertise_address(self.host, self.port)
        # reap the replaced processes that exited (polling the exit status reaps one)
        self.all_procs = [p for p in self.all_procs if p.exitcode is None
                          or any(q.process is p for q in self.procs.values())]
        out = {}
        for w in ids:
            incarnation = auth.new_nonce()
            # local workers are ids 0..num_local-1: their node-local index is the id
            place = Place(w, task_index=w, task_workers=max(self.num_local, w + 1))
            unit = start_unit(ctx, worker_main,
                              (w, self.host, self.port, address, incarnation, self.secret,
                               replacement), place, (logs.current_level(),),
                              tp=self.tp, name=f"chameleon-worker-{w}")
            self.procs[w] = Proc(w, incarnation, unit, host=socket.gethostname(),
                                 local_index=w)
            self.all_procs.append(unit)
            self.launched_pids.extend(unit.pids)
            out[w] = incarnation
        return out

    def admitted(self, worker: int, host: str, incarnation: str, alive: Iterable[int],
                 wanted: int | None = None) -> int:
        """A remote process on ``host`` takes ``worker`` as ``incarnation``; returns its
        node-local index there: ``wanted`` when its launcher gave it one (``LOCAL_RANK``,
        ``SLURM_LOCALID``: the cluster knows which GPU is whose), else the lowest index no
        other live worker of the host holds, so two workers of a host never share a GPU."""
        index = wanted if wanted is not None else free_index(
            p.local_index for w, p in self.procs.items()
            if w != worker and w in set(alive) and p.host == host)
        self.procs[worker] = Proc(worker, incarnation, host=host, local_index=index)
        return index

    def adopt(self, worker: int, incarnation: str, pid: int, started: int) -> bool:
        """Hold the process ``pid`` of this host (started at ``started``) as ``worker``'s
        (a re-attached worker; at ``tp > 1`` its rank 0, whose siblings follow its unit
        slot and leave with it); False when it is gone."""
        try:
            unit = Unit([Adopted(pid, started)])
        except (OSError, AttributeError):  # gone, or no pid file descriptors here
            return False
        self.procs[worker] = Proc(worker, incarnation, unit, host=socket.gethostname(),
                                  local_index=worker)
        self.all_procs.append(unit)
        return True

    def adopted(self, worker: int) -> bool:
        """Whether ``worker``'s process was adopted (not started here)."""
        p = self.procs.get(worker)
        return p is not None and p.process is not None and \
            isinstance(p.process.procs[0], Adopted)

    def pids(self, ids: Iterable[int]) -> list[int]:
        """The pids of local workers."""
        return [p.process.pid for w in ids if (p := self.procs.get(w)) is not None
                and p.process is not None]

    def exits(self) -> dict[int, int]:
        """Current local processes that exited, with their status."""
        return {w: p.process.exitcode for w, p in self.procs.items()
                if p.process is not None and p.process.exitcode is not None}

    def gone(self, worker: int) -> bool:
        """Whether the local process of ``worker`` exited (a remote one: not known)."""
        p = self.procs.get(worker)
        return p is not None and p.process is not None and p.process.exitcode is not None

    def kill(self, workers: Iterable[int]) -> list[int]:
        """SIGKILL the running local processes of ``workers`` (every rank of each);
        returns those signalled."""
        killed = []
        for w in workers:
            p = self.procs.get(w)
            unit = None if p is None else p.process
            if unit is None or unit.pid is None or not unit.is_alive():
                continue
            unit.kill()
            killed.append(w)
        return killed

    def join(self, workers: Sequence[int], timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` in all) for these workers' local processes to exit."""
        deadline = time.monotonic() + timeout_s
        for w in workers:
            p = self.procs.get(w)
            if p is not None and p.process is not None:
                p.process.join(max(0.0, deadline - time.monotonic()))

    def wait(self, workers: Iterable[int], timeout_s: float = POLL_S) -> None:
        """Sleep until one of these workers' local processes exits, or ``timeout_s``."""
        sentinels = [s for w in workers if (p := self.procs.get(w)) is not None
                     and p.process is not None for s in p.process.sentinels]
        if sentinels:
            multiprocessing.connection.wait(sentinels, timeout=timeout_s)
        else:
            time.sleep(timeout_s)

    def reap(self, timeout_s: float = REAP_S) -> None:
        """Leave no process behind: wait briefly, then SIGKILL by pid and join."""
        deadline = time.monotonic() + timeout_s
        for unit in self.all_procs:
            unit.join(max(0.0, deadline - time.monotonic()))
        for unit in self.all_procs:
            if unit.is_alive():
                unit.kill()
                unit.join(5.0)
