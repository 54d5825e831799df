"""The join slots' window, pure: which reserved slots the shell reads, which are still
waited for, and which are given up.

A joiner reserves the next slot index with a counter, then writes its request there. The
counter is a hint anyone can raise (the store authenticates nobody), so everything here
is bounded: at most ``MAX_BACKLOG`` reserved slots are looked at (a flood of reservations
moves the window on, the skipped slots counted as refused); a slot reserved but not
written yet is waited for at most the hang deadline, ``MAX_PENDING`` at a time, without
holding up the slots after it, and looked at again every ``RECHECK_S``.

What a written slot holds (its proof checked, a replayed proof refused) is the shell's to
read (``coordinator.admission``, I/O with the job's key); who is admitted is
:mod:`~chameleon_ft.runtime.control.joining`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.runtime.protocol import MISSING

MAX_BACKLOG = 64
"""Reserved slots looked at, at most: beyond, the oldest are skipped (a flood)."""
MAX_PENDING = 8
"""Slots reserved but not yet written waited for at once."""
RECHECK_S = 0.05
"""How often slots reserved but not yet written are looked at again."""


@dataclass(frozen=True)
class Window:
    """Where the reading of the join slots stands."""

    seen: int = 0
    """The first slot not looked at yet."""
    pending: Mapping[int, float] = field(default_factory=dict)
    """Slots reserved but not written: since when (run clock)."""
    recheck_at_s: float = 0.0
    """When the pending slots are looked at again."""


@dataclass(frozen=True)
class Look:
    """What to read after the reserved count was read."""

    window: Window
    due: tuple[int, ...]
    """The slots to read now, in order: the pending ones due again, then the new ones."""
    skipped: int
    """Reserved slots never looked at (a flood beyond ``MAX_BACKLOG``)."""


def look(w: Window, reserved: int, now_s: float) -> Look:
    """The slots to read, given the reserved count.

    Args:
        w: the window.
        reserved: the join slots reserved so far (as the counter says).
        now_s: the run clock.
    """
    seen, skipped = w.seen, 0
    if reserved - seen > MAX_BACKLOG:
        skipped = reserved - MAX_BACKLOG - seen
        seen = reserved - MAX_BACKLOG
    due = list(range(seen, max(seen, reserved)))
    recheck_at_s = w.recheck_at_s
    if w.pending and now_s >= w.recheck_at_s:
        due = sorted(w.pending) + due
        recheck_at_s = now_s + RECHECK_S
    return Look(Window(max(seen, reserved), w.pending, recheck_at_s), tuple(due), skipped)


def settle(w: Window, found: Sequence[tuple[int, Any]], *, now_s: float,
           hang_s: float) -> tuple[Window, list[Any], list[int]]:
    """Take what the slots read held.

    Args:
        w: the window.
        found: ``(slot, what it held)`` for each slot read, ``MISSING`` where unwritten.
        now_s: the run clock.
        hang_s: how long an unwritten slot is waited for.

    Returns:
        The new window, what the written slots held (in the order read), and the slots
        given up (unwritten past the hang deadline, or beyond ``MAX_PENDING``).
    """
    pending = dict(w.pending)
    taken: list[Any] = []
    given_up: list[int] = []
    for index, item in found:
        if item != MISSING:
            pending.pop(index, None)
            taken.append(item)
            continue
        since = pending.setdefault(index, now_s)
        if now_s - since >= hang_s:
            del pending[index]
            given_up.append(index)
        elif len(pending) > MAX_PENDING:
            oldest = min(pending)
            del pending[oldest]
            given_up.append(oldest)
    recheck_at_s = w.recheck_at_s if w.pending else now_s + RECHECK_S
    return Window(w.seen, pending, recheck_at_s), taken, given_up
