"""A plan's invariants, checked (:meth:`ExecutionPlan.validate
<chameleon_ft.plan.plan.ExecutionPlan.validate>`): every pipeline sound (micro-batches,
contiguous non-empty stages covering every layer), no worker used twice, every reroute's
peers live, elsewhere, on the dead stage's layers and sharing exactly its micro-batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleon_ft.plan.pipeline import _MICROBATCHES_OF, _ROW_END, _ROW_WORKERS
from chameleon_ft.spec.job import Schedule

if TYPE_CHECKING:
    from chameleon_ft.plan.plan import ExecutionPlan, Reroute

_SCHEDULE_CODES = {s.value: i for i, s in enumerate(Schedule)}


def validate_plan(plan: ExecutionPlan, num_microbatches: int | None = None) -> None:
    """Check the plan's invariants.

    Args:
        plan: the plan.
        num_microbatches: when given, the micro-batches of all pipelines must sum to it
            (the global batch is kept through every recovery).

    Raises:
        ValueError: saying which pipeline, stage, worker or reroute is wrong.
    """
    if plan.num_layers < 1:
        raise ValueError(f"plan.num_layers: must be >= 1, got {plan.num_layers}")
    if not plan.pipelines:
        raise ValueError("plan.pipelines: a plan needs at least one pipeline")
    if plan.micro_batch < 1:
        raise ValueError(f"plan.micro_batch: must be >= 1, got {plan.micro_batch}")
    if plan.schedule not in _SCHEDULE_CODES:
        raise ValueError(f"plan.schedule: unknown schedule {plan.schedule!r}; choose one "
                         f"of {', '.join(_SCHEDULE_CODES)}")
    rerouted = set()
    for r in plan.reroutes:
        key = (r.pipeline, r.stage)
        if key in rerouted:
            raise ValueError(f"plan.reroutes: pipeline {r.pipeline} stage {r.stage} is "
                             "rerouted twice")
        rerouted.add(key)
    seen = _live_positions(plan, rerouted)
    sound = seen is not None
    if seen is None:
        seen = _checked_stages(plan, rerouted)
    for r in plan.reroutes:
        _validate_reroute(plan, r, seen, rerouted)
    if num_microbatches is not None and plan.num_microbatches != num_microbatches:
        raise ValueError(f"plan: pipelines run {plan.num_microbatches} micro-batches per "
                         f"step, the global batch needs {num_microbatches}")
    if sound:
        # the very table stage_of_worker builds (same pairs, same order): keep it
        plan.__dict__.setdefault("stage_of_worker", seen)


def _live_positions(plan: ExecutionPlan, rerouted: set[tuple[int, int]]
                    ) -> dict[int, tuple[int, int]] | None:
    """``worker -> (pipeline, stage)`` of every live stage when every pipeline is sound
    (micro-batches, contiguous non-empty stages covering every layer, no worker used
    twice), checked from the pipelines' shared tables at C speed; ``None`` when some
    check fails (:func:`_checked_stages` then says which)."""
    tables = plan._tables()
    if (min(map(_MICROBATCHES_OF, plan.pipelines)) < 1
            or set(map(_ROW_END, tables)) != {plan.num_layers}):
        return None
    # the positions of the live stages (validate's rerouted stages are the plan's),
    # from the plan's own table when it was read already
    seen = plan.__dict__.get("stage_of_worker") or plan._live_positions_of(tables)
    live = sum(map(len, map(_ROW_WORKERS, tables))) - len(rerouted)
    return seen if len(seen) == live else None  # shorter: a worker named twice


def _checked_stages(plan: ExecutionPlan, rerouted: set[tuple[int, int]]
                    ) -> dict[int, tuple[int, int]]:
    """:func:`_live_positions`, stage by stage, raising at the first fault."""
    seen: dict[int, tuple[int, int]] = {}
    for p, pipe in enumerate(plan.pipelines):
        if pipe.num_microbatches < 1:
            raise ValueError(f"plan.pipelines[{p}]: needs at least one micro-batch, "
                             f"has {pipe.num_microbatches}")
        if not pipe.stages:
            raise ValueError(f"plan.pipelines[{p}]: has no stages")
        expected = 0
        for s, st in enumerate(pipe.stages):
            if st.first_layer != expected:
                raise ValueError(
                    f"plan.pipelines[{p}].stages[{s}]: starts at layer {st.first_layer}, "
                    f"expected {expected} (layers must be contiguous, each exactly once)")
            if st.end_layer <= st.first_layer:
                raise ValueError(f"plan.pipelines[{p}].stages[{s}]: empty layer range "
                                 f"[{st.first_layer}, {st.end_layer})")
            expected = st.end_layer
            if (p, s) in rerouted:
                continue
            if st.worker in seen:
                q, t = seen[st.worker]
                raise ValueError(f"plan: worker {st.worker} is used twice (pipeline {q} "
                                 f"stage {t} and pipeline {p} stage {s})")
            seen[st.worker] = (p, s)
        if expected != plan.num_layers:
            raise ValueError(f"plan.pipelines[{p}]: covers layers 0..{expected - 1}, the "
                             f"model has {plan.num_layers}")
    return seen


def _validate_reroute(plan: ExecutionPlan, r: Reroute, live: dict[int, tuple[int, int]],
                      rerouted: set[tuple[int, int]]) -> None:
    where = f"plan.reroutes[pipeline {r.pipeline} stage {r.stage}]"
    if not 0 <= r.pipeline < len(plan.pipelines):
        raise ValueError(f"{where}: no such pipeline")
    pipe = plan.pipelines[r.pipeline]
    if not 0 <= r.stage < len(pipe.stages):
        raise ValueError(f"{where}: no such stage")
    dead = pipe.stages[r.stage]
    if not r.shares:
        raise ValueError(f"{where}: no peer workers")
    total = 0
    peers = set()
    for worker, count in r.shares:
        if count < 1:
            raise ValueError(f"{where}: peer {worker} has {count} micro-batches; list only "
                             "peers with at least one")
        if worker in peers:
            raise ValueError(f"{where}: peer {worker} listed twice")
        peers.add(worker)
        total += count
        if worker not in live:
            raise ValueError(f"{where}: peer {worker} is not a live worker of the plan")
        q, t = live[worker]
        if q == r.pipeline:
            raise ValueError(f"{where}: peer {worker} belongs to the same pipeline")
        held = plan.pipelines[q].stages[t]
        if (held.first_layer, held.end_layer) != (dead.first_layer, dead.end_layer):
            raise ValueError(
                f"{where}: peer {worker} holds layers [{held.first_layer}, {held.end_layer}), "
                f"the stage needs [{dead.first_layer}, {dead.end_layer})")
    if total != pipe.num_microbatches:
        raise ValueError(f"{where}: shares sum to {total} micro-batches, the pipeline runs "
                         f"{pipe.num_microbatches}")
    if dead.worker in live:
        raise ValueError(f"{where}: the dead worker {dead.worker} still runs another stage")
