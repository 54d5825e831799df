"""Units of work in forked processes, a few at a time; a process that dies is a value.

``run_forked`` runs each task in its own forked process, at most ``jobs`` at once. A task
reports its results one by one through a pipe (``send``), so what a process finished
before it died is kept. A process killed from outside (the kernel's out-of-memory killer,
a user) ends in a :class:`Death` naming what it was doing, not in a traceback and not
with the other processes' results lost; a Python exception inside a task is raised again
in the parent (a bug or a bad job is an error, not a death).

This is the simulator's only use of processes (``runner.py`` decides what a task is).
"""

from __future__ import annotations

import multiprocessing
import resource
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

Send = Callable[[Any], None]
"""What a task calls to hand one message to the parent (picklable values)."""


@dataclass(frozen=True)
class Death:
    """A task's process ended without finishing its task."""

    task: int
    """Index of the task."""
    exitcode: int
    """The process's exit code; minus the signal number when a signal killed it."""
    peak_rss_bytes: int | None
    """The process's peak resident memory, when the system says (Linux), else ``None``."""

    @property
    def reason(self) -> str:
        """How it ended, in words (the signal's name, and the peak memory when known)."""
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            how = f"killed by {name}"
            if -self.exitcode == signal.SIGKILL:
                how += " (the kernel's out-of-memory killer, or a user)"
        else:
            how = f"exited with code {self.exitcode}"
        if self.peak_rss_bytes is not None:
            how += f" at {self.peak_rss_bytes / 2**30:.1f} GB resident"
        return how


@dataclass
class _Running:
    task: int
    process: Any
    finished: bool = False
    """The task sent its last message (a normal end)."""
    peak_rss_bytes: int | None = None


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``getrusage``; kB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_peak_bytes(pid: int) -> int | None:
    """A live process's peak resident memory from ``/proc`` (``None`` elsewhere)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_END = ("__end__",)
"""The last message of a task that finished (sent by the process, after the task)."""


def _child(task: Callable[[Send], None], conn: Connection) -> None:
    try:
        task(conn.send)
    except Exception as exc:  # raised again by the parent
        try:
            conn.send(("__error__", exc))
        except Exception:  # an exception that does not pickle: send its text
            conn.send(("__error__", RuntimeError(f"{type(exc).__name__}: {exc}")))
    else:
        conn.send(_END)
    finally:
        conn.close()


def run_forked(tasks: Sequence[Callable[[Send], None]], *, jobs: int,
               on_message: Callable[[int, Any], None],
               on_poll: Callable[[], None] | None = None,
               poll_s: float = 0.5) -> list[Death]:
    """Run every task in a forked process, ``jobs`` at a time, in order.

    Args:
        tasks: each is called in its own process with ``send``; what it sends arrives in
            ``on_message(task index, message)`` in the parent, in order.
        jobs: processes at once (>= 1).
        on_message: the parent's handler.
        on_poll: called at least every ``poll_s`` seconds while tasks run (progress).
        poll_s: see ``on_poll``.

    Returns:
        The tasks whose process died, in the order they were noticed.

    Raises:
        Exception: the first exception a task raised (the other processes are stopped).
        ValueError: when forking is not available here.
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError("forked processes are not available on this system")
    context = multiprocessing.get_context("fork")
    waiting = list(range(len(tasks)))[::-1]
    running: dict[Connection, _Running] = {}
    deaths: list[Death] = []
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                index = waiting.pop()
                reader, process = _start(context, tasks[index])
                running[reader] = _Running(index, process)
            for conn in wait(list(running), timeout=poll_s):
                assert isinstance(conn, Connection)
                _receive(conn, running, deaths, on_message)
            for state in running.values():
                peak = _status_peak_bytes(state.process.pid)
                if peak is not None:
                    state.peak_rss_bytes = peak
            if on_poll is not None:
                on_poll()
    finally:
        for state in running.values():
            state.process.kill()
            state.process.join()
    return deaths


def _start(context: Any, task: Callable[[Send], None]) -> tuple[Connection, Any]:
    """``task`` started in a forked process: the parent's end of its pipe, and the
    process."""
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(task, writer), daemon=True)
    process.start()
    writer.close()  # the child's end: EOF once the child is gone
    return reader, process


def _receive(conn: Connection, running: dict[Connection, _Running], deaths: list[Death],
             on_message: Callable[[int, Any], None]) -> None:
    """One message from a running task's pipe: handed to ``on_message``, the task's end
    noted, or its exception raised again here; a closed pipe: the process reaped, a death
    recorded unless it finished its task."""
    state = running[conn]
    try:
        message = conn.recv()
    except EOFError:
        del running[conn]
        death = _ended(state)
        if death is not None:
            deaths.append(death)
        return
    if message == _END:
        state.finished = True
    elif isinstance(message, tuple) and message[:1] == ("__error__",):
        raise message[1]
    else:
        on_message(state.task, message)


def _ended(state: _Running) -> Death | None:
    """Reap a process whose pipe closed; a :class:`Death` unless it finished its task."""
    state.process.join()
    if state.finished and state.process.exitcode == 0:
        return None
    return Death(task=state.task, exitcode=state.process.exitcode,
                 peak_rss_bytes=state.peak_rss_bytes)
