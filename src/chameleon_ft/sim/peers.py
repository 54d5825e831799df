"""The published systems Chameleon is measured against, as simulator policies.

- ``oobleck``: Oobleck as published (``recovery/oobleck.py``): the job's pipelines on
  consecutive workers, its templates, its re-instantiation rules (simple, borrow, merge),
  at least ``f + 1`` pipelines, a stop-the-world reconfiguration at every failure,
  returned workers waiting for the next reconfiguration; a checkpoint restart (on
  consecutive workers) when its rules cannot recover. Oobleck's pipelines run 1F1B, so a
  job on another schedule (interleaved, zero-bubble) runs under Oobleck as the same job
  on 1F1B, with a template for every pipeline length.
- ``recycle`` is the planner's ``recycle`` strategy as a fixed policy
  (``recovery/reroute.py``): ReCycle's rerouting with its decoupled backward and its
  re-join.

Each peer decides from the planner's job (templates, estimates) but never from
Chameleon's candidates or scores. Neither answers a slow worker but as a failure
(``policies.fail_stop``).
"""

from __future__ import annotations

from dataclasses import replace

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.policy import Planner
from chameleon_ft.profile import unfold_profile
from chameleon_ft.recovery.oobleck import OobleckSpec, instantiate, oobleck_spec, reconfigure
from chameleon_ft.sim.policies import (
    KEEP,
    Choice,
    EventContext,
    FailStopOnSlow,
    PlannerPolicy,
    PlannerPriced,
    terms_choice,
)
from chameleon_ft.spec.job import Schedule
from chameleon_ft.spec.recovery import RecoverySpec

OOBLECK_FAULT_THRESHOLD = 3
"""Oobleck's default ``f`` (``JobArguments.fault_threshold`` in its code)."""
OOBLECK_SCHEDULE = Schedule.ONE_F_ONE_B.value
"""Oobleck's pipelines run a DeepSpeed-derived 1F1B schedule (``OobleckPipelineSchedule``)."""


def oobleck_planner(planner: Planner) -> Planner:
    """The job as Oobleck runs it: ``planner`` itself on 1F1B, else a planner of the same
    job and cluster on 1F1B over the model's unfolded layers (an interleaved job plans
    with folded columns of chunks, which Oobleck, having no interleaving, never uses)."""
    job = planner.config.job
    if job.schedule == OOBLECK_SCHEDULE:
        return planner
    config = replace(planner.config,
                     job=replace(job, schedule=OOBLECK_SCHEDULE, virtual_stages=1))
    return Planner(config, profile=unfold_profile(planner.profile),
                   cache_size=planner.cache_size)


class OobleckPolicy(FailStopOnSlow, PlannerPriced):
    """Oobleck's reconfiguration; restart from the checkpoint when its rules cannot recover
    (a layer without a live replica, fewer than ``f + 1`` pipelines, no template)."""

    def __init__(self, planner: Planner, recovery: RecoverySpec, *,
                 fault_threshold: int = OOBLECK_FAULT_THRESHOLD, name: str = "oobleck") -> None:
        """Model Oobleck on the planner's job.

        Args:
            planner: the job's planner (templates, estimates, the restart fallback; on
                another schedule than 1F1B, see :func:`oobleck_planner`).
            recovery: the job's recovery settings.
            fault_threshold: ``f``; lowered to the job's pipelines minus one when the job
                starts with fewer than ``f + 1`` pipelines (Oobleck would not plan fewer).
            name: the policy name in reports.

        Raises:
            ValueError: when no pipeline of the job fits memory.
        """
        self.name = name
        planner = oobleck_planner(planner)
        self._planner = planner
        self._restart = PlannerPolicy("restart", planner, recovery)
        self._recovery = recovery
        initial = planner.initial_plan
        self.spec: OobleckSpec = oobleck_spec(
            planner.templates, num_workers=len(initial.workers),
            job_length=max(p.num_stages for p in initial.pipelines),
            fault_threshold=max(0, min(fault_threshold, initial.num_pipelines - 1)))

    def memory_load_s(self, plan: ExecutionPlan) -> float:
        """A reload of ``plan`` (on Oobleck's own layers) from other hosts' memory."""
        return float(self._planner.memory_load_s(plan))

    def start(self) -> Choice:
        """The job's pipelines as Oobleck instantiates them (consecutive workers)."""
        plan = instantiate(self._planner.initial_plan)
        est = self._planner.estimate(plan)
        return Choice(strategy="initial", plan=plan, step_s=est.step_s,
                      throughput_samples_s=est.throughput_samples_s)

    def on_failure(self, base: Choice, failed: frozenset[int], ctx: EventContext) -> Choice:
        """Oobleck's reconfiguration from ``base.plan``, else a restart."""
        if base.plan is None:
            return base
        state = self._planner.recovery_state(base.plan, ctx.alive)
        candidate = reconfigure(state, failed, self.spec)
        if not candidate.feasible or candidate.plan is None:
            return self._own_ranks(self._restart.on_failure(base, failed, ctx))
        return terms_choice(str(candidate.extra["rule"]), candidate.plan,
                            step_s=candidate.step_s,
                            throughput_samples_s=candidate.throughput_samples_s,
                            transition_s=candidate.transition_s, terms=candidate.terms,
                            rollback=False)

    def on_rejoin(self, base: Choice, returned: frozenset[int], ctx: EventContext) -> Choice:
        """Returned workers wait for the next reconfiguration; a job that was down
        restarts from its checkpoint."""
        if base.plan is not None:
            return Choice(strategy=KEEP, plan=None)
        return self._own_ranks(self._restart.on_rejoin(base, returned, ctx))

    def _own_ranks(self, choice: Choice) -> Choice:
        """A restart's layout with Oobleck's rank assignment (consecutive workers)."""
        if choice.plan is None or choice.then is not None:
            return choice
        plan = instantiate(choice.plan)
        est = self._planner.estimate(plan)
        return replace(choice, plan=plan, step_s=est.step_s,
                       throughput_samples_s=est.throughput_samples_s)
