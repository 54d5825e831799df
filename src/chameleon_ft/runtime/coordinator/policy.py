"""The recovery policy as the coordinator calls it.

The control plane asks (``Decide`` / ``DecideRejoin`` effects); the shell calls a
:data:`Decide` function and feeds the answer back. The default is the project's planner
(``chameleon_ft.policy.Planner``); tests pass their own function.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.profile import Profile
from chameleon_ft.runtime.control.decider import DecisionLike, ManualDecision
from chameleon_ft.spec.config import Config

__all__ = ["Decide", "DecisionLike", "ManualDecision", "PlannerDecide"]

Decide = Callable[[ExecutionPlan, frozenset[int], frozenset[int], float, float | None],
                  DecisionLike]
"""``(current plan, newly failed, alive, now_s, since_checkpoint_s) -> decision``."""


class PlannerDecide:
    """The project's policy (``chameleon_ft.policy.Planner``) as a :data:`Decide`.

    :meth:`precompute` prepares the candidates of likely failures of a plan on a background
    thread while training is healthy, so a decision at failure time is a cache look-up.
    """

    def __init__(self, config: Config, profile: Profile, policy: str) -> None:
        from chameleon_ft.policy import Planner  # pure core: imported only when training

        self.planner = Planner(config, profile=profile, policy=policy)
        self.lock = threading.Lock()

    def __call__(self, plan: ExecutionPlan, failed: frozenset[int], alive: frozenset[int],
                 now_s: float, since_checkpoint_s: float | None) -> DecisionLike:
        with self.lock:
            decision: DecisionLike = self.planner.decide(
                plan, sorted(failed), alive=sorted(alive), now_s=now_s,
                since_checkpoint_s=since_checkpoint_s)
            return decision

    def rejoin(self, plan: ExecutionPlan, returned: frozenset[int], alive: frozenset[int],
               now_s: float) -> DecisionLike:
        """The policy's answer to repaired workers coming back."""
        with self.lock:
            decision: DecisionLike = self.planner.decide_rejoin(
                plan, sorted(returned), alive=sorted(alive), now_s=now_s)
            return decision

    def precompute(self, plan: ExecutionPlan) -> None:
        """Start filling the planner's cache for ``plan`` in the background."""

        def work() -> None:
            with self.lock, contextlib.suppress(Exception):
                self.planner.precompute(plan)

        threading.Thread(target=work, daemon=True, name="chameleon-precompute").start()
