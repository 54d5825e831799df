"""Numbered slots read in order, pure: the one reader of the error reports and of the join
requests.

Messages from many writers go into numbered slots: a writer reserves the next index with a
counter, then writes its slot. The coordinator reads from its cursor on, in order, without
ever blocking: a slot reserved but not written yet stops the reading (its writer may be
about to write it) until the hang deadline, then is skipped with a log line (its writer
died between reserving and writing). What a written slot holds is the caller's to judge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from chameleon_ft.runtime.protocol import MALFORMED, MISSING

__all__ = ["MALFORMED", "MAX_SLOTS_PER_READ", "MISSING", "Cursor", "read"]

MAX_SLOTS_PER_READ = 64
"""Slots read in one poll at most (the rest wait for the next poll): a counter a stranger
raised cannot make one poll iterate it."""


@dataclass(frozen=True)
class Cursor:
    """Where the reading of one series of slots stands."""

    next: int = 0
    """The first slot not read yet."""
    wait_since_s: float | None = None
    """Since when ``next`` is reserved but unwritten."""


def read(cursor: Cursor, slots: Sequence[Any], *, now_s: float, hang_s: float,
         what: str) -> tuple[Cursor, list[Any], list[str]]:
    """Take the slots from ``cursor.next`` on, as read, in order.

    Args:
        cursor: where the reading stands.
        slots: the slots from ``cursor.next`` on (``MISSING`` where unwritten).
        now_s: the run clock.
        hang_s: how long an unwritten slot is waited for.
        what: the slots' name for the log ("generation 3: error report").

    Returns:
        The new cursor, the written slots taken (``MALFORMED`` ones included), and the log
        lines of slots skipped.
    """
    taken: list[Any] = []
    logs: list[str] = []
    for slot in slots[:MAX_SLOTS_PER_READ]:
        if slot == MISSING:
            since = now_s if cursor.wait_since_s is None else cursor.wait_since_s
            if now_s - since < hang_s:
                return replace(cursor, wait_since_s=since), taken, logs
            logs.append(f"{what} {cursor.next} was never written (its writer died); skipped")
        else:
            taken.append(slot)
        cursor = Cursor(cursor.next + 1)
    return cursor, taken, logs
