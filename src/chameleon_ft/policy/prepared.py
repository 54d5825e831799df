"""Decisions that never wait: likely failures prepared in the background, within a budget.

A :class:`PreparedPlanner` owns the :class:`~chameleon_ft.policy.planner.Planner` that
decides, and prepares the decisions of likely failures of the running plan (every single
worker and every node, :meth:`Planner.precompute`) on a background thread with a second
planner of the same job. The two share nothing but the decision cache
(:class:`~chameleon_ft.policy.cache.DecisionCache`, locked for one look-up or insert),
so a decision never waits for the preparation:

- a failure already prepared is a cache hit (re-scoring and renaming only);
- a failure that arrives mid-preparation stops it (before its next estimate: a search is
  a sequence of them) and is decided at once, cold if it was not prepared yet: bounded by
  a cold decision, not by the preparation;
- the preparation stops after ``[policy] precompute_budget_s`` seconds.

The runtime wraps it in four calls::

    prepared = PreparedPlanner(Planner(config, profile=profile, policy=policy))
    prepared.prepare(plan, idle=spares)  # after each change of plan; returns at once
    decision = prepared.decide(plan, failed, alive=alive, now_s=now_s,
                               since_checkpoint_s=since_checkpoint_s)
    decision = prepared.decide_rejoin(plan, returned, alive=alive, now_s=now_s)
    prepared.close()           # at shutdown: stops the preparation, joins its thread

``decide`` and ``decide_rejoin`` take :meth:`Planner.decide`'s and
:meth:`Planner.decide_rejoin`'s arguments and return their decisions; they may run on any
thread, one at a time (the deciding planner is not shared). ``detail=False`` names only
the chosen candidate's plans (a warm decision on 2,048 workers in about half the time);
the others keep their prices. :meth:`status` says how far the preparation got.

Python runs one thread at a time: while the preparation finishes the estimate it is on
(tens to a couple of hundred milliseconds on 2,048 workers), a decision shares the
interpreter with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.policy.planner import Decision, Planner


@dataclass(frozen=True)
class PrepareStatus:
    """How far the background preparation got."""

    state: str
    """``idle`` (nothing asked yet), ``preparing``, ``done`` (every failure set), ``budget``
    (out of time), ``cache full``, ``cancelled`` (a decision or :meth:`~PreparedPlanner.
    cancel` stopped it, or a newer plan replaced it) or ``failed`` (see ``error``)."""
    plan: ExecutionPlan | None
    """The plan being (or last) prepared."""
    num_sets: int
    """Failure sets asked for."""
    num_done: int
    """Failure sets prepared so far (equivalent ones share one search: most are a
    look-up)."""
    elapsed_s: float
    """Seconds the preparation has run."""
    error: str = ""
    """Why the preparation failed (``state == "failed"``)."""


@dataclass
class _Request:
    plan: ExecutionPlan
    failures: list[frozenset[int]] | None
    cancel: threading.Event
    idle: frozenset[int] = frozenset()


class PreparedPlanner:
    """A planner whose decisions never wait for the preparation of likely failures.

    Args:
        planner: decides; its decision cache is shared with the preparing planner.
        budget_s: seconds per preparation; default ``planner.config.policy.
            precompute_budget_s``.
        make_preparer: builds the planner that prepares (called once, on the background
            thread, so its setup does not hold up the caller); default: a planner of the
            same job, profile and policy sharing ``planner``'s cache.

    Raises:
        ValueError: for a negative budget.
    """

    def __init__(self, planner: Planner, *, budget_s: float | None = None,
                 make_preparer: Callable[[], Planner] | None = None) -> None:
        budget = planner.config.policy.precompute_budget_s if budget_s is None else budget_s
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
            raise ValueError(f"budget_s: must be a number >= 0, got {budget!r}")
        self._planner = planner
        self._budget_s = float(budget)
        self._make_preparer = make_preparer or (lambda: Planner(
            planner.config, profile=planner.profile, policy=planner.policy,
            cache=planner.cache))
        self._lock = threading.Condition()
        self._pending: _Request | None = None
        self._current: _Request | None = None
        self._closing = False
        self._status = PrepareStatus("idle", None, 0, 0, 0.0)
        self._thread: threading.Thread | None = None

    @property
    def planner(self) -> Planner:
        """The planner that decides."""
        return self._planner

    # ---------------------------------------------------------------- preparation
    def prepare(self, plan: ExecutionPlan,
                failures: Iterable[Iterable[int]] | None = None,
                idle: Iterable[int] = ()) -> None:
        """Prepare the decisions of likely failures of ``plan`` in the background; returns
        at once. A preparation still running (for an older plan) stops before its next
        estimate.

        Args:
            plan: the plan now running.
            failures: failure sets to prepare; default: every single worker and every
                node's workers (:meth:`Planner.precompute`).
            idle: live workers ``plan`` does not run (warm spares), alive in every
                prepared failure as the decisions will be told.
        """
        sets = None if failures is None else [frozenset(ws) for ws in failures]
        with self._lock:
            if self._closing:
                raise RuntimeError("prepare: the planner is closed")
            self._stop_locked()
            self._pending = _Request(plan, sets, threading.Event(), frozenset(idle))
            self._status = PrepareStatus("preparing", plan, 0, 0, 0.0)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="chameleon-prepare")
                self._thread.start()
            self._lock.notify_all()

    def cancel(self) -> None:
        """Stop the preparation before its next estimate, and drop one not started."""
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        if self._pending is not None:
            self._status = PrepareStatus("cancelled", self._pending.plan, 0, 0, 0.0)
            self._pending = None
        if self._current is not None:
            self._current.cancel.set()

    def wait(self, timeout_s: float) -> bool:
        """Wait until no preparation runs or is pending; False on timeout (for tests and
        benchmarks: decisions never need to)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending is not None or self._current is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def status(self) -> PrepareStatus:
        """How far the preparation got."""
        with self._lock:
            return self._status

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the preparation and join its thread (it ends after the estimate it is on,
        up to ``timeout_s``)."""
        with self._lock:
            self._closing = True
            self._stop_locked()
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        """The background thread: one preparation at a time, the latest asked for."""
        preparer: Planner | None = None
        while True:
            with self._lock:
                while self._pending is None and not self._closing:
                    self._lock.wait()
                if self._closing:
                    return
                request = self._pending
                assert request is not None
                self._pending, self._current = None, request
                self._status = PrepareStatus("preparing", request.plan, 0, 0, 0.0)
            try:
                if preparer is None:
                    preparer = self._make_preparer()
                status = self._prepare(preparer, request)
            except Exception as exc:  # reported, never raised into training
                status = PrepareStatus("failed", request.plan, 0, 0, 0.0,
                                       error=f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._current = None
                if self._pending is None:  # else a newer plan's status stands
                    self._status = status
                self._lock.notify_all()

    def _prepare(self, preparer: Planner, request: _Request) -> PrepareStatus:
        plan = request.plan
        asked = request.failures
        sets = list(dict.fromkeys(asked if asked is not None
                                  else preparer.likely_failures(plan)))
        done = 0
        start = time.perf_counter()

        def prepared(_: frozenset[int]) -> None:
            nonlocal done
            done += 1
            with self._lock:
                self._status = PrepareStatus("preparing", plan, len(sets), done,
                                             time.perf_counter() - start)

        preparer.precompute(plan, failures=sets, budget_s=self._budget_s,
                            stop=request.cancel.is_set, on_prepared=prepared,
                            idle=request.idle)
        elapsed = time.perf_counter() - start
        if done >= len(sets):
            state = "done"
        elif request.cancel.is_set():
            state = "cancelled"
        elif elapsed >= self._budget_s:
            state = "budget"
        else:
            state = "cache full"
        return PrepareStatus(state, plan, len(sets), done, elapsed)

    # ---------------------------------------------------------------- decisions
    def decide(self, plan: ExecutionPlan, failed: Iterable[int], **kwargs: Any) -> Decision:
        """:meth:`Planner.decide`, after telling the preparation to stop (before its next
        estimate; never waiting for it)."""
        self.cancel()
        return self._planner.decide(plan, failed, **kwargs)

    def decide_rejoin(self, plan: ExecutionPlan, returned: Iterable[int],
                      **kwargs: Any) -> Decision:
        """:meth:`Planner.decide_rejoin`, after telling the preparation to stop."""
        self.cancel()
        return self._planner.decide_rejoin(plan, returned, **kwargs)

    def decide_slow(self, plan: ExecutionPlan, worker: int, factor: float,
                    **kwargs: Any) -> Decision:
        """:meth:`Planner.decide_slow`, after telling the preparation to stop."""
        self.cancel()
        return self._planner.decide_slow(plan, worker, factor, **kwargs)

    def decide_slow_end(self, plan: ExecutionPlan, worker: int, **kwargs: Any) -> Decision:
        """:meth:`Planner.decide_slow_end`, after telling the preparation to stop."""
        self.cancel()
        return self._planner.decide_slow_end(plan, worker, **kwargs)


__all__ = ["PrepareStatus", "PreparedPlanner"]
