"""Simulator settings: the ``[simulation]`` and ``[failures]`` tables of a scenario file.

Defaults follow the published failure statistics (docs/design.md, "Sources of the defaults"):
Llama 3 saw 419 unexpected interruptions in 54 days on 2,048 8-GPU nodes (a node MTBF of
about 264 days); GPU-class faults (one device) were about 59 %, other host faults about
18 %, network switches and cables about 8 % and job-level software faults about 15 %.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from chameleon_ft.spec._fields import (
    check_choice,
    check_int,
    check_positive,
    fail,
    from_mapping,
    prefixed,
)
from chameleon_ft.spec.recovery import (
    FALCON_SLOW_MAX_S,
    FALCON_SLOW_MIN_S,
    LLAMA3_NODE_MTBF_HOURS,
)

POLICY_NAMES = ("chameleon", "oobleck", "recycle", "reroute", "dynamic", "restart", "shrink",
                "bamboo", "oracle", "swap")
"""Every policy the simulator compares, in report order."""


def default_policies(spare_nodes: int) -> tuple[str, ...]:
    """The policies a scenario runs when it names none: every one, ``swap`` only when the
    cluster has warm spares (without them it can only restart)."""
    return tuple(n for n in POLICY_NAMES if n != "swap" or spare_nodes > 0)


class Interarrival(StrEnum):
    """Distribution of the time between two failures of the cluster."""

    EXPONENTIAL = "exponential"
    WEIBULL = "weibull"


class RepairKind(StrEnum):
    """Distribution of the time a failed node takes to come back."""

    NONE = "none"
    FIXED = "fixed"
    EXPONENTIAL = "exponential"
    UNIFORM = "uniform"


@dataclass(frozen=True, kw_only=True)
class FailureSpec:
    """How failures are generated (the ``[failures]`` table)."""

    node_mtbf_hours: float = LLAMA3_NODE_MTBF_HOURS
    """Mean time between interruptions attributed to one node (all kinds together), hours."""
    interarrival: str = Interarrival.EXPONENTIAL.value
    """``exponential`` (memoryless) or ``weibull`` (bursty when ``weibull_shape`` < 1)."""
    weibull_shape: float = 0.7
    """Shape k of the Weibull inter-arrival; the scale keeps the mean of the exponential."""
    single_worker: float = 0.59
    """Share of interruptions that kill one worker (a GPU, its memory or NVLink)."""
    single_node: float = 0.18
    """Share that kill one whole node (host, NIC, power, unplanned maintenance)."""
    multi_node: float = 0.08
    """Share that kill a group of nodes behind one switch or cable."""
    software: float = 0.15
    """Share of job-level software faults: every process restarts, no hardware is lost."""
    group_nodes: int = 4
    """Nodes behind one switch: a multi-node failure takes out the aligned group of this size."""
    repair: str = RepairKind.FIXED.value
    """``none`` (failed hardware never returns), ``fixed``, ``exponential`` or ``uniform``."""
    repair_hours: float = 4.0
    """Repair time (``fixed``) or its mean (``exponential``), hours."""
    repair_min_hours: float = 5.0 / 60.0
    """Shortest repair for ``uniform``, hours (automated node replacement: ~5 min)."""
    repair_max_hours: float = 2.0
    """Longest repair for ``uniform``, hours."""
    slow_node_mtbf_hours: float | None = None
    """Mean time between fail-slows starting on one node, hours (a worker of it, drawn
    uniformly, runs slower for a while); unset: no fail-slows. Drawn as a stream of their
    own, so the failures stay those of the same seed without them (``sim/slowtraces.py``;
    the presets' rate: docs/design.md section 6)."""
    slow_min_s: float = FALCON_SLOW_MIN_S
    """Shortest fail-slow, seconds; durations are log-uniform between this and
    ``slow_max_s`` (Falcon, arXiv:2410.12588: "tens of seconds to nearly ten hours")."""
    slow_max_s: float = FALCON_SLOW_MAX_S
    """Longest fail-slow, seconds."""
    slow_min_factor: float = 1.3
    """Smallest slowdown factor of a fail-slow (uniform between this and
    ``slow_max_factor``; the range of slowdowns the runtime must detect, issue 34)."""
    slow_max_factor: float = 3.0
    """Largest slowdown factor of a fail-slow."""

    def __post_init__(self) -> None:
        check_positive("node_mtbf_hours", self.node_mtbf_hours)
        check_choice("interarrival", self.interarrival, [k.value for k in Interarrival])
        check_positive("weibull_shape", self.weibull_shape)
        for name in ("single_worker", "single_node", "multi_node", "software"):
            check_positive(name, getattr(self, name), allow_zero=True)
        total = self.single_worker + self.single_node + self.multi_node + self.software
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            fail("single_worker", f"the failure mix single_worker + single_node + multi_node + "
                 f"software must sum to 1, got {total:.6g}")
        check_int("group_nodes", self.group_nodes)
        check_choice("repair", self.repair, [k.value for k in RepairKind])
        check_positive("repair_hours", self.repair_hours)
        check_positive("repair_min_hours", self.repair_min_hours)
        check_positive("repair_max_hours", self.repair_max_hours)
        if self.repair_max_hours < self.repair_min_hours:
            fail("repair_max_hours", f"{self.repair_max_hours} is below repair_min_hours "
                 f"{self.repair_min_hours}")
        self._check_slow()

    def _check_slow(self) -> None:
        """The fail-slow settings: positive rate and durations, factors above 1, ranges in
        order."""
        if self.slow_node_mtbf_hours is not None:
            check_positive("slow_node_mtbf_hours", self.slow_node_mtbf_hours)
        check_positive("slow_min_s", self.slow_min_s)
        check_positive("slow_max_s", self.slow_max_s)
        if self.slow_max_s < self.slow_min_s:
            fail("slow_max_s", f"{self.slow_max_s} is below slow_min_s {self.slow_min_s}")
        if not (math.isfinite(self.slow_min_factor) and self.slow_min_factor > 1.0):
            fail("slow_min_factor", f"must be a number > 1 (F times slower), got "
                 f"{self.slow_min_factor}")
        if not (math.isfinite(self.slow_max_factor)
                and self.slow_min_factor <= self.slow_max_factor <= 1000.0):
            fail("slow_max_factor", f"must be between slow_min_factor "
                 f"({self.slow_min_factor}) and 1000, got {self.slow_max_factor}")

    @property
    def repairs(self) -> bool:
        """Whether failed hardware ever comes back."""
        return self.repair != RepairKind.NONE


@dataclass(frozen=True, kw_only=True)
class SimulationSpec:
    """What is simulated and compared (the ``[simulation]`` table)."""

    days: float = 7.0
    """Simulated training time, days."""
    policies: tuple[str, ...] = ()
    """Policies to run on the same traces; empty: every policy (``swap`` only when the
    cluster has spare nodes, :func:`default_policies`)."""
    seeds: int = 1
    """Independent traces; reports give the mean and spread over them."""
    seed: int = 0
    """First seed; trace i uses ``seed + i``."""
    trace: str = ""
    """CSV trace to replay instead of generating one (relative to the scenario file)."""
    bamboo_tax: float = 0.24
    """Bamboo's steady throughput tax for redundant computation (Oobleck's simulator: 0.197-0.279)."""
    oobleck_fault_threshold: int = 3
    """Oobleck's ``f``: it keeps at least ``f + 1`` pipelines (its code's default, 3)."""
    sweep_node_mtbf_hours: tuple[float, ...] = ()
    """For a sweep: node MTBF values, hours. Empty: no sweep."""
    sweep_repair_hours: tuple[float, ...] = ()
    """For a sweep: repair times, hours; ``inf`` means never repaired."""

    def __post_init__(self) -> None:
        check_positive("days", self.days)
        for i, name in enumerate(self.policies):
            check_choice(f"policies[{i}]", name, POLICY_NAMES)
        if len(set(self.policies)) != len(self.policies):
            fail("policies", f"lists a policy twice: {', '.join(self.policies)}")
        check_int("seeds", self.seeds)
        check_int("seed", self.seed, minimum=0)
        check_positive("bamboo_tax", self.bamboo_tax, allow_zero=True)
        check_int("oobleck_fault_threshold", self.oobleck_fault_threshold, minimum=0)
        if self.bamboo_tax >= 1:
            fail("bamboo_tax", f"is a fraction of throughput and must be < 1, got {self.bamboo_tax}")
        for i, value in enumerate(self.sweep_node_mtbf_hours):
            check_positive(f"sweep_node_mtbf_hours[{i}]", value)
        for i, value in enumerate(self.sweep_repair_hours):
            if not (isinstance(value, float) and math.isinf(value) and value > 0):
                check_positive(f"sweep_repair_hours[{i}]", value)
        if bool(self.sweep_node_mtbf_hours) != bool(self.sweep_repair_hours):
            fail("sweep_node_mtbf_hours", "a sweep needs both sweep_node_mtbf_hours and "
                 "sweep_repair_hours")

    @property
    def duration_s(self) -> float:
        """Simulated time in seconds."""
        return self.days * 86400.0

    @property
    def is_sweep(self) -> bool:
        """Whether this is a grid over failure and repair rates."""
        return bool(self.sweep_node_mtbf_hours)


def scenario_specs(extra: Mapping[str, Mapping[str, Any]]) -> tuple[SimulationSpec, FailureSpec]:
    """Validate the raw ``[simulation]`` and ``[failures]`` tables of a config.

    Args:
        extra: ``Config.extra``: raw tables by name.

    Returns:
        The typed simulation and failure settings (defaults for a missing table).

    Raises:
        ValueError: naming ``simulation.<key>`` or ``failures.<key>``.
    """
    try:
        simulation = from_mapping(SimulationSpec, extra.get("simulation", {}), "simulation")
    except ValueError as exc:
        raise prefixed("simulation", exc) from None
    try:
        failures = from_mapping(FailureSpec, extra.get("failures", {}), "failures")
    except ValueError as exc:
        raise prefixed("failures", exc) from None
    return simulation, failures
