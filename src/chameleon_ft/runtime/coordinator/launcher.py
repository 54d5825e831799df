"""Worker processes launched here: starting, killing, watching their exits, reaping.

This is a handle on processes, not a decision maker: which workers to launch, relaunch or
fence is decided by the control plane (``runtime.control``); the limits on repairs live
there too (``control.members``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from chameleon_ft import logs
from chameleon_ft.runtime import auth
from chameleon_ft.runtime.placement import Place

POLL_S = 0.002
"""Coordinator poll interval: bounds the commit latency it adds to every step."""
REAP_S = 5.0
"""How long the end of a run waits for its processes before killing them."""
PIDS_KEPT = 4096
"""Pids of launched processes remembered (the newest)."""


def forkserver_context(preload: Iterable[str] = ()) -> Any:
    """A forkserver context whose server preloads torch, the worker module and
    ``preload`` (e.g. the model's adapter: transformers takes seconds to import, once in
    the server instead of once per worker; a module that does not import is skipped).
    The server starts once per process: the first call's list is the one it keeps."""
    # Waits in slices make c10d log a warning per timed-out slice; keep errors only.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = multiprocessing.get_context("forkserver")
    # Workers fork from a server that already imported torch: ~0.3 s per worker, not 5-10 s.
    # torch._dynamo too: every worker imports it when it builds its optimizer, and the
    # coordinator's shape probe (layers on meta) in its child.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "chameleon_ft.runtime.worker.main", *preload])
    _start_sheltered()
    return ctx


def _start_sheltered() -> None:
    """Start the forkserver (once per process) with SIGTERM blocked in it for good.

    A scheduler stops a job by signalling every process of it (Slurm's ``scancel``, a
    requeue or a preemption; ``kill`` of a process group), the server included, which
    would die at once, and with it the pipes that report its children's exit statuses
    and start new ones, in the middle of the drain the signal asked for (the final
    checkpoint, the parameters' export). Its processes leave by the coordinator's
    directive or are killed by pid (SIGKILL); none needs SIGTERM (workers ignore it). The
    signal is blocked in the calling thread only while the server is spawned (a child
    keeps the mask across fork and exec, and nothing in the server unblocks it), as
    multiprocessing protects its own resource tracker: one that arrives meanwhile waits,
    then reaches this process's handler. The tracker is started first, since starting it
    unblocks the signal.
    """
    multiprocessing.resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


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


def adapter_modules(model: Any) -> tuple[str, ...]:
    """The module of the model's adapter when it is one of ours (the Hugging Face one
    imports transformers), for the forkserver to preload; a user's own module is left to
    the workers (importing it may do anything)."""
    module = type(model).__module__
    return (module,) if module.startswith("chameleon_ft.") else ()


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
                 num_local: int = 0) -> None:
        self.host, self.port, self.secret = host, port, secret
        self.num_local = num_local
        """Workers this coordinator runs on its host (its task's workers)."""
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
        from chameleon_ft.runtime.worker.main import worker_main

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
            proc = ctx.Process(target=worker_main,
                               args=(w, self.host, self.port, address, incarnation,
                                     self.secret, replacement, place, logs.current_level()),
                               daemon=False, name=f"chameleon-worker-{w}")
            proc.start()
            self.procs[w] = Proc(w, incarnation, proc, host=socket.gethostname(),
                                 local_index=w)
            self.all_procs.append(proc)
            self.launched_pids.append(proc.pid)
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
        """SIGKILL the running local processes of ``workers``; returns those signalled."""
        killed = []
        for w in workers:
            p = self.procs.get(w)
            proc = None if p is None else p.process
            if proc is None or proc.pid is None or proc.exitcode is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
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
        sentinels = [p.process.sentinel for w in workers
                     if (p := self.procs.get(w)) is not None and p.process is not None]
        if sentinels:
            multiprocessing.connection.wait(sentinels, timeout=timeout_s)
        else:
            time.sleep(timeout_s)

    def reap(self, timeout_s: float = REAP_S) -> None:
        """Leave no process behind: wait briefly, then SIGKILL by pid and join."""
        deadline = time.monotonic() + timeout_s
        for proc in self.all_procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.all_procs:
            if proc.exitcode is None and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join(5.0)
