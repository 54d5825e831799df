"""``restart``: reload the last checkpoint on the survivors with the best uniform layout.

Every pipeline gets the same length ``l`` (the job's template for ``l``); there are
``floor(survivors / l)`` of them (the rest idle), ``l`` within the dynamic search's length
range, and the global batch is split as evenly as
the pipelines allow. The length with the smallest estimated step wins. The only option
when some layer has no live replica; impossible without checkpoints. Workers are placed
as the job's ``placement`` says, over the survivors in id order (all state is reloaded, so
who held what before does not matter), at most the job's layout's workers (warm spares
replace lost workers, they add no pipelines). The checkpoint is read from storage, or
from other hosts' memory with ``memory_checkpoint`` when every layer kept a copy there
(``transition.reload_terms``).
"""

from __future__ import annotations

import functools

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.pipeline import pipeline_on
from chameleon_ft.recovery.allocation import allocate
from chameleon_ft.recovery.dynamic import max_length, placement_free_price
from chameleon_ft.recovery.transition import reload_terms, restart_terms
from chameleon_ft.recovery.types import (
    Candidate,
    CheckpointSource,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)
from chameleon_ft.spec.job import Placement

_FULL_ESTIMATES = 2
"""Lengths (ranked by one-pipeline estimates) priced as whole plans."""


def candidates(state: RecoveryState, failed: frozenset[int]) -> list[Candidate]:
    """The restart plan, or why there is none.

    Args:
        state: the job and the current plan; ``state.alive`` excludes ``failed``.
        failed: the newly failed workers.

    Returns:
        One candidate (feasible or not).
    """
    spec = state.config.recovery
    if not spec.checkpoint:
        return [infeasible(Strategy.RESTART, "recovery.checkpoint is false: no checkpoint to "
                                             "restart from")]
    templates = state.templates
    plan = state.plan
    workers = sorted(state.alive)
    usable = state.num_usable
    num_microbatches = plan.num_microbatches
    ranked = []
    for length in templates.feasible_lengths(max_length(state)):
        num_pipelines = min(usable // length, num_microbatches)
        step_s, counts = allocate([length] * num_pipelines, num_microbatches,
                                  templates.length_step_s)
        if counts:
            ranked.append((step_s, length, counts))
    if not ranked:
        return [infeasible(Strategy.RESTART, f"no uniform layout of the {len(workers)} "
                                             "survivors fits device memory")]
    ranked.sort(key=lambda item: (item[0], item[1]))
    shortlist = [(length, counts) for _, length, counts in ranked[:_FULL_ESTIMATES]]
    if state.topology.placement_free and len(shortlist) > 1:
        shortlist = _fastest_shape(state, workers, shortlist)
    best: Candidate | None = None
    terms = restart_terms(spec, state.since_checkpoint_s)
    source = CheckpointSource.STORAGE
    for length, counts in shortlist:
        dp = len(counts)
        new_plan = _restart_plan(state, workers, length, counts)
        est = state.estimate(new_plan)
        idle = len(workers) - dp * length
        if spec.memory_checkpoint:
            reload, source = reload_terms(state, new_plan)
            terms = {**terms, **reload}
        where = " in memory" if source == CheckpointSource.MEMORY else ""
        candidate = candidate_from_estimate(
            Strategy.RESTART, new_plan, est, terms,
            f"restart from the checkpoint{where} as {dp}x{length} stages, {idle} idle",
            extra={"pipeline_lengths": [length] * dp, "idle_workers": idle},
            rollback=source)
        if candidate.feasible and (best is None or candidate.step_s < best.step_s):
            best = candidate
    if best is None:
        return [infeasible(Strategy.RESTART, "no uniform layout of the survivors fits device "
                                             "memory")]
    return [best]


def _restart_plan(state: RecoveryState, workers: list[int], length: int,
                  counts: list[int]) -> ExecutionPlan:
    """Pipelines of ``length`` stages running ``counts`` micro-batches, each on its best
    template, the survivors ``workers`` (in id order) placed as the job's placement says."""
    templates, plan = state.templates, state.plan
    dp = len(counts)
    stage_major = state.config.job.placement == Placement.STAGE_MAJOR
    pipelines = []
    for p, m in enumerate(counts):
        _, layout = templates.best(length, m)
        assert layout is not None  # allocate only returns counts that fit
        row = (workers[p:p + length * dp:dp] if stage_major
               else workers[p * length:(p + 1) * length])
        pipelines.append(pipeline_on(layout, m, row))
    new_plan = ExecutionPlan(num_layers=plan.num_layers, pipelines=tuple(pipelines),
                             micro_batch=plan.micro_batch, schedule=plan.schedule)
    new_plan.validate()
    return new_plan


def _fastest_shape(state: RecoveryState, workers: list[int],
                   shortlist: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The shortlisted layout that the pricing loop of :func:`candidates` would keep (the
    first that fits memory with the smallest step), found from shape prices alone: on a
    placement-free topology a restart plan's step and memory verdict depend on its
    pipelines' lengths and micro-batches, not on who fills them
    (:func:`~chameleon_ft.recovery.dynamic.placement_free_price`), so only the kept
    layout is built as a plan. Empty when none fits."""
    kept: list[tuple[int, list[int]]] = []
    best_s = 0.0
    for length, counts in shortlist:
        step_s, fits = placement_free_price(
            state, [length] * len(counts), counts, None,
            functools.partial(_restart_plan, state, workers, length, counts))
        if fits and (not kept or step_s < best_s):
            kept, best_s = [(length, counts)], step_s
    return kept
