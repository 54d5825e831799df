"""``reroute-then-dynamic``: reroute at once, migrate in the background, then switch.

Training resumes after the reroute's transition and runs at the rerouted step time while
the dynamic plan's receivers build their new layers and its state is copied with the
bandwidth training leaves over (``recovery.background_share`` of it, at
``migration_efficiency``); un-hidden search time also runs in the background. Then
training pauses to create the communicators the final plan adds and to warm up
(``switch_terms``), and runs the dynamic plan. The policy scores the two phases (see
``policy/score.py``).

During the background copy a receiving worker holds its rerouted-plan memory plus the
incoming state; when that does not fit beside peers deferring weight gradients, the
interim plan runs fused backwards; the candidate is infeasible when it does not fit
either.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace

from chameleon_ft.perf import Estimate
from chameleon_ft.recovery.transition import comm_s, migration_s
from chameleon_ft.recovery.types import Candidate, RecoveryState, Strategy, infeasible


def combine(state: RecoveryState, reroute: Candidate, dynamic: Candidate, *,
            first_phase: str = "reroute now") -> Candidate:
    """The two-phase candidate from a reroute and a dynamic candidate.

    Args:
        state: the job (for the recovery settings and device memory).
        reroute: the rerouted plan (first phase); for a rejoin, the current plan.
        dynamic: the dynamic plan (second phase) with its migration.
        first_phase: how the reason names the first phase.

    Returns:
        One candidate (feasible or not).
    """
    if not reroute.feasible:
        return infeasible(Strategy.REROUTE_THEN_DYNAMIC, f"reroute: {reroute.reason}")
    if not dynamic.feasible or dynamic.migration is None or dynamic.plan is None:
        return infeasible(Strategy.REROUTE_THEN_DYNAMIC, f"dynamic: {dynamic.reason}")
    assert reroute.estimate is not None and reroute.plan is not None
    spec = state.config.recovery
    incoming: dict[int, float] = defaultdict(float)
    for transfer in dynamic.migration.transfers:
        incoming[transfer.dst] += transfer.num_bytes
    capacity = state.topology.memory_capacity_bytes
    interim, interim_est = reroute.plan, reroute.estimate
    staged_peak = _staged_peak(interim_est, incoming)
    if staged_peak > capacity and interim.defer_weight_grad:
        # Deferred weight gradients hold activations: stage the state beside fused
        # backwards instead (slower while it lasts, but it fits).
        fused = replace(interim, defer_weight_grad=False)
        fused_est = state.estimate(fused)
        if fused_est.memory_fits and _staged_peak(fused_est, incoming) <= capacity:
            interim, interim_est = fused, fused_est
            staged_peak = _staged_peak(fused_est, incoming)
    peak = max(staged_peak, interim_est.max_memory_bytes, dynamic.peak_memory_bytes)
    if staged_peak > capacity:
        return infeasible(Strategy.REROUTE_THEN_DYNAMIC,
                          f"no room to stage migrated state beside rerouted training "
                          f"({staged_peak / 2**30:.1f} GiB > {capacity / 2**30:.1f} GiB)")
    # Only the two candidates' plans are used (they may be named canonically, not as
    # ``state``): the switch creates the groups the final plan adds to the interim one and
    # warms up as the dynamic candidate would; its layers are built in the background.
    switch: dict[str, float]
    if spec.rebuild_s is not None:
        switch = {"rebuild_s": spec.rebuild_s}
    else:
        switch = {"comm_s": comm_s(interim, dynamic.plan, spec, tp=state.config.job.tp),
                  "warmup_s": dynamic.terms.get("warmup_s", 0.0)}
    building = dynamic.terms.get("build_s", 0.0)
    background_s = (migration_s(dynamic.migration.time_s, spec, background=True)
                    + dynamic.terms.get("search_s", 0.0) + building)
    return Candidate(
        strategy=Strategy.REROUTE_THEN_DYNAMIC, feasible=True, plan=dynamic.plan,
        estimate=dynamic.estimate, step_s=dynamic.step_s,
        throughput_samples_s=dynamic.throughput_samples_s,
        transition_s=reroute.transition_s, terms=dict(reroute.terms),
        peak_memory_bytes=peak,
        reason=f"{first_phase}, migrate in the background for {background_s:.1f} s, then switch",
        migration=dynamic.migration, interim_step_s=interim_est.step_s,
        interim_s=background_s, switch_s=sum(switch.values()), switch_terms=switch,
        interim_plan=interim)


def _staged_peak(interim: Estimate, incoming: Mapping[int, float]) -> float:
    """The largest per-device memory while migrated state arrives beside training."""
    peaks = interim.peak_memory_bytes
    return max((peaks.get(w, 0.0) + b for w, b in incoming.items()), default=0.0)
