"""``reroute``: keep every layout; peers holding a dead stage's layers run its micro-batches.

Works from the CURRENT plan, which may already be rerouted or heterogeneous: every stage
whose worker is dead (newly, or rerouted before) has its micro-batches spread over the
live stages of other pipelines that hold exactly the same layer range. Micro-batches are
handed out one at a time to the peer with the least work so far (its own pipeline's
micro-batches plus those already rerouted to it), so peers shared by two dead stages are
not overloaded. When that does not fit device memory, a second spread gives micro-batches
to peers in proportion to the memory the current plan leaves them free. Infeasible, with
the reason, when some dead stage has no such peer or the peers run out of memory.

``recycle`` is the same rerouting with ReCycle's decoupled backward: the peers split their
backward into input-gradient and weight-gradient operations and defer the weight
gradients into their idle time (``ExecutionPlan.defer_weight_grad``), when the job's
system can (``recovery.decoupled_backward``). Deferred weight gradients keep their
activations until they run; when that does not fit device memory, the peers run fused
backwards (ReCycle defers only what memory allows; here it is all or nothing).
"""

from __future__ import annotations

from dataclasses import replace

from chameleon_ft.perf import Estimate
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.reroute import dead_stages as plan_dead_stages
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.recovery.transition import recovery_terms
from chameleon_ft.recovery.types import (
    Candidate,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)


def dead_stages(state: RecoveryState) -> list[tuple[int, int]]:
    """``(pipeline, stage)`` of every stage of the current plan whose worker is not alive."""
    return plan_dead_stages(state.plan, dead_workers(state))


def dead_workers(state: RecoveryState) -> set[int]:
    """Workers named by the current plan's stages that are not alive (old and new dead)."""
    return set(state.named_dead())


def _spread(state: RecoveryState, headroom: dict[int, float] | None,
            defer: bool) -> ExecutionPlan | str:
    """The rerouted plan (peers deferring weight gradients when ``defer``), or the reason
    there is none."""
    try:
        plan = reroute_plan(state.plan, dead_workers(state), headroom)
    except ValueError as exc:
        return str(exc).removeprefix("reroute: ")
    # A plan without reroutes runs 1F1B either way: one form keeps caches shared.
    defer = defer and bool(plan.reroutes)
    return plan if plan.defer_weight_grad == defer else replace(plan, defer_weight_grad=defer)


def rerouted_plan(state: RecoveryState, *, defer: bool = False
                  ) -> tuple[ExecutionPlan, Estimate, str] | str:
    """The rerouted plan of ``state`` that fits memory, its estimate and how it spreads
    the work; or why there is none.

    Args:
        state: the job and the current plan; ``state.alive`` excludes the dead workers.
        defer: try the peers deferring their weight gradients first (ReCycle).

    Returns:
        ``(plan, estimate, how)``, or the reason rerouting is infeasible. When nothing fits
        memory, the first spread tried is returned (the caller reports it as over memory).
    """
    first: tuple[ExecutionPlan, Estimate, str] | None = None
    headroom: dict[int, float] | None = None
    for deferring in ([True, False] if defer else [False]):
        spread = _spread(state, None, deferring)
        if isinstance(spread, str):
            return spread
        if deferring and not spread.defer_weight_grad:
            continue  # nothing rerouted: nothing to defer
        suffix = ", weight gradients deferred" if deferring else ""
        est = state.estimate(spread)
        if first is None:
            first = (spread, est, "to same-stage peers" + suffix)
        if est.memory_fits:
            return spread, est, "to same-stage peers" + suffix
        # Second attempt: weight the peers by the memory the current plan leaves them.
        if headroom is None:
            capacity = state.topology.memory_capacity_bytes
            before = state.estimate(state.plan).peak_memory_bytes
            headroom = {w: capacity - peak for w, peak in before.items()}
        second = _spread(state, headroom, deferring)
        if not isinstance(second, str):
            second_est = state.estimate(second)
            if second_est.memory_fits:
                return second, second_est, "to same-stage peers by free memory" + suffix
    assert first is not None
    return first


def candidates(state: RecoveryState, failed: frozenset[int], *,
               decoupled: bool = False) -> list[Candidate]:
    """The rerouted plan, or why there is none.

    Args:
        state: the job and the current plan; ``state.alive`` excludes ``failed``.
        failed: the newly failed workers.
        decoupled: ``recycle``: the peers defer their weight gradients (ReCycle's
            decoupled backward) when memory allows; infeasible unless the job's system
            can (``recovery.decoupled_backward``).

    Returns:
        One candidate (feasible or not).
    """
    strategy = Strategy.RECYCLE if decoupled else Strategy.REROUTE
    if decoupled and not state.config.recovery.decoupled_backward:
        return [infeasible(strategy, "recovery.decoupled_backward is false: the training "
                                     "system runs fused backwards")]
    plan = state.plan
    dead = dead_stages(state)
    found = rerouted_plan(state, defer=decoupled)
    if isinstance(found, str):
        return [infeasible(strategy, found)]
    new_plan, est, how = found
    newly = sorted((p, s) for p, s in dead if (p, s) not in plan.reroute_map)
    what = ", ".join(f"p{p}s{s}" for p, s in newly) or "nothing new"
    return [candidate_from_estimate(strategy, new_plan, est,
                                    recovery_terms(state, new_plan, est.step_s),
                                    f"reroute {what} {how} "
                                    f"({len(new_plan.reroutes)} stage(s) rerouted in all)")]


def recycle_candidates(state: RecoveryState, failed: frozenset[int]) -> list[Candidate]:
    """:func:`candidates` with ReCycle's decoupled backward."""
    return candidates(state, failed, decoupled=True)
