"""``shrink``: drop every pipeline that lost a worker; the rest take the whole global batch.

What per-replica fault tolerance (TorchFT) does. Survivors of dropped pipelines idle. The
global batch is kept: micro-batches are re-split over the remaining pipelines to
minimise the slowest one (``templates.allocate``). No state moves.
"""

from __future__ import annotations

from chameleon_ft.plan import ExecutionPlan, Pipeline
from chameleon_ft.recovery.reroute import dead_stages
from chameleon_ft.recovery.templates import allocate
from chameleon_ft.recovery.transition import shrink_terms
from chameleon_ft.recovery.types import (
    Candidate,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)


def candidates(state: RecoveryState, failed: frozenset[int]) -> list[Candidate]:
    """The shrunk plan, or why there is none.

    Args:
        state: the job and the current plan; ``state.alive`` excludes ``failed``.
        failed: the newly failed workers.

    Returns:
        One candidate (feasible or not).
    """
    plan = state.plan
    damaged = {p for p, _ in dead_stages(state)}
    kept = [pipe for p, pipe in enumerate(plan.pipelines) if p not in damaged]
    if not kept:
        return [infeasible(Strategy.SHRINK, "every pipeline lost a worker")]
    layouts = [pipe.layout for pipe in kept]
    _, counts = allocate(layouts, plan.num_microbatches, state.templates.step_s)
    if not counts:
        return [infeasible(Strategy.SHRINK,
                           f"the {len(kept)} remaining pipeline(s) cannot hold "
                           f"{plan.num_microbatches} micro-batches within device memory")]
    new_plan = ExecutionPlan(
        num_layers=plan.num_layers,
        pipelines=tuple(Pipeline(pipe.stages, m) for pipe, m in zip(kept, counts, strict=True)),
        micro_batch=plan.micro_batch, schedule=plan.schedule)
    new_plan.validate()
    est = state.estimate(new_plan)
    return [candidate_from_estimate(
        Strategy.SHRINK, new_plan, est, shrink_terms(state.config.recovery),
        f"drop {len(damaged)} damaged pipeline(s), keep {len(kept)}")]
