"""Answers to a slow worker (a fail-slow): the plans that work around it, priced.

A slow worker keeps running, ``F`` times slower; every candidate is priced with the
estimator at the workers' measured speeds (``state.estimate`` is bound to them), and none
changes the samples of a step or their normalisation (the global batch stays whole):

- ``keep``: the current plan at the slow speed; no transition.
- ``rebalance`` (:func:`rebalanced_plan`): the same pipelines, stages and layers; the
  micro-batches split again so that each pipeline's step, at its workers' speeds, is as
  short as can be (the slow worker's pipeline takes fewer, the others more). Nothing
  moves; the communicators stay.
- ``dynamic`` (:func:`repartitioned_plan`): the slow worker's pipeline re-split by layers
  at its stages' speeds (the slow stage holds fewer layers), then rebalanced; layers move
  from live replicas.
- ``swap`` (:func:`swapped_out_plan`): an idle worker at full speed takes the slow
  worker's place, copying its layers (the slow worker itself is one source).

``evict`` (out of the plan as if it had died) is the failure decision's answer, built by
the planner (``policy/slow.py``). Pipelines that take part in reroutes (rerouted, or
hosting a rerouted stage's micro-batches) keep their micro-batches and layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from itertools import accumulate, pairwise

from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage, layer_costs
from chameleon_ft.plan.partition import bounds_from_cuts
from chameleon_ft.recovery.allocation import allocate
from chameleon_ft.recovery.restorer import copy_in
from chameleon_ft.recovery.swap import assign_spares, swapped_plan
from chameleon_ft.recovery.types import (
    Candidate,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)

_REL_TOL = 1e-9
"""Relative tolerance of the layer split's minimum (as ``plan/partition.py``)."""

Kind = tuple[object, ...]
"""What one pipeline's step depends on besides its micro-batches: its layout, its stages'
factors and which neighbouring stages share a node."""


def _rerouting(plan: ExecutionPlan) -> frozenset[int]:
    """Pipelines that take part in reroutes: rerouted ones and those hosting a share."""
    stage_of = plan.stage_of_worker
    return frozenset(r.pipeline for r in plan.reroutes) | frozenset(
        stage_of[peer][0] for r in plan.reroutes for peer, _ in r.shares if peer in stage_of)


def _kind(pipe: Pipeline, slow: Mapping[int, float], node_of: Callable[[int], int]) -> Kind:
    workers = pipe.workers
    return (pipe.layout, tuple(slow.get(w, 1.0) for w in workers),
            tuple(node_of(a) == node_of(b) for a, b in pairwise(workers)))


def rebalanced_plan(state: RecoveryState, slow: Mapping[int, float]) -> ExecutionPlan | str:
    """The current plan with its micro-batches split again at the workers' speeds (module
    docstring), or why it cannot be.

    Args:
        state: the current plan; ``state.estimate`` prices at the measured speeds.
        slow: worker -> slowdown factor of every slow worker.

    Returns:
        The plan (the current one when its split is already the best), or the reason.
    """
    plan = state.plan
    fixed = _rerouting(plan)
    free = [p for p in range(plan.num_pipelines) if p not in fixed]
    if not free:
        return "every pipeline takes part in reroutes"
    node_of = state.topology.node_of
    kinds = [_kind(plan.pipelines[p], slow, node_of) for p in free]
    representative = dict(zip(reversed(kinds), reversed(free), strict=True))

    def step_s(kind: Kind, m: int) -> float:
        one = ExecutionPlan(num_layers=plan.num_layers,
                            pipelines=(plan.pipelines[representative[kind]].with_microbatches(m),),
                            micro_batch=plan.micro_batch, schedule=plan.schedule)
        est = state.estimate(one)
        return est.step_s if est.memory_fits else math.inf

    total = sum(plan.pipelines[p].num_microbatches for p in free)
    slowest, counts = allocate(kinds, total, step_s)
    if not math.isfinite(slowest):
        return "no split of the micro-batches fits device memory"
    if all(plan.pipelines[p].num_microbatches == m for p, m in zip(free, counts, strict=True)):
        return plan
    pipelines = list(plan.pipelines)
    for p, m in zip(free, counts, strict=True):
        pipelines[p] = pipelines[p].with_microbatches(m)
    return _with_pipelines(plan, pipelines)


def _with_pipelines(plan: ExecutionPlan, pipelines: Sequence[Pipeline]) -> ExecutionPlan:
    new = ExecutionPlan(num_layers=plan.num_layers, pipelines=tuple(pipelines),
                        reroutes=plan.reroutes, micro_batch=plan.micro_batch,
                        schedule=plan.schedule, defer_weight_grad=plan.defer_weight_grad)
    new.validate()
    return new


def speed_bounds(costs: Sequence[float], factors: Sequence[float]) -> list[tuple[int, int]]:
    """Split layers with per-layer ``costs`` over stages whose compute takes ``factors``
    times as long, minimising the slowest stage (``factor * its layers' cost``); among the
    splits reaching it, the one with the smallest sum of squared stage times (the most
    even), as :func:`~chameleon_ft.plan.partition.balanced_bounds` does at unit speed.

    Raises:
        ValueError: when there are fewer layers than stages.
    """
    n, num_stages = len(costs), len(factors)
    if not 1 <= num_stages <= n:
        raise ValueError(f"factors: {num_stages} stages need between 1 and {n} layers")
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    limit = math.inf
    for squares in (False, True):
        best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0.0
        for k in range(1, num_stages + 1):
            factor = factors[k - 1]
            for i in range(k, n - (num_stages - k) + 1):
                for j in range(k - 1, i):
                    stage = factor * (prefix[i] - prefix[j])
                    if stage > limit or best[k - 1][j] == math.inf:
                        continue
                    value = (best[k - 1][j] + stage * stage if squares
                             else max(best[k - 1][j], stage))
                    if value < best[k][i] * (1 - _REL_TOL) - 1e-300:
                        best[k][i], cut[k][i] = value, j
        limit = best[num_stages][n] * (1 + _REL_TOL) + 1e-300
    return bounds_from_cuts(cut, n, num_stages)


def repartitioned_plan(state: RecoveryState, slow: Mapping[int, float]) -> ExecutionPlan | str:
    """The current plan with each pipeline that runs a slow worker re-split by layers at
    its stages' speeds (:func:`speed_bounds`) and each other pipeline back on the fastest
    layout of its length (``Templates.best``: a slowdown that ended), then rebalanced
    (:func:`rebalanced_plan`); or why it cannot be."""
    plan = state.plan
    costs = layer_costs(state.profile)
    fixed = _rerouting(plan)
    pipelines = list(plan.pipelines)
    for p, pipe in enumerate(plan.pipelines):
        if p in fixed:
            continue
        lo = pipe.stages[0].first_layer
        if any(w in slow for w in pipe.workers):
            bounds = [(lo + a, lo + b) for a, b in speed_bounds(
                costs[lo:pipe.stages[-1].end_layer], [slow.get(w, 1.0) for w in pipe.workers])]
        else:
            layout = state.templates.best(pipe.num_stages, pipe.num_microbatches)[1]
            if layout is None or layout == pipe.layout:
                continue
            bounds = list(layout)
        stages = tuple(Stage(st.worker, a, b)
                       for st, (a, b) in zip(pipe.stages, bounds, strict=True))
        pipelines[p] = Pipeline(stages, pipe.num_microbatches)
    if pipelines == list(plan.pipelines):
        return rebalanced_plan(state, slow)
    return rebalanced_plan(replace(state, plan=_with_pipelines(plan, pipelines)), slow)


def swapped_out_plan(state: RecoveryState, worker: int,
                     unusable: Collection[int]) -> ExecutionPlan | str:
    """The current plan with an idle live worker (a warm spare first: the nodes with the
    most idle workers) in ``worker``'s place, or why there is none.

    Args:
        state: the current plan and the live workers.
        worker: the slow worker to replace.
        unusable: idle workers that may not take its place (slow ones themselves).
    """
    plan = state.plan
    position = plan.stage_of_worker.get(worker)
    if position is None:
        return f"worker {worker} runs no stage"
    if any(peer == worker for r in plan.reroutes for peer, _ in r.shares):
        return f"worker {worker} runs rerouted micro-batches"
    # a worker a rerouted stage still names stays out: the plan keeps its reroutes
    idle = [w for w in state.idle_workers() if w not in unusable and w not in plan.dead_workers]
    assignment = assign_spares(plan, [position], idle, state.topology)
    if assignment is None:
        return f"no idle worker at full speed to take worker {worker}'s place"
    swapped = swapped_plan(plan, assignment)
    if plan.reroutes:
        swapped = replace(swapped, reroutes=plan.reroutes,
                          defer_weight_grad=plan.defer_weight_grad)
        swapped.validate()
    return swapped


def slow_candidates(state: RecoveryState, worker: int, slow: Mapping[int, float],
                    wanted: Collection[Strategy]) -> list[Candidate]:
    """The ``wanted`` candidates among keep, rebalance, dynamic and swap for ``worker``
    running at ``slow[worker]`` (absent: at full speed again, a slowdown that ended).

    Args:
        state: the current plan, every live worker (the slow one included) and an
            estimate at the measured speeds.
        worker: the slow worker (or the one whose slowdown ended).
        slow: worker -> factor of every worker still slow.
        wanted: which strategies to price.

    Returns:
        One candidate per wanted strategy, in the order keep, rebalance, dynamic, swap.
    """
    out: list[Candidate] = []
    if Strategy.KEEP in wanted:
        out.append(candidate_from_estimate(Strategy.KEEP, state.plan,
                                           state.estimate(state.plan), {},
                                           "keep the current plan at the measured speeds"))
    builders: tuple[tuple[Strategy, Callable[[], ExecutionPlan | str], str], ...] = (
        (Strategy.REBALANCE, lambda: rebalanced_plan(state, slow),
         "split the micro-batches again at the measured speeds"),
        (Strategy.DYNAMIC, lambda: repartitioned_plan(state, slow),
         "re-split the slow worker's pipeline by layers at its speeds, then rebalance"),
        (Strategy.SWAP, lambda: swapped_out_plan(state, worker, slow),
         f"an idle worker takes worker {worker}'s place"))
    for strategy, build, reason in builders:
        if strategy not in wanted:
            continue
        found = build()
        if isinstance(found, str):
            out.append(infeasible(strategy, found))
        else:
            out.append(copy_in(state, strategy, found, reason))
    return out
