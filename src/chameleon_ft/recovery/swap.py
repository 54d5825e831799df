"""``swap``: idle workers (warm spares) take the failed workers' places in the same plan.

The plan keeps its pipelines, stages, layer ranges and micro-batches; every stage whose
worker is dead (newly failed, or rerouted before) gets an idle live worker instead: one of
the spare nodes' workers (``[cluster] spare_nodes``), a repaired worker the policy kept
idle, or a survivor an earlier recovery left idle. Its reroutes go away. What the
newcomers lack moves as in a dynamic recovery (TrainMover's and DeadPool's standby
machines, ByteRobust's warm standby):

- every layer of the slot has a live replica: the spare copies the slot's layers
  (parameters and optimizer state) from same-stage replicas
  (:func:`~chameleon_ft.recovery.restorer.schedule_migration`), priced by the same terms
  as every candidate (``transition.recovery_terms``: detection, the groups that change,
  the spare's layer builds and a warm-up step, the step in flight; ``migrate_s``);
- some layer lost every replica (a stage wiped): every worker reloads the last
  checkpoint on the same plan, the spare in the slot (:func:`~chameleon_ft.recovery.
  transition.reload_terms`: ``load_s`` from storage or from memory, ``lost_s`` the work
  since it). The survivors' processes and the warm spares keep running, so no job
  restart (``restart_s``) is paid; only jobs launched with spare nodes price it, since
  the runtime must reload in place on a plan that names a spare.

Which idle worker takes which slot: a returned worker takes back its own rerouted slot;
the other slots, ordered by the node they were on, take idle workers from the nodes with
the most idle workers first (a whole failed node's slots land on one whole spare node, so
the workers that shared a node still do), in id order. Infeasible when fewer workers are
idle than stages are dead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence

from chameleon_ft.perf.network import Topology
from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.recovery.restorer import schedule_migration
from chameleon_ft.recovery.transition import (
    migration_s,
    rebuild_terms,
    recovery_terms,
    reload_terms,
)
from chameleon_ft.recovery.types import (
    Candidate,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)


def dead_slots(plan: ExecutionPlan, alive: Collection[int]) -> list[tuple[int, int]]:
    """``(pipeline, stage)`` of every stage of ``plan`` that needs a worker: its worker is
    not in ``alive``, or the stage is rerouted (its worker died before)."""
    rerouted = plan.reroute_map
    with_reroutes = {p for p, _ in rerouted}
    out: list[tuple[int, int]] = []
    for p, workers in enumerate(plan.worker_rows()):
        if p in with_reroutes or not all(map(alive.__contains__, workers)):
            out.extend((p, s) for s, w in enumerate(workers)
                       if (p, s) in rerouted or w not in alive)
    return out


def assign_spares(plan: ExecutionPlan, slots: Sequence[tuple[int, int]],
                  idle: Sequence[int], topology: Topology
                  ) -> dict[tuple[int, int], int] | None:
    """The idle worker that takes each slot (module docstring), or ``None`` when too few
    are idle.

    Args:
        plan: the current plan.
        slots: the slots to fill (:func:`dead_slots`).
        idle: live workers ``plan`` does not run.
        topology: which node each worker is on.

    Returns:
        ``(pipeline, stage) -> worker``.
    """
    if len(idle) < len(slots):
        return None
    node_of = topology.node_of
    free = set(idle)
    out: dict[tuple[int, int], int] = {}
    rest = []
    for p, s in slots:
        own = plan.pipelines[p].stages[s].worker
        if own in free:  # a returned worker takes its own stage back
            out[(p, s)] = own
            free.discard(own)
        else:
            rest.append((p, s))
    per_node: dict[int, int] = defaultdict(int)
    for w in free:
        per_node[node_of(w)] += 1
    spares = sorted(free, key=lambda w: (-per_node[node_of(w)], node_of(w), w))
    rest.sort(key=lambda ps: (node_of(plan.pipelines[ps[0]].stages[ps[1]].worker),
                              plan.pipelines[ps[0]].stages[ps[1]].worker))
    for slot, worker in zip(rest, spares, strict=False):
        out[slot] = worker
    return out


def swap_plan(plan: ExecutionPlan, alive: Collection[int],
              topology: Topology) -> ExecutionPlan | None:
    """``plan`` with idle workers of ``alive`` in the places of its dead stages (module
    docstring), or ``None`` when too few are idle (what ``chameleon estimate`` shows)."""
    slots = dead_slots(plan, alive)
    used = plan.stage_of_worker
    assignment = assign_spares(plan, slots, sorted(w for w in alive if w not in used),
                               topology)
    return None if assignment is None else swapped_plan(plan, assignment)


def swapped_plan(plan: ExecutionPlan, assignment: dict[tuple[int, int], int]) -> ExecutionPlan:
    """``plan`` with each assigned slot run by its new worker and no reroutes (pipelines
    without a new worker are the very same objects)."""
    by_pipeline: dict[int, dict[int, int]] = defaultdict(dict)
    for (p, s), worker in assignment.items():
        by_pipeline[p][s] = worker
    pipelines = list(plan.pipelines)
    for p, changes in by_pipeline.items():
        pipe = pipelines[p]
        pipelines[p] = Pipeline(tuple(Stage(changes[s], st.first_layer, st.end_layer)
                                      if s in changes else st
                                      for s, st in enumerate(pipe.stages)),
                                pipe.num_microbatches)
    return ExecutionPlan(num_layers=plan.num_layers, pipelines=tuple(pipelines),
                         micro_batch=plan.micro_batch, schedule=plan.schedule)


def candidates(state: RecoveryState, failed: frozenset[int]) -> list[Candidate]:
    """The swapped plan, priced, or why there is none.

    Args:
        state: the job and the current plan; ``state.alive`` excludes ``failed`` and
            includes the idle workers (the spares).
        failed: the newly failed workers.

    Returns:
        One candidate (feasible or not).
    """
    slots = dead_slots(state.plan, state.alive)
    if not slots:
        return [infeasible(Strategy.SWAP, "no stage lost its worker")]
    assignment = assign_spares(state.plan, slots, state.idle_workers(), state.topology)
    if assignment is None:
        return [infeasible(Strategy.SWAP, f"{len(slots)} stage(s) lost their worker, "
                                          f"{len(state.idle_workers())} worker(s) idle")]
    new_plan = swapped_plan(state.plan, assignment)
    new_plan.validate()
    est = state.estimate(new_plan)
    spec = state.config.recovery
    what = f"{len(slots)} idle worker(s) take the dead stages' places"
    missing = state.missing_layers()
    if missing:
        if not spec.checkpoint:
            return [infeasible(Strategy.SWAP, f"layer {missing[0]} has no live replica and "
                                              "recovery.checkpoint is false")]
        if state.config.cluster.spare_nodes == 0:
            return [infeasible(Strategy.SWAP, f"layer {missing[0]} has no live replica: a "
                                              "swap from the checkpoint needs warm spares "
                                              "(cluster.spare_nodes)")]
        terms = {"detect_s": spec.detect_s}
        terms.update(rebuild_terms(spec, old=state.plan, new=new_plan,
                                   held=state.held_layers(), profile=state.profile,
                                   tp=state.config.job.tp, new_step_s=est.step_s))
        reload, source = reload_terms(state, new_plan)
        terms.update(reload)
        return [candidate_from_estimate(
            Strategy.SWAP, new_plan, est, terms,
            f"{what}; layer {missing[0]} lost every replica: every worker reloads the "
            f"checkpoint from {source}", rollback=source,
            extra={"swapped": len(slots)})]
    held = state.held_layers()
    migration = schedule_migration(new_plan, held, state.profile, state.topology,
                                   max_parts=spec.migration_max_parts)
    terms = recovery_terms(state, new_plan, est.step_s)
    terms["migrate_s"] = migration_s(migration.time_s, spec)
    return [candidate_from_estimate(
        Strategy.SWAP, new_plan, est, terms,
        f"{what}, copying {migration.moved_bytes / 2**30:.2f} GiB from same-stage replicas "
        f"in {len(migration.rounds)} round(s)", migration=migration,
        extra={"swapped": len(slots)})]
