"""Coordinators in processes of their own, to be killed and replaced under live workers.

A coordinator here is a child forked from the tests' forkserver (torch already imported)
that asks the same forkserver for its workers: so its workers outlive it (they are the
server's children, reaped there), and starting one costs a fork, not an interpreter. Its
log lines go to ``coordinator.log`` in the run folder, each with the wall clock, for the
test to read; its exit status says how the run ended (0 trained, 1 failed, 2 bad input).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dist_harness import tiny_config

from chameleon_ft.runtime.chaos import alive
from chameleon_ft.runtime.coordinator.launcher import forkserver_context

LOG = "coordinator.log"


class StuckPolicy:
    """A recovery policy that never returns (it writes when it was called into
    ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __call__(self, *_args: Any) -> Any:
        self.marker.write_text(repr(time.time()))
        while True:
            time.sleep(3600)


def _split_commit(step: int, stopped: int) -> None:
    """Have the coordinator stop worker ``stopped`` (SIGSTOP) before it writes step
    ``step``'s commit, let the others read it, then die: the verdict is read by some
    workers only."""
    from chameleon_ft.runtime.coordinator.store import ControlStore

    original = ControlStore.commit

    def commit(self: ControlStore, gen: int, at: int, *, end: bool) -> None:
        if at == step:
            os.kill(_PIDS[stopped], signal.SIGSTOP)
            original(self, gen, at, end=end)
            time.sleep(0.5)  # the other workers read it and apply the step
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, gen, at, end=end)

    ControlStore.commit = commit  # type: ignore[method-assign]


_PIDS: dict[int, int] = {}


def _coordinator_main(out: str, train: dict[str, Any], options: dict[str, Any]) -> None:
    """A coordinator's process: run the tiny job, log to the run folder, exit with how it
    ended."""
    from chameleon_ft.runtime.coordinator.shell import Coordinator, WorkerFailure

    # the forkserver this process came from serves its workers too (they outlive it)
    multiprocessing.forkserver.ensure_running = lambda: None  # type: ignore[assignment]
    multiprocessing.forkserver._forkserver.ensure_running = lambda: None  # type: ignore[method-assign]
    log_file = open(Path(out) / LOG, "a", buffering=1)  # noqa: SIM115 - until os._exit

    def log(line: str) -> None:
        log_file.write(f"{time.time():.6f} {line}\n")
        match = re.search(r"launched workers 0-\d+ \(pids ([\d ]+)\)", line)
        if match:
            _PIDS.update(enumerate(int(p) for p in match.group(1).split()))

    layout = options.pop("layout", {})  # tiny_config's [cluster] and [job] overrides
    split = options.pop("split_commit", None)
    if split is not None:
        _split_commit(*split)
    if options.pop("no_watchdog", False):  # only the workers can tell the loop is stuck
        from chameleon_ft.runtime.coordinator.watchdog import LoopWatch

        LoopWatch.start = lambda self: None  # type: ignore[method-assign]
    code = 0
    try:
        Coordinator(tiny_config(**layout, **train), out_dir=out, log=log, **options).run()
    except WorkerFailure as exc:
        log(f"training failed: {exc}")
        code = 1
    except ValueError as exc:
        log(f"bad input: {exc}")
        code = 2
    log_file.close()
    os._exit(code)


class Coordinating:
    """A coordinator process on the tiny job, and what its log says."""

    def __init__(self, out: Path, train: dict[str, Any], **options: Any) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.proc = forkserver_context().Process(
            target=_coordinator_main, args=(str(out), train, options), daemon=False,
            name="chameleon-test-coordinator")
        self.started = len(self.lines())
        self.proc.start()

    def lines(self) -> list[tuple[float, str]]:
        """This run folder's coordinator lines so far (every coordinator's)."""
        path = self.out / LOG
        if not path.exists():
            return []
        out = []
        for text in path.read_text().splitlines():
            stamp, _, line = text.partition(" ")
            out.append((float(stamp), line))
        return out

    def mine(self) -> list[tuple[float, str]]:
        """This coordinator's lines."""
        return self.lines()[self.started:]

    def until(self, pattern: str, limit_s: float = 60.0) -> tuple[float, re.Match[str]]:
        """The first line of this coordinator matching ``pattern`` (waits for it)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for stamp, line in self.mine():
                match = re.search(pattern, line)
                if match:
                    return stamp, match
            if not self.proc.is_alive() and self.proc.exitcode is not None:
                time.sleep(0.1)
                for stamp, line in self.mine():
                    match = re.search(pattern, line)
                    if match:
                        return stamp, match
                break
            time.sleep(0.02)
        raise AssertionError(f"never saw {pattern!r}: {[x for _, x in self.mine()][-15:]}")

    def pids(self) -> list[int]:
        """Its workers' pids (from its launch line)."""
        _, match = self.until(r"launched workers 0-\d+ \(pids ([\d ]+)\)")
        return [int(p) for p in match.group(1).split()]

    def committed(self) -> int:
        """Steps committed so far (``metrics.jsonl``)."""
        path = self.out / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def kill(self) -> float:
        """SIGKILL it; returns when (wall clock)."""
        os.kill(self.proc.pid, signal.SIGKILL)
        at = time.time()
        self.proc.join(10)
        return at

    def wait(self, limit_s: float = 90.0) -> int | None:
        """Its exit status once it ended (None: still running after ``limit_s``)."""
        self.proc.join(limit_s)
        return self.proc.exitcode


def siblings_of(pid: int, leave_out: int) -> list[int]:
    """The other children of ``pid``'s parent (the tests' forkserver), ``leave_out`` (a
    coordinator it serves) left out: at ``tp > 1`` the worker's processes other than
    rank 0, whose pids the coordinator does not log."""
    def parent(of: int) -> int | None:
        try:
            return int(Path(f"/proc/{of}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None

    server = parent(pid)
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in (pid, leave_out) and \
                parent(int(entry.name)) == server:
            out.append(int(entry.name))
    return sorted(out)


def gone_within(pids: list[int], limit_s: float) -> dict[int, float]:
    """When (wall clock) each process was seen gone, watched for at most ``limit_s``."""
    gone: dict[int, float] = {}
    deadline = time.monotonic() + limit_s
    while len(gone) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in gone and not alive(pid):
                gone[pid] = time.time()
        time.sleep(0.01)
    return gone


def until(condition: Callable[[], bool], limit_s: float) -> None:
    """Wait (bounded) until ``condition`` holds."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def kill_all(*pids: int) -> None:
    """SIGKILL what is left (by pid; SIGCONT first, a stopped process included)."""
    for pid in pids:
        if alive(pid):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
