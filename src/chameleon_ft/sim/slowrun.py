"""The engine's part for fail-slows: speeds that change, and the policy's answers.

Semantics (docs/design.md section 6):

- A ``slow`` event sets its worker's factor at once for every decision; the running plan
  goes on at the new speed from its next step boundary (``Respeed``), so no step is lost
  or split. The job notices the slowdown ``recovery.slow_detect_steps`` steps later
  (``SlowCheck``) and the policy answers (``SlowPolicy.on_slow``); a change of plan starts
  at a step boundary, nothing is lost but the transition. A ``slow-end`` is noticed the
  same way: a worker the plan no longer runs (evicted, swapped out) comes back through the
  policy's re-join, one it still runs through ``on_slow_end``.
- A worker taken out of the plan for its slowness is left out of the live workers every
  decision is told about until its slowdown ends (``excluded``); one that dies is neither
  slow nor excluded any more, and a repaired one comes back at full speed.
- Every plan that commits is priced at the speeds of the moment (``SlowPolicy.priced``);
  after a failure's or re-join's plan commits, each slow worker it runs is answered again
  at once (the job already knows it is slow).
- Training at a slowed speed books the shortfall against the same plan at full speed as
  ``slow_s``; the rest of a degraded plan's shortfall stays ``degraded_s``.

A trace without fail-slows never reaches this module's paths: its results are the same,
bit for bit, as before it existed.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from chameleon_ft.failures import SLOW_KINDS, Trace, TraceEvent
from chameleon_ft.sim.events import Respeed, SlowCheck
from chameleon_ft.sim.policies import Choice, EventContext, SimPolicy, SlowPolicy

if TYPE_CHECKING:
    from chameleon_ft.sim.events import Commit, Switch
    from chameleon_ft.spec.recovery import RecoverySpec

class Horizons:
    """The oracle's true horizons in a trace with fail-slows: a failure's or re-join's is
    the next event that is not a speed change (another worker's slowdown changes no plan
    by itself); a slow worker's is that, or its own next speed change if sooner."""

    def __init__(self, trace: Trace) -> None:
        events = trace.events
        self._next = [trace.duration_s] * (len(events) + 1)
        for i in range(len(events) - 1, -1, -1):
            self._next[i] = (self._next[i + 1] if events[i].kind in SLOW_KINDS
                             else events[i].time_s)
        self._speed: dict[int, list[float]] = {}
        for event in events:
            if event.kind in SLOW_KINDS:
                self._speed.setdefault(event.target[0], []).append(event.time_s)
        self._end = trace.duration_s

    def next_change_s(self, handled: int) -> float:
        """After ``handled`` trace events: the time of the next one that is not a speed
        change (the trace's end when none is left)."""
        return self._next[handled]

    def next_speed_s(self, worker: int, now_s: float) -> float:
        """The time of ``worker``'s next speed change after ``now_s``."""
        times = self._speed.get(worker, [])
        i = bisect.bisect_right(times, now_s)
        return times[i] if i < len(times) else self._end


SLOW_PREFIX = "slow-"
"""Decisions answering a slow worker are counted as ``slow-<strategy>``."""


class SlowRun:
    """Fail-slow state and handlers of the engine's run (mixed into ``engine._Run``)."""

    if TYPE_CHECKING:
        policy: SimPolicy
        recovery: RecoverySpec
        alive: set[int]
        now: float
        committed: Choice
        pending: Choice | None
        token: int
        run_start_s: float
        run_start_samples: float
        run_start_steps: int
        samples: float
        steps: int
        deferred_returned: set[int]
        decisions: dict[str, int]

        def push(self, time_s: float, item: TraceEvent | Commit | Switch | Respeed
                 | SlowCheck) -> None: ...

        def context(self, next_event_s: float) -> EventContext: ...

        def interrupt(self) -> None: ...

        def apply(self, choice: Choice, *, decided: bool = True) -> None: ...

        def rejoin(self, returned: set[int], next_event_s: float) -> None: ...

        def _steps_in_run(self, at_s: float) -> int: ...

    def init_slow(self) -> None:
        """No worker slow, none excluded."""
        self.slow: dict[int, float] = {}
        """Live slow workers and their factors."""
        self.excluded: set[int] = set()
        """Live workers taken out of the plan for their slowness, until it ends."""
        self.speed_seq: dict[int, int] = {}
        """Per worker, the number of its speed changes (stale ``SlowCheck``s are ignored)."""
        self.deferred_checks: dict[int, SlowCheck] = {}
        """Checks that fell during a transition or while the job was down."""

    @property
    def slow_policy(self) -> SlowPolicy:
        """The policy's fail-slow answers."""
        return cast(SlowPolicy, self.policy)

    def priced(self, choice: Choice) -> Choice:
        """``choice`` at the speeds of now (itself when nothing is slow)."""
        if not self.slow and choice.nominal is None:
            return choice
        return self.slow_policy.priced(choice, self.slow)

    def _running(self) -> bool:
        return self.pending is None and self.committed.plan is not None

    def _boundary_after(self, at_s: float) -> float:
        """The running plan's first step boundary at or after ``at_s``."""
        step_s = self.committed.step_s
        steps = math.ceil((at_s - self.run_start_s) / step_s - 1e-9)
        return self.run_start_s + max(steps, 0) * step_s

    def on_speed(self, event: TraceEvent) -> None:
        """A ``slow`` or ``slow-end`` row: the factor changes now; the plan's speed at the
        next step boundary; the job notices it ``slow_detect_steps`` steps later."""
        worker = event.target[0]
        if worker not in self.alive:
            return
        factor = event.factor
        ending = factor is None
        if factor is None:
            self.slow.pop(worker, None)
        else:
            self.slow[worker] = float(factor)
        seq = self.speed_seq[worker] = self.speed_seq.get(worker, 0) + 1
        if not self._running():
            self.deferred_checks[worker] = SlowCheck(self.now, worker, seq, ending)
            return
        at_s = self._boundary_after(self.now)
        self.push(at_s, Respeed(at_s, self.token))
        # the steps the job notices it by are those it runs after the change
        delay_s = self.recovery.slow_detect_steps * self.priced(self.committed).step_s
        check_s = at_s + delay_s  # a boundary of the plan at its new speed
        self.push(check_s, SlowCheck(check_s, worker, seq, ending))

    def on_respeed(self, respeed: Respeed) -> None:
        """At a step boundary the running plan goes on at the speeds of now."""
        if respeed.token != self.token or not self._running():
            return  # a plan committed since was priced at them
        self.steps = self.run_start_steps + self._steps_in_run(self.now)
        self.run_start_s = self.now
        self.run_start_samples = self.samples
        self.run_start_steps = self.steps
        self.committed = self.priced(self.committed)

    def on_slow_check(self, check: SlowCheck, next_event_s: float) -> None:
        """The job notices a speed change: its policy answers (deferred to the end of a
        transition under way)."""
        worker = check.worker
        if check.seq != self.speed_seq.get(worker) or worker not in self.alive:
            return
        if not self._running():
            self.deferred_checks[worker] = check
            return
        if check.ending:
            self._slow_ended(worker, next_event_s)
            return
        plan = self.committed.plan
        assert plan is not None
        if worker not in plan.stage_of_worker:
            return  # idle: nothing runs slower; a plan that takes it is answered then
        choice = self.slow_policy.on_slow(self.committed, worker, self.slow[worker],
                                          dict(self.slow), self.context(next_event_s))
        self._answer(choice, worker)

    def _slow_ended(self, worker: int, next_event_s: float) -> None:
        """A slowdown's end noticed: an excluded worker re-joins, a running one is
        answered by ``on_slow_end``."""
        if worker in self.excluded:
            self.excluded.discard(worker)
            self.rejoin({worker}, next_event_s)
            return
        plan = self.committed.plan
        if plan is None or worker not in plan.stage_of_worker:
            return
        choice = self.slow_policy.on_slow_end(self.committed, worker, dict(self.slow),
                                              self.context(next_event_s))
        self._answer(choice, worker)

    def _answer(self, choice: Choice, worker: int) -> None:
        """Apply a slow answer at this step boundary (``keep``: count it only)."""
        name = SLOW_PREFIX + choice.strategy
        if choice.keep:
            self.decisions[name] = self.decisions.get(name, 0) + 1
            return
        self.interrupt()  # at a step boundary: nothing is lost
        self.apply(replace(choice, strategy=name))
        plan = choice.plan
        if worker in self.slow and plan is not None and worker not in plan.stage_of_worker:
            self.excluded.add(worker)

    def after_commit(self) -> None:
        """A plan committed: checks deferred during the transition run now; a failure's or
        re-join's plan is answered for each slow worker it runs."""
        from_slow = self.committed.strategy.startswith(SLOW_PREFIX)
        checks = sorted(self.deferred_checks.values(), key=lambda c: c.worker)
        self.deferred_checks = {}
        plan = self.committed.plan
        if not from_slow and plan is not None:
            pending = {c.worker for c in checks}
            checks += [SlowCheck(self.now, w, self.speed_seq[w], False)
                       for w in sorted(self.slow) if w in plan.stage_of_worker
                       and w not in pending]
        for check in checks:
            self.push(self.now, SlowCheck(self.now, check.worker, check.seq, check.ending))

    def died(self, workers: set[int]) -> None:
        """Dead workers are neither slow nor excluded (a repaired one runs at full speed)."""
        for worker in workers:
            self.slow.pop(worker, None)
            if worker in self.speed_seq:
                self.speed_seq[worker] += 1
            self.excluded.discard(worker)
            self.deferred_checks.pop(worker, None)
