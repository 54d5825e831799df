"""The recovery policy as the coordinator calls it.

The control plane asks (``Decide`` / ``DecideRejoin`` effects); the shell calls a
:data:`Decide` function and feeds the answer back. The default is the project's planner
(``chameleon_ft.policy.Planner``); tests pass their own function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.profile import Profile
from chameleon_ft.runtime.control.decider import DecisionLike, ManualDecision
from chameleon_ft.spec.config import Config

__all__ = ["Decide", "DecisionLike", "ManualDecision", "PlannerDecide"]

Decide = Callable[[ExecutionPlan, frozenset[int], frozenset[int], float, float | None],
                  DecisionLike]
"""``(current plan, newly failed, alive, now_s, since_checkpoint_s) -> decision``."""


class PlannerDecide:
    """The project's policy (``chameleon_ft.policy``) as a :data:`Decide`.

    Decisions never wait: after each publish the likely failures of the new plan are
    prepared in the background within ``[policy] precompute_budget_s``
    (:class:`~chameleon_ft.policy.prepared.PreparedPlanner`), and a real failure stops
    that preparation and is decided at once, a cache hit when it was prepared.
    """

    def __init__(self, config: Config, profile: Profile, policy: str) -> None:
        from chameleon_ft.policy import Planner  # pure core: imported only when training
        from chameleon_ft.policy.prepared import PreparedPlanner

        self.prepared = PreparedPlanner(Planner(config, profile=profile, policy=policy))

    def __call__(self, plan: ExecutionPlan, failed: frozenset[int], alive: frozenset[int],
                 now_s: float, since_checkpoint_s: float | None) -> DecisionLike:
        decision: DecisionLike = self.prepared.decide(
            plan, sorted(failed), alive=sorted(alive), now_s=now_s,
            since_checkpoint_s=since_checkpoint_s)
        return decision

    def rejoin(self, plan: ExecutionPlan, returned: frozenset[int], alive: frozenset[int],
               now_s: float) -> DecisionLike:
        """The policy's answer to repaired workers coming back."""
        decision: DecisionLike = self.prepared.decide_rejoin(
            plan, sorted(returned), alive=sorted(alive), now_s=now_s)
        return decision

    def slow(self, plan: ExecutionPlan, worker: int, factor: float, alive: frozenset[int],
             slow: Mapping[int, float], now_s: float, end: bool) -> DecisionLike:
        """The policy's answer to ``worker`` running ``factor`` times slower (``end``: to
        its slowdown's end), with the other slow workers' factors (``[recovery]
        slow_policy`` picks the answer)."""
        if end:
            ended: DecisionLike = self.prepared.decide_slow_end(
                plan, worker, alive=sorted(alive), slow=dict(slow), now_s=now_s)
            return ended
        decision: DecisionLike = self.prepared.decide_slow(
            plan, worker, factor, alive=sorted(alive), slow=dict(slow), now_s=now_s)
        return decision

    def precompute(self, plan: ExecutionPlan, idle: frozenset[int] = frozenset()) -> None:
        """Prepare the likely failures of ``plan`` in the background (returns at once);
        ``idle`` workers (warm spares) are alive in each, as the decision will be told."""
        self.prepared.prepare(plan, idle=idle)

    def close(self) -> None:
        """Stop the preparation and join its thread."""
        self.prepared.close()
