"""The simulator engine's own events: small frozen values, all in this one module.

The failure trace it replays (:class:`~chameleon_ft.failures.Trace`) is defined below both
the simulator and the runtime, in :mod:`chameleon_ft.failures`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Commit:
    """Internal engine event: a transition ends and its plan starts running.

    ``token`` identifies the transition; a later failure aborts it by bumping the engine's
    token, so a stale commit is ignored when it is popped.
    """

    time_s: float
    token: int


@dataclass(frozen=True, slots=True)
class Switch:
    """Internal engine event: a two-phase recovery's background migration is done and the
    job switches to the final plan (ignored when ``token`` is stale)."""

    time_s: float
    token: int
