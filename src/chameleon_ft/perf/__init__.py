"""The estimator: step time, throughput and memory of any plan; closed forms; schedules."""

from __future__ import annotations

from collections.abc import Mapping

from chameleon_ft.perf.estimator import (
    Breakdown,
    Estimate,
    Estimator,
    estimate,
    estimator_for,
    speeds_from_factors,
)
from chameleon_ft.perf.network import Topology
from chameleon_ft.perf.schedule import Op, OpKind, Schedule
from chameleon_ft.perf.sync import Bucket, sync_rounds, tie_members
from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.profile.profile import Profile


def build_schedule(plan: ExecutionPlan, profile: Profile, topology: Topology,
                   speeds: Mapping[int, float] | None = None) -> Schedule:
    """The per-worker operation order the estimator times for ``plan``.

    The runtime executes exactly these lists, then the all-reduce rounds, then the
    optimizer step.
    """
    est = estimator_for(profile, topology)
    ops: dict[int, tuple[Op, ...]] = {}
    for timeline in est.timelines(plan, speeds):
        for worker, seq in timeline.ops.items():
            ops[worker] = tuple(seq)
    return Schedule(ops=ops, sync_rounds=sync_rounds(plan, profile))


__all__ = ["Breakdown", "Bucket", "Estimate", "Estimator", "Op", "OpKind", "Schedule",
           "Topology", "build_schedule", "estimate", "estimator_for", "speeds_from_factors",
           "sync_rounds", "tie_members"]
