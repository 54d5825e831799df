"""A decision's candidates: each strategy's, built from the current plan for a failure or a
re-join, the two-phase ones combined from them, and the changes a decision makes to
candidates it takes from the cache (a hidden search, the exact work a reload loses).

Candidates are built unscored; the planner scores them for its window and chooses
(``choice.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from chameleon_ft.perf import Estimate
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.recovery import dynamic, reroute, restart, shrink, swap
from chameleon_ft.recovery.reroute_then_dynamic import combine
from chameleon_ft.recovery.restorer import copy_in
from chameleon_ft.recovery.types import (
    Candidate,
    CheckpointSource,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)

_Bar = Callable[[Candidate, RecoveryState], "dynamic.Beaten | None"]
"""A decision's first candidate (in canonical names, with its state) -> the test it sets
for the dynamic search, or ``None`` when it sets none."""

_FAILURE_BUILDERS = {Strategy.REROUTE: reroute.candidates,
                     Strategy.RECYCLE: reroute.recycle_candidates,
                     Strategy.DYNAMIC: dynamic.candidates,
                     Strategy.RESTART: restart.candidates, Strategy.SHRINK: shrink.candidates,
                     Strategy.SWAP: swap.candidates}
_OWN = {Strategy.REROUTE: (Strategy.REROUTE,), Strategy.RECYCLE: (Strategy.RECYCLE,),
        Strategy.DYNAMIC: (Strategy.DYNAMIC,), Strategy.RESTART: (Strategy.RESTART,),
        Strategy.SHRINK: (Strategy.SHRINK,), Strategy.SWAP: (Strategy.SWAP,)}
"""The candidates a fixed-strategy policy needs when it does not compare
(reroute-then-dynamic: the job's rerouting and dynamic, see ``Planner._own``)."""
_REJOIN: dict[str, tuple[Strategy, ...]] = {
    s: (Strategy.KEEP, s)
    for s in (Strategy.DYNAMIC, Strategy.REROUTE, Strategy.RECYCLE, Strategy.SHRINK)}
"""What a rejoin is answered with, per fixed policy (chameleon: see ``Planner._rejoin``;
others: keep, or dynamic to compare)."""


def build_candidate(kind: str, strategy: Strategy, state: RecoveryState,
                    marked: frozenset[int], estimate: Callable[[ExecutionPlan], Estimate],
                    beaten: dynamic.Beaten | None = None) -> Candidate:
    """One strategy's candidate from the current plan, not yet scored.

    Args:
        kind: ``fail`` (``marked``: the newly failed workers; restart priced with the
            default lost work) or ``rejoin`` (``marked``: the returned workers): ``keep``,
            a dynamic re-plan over every live worker (announced, so without detection),
            ``reroute`` (ReCycle's re-join: returned workers take their stages back) or
            ``shrink`` (TorchFT's: idle workers form whole new replicas).
        strategy: the strategy.
        state: the job, the current plan and the live workers.
        marked: see ``kind``.
        estimate: the estimator's view of a plan (``keep``'s price).
        beaten: a dynamic search's test of its fastest step (``Planner._beaten_by``).

    Returns:
        The candidate (feasible or not).
    """
    if kind == "fail":
        if strategy == Strategy.DYNAMIC:
            return dynamic.candidates(state, marked, beaten=beaten)[0]
        return _FAILURE_BUILDERS[strategy](state, marked)[0]
    if strategy == Strategy.KEEP:
        return candidate_from_estimate(Strategy.KEEP, state.plan, estimate(state.plan), {},
                                       "keep the current plan; returned workers stay idle")
    if strategy == Strategy.DYNAMIC:
        return dynamic.candidates(state, frozenset(), failure=False, beaten=beaten)[0]
    if strategy == Strategy.SHRINK:
        return shrink.grow(state)
    return reroute_back(state, marked, strategy)


def reroute_back(state: RecoveryState, returned: frozenset[int],
                 strategy: Strategy) -> Candidate:
    """ReCycle's re-join: a returned worker copies its stage's parameters and optimizer
    state from a live replica and takes its micro-batches back; the other dead stages
    stay rerouted (``recycle``: their peers keep deferring weight gradients when memory
    allows). Infeasible when no returned worker had a rerouted stage."""
    plan = state.plan
    if not any(r in plan.dead_workers for r in returned):
        return infeasible(strategy, "no returned worker had a rerouted stage")
    found = reroute.rerouted_plan(state, defer=strategy == Strategy.RECYCLE
                                  and state.config.recovery.decoupled_backward)
    if isinstance(found, str):
        return infeasible(strategy, found)
    new_plan = found[0]
    return copy_in(state, strategy, new_plan,
                   f"returned workers take their stages back ({len(new_plan.reroutes)} "
                   "stage(s) still rerouted)")


def failure_candidates(state: RecoveryState, raw: tuple[Candidate, ...],
                       rerouting: Strategy) -> tuple[Candidate, ...]:
    """A failure's candidates to choose among: ``raw`` and, when both were priced, the
    two-phase one that reroutes now and re-plans in the background
    (``reroute-then-dynamic``)."""
    by_strategy = {c.strategy: c for c in raw}
    first = by_strategy.get(rerouting)
    if first is not None and Strategy.DYNAMIC in by_strategy:
        return (*raw, combine(state, first, by_strategy[Strategy.DYNAMIC]))
    return raw


def rejoin_candidates(state: RecoveryState, raw: tuple[Candidate, ...]
                      ) -> tuple[Candidate, ...]:
    """A re-join's candidates to choose among, from ``raw`` (``keep`` among them): keep;
    dynamic and the two-phase one that keeps training on the current plan while the state
    is copied; the reroutings that hand stages back; shrink as a two-phase candidate
    (its new replicas load in the background)."""
    by_strategy = {c.strategy: c for c in raw}
    keep = by_strategy[Strategy.KEEP]
    running = replace(keep, terms={}, transition_s=0.0)
    candidates = [keep]
    if Strategy.DYNAMIC in by_strategy:
        dyn = by_strategy[Strategy.DYNAMIC]
        candidates += [dyn, combine(state, running, dyn, first_phase="keep the current plan")]
    for rerouting in (Strategy.REROUTE, Strategy.RECYCLE):
        if rerouting in by_strategy:
            candidates.append(by_strategy[rerouting])
    if Strategy.SHRINK in by_strategy:
        grown = by_strategy[Strategy.SHRINK]
        two_phase = combine(state, running, grown, first_phase="keep training")
        candidates.append(replace(two_phase, strategy=Strategy.SHRINK,
                                  reason=f"{grown.reason}: {two_phase.reason}")
                          if two_phase.feasible else
                          infeasible(Strategy.SHRINK, two_phase.reason))
    return tuple(candidates)


def _with_term(candidate: Candidate, name: str, value: float) -> Candidate:
    if not candidate.feasible or name not in candidate.terms:
        return candidate
    terms = dict(candidate.terms)
    terms[name] = value
    return replace(candidate, terms=terms, transition_s=sum(terms.values()))


def _without_search(candidate: Candidate) -> Candidate:
    """``candidate`` with no plan-search term."""
    if not candidate.feasible or "search_s" not in candidate.terms:
        return candidate
    terms = {k: v for k, v in candidate.terms.items() if k != "search_s"}
    return replace(candidate, terms=terms, transition_s=math.fsum(terms.values()))


def _priced_only(candidate: Candidate) -> Candidate:
    """``candidate`` without its plans, estimate and migration (prices and reason kept)."""
    return replace(candidate, plan=None, estimate=None, migration=None, interim_plan=None)


def _reloads_lose(candidates: tuple[Candidate, ...],
                  lost: dict[CheckpointSource, float | None]) -> tuple[Candidate, ...]:
    """A reload loses exactly the work since the checkpoint it reads, where the caller
    knows it (``lost[source]`` not None); other candidates are unchanged."""
    return tuple(_with_lost(c, lost[c.rollback])
                 if c.rollback is not None and c.feasible else c for c in candidates)


def _with_lost(candidate: Candidate, lost_s: float | None) -> Candidate:
    """A reload's candidate with its ``lost_s`` term set to ``lost_s`` (unchanged when
    ``None``: the default, half an interval)."""
    if lost_s is None:
        return candidate
    terms = dict(candidate.terms)
    terms["lost_s"] = float(lost_s)
    return replace(candidate, terms=terms, transition_s=sum(terms.values()))
