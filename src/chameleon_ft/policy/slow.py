"""The planner's answers to a slow worker (a fail-slow) and to the end of its slowdown.

:class:`SlowDecisions` is mixed into :class:`~chameleon_ft.policy.planner.Planner`:
``decide_slow`` sits beside ``decide`` and ``decide_rejoin`` and answers with the same
:class:`~chameleon_ft.policy.choice.Decision`. The candidates (docs/design.md 3.4):

- ``keep``, ``rebalance``, ``dynamic`` and ``swap``: ``recovery/slowdown.py``, every plan
  priced at the workers' measured speeds;
- ``evict``: the slow worker out of the plan as if it had died: the candidate the failure
  decision of the job's policy takes (reroute, dynamic, shrink, swap, restart...), without
  detection (the worker is alive) nor a lost step (the change waits for a step boundary),
  priced at the other slow workers' speeds.

``recovery.slow_policy`` (or the ``slow_policy`` argument) picks: ``chameleon`` takes the
best Eq. 8 score over the expected slowdown (its mean ``recovery.slow_expected_s``, cut
short by the next failure: the window's mean is ``1 / (1 / D_slow + 1 / D_fail)``) when the
failure policy is ``chameleon``, and evicts under a fixed failure policy (the common
practice, a fail-slow treated as a fail-stop); a fixed answer takes its own candidate when
feasible, else keeps. No plan changes the samples of a step nor their normalisation: the
update stays the failure-free one. When the slowdown ends ``decide_slow_end`` re-plans as a
re-join does: a worker out of the plan comes back through ``decide_rejoin``; one still in
it is priced again at full speed (keep, or rebalance and dynamic back).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from chameleon_ft.perf import Estimate, speeds_from_factors
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.policy.candidates import _reloads_lose, failure_candidates
from chameleon_ft.policy.choice import Decision, pick
from chameleon_ft.policy.inputs import check_horizon, check_policy
from chameleon_ft.recovery.slowdown import slow_candidates
from chameleon_ft.recovery.types import (
    Candidate,
    CheckpointSource,
    RecoveryState,
    Strategy,
    infeasible,
)
from chameleon_ft.spec.recovery import SLOW_POLICY_NAMES

if TYPE_CHECKING:
    from collections.abc import Callable

    from chameleon_ft.perf import Estimator
    from chameleon_ft.policy.cache import _Found
    from chameleon_ft.policy.choice import Chooser
    from chameleon_ft.policy.inputs import DecisionInputs
    from chameleon_ft.spec.config import Config

_EVERY = (Strategy.KEEP, Strategy.REBALANCE, Strategy.DYNAMIC, Strategy.SWAP, Strategy.EVICT)
"""Chameleon's answers to a slow worker, in the order decisions list them."""
_FIXED = {"keep": (), "rebalance": (Strategy.REBALANCE,), "dynamic": (Strategy.DYNAMIC,),
          "swap": (Strategy.SWAP,), "evict": (Strategy.EVICT,)}
"""What a fixed ``slow_policy`` prices besides keep."""
_NOT_PAID = ("detect_s", "lost_step_s")
"""Failure terms an eviction does not pay: the worker is alive, the change is announced."""


def check_slow_policy(name: str) -> str:
    """``name``, a known ``slow_policy``.

    Raises:
        ValueError: for an unknown one.
    """
    if name not in SLOW_POLICY_NAMES:
        raise ValueError(f"slow_policy: unknown answer {name!r}; choose one of "
                         f"{', '.join(SLOW_POLICY_NAMES)}")
    return name


def _slow_map(slow: Mapping[int, float] | None, worker: int, factor: float | None
              ) -> dict[int, float]:
    """Every slow worker's factor: ``slow`` with ``worker`` at ``factor`` (``None``: at
    full speed again).

    Raises:
        ValueError: for a factor that is not a finite number >= 1.
    """
    out = dict(slow or {})
    if factor is None:
        out.pop(worker, None)
    else:
        out[worker] = factor
    speeds_from_factors(out)  # validates
    return out


class SlowDecisions:
    """``decide_slow`` and ``decide_slow_end``, mixed into the planner (module docstring)."""

    if TYPE_CHECKING:
        config: Config
        _estimator: Estimator
        _chooser: Chooser
        _inputs: DecisionInputs

        @property
        def rerouting(self) -> Strategy: ...

        def _state(self, plan: ExecutionPlan, alive: frozenset[int],
                   since_checkpoint_s: float | None) -> RecoveryState: ...

        def _failure_state(self, plan: ExecutionPlan, alive: frozenset[int],
                           failed: frozenset[int]) -> RecoveryState: ...

        def _failure_found(self, state: RecoveryState, failed: frozenset[int], policy: str, *,
                           compare: bool, detail: bool, horizon_s: float | None,
                           now_s: float) -> _Found: ...

        def _choose(self, candidates: tuple[Candidate, ...], *, plan: ExecutionPlan,
                    policy: str, horizon_s: float | None, num_live: int, now_s: float,
                    search_s: float, cache_hit: bool,
                    back: Callable[[Candidate], Candidate] | None = None,
                    num_idle: int = 0) -> Decision: ...

        def decide_rejoin(self, plan: ExecutionPlan, returned: Iterable[int], *,
                          alive: Iterable[int] | None = None, now_s: float = 0.0,
                          horizon_s: float | None = None, policy: str | None = None,
                          detail: bool = True, hide_search: bool = False) -> Decision: ...

        policy: str

    def estimate_slow(self, plan: ExecutionPlan, slow: Mapping[int, float]) -> Estimate:
        """``plan``'s estimate with each worker of ``slow`` computing that many times slower
        (``perf.speeds_from_factors``): the unit-speed estimate, exactly, when none of them
        runs in ``plan`` or every factor is 1.

        Raises:
            ValueError: for a factor that is not a finite number >= 1.
        """
        return self._estimator.estimate(plan, speeds_from_factors(slow, plan.stage_of_worker))

    def decide_slow(self, plan: ExecutionPlan, worker: int, factor: float, *,
                    alive: Iterable[int] | None = None, slow: Mapping[int, float] | None = None,
                    now_s: float = 0.0, horizon_s: float | None = None,
                    policy: str | None = None, slow_policy: str | None = None,
                    hide_search: bool = False, since_checkpoint_s: float | None = None,
                    since_memory_checkpoint_s: float | None = None) -> Decision:
        """Choose how to answer ``worker`` running ``factor`` times slower under ``plan``.

        Args:
            plan: the plan now running.
            worker: the slow worker (one of ``alive``).
            factor: its measured slowdown (>= 1).
            alive: every live worker, idle ones included; default: the plan's workers.
            slow: the other slow workers' factors (``worker``'s is ``factor``).
            now_s: seconds since the job began.
            horizon_s: the window for Eq. 8; default: the expected slowdown, cut short by
                the next failure (module docstring).
            policy: the failure policy (overrides the planner's): ``evict`` answers as it
                answers a failure.
            slow_policy: overrides ``recovery.slow_policy``.
            hide_search: as in ``decide``.
            since_checkpoint_s: as in ``decide`` (an eviction may restart).
            since_memory_checkpoint_s: as in ``decide``.

        Returns:
            The decision (strategy ``keep``, ``rebalance``, ``dynamic``, ``swap`` or
            ``evict``) with every candidate priced.

        Raises:
            ValueError: for a worker outside the cluster or not alive, a bad factor,
                horizon or policy.
        """
        chosen_policy, answer, alive_set, horizon = self._slow_inputs(
            plan, worker, alive, now_s, horizon_s, policy, slow_policy)
        speeds = _slow_map(slow, worker, float(factor))
        wanted: tuple[Strategy, ...]
        if answer == "chameleon":
            wanted = _EVERY if chosen_policy == "chameleon" else (Strategy.KEEP, Strategy.EVICT)
        else:
            wanted = (Strategy.KEEP, *_FIXED[answer])
        if worker not in plan.stage_of_worker:
            wanted = (Strategy.KEEP,)  # an idle worker: nothing runs slower
        state = self._slow_state(plan, alive_set, speeds)
        candidates = slow_candidates(state, worker, speeds, wanted)
        if Strategy.EVICT in wanted:
            candidates.append(self._evict(
                plan, worker, alive_set, speeds, chosen_policy, now_s, hide_search,
                {CheckpointSource.STORAGE: since_checkpoint_s,
                 CheckpointSource.MEMORY: since_memory_checkpoint_s}))
        window, expected = self._slow_window(horizon, len(alive_set), now_s)
        fixed = None if answer == "chameleon" and chosen_policy == "chameleon" else wanted[-1]
        return self._slow_decision(plan, tuple(candidates), fixed, window, expected,
                                   alive_set, now_s)

    def decide_slow_end(self, plan: ExecutionPlan, worker: int, *,
                        alive: Iterable[int] | None = None,
                        slow: Mapping[int, float] | None = None, now_s: float = 0.0,
                        horizon_s: float | None = None, policy: str | None = None,
                        slow_policy: str | None = None,
                        hide_search: bool = False) -> Decision:
        """Re-plan when ``worker``'s slowdown ends, as for a re-join.

        A worker out of ``plan`` (evicted, swapped out) is a returned worker:
        ``decide_rejoin``. One still in it runs at full speed again: keep, or (chameleon,
        or the fixed answer that put it there) rebalance and dynamic priced back at the
        remaining speeds, over the expected time to the next failure.

        Args:
            plan: the plan now running.
            worker: the worker at full speed again.
            alive: every live worker; default: the plan's workers.
            slow: the workers still slow (``worker`` is left out if named).
            now_s: seconds since the job began.
            horizon_s: the window; default: the expected time to the next failure.
            policy: the failure policy (overrides the planner's).
            slow_policy: overrides ``recovery.slow_policy``.
            hide_search: as in ``decide``.

        Returns:
            The decision.

        Raises:
            ValueError: as :meth:`decide_slow`.
        """
        chosen_policy, answer, alive_set, horizon = self._slow_inputs(
            plan, worker, alive, now_s, horizon_s, policy, slow_policy)
        if worker not in plan.stage_of_worker:
            return self.decide_rejoin(plan, [worker], alive=alive_set, now_s=now_s,
                                      horizon_s=horizon, policy=chosen_policy, detail=True,
                                      hide_search=hide_search)
        speeds = _slow_map(slow, worker, None)
        if answer == "chameleon" and chosen_policy == "chameleon":
            wanted: tuple[Strategy, ...] = (Strategy.KEEP, Strategy.REBALANCE, Strategy.DYNAMIC)
        elif answer in ("rebalance", "dynamic"):
            wanted = (Strategy.KEEP, *_FIXED[answer])
        else:
            wanted = (Strategy.KEEP,)
        candidates = slow_candidates(self._slow_state(plan, alive_set, speeds), worker,
                                     speeds, wanted)
        window, expected = self._chooser.window(horizon, len(alive_set), now_s)
        fixed = None if len(wanted) == 3 else wanted[-1]
        return self._slow_decision(plan, tuple(candidates), fixed, window, expected,
                                   alive_set, now_s)

    # ------------------------------------------------------------------ parts
    def _slow_inputs(self, plan: ExecutionPlan, worker: int, alive: Iterable[int] | None,
                     now_s: float, horizon_s: float | None, policy: str | None,
                     slow_policy: str | None
                     ) -> tuple[str, str, frozenset[int], float | None]:
        """The checked arguments: failure policy, slow answer, live workers, horizon.

        Raises:
            ValueError: naming the argument that is wrong.
        """
        (checked,) = self._inputs.workers("worker", [worker])
        if now_s < 0 or math.isnan(now_s):
            raise ValueError(f"now_s: must be >= 0, got {now_s}")
        alive_set = (frozenset(plan.workers) | {checked} if alive is None
                     else self._inputs.workers("alive", alive))
        if checked not in alive_set:
            raise ValueError(f"worker: worker {checked} is not alive; a dead worker is a "
                             "failure (decide)")
        self._inputs.exposure.observe(now_s, len(alive_set))
        return (check_policy(policy if policy is not None else self.policy),
                check_slow_policy(slow_policy if slow_policy is not None
                                  else self.config.recovery.slow_policy),
                alive_set, check_horizon(horizon_s))

    def _slow_state(self, plan: ExecutionPlan, alive: frozenset[int],
                    slow: Mapping[int, float]) -> RecoveryState:
        """The state candidates are priced from: estimates at the measured speeds."""
        return replace(self._state(plan, alive, None),
                       estimate=functools.partial(self.estimate_slow, slow=dict(slow)))

    def _slow_window(self, horizon_s: float | None, num_live: int,
                     now_s: float) -> tuple[float, bool]:
        """A slow worker's window: given, else the expected slowdown cut short by the
        next failure (both exponential: their rates add)."""
        window, expected = self._chooser.window(horizon_s, num_live, now_s)
        if not expected:
            return window, False
        rate = 1.0 / self.config.recovery.slow_expected_s + (
            1.0 / window if window > 0 and math.isfinite(window) else 0.0)
        return 1.0 / rate, True

    def _evict(self, plan: ExecutionPlan, worker: int, alive: frozenset[int],
               slow: Mapping[int, float], policy: str, now_s: float, hide_search: bool,
               lost: dict[CheckpointSource, float | None]) -> Candidate:
        """The failure decision's answer to losing ``worker`` (under ``policy``), without
        detection or a lost step, priced at the other slow workers' speeds."""
        failed = frozenset({worker})
        survivors = alive - failed
        try:
            state = self._failure_state(plan, survivors, failed)
            found = self._failure_found(state, failed, policy, compare=False, detail=True,
                                        horizon_s=None, now_s=now_s)
            raw, back = found.to_choose(True, hide_search)
            decision = self._choose(
                failure_candidates(state, _reloads_lose(raw, lost), self.rerouting),
                plan=plan, policy=policy, horizon_s=None, num_live=len(survivors),
                now_s=now_s, search_s=found.search_s, cache_hit=found.hit, back=back,
                num_idle=len(survivors) - len(plan.stage_of_worker) + 1)
        except ValueError as exc:
            return infeasible(Strategy.EVICT, str(exc))
        chosen = decision.chosen
        assert chosen.plan is not None
        rest = {w: f for w, f in slow.items() if w != worker}
        est = self.estimate_slow(chosen.plan, rest)
        terms = {k: v for k, v in chosen.terms.items() if k not in _NOT_PAID}
        interim = (None if chosen.interim_plan is None
                   else self.estimate_slow(chosen.interim_plan, rest).step_s)
        return replace(chosen, strategy=Strategy.EVICT, estimate=est, step_s=est.step_s,
                       throughput_samples_s=est.throughput_samples_s, terms=terms,
                       transition_s=math.fsum(terms.values()), interim_step_s=interim,
                       reason=f"out of the plan as if it had died: {chosen.strategy}, "
                              f"{chosen.reason}",
                       extra={**chosen.extra, "as": str(chosen.strategy)})

    def _slow_decision(self, plan: ExecutionPlan, candidates: tuple[Candidate, ...],
                       fixed: Strategy | None, window: float, expected: bool,
                       alive: frozenset[int], now_s: float) -> Decision:
        """Score ``candidates`` over the window; take the best (``fixed`` None) or the
        fixed answer when feasible, else keep."""
        num_live = len(alive)
        scored = self._chooser.scored(candidates, batch=plan.global_batch, window_s=window,
                                      expected=expected,
                                      num_live=min(num_live, self.config.num_workers),
                                      now_s=now_s,
                                      num_idle=num_live - len(plan.stage_of_worker))
        if fixed is None:
            best, reason = pick(scored, "chameleon", window, expected)
        else:
            own = next((c for c in scored if c.strategy == fixed and c.feasible), None)
            best = own if own is not None else next(c for c in scored
                                                    if c.strategy == Strategy.KEEP)
            why = ("fixed answer" if own is not None else
                   "fixed answer infeasible ("
                   + next(c.reason for c in scored if c.strategy == fixed) + "); keep")
            reason = f"slow policy {fixed}: {why} (step {best.step_s:.3f} s)"
        assert best.plan is not None
        return Decision(strategy=str(best.strategy), plan=best.plan, candidates=scored,
                        reason=reason, transition_s=best.transition_s, horizon_s=window,
                        search_s=0.0, cache_hit=False, migration=best.migration,
                        horizon_expected=expected)
