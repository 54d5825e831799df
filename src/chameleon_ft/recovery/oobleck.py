"""Oobleck (Jang et al., SOSP 2023) as published: templates, its re-instantiation rules and a
stop-the-world reconfiguration.

Our worker is Oobleck's node (a tensor-parallel group; Oobleck's agents can stand for
parts of a physical node, and its Rust planner puts one stage per node). Sources: the
SOSP-era engine (``ReconfigurationEngine.on_reconfigure``, ``_merge_pipelines``,
``_copy_model_states``) and the artifact's simulator; docs/design.md section 2 says
where our reading had to choose.

- **Templates**, computed once per job: one layout per pipeline length ``n`` from ``n0``
  (the shortest pipeline that fits memory) to ``N - f * n0`` (capped at the layers),
  ``N`` the job's workers: the job's min-max template of ``n`` stages
  (``Templates.layout``), one stage per worker. The layout does not depend on the
  micro-batch count.
- **Re-instantiation** (:func:`reinstantiate`): the lost workers leave their pipelines;
  a pipeline left with at least ``n0`` workers keeps them (*simple*); a smaller one takes
  the last worker of the largest pipeline that has more than ``n0`` (ties: the later one)
  until it has ``n0`` (*borrow*); when no pipeline can lend, the undersized lists are
  concatenated in order until each has ``n0`` and a last undersized one joins the first
  ordinary pipeline (*merge*). Lists are sorted, pipelines ordered by (size, first
  worker); each becomes an instance of the template of its size, stage ``i`` on its
  ``i``-th worker.
- **f + 1 replicas**: a reconfiguration that would leave fewer than ``f + 1`` pipelines,
  or a pipeline with no template, is not an Oobleck recovery (the caller restarts from the
  checkpoint).
- **Start**: the job's pipelines (its lengths, splits and micro-batches) on consecutive
  workers, as Oobleck's instantiation assigns ranks (:func:`instantiate`).
- **Batch**: the global batch's micro-batches are split over the instances to minimise
  the slowest one (the 2024 planner's minimax).
- **Returned workers** wait: they join at the next reconfiguration, entering the rules as
  new pipelines of the job's length (the remainder as a smaller one).
- **Transition**: stop-the-world. Detection; the world group and every group re-created
  (one data-parallel group per layer); every layer of every worker re-instantiated;
  each missing layer's parameters copied from its first surviving replica (the optimizer
  is re-created, not moved); a warm-up step; the step in flight is lost.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from chameleon_ft.plan import ExecutionPlan, Pipeline
from chameleon_ft.plan.pipeline import pipeline_on
from chameleon_ft.recovery.allocation import allocate
from chameleon_ft.recovery.restorer import schedule_migration
from chameleon_ft.recovery.templates import Layout, Templates
from chameleon_ft.recovery.transition import lost_step_s, migration_s, rebuild_terms
from chameleon_ft.recovery.types import (
    Candidate,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)

SIMPLE, BORROW, MERGE = "simple", "borrow", "merge"
"""Oobleck's re-instantiation rules, in the order they are tried."""


@dataclass(frozen=True)
class Reinstantiation:
    """The rank lists after a reconfiguration and the strongest rule it needed."""

    ranks: tuple[tuple[int, ...], ...]
    """Workers of each new pipeline, sorted; pipelines ordered by (size, first worker)."""
    rule: str
    """``simple``, ``borrow`` or ``merge``."""


def reinstantiate(pipelines: Sequence[Sequence[int]], lost: Collection[int],
                  min_ranks: int) -> Reinstantiation:
    """Oobleck's rank re-assignment after losing ``lost`` workers.

    Args:
        pipelines: each pipeline's workers, in pipeline order (a pipeline's list is kept in
            its order; its last worker is the one it lends).
        lost: the workers that are gone.
        min_ranks: the smallest template's size (``n0``).

    Returns:
        The new rank lists and the rule that produced them.

    Raises:
        ValueError: when too few workers are left to form one pipeline of ``min_ranks``.
    """
    if min_ranks < 1:
        raise ValueError(f"min_ranks: must be >= 1, got {min_ranks}")
    gone = set(lost)
    lists = [[w for w in ranks if w not in gone] for ranks in pipelines]
    rule = SIMPLE
    need_merge = False
    new: list[list[int]] = []
    for ranks in lists:
        if not ranks:
            continue  # every worker of this pipeline is gone
        while len(ranks) < min_ranks:
            donor = _largest_lender(lists, min_ranks)
            if donor is None:
                need_merge = True
                break
            rule = BORROW
            while len(donor) > min_ranks and len(ranks) < min_ranks:
                ranks.append(donor.pop())
        new.append(ranks)
    if need_merge:
        rule = MERGE
        new = _merge(new, min_ranks)
    out = sorted((tuple(sorted(r)) for r in new if r), key=lambda r: (len(r), r[0]))
    return Reinstantiation(ranks=tuple(out), rule=rule)


def _largest_lender(lists: list[list[int]], min_ranks: int) -> list[int] | None:
    """The largest list (ties: the later one) if it can lend a worker."""
    biggest: list[int] | None = None
    for ranks in lists:
        if biggest is None or len(ranks) >= len(biggest):
            biggest = ranks
    if biggest is not None and len(biggest) > min_ranks:
        return biggest
    return None


def _merge(lists: list[list[int]], min_ranks: int) -> list[list[int]]:
    """Concatenate undersized lists in order until each has ``min_ranks``; a last
    undersized one joins the first ordinary list.

    Raises:
        ValueError: when the workers cannot make one list of ``min_ranks``.
    """
    small = [r for r in lists if len(r) < min_ranks]
    results = [r for r in lists if len(r) >= min_ranks]
    while small:
        ranks = small.pop(0)
        while len(ranks) < min_ranks and small:
            ranks.extend(small.pop(0))
        if len(ranks) < min_ranks:
            if not results:
                raise ValueError(f"reinstantiate: {len(ranks)} worker(s) left, a pipeline "
                                 f"needs {min_ranks}")
            ranks.extend(results.pop(0))
        results.append(ranks)
    return results


@dataclass(frozen=True)
class OobleckSpec:
    """Oobleck's settings for one job."""

    fault_threshold: int
    """``f``: Oobleck keeps at least ``f + 1`` pipelines."""
    min_length: int
    """``n0``: the shortest pipeline that fits memory."""
    max_length: int
    """The longest template: ``N - f * n0``, capped at the layers."""
    job_length: int
    """The job's pipeline length (returned workers join in pipelines of it)."""


def oobleck_spec(templates: Templates, *, num_workers: int, job_length: int,
                 fault_threshold: int) -> OobleckSpec:
    """Oobleck's template range for a job.

    Args:
        templates: the job's templates (memory-checked).
        num_workers: workers of the job.
        job_length: the job's pipeline length.
        fault_threshold: ``f``.

    Returns:
        The settings.

    Raises:
        ValueError: when no pipeline fits memory or ``f`` is negative.
    """
    if fault_threshold < 0:
        raise ValueError(f"fault_threshold: must be >= 0, got {fault_threshold}")
    limit = min(num_workers, templates.num_layers)
    n0 = next((n for n in range(1, limit + 1) if templates.layout(n) is not None), None)
    if n0 is None:
        raise ValueError("oobleck: no pipeline of the job fits device memory")
    top = max(n0, min(templates.num_layers, num_workers - fault_threshold * n0))
    return OobleckSpec(fault_threshold=fault_threshold, min_length=n0, max_length=top,
                       job_length=job_length)


def instantiate(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan``'s pipelines as Oobleck instantiates them: the same lengths, layer splits and
    micro-batches, each pipeline on consecutive workers (Oobleck's rank grid gives
    pipeline ``i`` the next ``n`` ranks, stage ``j`` its ``j``-th).

    Args:
        plan: a plan without reroutes (the job's failure-free plan).

    Returns:
        The plan with its workers reassigned.
    """
    workers = iter(sorted(plan.workers))
    pipelines = tuple(pipe.on_workers(next(workers) for _ in pipe.stages)
                      for pipe in plan.pipelines)
    out = replace(plan, pipelines=pipelines, reroutes=())
    out.validate()
    return out


def _pipeline_ranks(plan: ExecutionPlan) -> list[list[int]]:
    """Each pipeline's workers in stage order (dead ones included: they are removed)."""
    return [[st.worker for st in pipe.stages] for pipe in plan.pipelines]


def _instances(plan: ExecutionPlan, ranks: Sequence[tuple[int, ...]],
               layouts: Sequence[Layout], counts: Sequence[int]) -> tuple[Pipeline, ...]:
    """The template instances on ``ranks``, ``counts`` micro-batches each: a pipeline of
    ``plan`` with the same workers, layout and micro-batches is taken as it is (most
    pipelines outlive a reconfiguration), so the new plan shares its tables and the
    estimator's per-pipeline memo (a pipeline equal to a new one is the same value)."""
    kept = {(pipe.workers, pipe.num_microbatches): pipe for pipe in plan.pipelines}
    out = []
    for row, layout, m in zip(ranks, layouts, counts, strict=True):
        pipe = kept.get((row, m))
        if pipe is None or pipe.layout != layout:
            pipe = pipeline_on(layout, m, row)
        out.append(pipe)
    return tuple(out)


def reconfigure(state: RecoveryState, failed: Collection[int], spec: OobleckSpec) -> Candidate:
    """Oobleck's reconfiguration of ``state.plan`` after ``failed`` workers died; workers
    alive but idle (returned since the last reconfiguration) join.

    Args:
        state: the job, the plan that ran and every live worker (idle ones included).
        failed: the workers that just died.
        spec: the template range and ``f``.

    Returns:
        The candidate (strategy ``dynamic``, the rule in ``extra``), infeasible when
        Oobleck cannot recover (fewer than ``f + 1`` pipelines, a size without a
        template, a layer without a live replica, or memory).
    """
    plan = state.plan
    lists, waiting = _node_lists(state, spec)
    lost = (set(plan.workers) - set(state.alive)) | set(failed) | plan.dead_workers
    missing = state.missing_layers()
    if missing:
        return infeasible(Strategy.DYNAMIC, f"oobleck: layer {missing[0]} has no live replica")
    try:
        result = reinstantiate(lists, lost, spec.min_length)
    except ValueError as exc:
        return infeasible(Strategy.DYNAMIC, f"oobleck: {exc}")
    sizes = [len(r) for r in result.ranks]
    layouts = _template_layouts(sizes, spec, state.templates)
    if isinstance(layouts, str):
        return infeasible(Strategy.DYNAMIC, layouts)
    _, counts = allocate(layouts, plan.num_microbatches, state.templates.step_s)
    if not counts or min(counts) < 1:
        return infeasible(Strategy.DYNAMIC, "oobleck: the global batch does not cover every "
                                            "pipeline")
    pipelines = _instances(plan, result.ranks, layouts, counts)
    new_plan = ExecutionPlan(num_layers=plan.num_layers, pipelines=pipelines,
                             micro_batch=plan.micro_batch, schedule=plan.schedule)
    new_plan.validate()
    return _priced(state, new_plan, result, sizes, len(waiting))


def _node_lists(state: RecoveryState, spec: OobleckSpec) -> tuple[list[list[int]], list[int]]:
    """Each pipeline's workers in stage order, then the waiting workers (alive, idle) in
    lists of the job's pipeline length, as Oobleck re-assigns them; and the waiting
    workers (no more than the job's layout has room for when it has warm spares)."""
    plan = state.plan
    lists = _pipeline_ranks(plan)
    waiting = sorted(set(state.alive) - set(plan.workers) - plan.dead_workers)
    if state.max_workers is not None:
        # warm spares replace lost workers: no more workers than the job's layout has
        room = state.max_workers - len(set(plan.workers) & state.alive)
        waiting = waiting[:max(0, room)]
    step = spec.job_length
    for start in range(0, len(waiting), step):
        lists.append(waiting[start:start + step])
    return lists, waiting


def _template_layouts(sizes: list[int], spec: OobleckSpec,
                      templates: Templates) -> list[Layout] | str:
    """The template layout of each pipeline size, or why Oobleck cannot run them (fewer
    than ``f + 1`` pipelines, a size without a template, a template that does not fit
    memory)."""
    if len(sizes) < spec.fault_threshold + 1:
        return (f"oobleck: {len(sizes)} pipeline(s) left, f + 1 = "
                f"{spec.fault_threshold + 1} needed")
    too_long = [n for n in sizes if n > spec.max_length]
    if too_long:
        return (f"oobleck: no template of {too_long[0]} nodes "
                f"(templates {spec.min_length}..{spec.max_length})")
    layouts: list[Layout] = []
    for n in sizes:
        layout = templates.layout(n)
        if layout is None:
            return f"oobleck: the {n}-node template does not fit memory"
        layouts.append(layout)
    return layouts


def _priced(state: RecoveryState, new_plan: ExecutionPlan, result: Reinstantiation,
            sizes: list[int], num_joined: int) -> Candidate:
    """The reconfiguration's candidate: ``new_plan`` estimated, its parameters copied from
    first replicas, stop-the-world terms (every layer rebuilt)."""
    plan = state.plan
    est = state.estimate(new_plan)
    recovery = state.config.recovery
    held = state.held_layers()
    migration = schedule_migration(new_plan, held, state.profile, state.topology,
                                   first_source=True, parameters_only=True)
    terms = {"detect_s": recovery.detect_s}
    terms.update(rebuild_terms(recovery, old=None, new=new_plan, held=held,
                               profile=state.profile, tp=state.config.job.tp,
                               new_step_s=est.step_s, everything=True, per_layer=True))
    terms["migrate_s"] = migration_s(migration.time_s, recovery)
    terms["lost_step_s"] = lost_step_s(state.estimate(plan).step_s)
    shape = "+".join(f"{sizes.count(n)}x{n}" for n in sorted(set(sizes), reverse=True))
    return candidate_from_estimate(
        Strategy.DYNAMIC, new_plan, est, terms,
        f"oobleck {result.rule}: {shape} stages; copies "
        f"{migration.moved_bytes / 2**30:.2f} GiB of parameters from first replicas",
        migration=migration,
        extra={"rule": result.rule, "pipeline_lengths": sizes,
               "joined_workers": num_joined})
