"""A plan's timed schedule: :func:`simulate` builds the operation graph of some pipelines
and list-schedules it with one rule and one order variant; :func:`best_timeline` tries the
variants and rules that can matter and keeps the fastest that fits device memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from chameleon_ft.perf.graph import ChunkCosts, _stage_costs, build_graph, schedule_variants
from chameleon_ft.perf.list_scheduler import Timeline, _list_schedule
from chameleon_ft.perf.network import Topology
from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.profile.profile import Profile
from chameleon_ft.spec.job import Schedule as ScheduleName

DEFAULT_RULES = ("rerouted-first", "ready-first")
"""The rules :func:`best_timeline` tries. On 600 random rerouted plans this pair came within
0.11% (mean) of the best of all three rules, at two thirds of the cost."""

SECOND_RULE_MAX_OPS = 20_000
"""Graphs with more operations are merged by the first rule alone: on the 16,384-GPU
interleaved job (70,000 operations per rerouted component) the second rule was faster on
8 of 78 rerouted components from random failures, by at most 0.7% (the first was 0.37%
faster on average; benchmarks/schedules.py), and it doubles the cost of the simulator's
most expensive step."""


def simulate(
    plan: ExecutionPlan,
    profile: Profile,
    topology: Topology,
    pipelines: Sequence[int] | None = None,
    speeds: Mapping[int, float] | None = None,
    costs: Mapping[tuple[int, int], ChunkCosts] | None = None,
    rule: str = "rerouted-first",
    variant: int = 0,
) -> Timeline:
    """List-schedule the operations of ``pipelines`` (default: all) of ``plan``.

    The chosen pipelines must be closed under reroutes: a peer's own pipeline is simulated
    together with every pipeline whose stage it serves.

    Args:
        plan: the execution plan.
        profile: per-layer costs.
        topology: links between workers.
        pipelines: which pipelines to simulate.
        speeds: relative speed of each worker (default 1.0): durations are divided by it.
        costs: precomputed per-(pipeline, stage) chunk costs (an optimisation).
        rule: a key of :data:`PRIORITIES`, for workers that run several streams.
        variant: an index into :func:`schedule_variants` (the order variant).

    Returns:
        The timed per-worker schedule.

    Raises:
        RuntimeError: if the fixed orders deadlock (a bug: the schedules here never do).
    """
    graph = build_graph(plan, profile, topology, pipelines, speeds, costs, variant)
    return _list_schedule(graph, rule)


def best_timeline(
    plan: ExecutionPlan,
    profile: Profile,
    topology: Topology,
    pipelines: Sequence[int] | None = None,
    speeds: Mapping[int, float] | None = None,
    costs: Mapping[tuple[int, int], ChunkCosts] | None = None,
    with_ops: bool = True,
    lower_bound_s: float = 0.0,
) -> Timeline:
    """:func:`simulate` with each order variant and each of :data:`DEFAULT_RULES`; the
    fastest timeline (first on ties), among those that fit device memory when some do
    (interleaved: the padded variant only when the first does not fit).

    Without ``with_ops`` the timeline's per-worker op lists are left empty (timings only).
    ``lower_bound_s`` is a makespan no timeline can beat (the estimator passes the slowest
    failure-free makespan of the component's intact pipelines when no worker splits its
    backward: their operations, links and stream orders are all still there): once a
    timeline reaches it the others are skipped, which changes nothing (the first of equal
    timelines is kept).

    Only workers that run several streams (rerouted peers) depend on the rule, so plans
    without reroutes are simulated with one rule, and so are graphs above
    :data:`SECOND_RULE_MAX_OPS` operations; only ``zero-bubble`` has several variants.
    """
    chosen = list(range(plan.num_pipelines)) if pipelines is None else list(pipelines)
    rules = list(DEFAULT_RULES)
    if not any(r.pipeline in chosen for r in plan.reroutes):
        rules = rules[:1]
    costs = costs if costs is not None else _stage_costs(plan, profile)
    variants = schedule_variants(plan, chosen, max(len(c) for c in costs.values()))
    static: dict[int, float] = {}
    if len(variants) > 1:
        # Variants trade bubble for memory: the fastest one that fits wins.
        for p in chosen:
            for s, st in enumerate(plan.pipelines[p].stages):
                if (p, s) not in plan.reroute_map:
                    static[st.worker] = sum(c.static_bytes for c in costs[(p, s)])
    capacity = topology.memory_capacity_bytes
    best: Timeline | None = None
    best_fits = False
    for variant in variants:
        graph = build_graph(plan, profile, topology, chosen, speeds, costs, variant)
        for rule in rules if len(graph.op_kind) <= SECOND_RULE_MAX_OPS else rules[:1]:
            timeline = _list_schedule(graph, rule, with_ops)
            fits = all(static.get(w, 0.0) + peak <= capacity
                       for w, peak in timeline.peak_activation_bytes.items())
            if (best is None or (fits and not best_fits)
                    or (fits == best_fits and timeline.makespan_s < best.makespan_s - 1e-12)):
                best, best_fits = timeline, fits
            if best_fits and best.makespan_s <= lower_bound_s + 1e-12:
                return best
        if best_fits and plan.schedule == ScheduleName.INTERLEAVED:
            break  # the larger groups fit: padding would only add bubble
    assert best is not None
    return best

