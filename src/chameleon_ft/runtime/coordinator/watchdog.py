"""The coordinator's loop as its workers and its own watchdog see it (docs/design.md 4.2).

The loop marks each pass (:meth:`LoopWatch.polled`) and, every half heartbeat, advances
the sealed progress value in the store (``protocol.PROGRESS_KEY``): a worker that sees
it frozen for the hang deadline takes the coordinator for gone, whatever the store's own
thread still answers. A thread here, which touches neither the store nor the loop's state,
sees the loop frozen for twice the hang deadline, at least 10 s (a policy call that never
returns, a defect that loops; the workers took it for gone after one), writes ``report.json``
saying where the loop is stuck (the effect it performs, its innermost frames) and ends the
process with status 1: its store goes with it, so the workers see the coordinator gone at
once and wait ``[train] coordinator_grace_s`` for the next one. Time the whole process did
not run (a starved host, a stop) does not count: its loop did not run either.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

STUCK_STATUS = 1
"""The exit status of a coordinator whose loop is stuck (training failed)."""
FRAMES = 4
"""Innermost frames of the stuck loop the report names."""
STARVED_S = 0.5
"""A watchdog tick this late means the whole process did not run meanwhile."""
STUCK_FLOOR_S = 10.0
"""The loop is judged stuck after twice the hang deadline, and never before this: a disk
that takes seconds to sync a file (a shared file system) is slow, not stuck, and a stuck
loop held longer costs little (its workers took it for gone after one hang deadline)."""


def stuck_after_s(hang_s: float) -> float:
    """How long the loop may stay in one pass before the watchdog ends the process."""
    return max(2 * hang_s, STUCK_FLOOR_S)


class LoopWatch:
    """Marks of the coordinator's loop, and the watchdog thread that judges them.

    Args:
        limit_s: how long the loop may stay in one pass (the hang deadline).
        progress_every_s: how often the sealed progress value advances.
        on_stuck: called on the watchdog's thread with the reason and where the loop is
            (the coordinator's: :func:`die` after writing the report).
    """

    def __init__(self, limit_s: float, progress_every_s: float,
                 on_stuck: Callable[[str, dict[str, Any]], None]) -> None:
        self.limit_s, self.every_s = limit_s, progress_every_s
        self.on_stuck = on_stuck
        self.polled_s = time.monotonic()
        self.written_s = -progress_every_s
        self.count = 0
        self.doing = "polling"
        """What the loop does now (the effect it performs)."""
        self.armed = False
        self.thread_id = threading.get_ident()
        """The loop's thread."""

    def polled(self, write: Callable[[int], None]) -> None:
        """The loop made one more pass; the progress value advances when it is due."""
        now = self.polled_s = time.monotonic()
        self.doing = "polling"
        if now - self.written_s >= self.every_s:
            self.written_s = now
            self.count += 1
            write(self.count)

    def start(self) -> None:
        """Arm the watchdog (on the loop's thread, as the loop begins)."""
        self.thread_id = threading.get_ident()
        self.polled_s = time.monotonic()
        self.armed = True
        threading.Thread(target=self._watch, name="coordinator-watchdog", daemon=True).start()

    def stop(self) -> None:
        """Disarm it (the loop ended)."""
        self.armed = False

    def _watch(self) -> None:
        interval_s = min(0.1, self.limit_s / 8)
        last = time.monotonic()
        while self.armed:
            time.sleep(interval_s)
            now = time.monotonic()
            late_s, last = now - last - interval_s, now
            if late_s > STARVED_S:  # this process did not run (its host starved it, or it
                # was stopped): neither did its loop, which is not stuck for that
                self.polled_s = min(now, self.polled_s + late_s)
            frozen_s = now - self.polled_s
            if self.armed and frozen_s > self.limit_s:
                where = self.where()
                reason = (f"the coordinator's loop made no progress for {frozen_s:.1f} s, "
                          f"stuck in {self.doing} ({where[-1] if where else 'unknown'})")
                self.on_stuck(reason, {"in": self.doing, "for_s": frozen_s, "at": where})
                return

    def where(self) -> list[str]:
        """The loop thread's innermost frames, outermost first."""
        frame = sys._current_frames().get(self.thread_id)
        if frame is None:
            return []
        return [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
                for f in traceback.extract_stack(frame)[-FRAMES:]]


def die(report: Callable[[str, dict[str, Any]], None], reason: str,
        stuck: dict[str, Any]) -> None:
    """Write the report (``report``), say why in one line, and end the process at once:
    the loop cannot be interrupted, and waiting for it would keep the store, and so the
    workers, waiting."""
    try:
        report(reason, stuck)
    except Exception as exc:  # the run folder refused: the line below still says why
        reason += f" (report.json not written: {exc})"
    try:
        os.write(2, f"chameleon train: training failed: {reason}\n".encode())
    finally:
        os._exit(STUCK_STATUS)
