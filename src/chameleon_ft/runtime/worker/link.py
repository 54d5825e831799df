"""A worker's tie to its coordinator: whether the coordinator is there, and the next one
found when it goes (docs/design.md 4.1, "A coordinator replaced under live workers").

The coordinator is *lost* when its port refuses connections, when its store took no
heartbeat for the hang deadline (stopped, cut off), or when its progress value
(``protocol.PROGRESS_KEY``, advanced by its loop, not by the store's own thread) stayed
frozen for the hang deadline (a loop stuck in a policy call). A lost coordinator is
still waited on and beaten to: if its progress moves again it was only slow, and it is no
longer lost (nothing was abandoned). Once its store fails (its process died, or its own
watchdog ended it) the training thread keeps the worker's state (the layers and optimizer
state of its last committed step, and the gradients of a step it reduced whose verdict it
never read), abandons the generation in flight, and looks, with bounded retries, for a
coordinator on the job's address:

- one of a later term (``chameleon train --resume``, or the scheduler restarting it):
  the worker reports what it holds (sealed for that term) and follows its directives;
- the same one, whose progress moved again (its store failed one request, it did not
  die): the worker goes on with it (its next directive fences the worker if it was
  declared dead meanwhile);
- none by the end of ``[train] coordinator_grace_s`` from the loss: the worker exits
  (``EXIT_COORDINATOR_GONE``), as it did before coordinators could be replaced. The
  watchdog thread enforces the end of the grace whatever the training thread is blocked
  in.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.signing import PEEK, Forged, Signer, control_key, payload_of
from chameleon_ft.runtime.worker.exits import EXIT_COORDINATOR_GONE, exit_now

RETRY_S = 0.1
"""Pause between two looks for a coordinator while the previous one is lost."""


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc``; None: no such
    process). With the pid it names one process: a pid is reused, the pair is not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


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


class Link:
    """What a worker process knows of its coordinator (thread-safe).

    Args:
        host: the job's address.
        port: its port.
        hang_s: the hang deadline (a coordinator silent or frozen this long is lost).
        grace_s: how long a lost coordinator's successor is waited for.
        term: the coordinator's term.
    """

    def __init__(self, host: str, port: int, *, hang_s: float, grace_s: float,
                 term: int) -> None:
        self.host, self.port = host, port
        self.hang_s, self.grace_s = hang_s, grace_s
        self.term = term
        self.epoch = 0
        """Bumped at each attach: the helper threads then open new connections."""
        self.lock = threading.Lock()
        self.lost_at: float | None = None
        self.why = ""
        self.recovering = False
        """The training thread gave the coordinator up (its store failed) and looks for
        one to follow: only it decides which (``find``)."""
        now = time.monotonic()
        self.beat_s = now
        """When the coordinator last took a heartbeat."""
        self.progress_s = now
        """When its progress value last moved (or since when it is awaited)."""
        self.progress_seq = -1
        self.gone = (f"the coordinator at {host}:{port} is gone and no other came within "
                     f"coordinator_grace_s = {grace_s:g} s; exiting")

    @property
    def lost(self) -> bool:
        """Whether the coordinator is lost (and no other attached yet)."""
        return self.lost_at is not None

    def beat_taken(self) -> None:
        """The coordinator took a heartbeat."""
        self.beat_s = time.monotonic()

    def progress(self, seq: int | None) -> None:
        """The progress value as read with a heartbeat the coordinator took (None: none
        yet). Lost, it moved again: the coordinator was slow, not gone (the worker's
        waits on it went on: nothing was abandoned)."""
        if seq is not None and seq > self.progress_seq:
            self.progress_seq, self.progress_s = seq, time.monotonic()
            with self.lock:
                if self.lost_at is not None and not self.recovering:
                    self.lost_at, self.why = None, ""

    def lose(self, at_s: float, why: str) -> None:
        """The coordinator is lost since ``at_s`` (the first report wins)."""
        with self.lock:
            if self.lost_at is None:
                self.lost_at, self.why = min(at_s, time.monotonic()), why

    def judge(self) -> None:
        """Lose the coordinator when it took no heartbeat, or its progress value did not
        move, for the hang deadline; exit once the grace is over."""
        now = time.monotonic()
        lost_at = self.lost_at
        if lost_at is not None:
            if now > lost_at + self.grace_s:
                exit_now(EXIT_COORDINATOR_GONE, f"chameleon worker: {self.why}; {self.gone}")
            return
        if now - self.beat_s > self.hang_s:
            self.lose(self.beat_s + self.hang_s, f"the coordinator took no heartbeat for "
                      f"{self.hang_s:g} s")
        elif now - self.progress_s > self.hang_s:
            self.lose(self.progress_s + self.hang_s, f"the coordinator's loop made no "
                      f"progress for {self.hang_s:g} s")

    def attached(self, term: int) -> None:
        """A coordinator of ``term`` is there (a new one, or the same one again)."""
        with self.lock:
            if term != self.term:
                self.progress_seq = -1  # the next coordinator numbers its own
            self.term, self.lost_at, self.why, self.recovering = term, None, "", False
            self.beat_s = self.progress_s = time.monotonic()
            self.epoch += 1


@dataclass
class Found:
    """A coordinator found on the job's address: a connection to it and its job."""

    raw: Any
    job: proto.JobInfo
    signer: Signer


def find(link: Link, secret: bytes, job_id: str, signer: Signer) -> Found:
    """Look for a coordinator on the job's address until the grace ends: one of a later
    term, or the same one whose progress moved again. Exits the process at the end of the
    grace."""
    while link.lost_at is not None and time.monotonic() < link.lost_at + link.grace_s:
        found = _look(link, secret, job_id, signer)
        if found is not None:
            return found
        time.sleep(RETRY_S)
    exit_now(EXIT_COORDINATOR_GONE, f"chameleon worker: {link.why}; {link.gone}")
    raise AssertionError("unreachable")  # exit_now does not return


def _look(link: Link, secret: bytes, job_id: str, signer: Signer) -> Found | None:
    """One look: a coordinator to attach to, or None."""
    if link.lost_at is None or refused(link.host, link.port):
        return None
    left_s = link.lost_at + link.grace_s - time.monotonic()
    try:
        raw = dist.TCPStore(link.host, link.port, is_master=False,
                            timeout=timedelta(seconds=max(0.1, min(link.hang_s / 2, left_s))))
        raw.set_timeout(timedelta(seconds=max(1.0, link.hang_s / 2)))
        value = _peek(raw, proto.JOB_KEY)
    except (dist.DistError, OSError, RuntimeError):
        return None  # frozen, or gone again: look later
    found = None if value is None else _opened(raw, value, secret, job_id)
    if found is None:
        return None
    if found.job.term > link.term:
        return found
    if found.job.term == link.term:
        with contextlib.suppress(dist.DistError, OSError, RuntimeError, Forged):
            progress = _peek(raw, proto.PROGRESS_KEY)
            if progress is not None and \
                    signer.open(proto.PROGRESS_KEY, progress).seq > link.progress_seq:
                return Found(raw, found.job, signer)  # the same one goes on: slow, not gone
    return None


def _peek(raw: Any, key: str) -> bytes | None:
    """The bytes at ``key`` without blocking or creating it (None: no such key)."""
    value = bytes(raw.compare_set(key, PEEK, PEEK))
    return None if value == PEEK else value


def _opened(raw: Any, value: bytes, secret: bytes, job_id: str) -> Found | None:
    """The job at ``value`` if it is this job's, sealed for its term (None: not yet, a
    replayed one, or another job's)."""
    try:
        job = proto.JobInfo.from_json(payload_of(value))
        signer = Signer(control_key(secret), job.job_id, job.term)
        signer.open(proto.JOB_KEY, value)
    except (ValueError, Forged):
        return None
    return Found(raw, job, signer) if job.job_id == job_id else None
