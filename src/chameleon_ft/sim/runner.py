"""Run a scenario: every policy on the same traces, over seeds and sweep cells.

The profile and the failure-free estimate are built once per job. Each (cell, seed) runs
as fixed units of policies (:data:`POLICY_GROUPS` says which and why they share a
planner), in parallel processes when asked; results do not depend on how many.
"""

from __future__ import annotations

import contextlib
import gc
import math
import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from chameleon_ft.failures import Trace
from chameleon_ft.perf import Topology, estimate
from chameleon_ft.plan import ExecutionPlan, initial_plan
from chameleon_ft.policy import Planner
from chameleon_ft.profile import Profile, build_profile
from chameleon_ft.recovery.restorer import load_matching
from chameleon_ft.sim.bamboo import BambooPolicy
from chameleon_ft.sim.engine import RunResult, simulate
from chameleon_ft.sim.forked import Send, peak_rss_bytes, run_forked
from chameleon_ft.sim.peers import OOBLECK_FAULT_THRESHOLD, OobleckPolicy
from chameleon_ft.sim.policies import PlannerPolicy, SimPolicy
from chameleon_ft.sim.scenarios import Scenario
from chameleon_ft.sim.traces import generate_trace
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.scenario import FailureSpec, RepairKind, default_policies


@dataclass(frozen=True)
class SeedRun:
    """Every policy on one trace."""

    seed: int
    """The trace's seed (``None``-free: a replayed CSV trace reports the base seed)."""
    trace: Trace
    """The trace all policies ran on."""
    results: tuple[RunResult, ...]
    """One result per policy, in the order asked for (a policy whose simulation process
    died has none: see ``lost``)."""
    lost: tuple[LostRun, ...] = ()
    """Policies on this trace whose simulation process died."""

    def result(self, policy: str) -> RunResult | None:
        """``policy``'s result on this trace, ``None`` when its process died."""
        return next((r for r in self.results if r.name == policy), None)


@dataclass(frozen=True)
class LostRun:
    """A policy's simulation on one trace that never finished: its process died."""

    seed: int
    """The trace's seed."""
    policy: str
    """The policy being simulated when the process died."""
    reason: str
    """How the process died (``killed by SIGKILL ... at 12.4 GB resident``)."""
    not_run: tuple[str, ...] = ()
    """Later policies of the same process that never started."""
    cell: str = ""
    """The sweep cell (``node MTBF 6 h, repair 2 h``), empty for a single-cell scenario."""

    def line(self) -> str:
        """The one line that reports it."""
        where = f" ({self.cell})" if self.cell else ""
        rest = f"; {', '.join(self.not_run)} not run on it either" if self.not_run else ""
        return (f"simulate: the simulation of {self.policy} on seed {self.seed}{where} died, "
                f"{self.reason}{rest}; the other results are kept")


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
    process_peak_rss_bytes: tuple[int, ...] = ()
    """Peak resident memory of each process that ran policies (one per unit in separate
    processes; this process's alone otherwise): what a run needs, not part of reports."""

    @property
    def lost(self) -> tuple[LostRun, ...]:
        """Every policy run whose process died, over all cells and seeds."""
        return tuple(lost for cell in self.cells for run in cell.runs for lost in run.lost)


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


CACHED_DECISION_WORKERS = 2 ** 20
"""Bound on a unit's planner cache, counted in workers: a cached decision holds a few
whole plans with their estimates (about 1 MB per 1,000 workers), so a planner keeps the
planner's default 512 decisions up to 2,048 workers and 128 of 8,192 workers (0.5 GB or
so at any scale). Eviction only costs time: a decision is recomputed the same."""


def planner_cache_size(num_workers: int) -> int:
    """Decisions a unit's planner keeps for a cluster of ``num_workers``."""
    return max(32, min(512, CACHED_DECISION_WORKERS // max(1, num_workers)))


def make_policy(name: str, planner: Planner, config: Config, *, bamboo_tax: float,
                oobleck_fault_threshold: int = OOBLECK_FAULT_THRESHOLD) -> SimPolicy:
    """A fresh policy of ``name`` for one run on ``config``'s job.

    Args:
        name: a policy name from ``POLICY_NAMES``.
        planner: the planner of this (cell, seed), shared by its policies (see
            :func:`run_scenario` for why that is sound).
        config: the job (its ``[recovery]`` costs).
        bamboo_tax: Bamboo's steady throughput tax.
        oobleck_fault_threshold: Oobleck's ``f``.

    Returns:
        The policy.
    """
    if name == "oobleck":
        return OobleckPolicy(planner, config.recovery, fault_threshold=oobleck_fault_threshold)
    if name == "bamboo":
        def step_time(plan: ExecutionPlan) -> float:
            return float(planner.estimate(plan).step_s)

        def slow_step_time(plan: ExecutionPlan, slow: Mapping[int, float]) -> float:
            return float(planner.estimate_slow(plan, slow).step_s)

        return BambooPolicy(planner.initial_plan, planner.failure_free.step_s, step_time,
                            config.recovery, tax=bamboo_tax, slow_step_time=slow_step_time)
    return PlannerPolicy(name, planner, config.recovery)


POLICY_GROUPS = (("chameleon", "oracle"),)
"""Policies run together on one planner; every other policy forms the second group.
Chameleon runs first on its planner, so its failure-rate estimate counts exactly the
failures and live worker-seconds it saw (fixed policies ignore scores; the oracle passes
the true horizon, and its fragility term reads the rate over Chameleon's whole run), and
the oracle reuses most of its candidates. The fixed-strategy policies, Bamboo and Oobleck
share the second planner (ReCycle first there: its candidates are among Chameleon's, and
ReCycle's and reroute's re-joins share theirs). On ``llama3-16k`` the two units take
about the same time (benchmarks/RESULTS.md, section 4)."""


def policy_groups(names: Sequence[str]) -> list[tuple[str, ...]]:
    """``names`` split into the groups that share a planner (empty groups dropped)."""
    first = (tuple(n for n in names if n == "chameleon")
             + tuple(n for n in names if n in POLICY_GROUPS[0] and n != "chameleon"))
    rest = tuple(n for n in names if n not in first)
    return [g for g in (first, rest) if g]


@dataclass(frozen=True)
class _Unit:
    """Some policies on one trace, with one planner: what one process runs."""

    config: Config
    profile: Profile
    trace: Trace
    policies: tuple[str, ...]
    bamboo_tax: float
    oobleck_fault_threshold: int
    failure_free_samples_s: float


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """Run the cyclic garbage collector rarely for a while.

    A simulation allocates millions of short-lived tuples while the planner's caches hold
    large, long-lived plans and timelines; at the default thresholds the collector rescans
    those caches thousands of times (about a sixth of a 2,048-worker run). Reference
    counting still frees almost everything at once; only cycles wait longer.
    """
    before = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _run_unit(unit: _Unit, tick: Callable[[int], None],
              started: Callable[[str], None]) -> Iterator[tuple[str, RunResult]]:
    """Run one unit's policies, in order, on a fresh planner; yields each result as soon
    as it is there (``started`` is told before each policy begins)."""
    with _few_collections():
        planner = Planner(unit.config, profile=unit.profile,
                          cache_size=planner_cache_size(unit.config.num_workers))
        for name in unit.policies:
            started(name)
            policy = make_policy(name, planner, unit.config, bamboo_tax=unit.bamboo_tax,
                                 oobleck_fault_threshold=unit.oobleck_fault_threshold)
            last = [0]

            def handled(n: int, last: list[int] = last) -> None:
                tick(n - last[0])
                last[0] = n

            # a policy planning on layers of its own (oobleck) reads them back itself
            reload: Callable[[ExecutionPlan], float] = getattr(
                policy, "memory_load_s", planner.memory_load_s)
            yield name, simulate(unit.trace, policy,
                                 failure_free_samples_s=unit.failure_free_samples_s,
                                 recovery=unit.config.recovery,
                                 num_workers=unit.config.total_workers,
                                 workers_per_node=unit.config.workers_per_node, progress=handled,
                                 checkpoint_every_steps=unit.config.train.checkpoint_every,
                                 memory_load_s=reload)


@dataclass
class _Outcome:
    """What came back from one unit."""

    results: dict[str, RunResult] = field(default_factory=dict)
    running: str | None = None
    """The policy started last and not finished (what a dead process was doing)."""
    peak_rss_bytes: int = 0
    """Peak resident memory of the process that ran it (this process's when run here)."""
    death: str | None = None
    """How its process died, when it did."""


def _run_units(units: Sequence[_Unit], *, jobs: int, total: int,
               progress: Callable[[int, int], None] | None) -> list[_Outcome]:
    """Every unit's outcome, in order; ``jobs`` processes at once (forked: Linux, macOS).

    In separate processes a unit whose process dies (killed by the kernel for memory, by a
    user) keeps the results its policies finished and says how it died; the others run on.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs: must be an integer >= 1, got {jobs!r}")
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    outcomes = [_Outcome() for _ in units]
    jobs = min(jobs, len(units))
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        _run_here(units, outcomes, tick)
    else:
        _run_in_processes(units, outcomes, jobs=jobs, total=total, progress=progress)
    return outcomes


def _run_here(units: Sequence[_Unit], outcomes: list[_Outcome],
              tick: Callable[[int], None]) -> None:
    """Every unit in this process, one after the other, into ``outcomes``."""
    for unit, outcome in zip(units, outcomes, strict=True):
        def started(name: str, outcome: _Outcome = outcome) -> None:
            outcome.running = name

        for name, result in _run_unit(unit, tick, started):
            outcome.results[name] = result
            outcome.running = None
        outcome.peak_rss_bytes = peak_rss_bytes()


def _run_in_processes(units: Sequence[_Unit], outcomes: list[_Outcome], *, jobs: int,
                      total: int, progress: Callable[[int, int], None] | None) -> None:
    """Every unit in a forked process of its own, ``jobs`` at once, into ``outcomes``
    (a process that dies leaves what its unit finished and how it died)."""
    load_matching()  # imported once here rather than by every forked unit
    counter = multiprocessing.get_context("fork").Value("q", 0)

    def shared_tick(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    def task(unit: _Unit) -> Callable[[Send], None]:
        def run(send: Send) -> None:
            for name, result in _run_unit(unit, shared_tick, lambda n: send(("start", n))):
                send(("done", name, result, peak_rss_bytes()))
        return run

    def on_message(index: int, message: Any) -> None:
        outcome = outcomes[index]
        if message[0] == "start":
            outcome.running = message[1]
        else:
            _, name, result, peak = message
            outcome.results[name] = result
            outcome.running = None
            outcome.peak_rss_bytes = max(outcome.peak_rss_bytes, peak)

    def on_poll() -> None:
        if progress is not None:
            progress(min(counter.value, total), total)

    for death in run_forked([task(u) for u in units], jobs=jobs, on_message=on_message,
                            on_poll=on_poll):
        outcome = outcomes[death.task]
        outcome.death = death.reason
        if death.peak_rss_bytes is not None:
            outcome.peak_rss_bytes = max(outcome.peak_rss_bytes, death.peak_rss_bytes)


def default_jobs() -> int:
    """The cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def run_scenario(scenario: Scenario, *, policies: Sequence[str] | None = None,
                 seeds: int | None = None, seed: int | None = None,
                 trace: Trace | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 jobs: int = 1) -> ScenarioRun:
    """Run every policy on the same traces.

    The work is split into units: for each (cell, seed), the policies of each group of
    :func:`policy_groups`, with one planner per unit shared by its policies. Units are
    independent, so ``jobs`` processes run them at once; the split does not depend on
    ``jobs``, so neither do the results.

    Args:
        scenario: the scenario.
        policies: overrides ``simulation.policies``.
        seeds: overrides ``simulation.seeds``.
        seed: overrides ``simulation.seed``.
        trace: replay this trace (one cell, one seed) instead of generating traces.
        progress: called as ``progress(done, total)`` in trace events over all runs.
        jobs: processes running units at once (1: all in this process).

    Returns:
        The results.

    Raises:
        ValueError: for a job the planner cannot plan, or a trace with a sweep.
    """
    sim = scenario.simulation
    names = (tuple(policies) if policies is not None
             else sim.policies or default_policies(scenario.config.cluster.spare_nodes))
    num_seeds = seeds if seeds is not None else sim.seeds
    first_seed = seed if seed is not None else sim.seed
    config = scenario.config
    profile = build_profile(config)
    cells_in = _cell_specs(scenario)
    if trace is not None and len(cells_in) != 1:
        raise ValueError("--trace: a replayed trace cannot drive a sweep")
    traces = _traces(scenario, cells_in, trace, first_seed, num_seeds)
    total = sum(len(t.events) for cell in traces for _, t in cell) * len(names)
    failure_free = estimate(initial_plan(config, profile), profile, Topology.from_config(config))
    units = [(c, k, group) for c, cell_traces in enumerate(traces)
             for k in range(len(cell_traces)) for group in policy_groups(names)]
    specs = [_Unit(config=cells_in[c][1], profile=profile, trace=traces[c][k][1],
                   policies=group, bamboo_tax=sim.bamboo_tax,
                   oobleck_fault_threshold=sim.oobleck_fault_threshold,
                   failure_free_samples_s=float(failure_free.throughput_samples_s))
             for c, k, group in units]
    outcomes = _run_units(specs, jobs=jobs, total=total, progress=progress)
    ff = failure_free
    return ScenarioRun(scenario=scenario, policies=names,
                       failure_free_samples_s=float(ff.throughput_samples_s),
                       failure_free_step_s=float(ff.step_s),
                       cells=_cells(units, outcomes, traces, cells_in, names),
                       process_peak_rss_bytes=tuple(o.peak_rss_bytes for o in outcomes))


def _traces(scenario: Scenario, cells_in: list[tuple[FailureSpec, Config]],
            trace: Trace | None, first_seed: int, num_seeds: int
            ) -> list[list[tuple[int, Trace]]]:
    """Each cell's ``(seed, trace)`` pairs: ``trace`` replayed as the one seed, else one
    generated trace per seed."""
    sim, config = scenario.simulation, scenario.config
    num_nodes = config.cluster.num_nodes
    per_node = config.workers_per_node
    traces: list[list[tuple[int, Trace]]] = []
    for failures, _ in cells_in:
        if trace is not None:
            traces.append([(first_seed, trace)])
            continue
        traces.append([(s, generate_trace(failures, num_nodes=num_nodes, workers_per_node=per_node,
                                          duration_s=sim.duration_s, seed=s,
                                          spare_nodes=config.cluster.spare_nodes))
                       for s in range(first_seed, first_seed + num_seeds)])
    return traces


def _cells(units: list[tuple[int, int, tuple[str, ...]]], outcomes: list[_Outcome],
           traces: list[list[tuple[int, Trace]]], cells_in: list[tuple[FailureSpec, Config]],
           names: tuple[str, ...]) -> tuple[CellRun, ...]:
    """The units' outcomes gathered per (cell, seed): each policy's result in the order
    asked for, and the policies whose process died."""
    by_unit: dict[tuple[int, int], dict[str, RunResult]] = {}
    lost: dict[tuple[int, int], list[LostRun]] = {}
    for (c, k, group), outcome in zip(units, outcomes, strict=True):
        by_unit.setdefault((c, k), {}).update(outcome.results)
        if outcome.death is not None:
            running = outcome.running or next(n for n in group if n not in outcome.results)
            later = group[group.index(running) + 1:]
            lost.setdefault((c, k), []).append(LostRun(
                seed=traces[c][k][0], policy=running, reason=outcome.death, not_run=later,
                cell=_cell_label(cells_in[c][0]) if len(cells_in) > 1 else ""))
    cells = []
    for c, ((failures, _), cell_traces) in enumerate(zip(cells_in, traces, strict=True)):
        runs = tuple(SeedRun(seed=s, trace=cell_trace,
                             results=tuple(by_unit[(c, k)][n] for n in names
                                           if n in by_unit[(c, k)]),
                             lost=tuple(lost.get((c, k), ())))
                     for k, (s, cell_trace) in enumerate(cell_traces))
        cells.append(CellRun(node_mtbf_hours=failures.node_mtbf_hours,
                             repair_hours=_repair_hours(failures), runs=runs))
    return tuple(cells)


def _repair_hours(failures: FailureSpec) -> float | None:
    """A cell's mean or fixed repair time; ``None``: never repaired."""
    if failures.repair == RepairKind.UNIFORM:
        return (failures.repair_min_hours + failures.repair_max_hours) / 2
    if failures.repairs:
        return failures.repair_hours
    return None


def _cell_label(failures: FailureSpec) -> str:
    repair = _repair_hours(failures)
    return (f"node MTBF {failures.node_mtbf_hours:g} h, repair "
            + ("never" if repair is None else f"{repair:g} h"))
