"""The simulator engine's own events: small frozen values, all in this one module.

The failure trace it replays (:class:`~chameleon_ft.failures.Trace`) is defined below both
the simulator and the runtime, in :mod:`chameleon_ft.failures`. ``Respeed`` and
``SlowCheck`` follow a trace's fail-slows (``sim/slowrun.py``).
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


@dataclass(frozen=True, slots=True)
class Respeed:
    """Internal engine event: a worker's speed changed (a fail-slow began or ended); at
    this step boundary the running plan goes on at the new speed (ignored when ``token``
    is stale: a plan committed since was priced at it)."""

    time_s: float
    token: int


@dataclass(frozen=True, slots=True)
class SlowCheck:
    """Internal engine event: the job notices that ``worker`` runs slow (``ending``: at
    full speed again) and its policy answers; ignored when ``seq`` is not the worker's
    latest speed change."""

    time_s: float
    worker: int
    seq: int
    ending: bool
