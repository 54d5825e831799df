"""Execution plans, their validation, and layer partitioning."""

from __future__ import annotations

from chameleon_ft.plan.partition import balanced_bounds, stage_costs
from chameleon_ft.plan.plan import ExecutionPlan, Pipeline, Reroute, Stage, even_bounds
from chameleon_ft.profile.profile import Profile
from chameleon_ft.spec.config import Config


def layer_costs(profile: Profile) -> list[float]:
    """Per-layer compute seconds (forward + backward) used to balance stages."""
    return [layer.fwd_s + layer.bwd_s for layer in profile.layers]


def initial_plan(config: Config, profile: Profile) -> ExecutionPlan:
    """The failure-free dp x pp plan of a job, stages balanced over the profile's costs.

    Raises:
        ValueError: when the job does not fit the profile.
    """
    job = config.job
    if job.pp > profile.num_layers:
        raise ValueError(f"job.pp: {job.pp} stages need at least {job.pp} layers, the profile "
                         f"has {profile.num_layers}")
    costs = layer_costs(profile)
    bounds = balanced_bounds(costs, job.pp) if any(costs) else even_bounds(profile.num_layers,
                                                                           job.pp)
    return ExecutionPlan.uniform(
        dp=job.dp, pp=job.pp, num_layers=profile.num_layers,
        num_microbatches=job.num_microbatches, micro_batch=job.micro_batch,
        placement=job.placement, layer_bounds=bounds, schedule=job.schedule,
    )


__all__ = ["ExecutionPlan", "Pipeline", "Reroute", "Stage", "balanced_bounds", "even_bounds",
           "initial_plan", "layer_costs", "stage_costs"]
