"""Recovery decisions, pure: the run's state and the policy's answer -> what to run next.

The policy (``chameleon_ft.policy``, or a test's function) prices candidates; this module
holds the runtime's own rules around it (docs/design.md 4.1, 4.3):

- what a decision starts from: the placement the workers' state really has;
- *keep*: nothing of that placement was lost (only a migration source or an interim
  plan's extra worker died): train on it again, no policy needed;
- the reload guard: after a (re)load, before anything committed, the only consistent move
  is to reload again, on the survivors (it is checked before *keep*: a reloaded state does
  not match the older placement);
- the translation of a decision into a :class:`~chameleon_ft.runtime.control.state.Recovery`
  (a two-phase decision trains on its interim plan first);
- the bounded escalation of errors no death explains (retry, restart, stop);
- the re-join rule (ask once per state; a plan that uses no idle worker is no re-join).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.runtime.control import state as st


class DecisionLike(Protocol):
    """What the control plane reads from a policy decision."""

    @property
    def strategy(self) -> Any: ...

    @property
    def plan(self) -> ExecutionPlan | None: ...

    @property
    def migration(self) -> Any: ...

    @property
    def reason(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ManualDecision:
    """A decision made by the runtime itself (keep, a forced restart) or by hand (tests)."""

    strategy: str
    plan: ExecutionPlan | None
    migration: Any = None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"strategy": self.strategy, "reason": self.reason, "candidates": [],
                "plan": None if self.plan is None else self.plan.to_dict()}


@dataclass(frozen=True)
class Ask:
    """The policy must decide: recover ``base`` from the loss of ``failed``."""

    base: ExecutionPlan
    failed: frozenset[int]
    usable: frozenset[int]
    restart_only: bool = False
    """The state was just (re)loaded: only a restart candidate is consistent."""


@dataclass(frozen=True)
class Decided:
    """No policy needed: the runtime's own decision."""

    decision: ManualDecision


def request(state: st.RunState) -> Ask | Decided:
    """What a recovery decision needs after deaths broke the running generation.

    After a (re)load nothing committed, so the workers hold the reloaded state of the
    running plan, not the older placement: reload again, on the running plan when all its
    workers live, else on a plan the policy makes for the survivors. Otherwise the
    decision starts from the placement the state has (``state.decision_inputs``), and an
    intact placement is kept.
    """
    if state.from_checkpoint:
        lost = frozenset(state.plan.workers) - state.alive
        if not lost:
            return Decided(ManualDecision(
                "restart", state.plan, reason="a failure before the first commit after "
                "loading the state, none of the plan's workers lost: load it again"))
        return Ask(state.plan, lost, state.alive, restart_only=True)
    base, newly, usable = st.decision_inputs(state)
    if not newly:
        return Decided(ManualDecision("keep", base, reason="the state's placement is intact"))
    return Ask(base, newly, usable)


@dataclass(frozen=True)
class Stop:
    """Training cannot go on."""

    reason: str


def reloads(decision: DecisionLike) -> bool:
    """Whether the decision reloads the checkpoint: a restart, or a candidate that rolls
    back (``rollback`` set: a swap onto a wiped stage reloads on the same plan, the
    spare in the slot, without restarting the survivors)."""
    return str(decision.strategy) == "restart" or \
        getattr(decision, "rollback", None) is not None


def restart_candidate(decision: DecisionLike) -> DecisionLike | None:
    """The decision itself if it reloads, else its feasible restart candidate."""
    if reloads(decision):
        return decision
    for c in getattr(decision, "candidates", ()):
        if str(c.strategy) == "restart" and c.feasible and c.plan is not None:
            return ManualDecision("restart", c.plan, reason="failure before the first commit "
                                  "after loading the state: restart again")
    return None


def recovery(state: st.RunState, ask: Ask | None,
             decision: DecisionLike) -> tuple[DecisionLike, st.Recovery] | Stop:
    """The recovery a decision asks for, in the state's terms.

    Args:
        state: the run (deaths applied).
        ask: what the policy was asked (None: the runtime decided itself).
        decision: the policy's (or the runtime's) decision.

    Returns:
        The decision finally taken (a restart candidate under the reload guard) and the
        recovery, or why training stops.
    """
    if ask is not None and ask.restart_only:
        forced = restart_candidate(decision)
        if forced is None:
            return Stop("a failure before the first step after a restart, and no restart "
                        "plan for the survivors")
        decision = forced
    plan = decision.plan
    if plan is None:
        return Stop(f"no recovery possible: {decision.reason}")
    strategy = str(decision.strategy)
    if reloads(decision):  # every worker of the plan loads the checkpoint in place
        return decision, st.Recovery("restart", plan, restored_step=state.latest_checkpoint())
    chosen: Any = getattr(decision, "chosen", None)
    interim = getattr(chosen, "interim_plan", None)
    if strategy == "reroute-then-dynamic" and interim is not None:
        after = 1
        if chosen.interim_step_s and chosen.interim_s:
            after = max(1, math.ceil(chosen.interim_s / chosen.interim_step_s))
        return decision, st.Recovery(strategy, plan, migration=decision.migration,
                                     interim=interim, switch_after=after)
    return decision, st.Recovery(strategy, plan, migration=decision.migration)


def escalation(state: st.RunState, max_retries: int) -> st.RunState | Stop:
    """Errors no death explains: redo the generation ``max_retries`` times, then restart
    from the checkpoint (on the placement the state has when its workers all live), then
    stop."""
    action = st.retry_action(state, max_retries)
    if action is st.RetryAction.RETRY:
        return st.retried(state)
    if action is st.RetryAction.RESTART:
        plan = state.state_plan if set(state.state_plan.workers) <= state.alive else state.plan
        return st.escalated(state, plan, state.latest_checkpoint())
    return Stop(f"errors persist after {max_retries} retries and a restart")


def rejoin_question(state: st.RunState) -> tuple[ExecutionPlan, frozenset[int]] | None:
    """The re-join question to ask the policy now, if any: idle workers while training
    runs and no switch is pending (the same question is asked once: the caller keeps the
    last one asked)."""
    if state.pending is not None or not state.idle or state.mode is not st.Mode.TRAINING:
        return None
    return state.plan, state.idle


def rejoin_strategy(state: st.RunState, decision: DecisionLike) -> str:
    """``keep``, or the strategy that folds idle workers in (a plan that leaves every idle
    worker idle is no re-join: switching to it would only cost a generation)."""
    uses = state.idle & frozenset(decision.plan.workers) if decision.plan is not None \
        else frozenset()
    strategy = str(decision.strategy)
    if strategy == "keep" or decision.plan is None or not uses:
        return "keep"
    return strategy
