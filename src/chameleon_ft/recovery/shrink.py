"""``shrink``: drop every pipeline that lost a worker; the rest take the whole global batch.

What per-replica fault tolerance (TorchFT) does. Survivors of dropped pipelines idle. The
global batch is kept: micro-batches are re-split over the remaining pipelines to
minimise the slowest one (``templates.allocate``). No state moves. When workers come
back, :func:`grow` re-admits whole replicas made of idle workers.
"""

from __future__ import annotations

from dataclasses import replace

from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.recovery.allocation import allocate
from chameleon_ft.recovery.reroute import dead_stages
from chameleon_ft.recovery.restorer import copy_in
from chameleon_ft.recovery.transition import recovery_terms
from chameleon_ft.recovery.types import (
    Candidate,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)
from chameleon_ft.spec.job import Placement


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
        pipelines=tuple(map(Pipeline.with_microbatches, kept, counts)),
        micro_batch=plan.micro_batch, schedule=plan.schedule)
    new_plan.validate()
    est = state.estimate(new_plan)
    return [candidate_from_estimate(
        Strategy.SHRINK, new_plan, est, recovery_terms(state, new_plan, est.step_s),
        f"drop {len(damaged)} damaged pipeline(s), keep {len(kept)}")]


def grow(state: RecoveryState) -> Candidate:
    """Re-admit healed replicas, as TorchFT does: idle live workers form whole new pipelines
    with the current pipelines' layout, copy their stages' state from live replicas while
    the others train on, and join at a step boundary (the caller makes it two-phase).

    Pipelines are placed over the idle workers in id order as the job's ``placement``
    says; the global batch is re-split over all pipelines (``templates.allocate``). A
    stage the current plan reroutes stays rerouted while its worker is dead, its
    micro-batches spread again over its peers (a returned one takes its stage back).

    Args:
        state: the job and the current plan; ``state.alive`` includes the returned workers.

    Returns:
        One candidate (feasible or not), from :func:`~chameleon_ft.recovery.restorer.copy_in`.
    """
    plan = state.plan
    idle = sorted(set(state.alive) - set(plan.workers) - plan.dead_workers)
    if not plan.pipelines:
        return infeasible(Strategy.SHRINK, "no pipeline to copy a layout from")
    layout = plan.pipelines[0].layout
    length = len(layout)
    room = plan.num_microbatches - plan.num_pipelines
    count = min(len(idle) // length, room)
    if state.max_workers is not None:
        # warm spares replace lost workers; they add no replica beyond the job's layout
        count = min(count, max(0, state.max_workers - len(plan.workers)) // length)
    if count < 1:
        return infeasible(Strategy.SHRINK, f"{len(idle)} idle worker(s) make no whole "
                                           f"{length}-stage pipeline")
    stage_major = state.config.job.placement == Placement.STAGE_MAJOR
    added = [tuple(Stage(idle[s * count + k if stage_major else k * length + s], lo, hi)
                   for s, (lo, hi) in enumerate(layout))
             for k in range(count)]
    _, counts = allocate([pipe.layout for pipe in plan.pipelines] + [layout] * count,
                         plan.num_microbatches, state.templates.step_s)
    if not counts:
        return infeasible(Strategy.SHRINK, "the grown pipelines cannot hold the global batch "
                                           "within device memory")
    new_plan = ExecutionPlan(
        num_layers=plan.num_layers,
        pipelines=(*map(Pipeline.with_microbatches, plan.pipelines, counts),
                   *(Pipeline(ss, m) for ss, m in zip(added, counts[plan.num_pipelines:],
                                                      strict=True))),
        reroutes=(), micro_batch=plan.micro_batch, schedule=plan.schedule)
    still_dead = plan.dead_workers - state.alive
    if still_dead:
        try:
            rerouted = reroute_plan(new_plan, still_dead)
        except ValueError as exc:
            return infeasible(Strategy.SHRINK, str(exc).removeprefix("reroute: "))
        new_plan = replace(rerouted, defer_weight_grad=plan.defer_weight_grad)
    new_plan.validate()
    return copy_in(state, Strategy.SHRINK, new_plan,
                   f"re-admit {count} healed pipeline(s), {new_plan.num_pipelines} in all")
