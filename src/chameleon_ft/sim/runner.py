"""Run a scenario: every policy on the same traces, over seeds and sweep cells.

The profile and the failure-free estimate are built once per job; each (cell, seed) gets
one planner that all its policies share (``run_scenario`` says why that is sound).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from chameleon_ft.perf import Estimate
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.policy import Planner
from chameleon_ft.profile import build_profile
from chameleon_ft.sim.engine import RunResult, simulate
from chameleon_ft.sim.events import Trace
from chameleon_ft.sim.policies import BambooPolicy, PlannerPolicy, SimPolicy
from chameleon_ft.sim.scenarios import Scenario
from chameleon_ft.sim.traces import generate_trace
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.scenario import FailureSpec, RepairKind


@dataclass(frozen=True)
class SeedRun:
    """Every policy on one trace."""

    seed: int
    """The trace's seed (``None``-free: a replayed CSV trace reports the base seed)."""
    trace: Trace
    """The trace all policies ran on."""
    results: tuple[RunResult, ...]
    """One result per policy, in the order asked for."""


@dataclass(frozen=True)
class CellRun:
    """One point of a scenario: its failure settings and the runs over seeds."""

    node_mtbf_hours: float
    """Node MTBF of this cell."""
    repair_hours: float | None
    """Mean or fixed repair time; ``None``: never repaired."""
    runs: tuple[SeedRun, ...]
    """One per seed."""


@dataclass(frozen=True)
class ScenarioRun:
    """A whole scenario's results."""

    scenario: Scenario
    """What was run."""
    policies: tuple[str, ...]
    """Policies, in report order."""
    failure_free_samples_s: float
    """Failure-free throughput of the job."""
    failure_free_step_s: float
    """Failure-free step time of the job."""
    cells: tuple[CellRun, ...]
    """One cell, or the sweep grid in row-major (MTBF, repair) order."""


def _cell_specs(scenario: Scenario) -> list[tuple[FailureSpec, Config]]:
    """The failure settings of each cell, with the policy prior set to match."""
    sim, failures = scenario.simulation, scenario.failures
    if not sim.is_sweep:
        return [(failures, scenario.config)]
    out = []
    for mtbf in sim.sweep_node_mtbf_hours:
        for repair in sim.sweep_repair_hours:
            if math.isinf(repair):
                cell = replace(failures, node_mtbf_hours=mtbf, repair=RepairKind.NONE.value)
                prior_repair = None
            else:
                kind = (failures.repair if failures.repair != RepairKind.NONE
                        else RepairKind.FIXED.value)
                cell = replace(failures, node_mtbf_hours=mtbf, repair=kind, repair_hours=repair)
                prior_repair = repair
            policy = replace(scenario.config.policy, node_mtbf_hours=mtbf,
                             repair_hours=prior_repair)
            out.append((cell, replace(scenario.config, policy=policy)))
    return out


def make_policy(name: str, planner: Planner, config: Config, *, bamboo_tax: float) -> SimPolicy:
    """A fresh policy of ``name`` for one run on ``config``'s job.

    Args:
        name: a policy name from ``POLICY_NAMES``.
        planner: the planner of this (cell, seed), shared by its policies (see
            :func:`run_scenario` for why that is sound).
        config: the job (its ``[recovery]`` costs).
        bamboo_tax: Bamboo's steady throughput tax.

    Returns:
        The policy.
    """
    if name == "bamboo":
        def step_time(plan: ExecutionPlan) -> float:
            return float(planner.estimate(plan).step_s)

        return BambooPolicy(planner.initial_plan, planner.failure_free.step_s, step_time,
                            config.recovery, tax=bamboo_tax)
    return PlannerPolicy(name, planner, config.recovery)


def run_scenario(scenario: Scenario, *, policies: Sequence[str] | None = None,
                 seeds: int | None = None, seed: int | None = None,
                 trace: Trace | None = None,
                 progress: Callable[[int, int], None] | None = None) -> ScenarioRun:
    """Run every policy on the same traces.

    Args:
        scenario: the scenario.
        policies: overrides ``simulation.policies``.
        seeds: overrides ``simulation.seeds``.
        seed: overrides ``simulation.seed``.
        trace: replay this trace (one cell, one seed) instead of generating traces.
        progress: called as ``progress(done, total)`` in trace events over all runs.

    Returns:
        The results.

    Raises:
        ValueError: for a job the planner cannot plan, or a trace with a sweep.
    """
    sim = scenario.simulation
    names = tuple(policies) if policies is not None else sim.policies
    num_seeds = seeds if seeds is not None else sim.seeds
    first_seed = seed if seed is not None else sim.seed
    config = scenario.config
    profile = build_profile(config)
    cells_in = _cell_specs(scenario)
    if trace is not None and len(cells_in) != 1:
        raise ValueError("--trace: a replayed trace cannot drive a sweep")
    num_nodes = config.cluster.num_nodes
    per_node = config.workers_per_node
    traces: list[list[tuple[int, Trace]]] = []
    for failures, _ in cells_in:
        if trace is not None:
            traces.append([(first_seed, trace)])
            continue
        traces.append([(s, generate_trace(failures, num_nodes=num_nodes, workers_per_node=per_node,
                                          duration_s=sim.duration_s, seed=s))
                       for s in range(first_seed, first_seed + num_seeds)])
    total = sum(len(t.events) for cell in traces for _, t in cell) * len(names)
    done = 0
    cells = []
    failure_free: Estimate | None = None
    for (failures, cell_config), cell_traces in zip(cells_in, traces, strict=True):
        runs = []
        for s, cell_trace in cell_traces:
            # One planner per (cell, seed), shared by every policy so they share its plan
            # and estimate caches. Its failure-rate estimate counts the failures decide()
            # has seen, and only chameleon's decisions read it (fixed policies ignore
            # scores, the oracle passes the true horizon): chameleon runs first, on the
            # fresh planner, so it sees exactly its own history.
            planner = Planner(cell_config, profile=profile)
            if failure_free is None:
                failure_free = planner.failure_free
            ff = failure_free
            order = sorted(names, key=lambda n: n != "chameleon")
            by_name: dict[str, RunResult] = {}
            for name in order:
                policy = make_policy(name, planner, cell_config, bamboo_tax=sim.bamboo_tax)
                offset = done

                def tick(handled: int, offset: int = offset) -> None:
                    if progress is not None:
                        progress(offset + handled, total)

                by_name[name] = simulate(
                    cell_trace, policy, failure_free_samples_s=ff.throughput_samples_s,
                    recovery=cell_config.recovery, num_workers=config.num_workers,
                    workers_per_node=per_node, progress=tick)
                done += len(cell_trace.events)
            runs.append(SeedRun(seed=s, trace=cell_trace,
                                results=tuple(by_name[n] for n in names)))
        repair: float | None = None
        if failures.repair == RepairKind.UNIFORM:
            repair = (failures.repair_min_hours + failures.repair_max_hours) / 2
        elif failures.repairs:
            repair = failures.repair_hours
        cells.append(CellRun(node_mtbf_hours=failures.node_mtbf_hours, repair_hours=repair,
                             runs=tuple(runs)))
    assert failure_free is not None  # there is at least one cell and one seed
    ff = failure_free
    return ScenarioRun(scenario=scenario, policies=names,
                       failure_free_samples_s=float(ff.throughput_samples_s),
                       failure_free_step_s=float(ff.step_s), cells=tuple(cells))
