"""``reroute``: keep every layout; peers holding a dead stage's layers run its micro-batches.

Works from the CURRENT plan, which may already be rerouted or heterogeneous: every stage
whose worker is dead (newly, or rerouted before) has its micro-batches spread over the
live stages of other pipelines that hold exactly the same layer range. Micro-batches are
handed out one at a time to the peer with the least work so far (its own pipeline's
micro-batches plus those already rerouted to it), so peers shared by two dead stages are
not overloaded. When that does not fit device memory, a second spread gives micro-batches
to peers in proportion to the memory the current plan leaves them free. Infeasible, with
the reason, when some dead stage has no such peer or the peers run out of memory.
"""

from __future__ import annotations

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
    return {st.worker for _, _, st in state.plan.iter_stages()} - set(state.alive)


def _spread(state: RecoveryState, headroom: dict[int, float] | None) -> ExecutionPlan | str:
    """The rerouted plan, or the reason there is none."""
    try:
        return reroute_plan(state.plan, dead_workers(state), headroom)
    except ValueError as exc:
        return str(exc).removeprefix("reroute: ")


def candidates(state: RecoveryState, failed: frozenset[int]) -> list[Candidate]:
    """The rerouted plan, or why there is none.

    Args:
        state: the job and the current plan; ``state.alive`` excludes ``failed``.
        failed: the newly failed workers.

    Returns:
        One candidate (feasible or not).
    """
    plan = state.plan
    dead = dead_stages(state)
    spread = _spread(state, None)
    if isinstance(spread, str):
        return [infeasible(Strategy.REROUTE, spread)]
    new_plan = spread
    est = state.estimate(new_plan)
    how = "to same-stage peers"
    if not est.memory_fits:
        # Second attempt: weight the peers by the memory the current plan leaves them.
        capacity = state.topology.memory_capacity_bytes
        before = state.estimate(plan).peak_memory_bytes
        headroom = {w: capacity - peak for w, peak in before.items()}
        second = _spread(state, headroom)
        if not isinstance(second, str):
            second_est = state.estimate(second)
            if second_est.memory_fits:
                new_plan, est = second, second_est
                how = "to same-stage peers by free memory"
    newly = sorted((p, s) for p, s in dead if (p, s) not in plan.reroute_map)
    what = ", ".join(f"p{p}s{s}" for p, s in newly) or "nothing new"
    return [candidate_from_estimate(Strategy.REROUTE, new_plan, est,
                                    recovery_terms(state, new_plan, est.step_s),
                                    f"reroute {what} {how} "
                                    f"({len(new_plan.reroutes)} stage(s) rerouted in all)")]
