"""Bamboo (Thorpe et al., NSDI 2023) as a simulator policy: redundant computation modelled
from published figures (docs/design.md, "Sources of the defaults"); the constants and rules
are documented on :class:`BambooPolicy`."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.sim.policies import (
    DOWN,
    KEEP,
    Choice,
    EventContext,
    FailStopOnSlow,
    slowed,
    terms_choice,
)
from chameleon_ft.spec.recovery import RecoverySpec

BAMBOO_TAX = 0.24
"""Steady throughput tax of redundant computation: the middle of the 19.7-27.9 % that
Oobleck's simulator charges Bamboo (``bamboo_simulator.py``), paid even with no failure."""
BAMBOO_FALLBACK_SLOWDOWN = 1.5
"""Step slowdown while a node runs its own and its dead successor's stage
(``fallback_slowdown`` in Bamboo's simulator). One slow pipeline slows the whole
synchronous step, so the whole job runs 1.5x slower."""
BAMBOO_RECONFIGURE_FRACTION = 0.05
"""Bamboo reconfigures when ``2 * overloaded / active`` exceeds this (risk of a fatal
adjacent failure; ``simulate_should_reconfigure``)."""
BAMBOO_RENDEZVOUS_S = 30.0
"""Global rendezvous timeout of a Bamboo reconfiguration (Bamboo's simulator)."""


@dataclass(frozen=True)
class BambooState:
    """Which stages of the current plan have a dead worker covered by their predecessor."""

    covered: frozenset[tuple[int, int]] = frozenset()
    """``(pipeline, stage)`` positions run by the worker of ``(pipeline, stage - 1)``."""


class BambooPolicy(FailStopOnSlow):
    """Bamboo (Thorpe et al., NSDI 2023) as published figures model it.

    Rules (docs/design.md, "Sources of the defaults"):

    - Always: throughput x (1 - ``tax``) for the redundant forward work.
    - A failure of stage ``s`` whose predecessor ``s - 1`` (cyclic, in the same pipeline) is
      alive, not itself covering a stage, and whose own worker was not covering one: the
      predecessor takes over after detection only (fallback groups are pre-built; a
      hardware failure has no preemption notice, so ``detect_s`` is still paid), and the
      job runs ``BAMBOO_FALLBACK_SLOWDOWN`` slower.
    - Any other failure (adjacent stages, e.g. a whole pipeline on one node) is fatal: a
      full restart from the checkpoint (detect + restart + load + the work since it).
    - When ``2 * covered / active > BAMBOO_RECONFIGURE_FRACTION`` after a takeover, or when a
      returned node can end an overload or add a pipeline, Bamboo reconfigures: a rendezvous
      (``BAMBOO_RENDEZVOUS_S``) plus reloading the model state into the new layout
      (``checkpoint_load_s``, standing for Bamboo's 76-450 s local restart), no lost work.
      The new layout is ``floor(alive / S)`` uniform pipelines of the original ``S``
      stages and layer bounds (Bamboo keeps its pipeline depth), stage-major over the
      sorted live workers, never more workers than the job's layout (idle warm spares
      replace lost workers, they add no pipelines).
    - Memory for the successor's weights is not checked: optimistic for Bamboo.
    """

    def __init__(self, initial: ExecutionPlan, failure_free_step_s: float,
                 step_time: Callable[[ExecutionPlan], float], recovery: RecoverySpec, *,
                 tax: float = BAMBOO_TAX, name: str = "bamboo",
                 slow_step_time: Callable[[ExecutionPlan, Mapping[int, float]], float]
                 | None = None) -> None:
        """Model Bamboo on a job.

        Args:
            initial: the failure-free plan (its layout is Bamboo's pipeline layout).
            failure_free_step_s: the step time of ``initial`` without redundancy.
            step_time: step time of a plan (the estimator), called once per pipeline count.
            recovery: detection, restart and load times.
            tax: the steady throughput tax.
            name: the policy name in reports.
            slow_step_time: a plan's step time with workers slowed by the given factors
                (fail-slows stretch Bamboo's steps by its ratio to the full-speed one);
                default: fail-slows cost Bamboo nothing.
        """
        self.name = name
        self._slow_step_time = slow_step_time
        self._initial = initial
        self._step_time = step_time
        self._recovery = recovery
        self._tax = tax
        self._num_stages = initial.pipelines[0].num_stages
        self._bounds = initial.pipelines[0].layout
        self._steps: dict[int, float] = {initial.num_pipelines: failure_free_step_s}

    def _run(self, strategy: str, plan: ExecutionPlan, state: BambooState,
             terms: Mapping[str, float], rollback: bool) -> Choice:
        step_s = self._steps[plan.num_pipelines]
        if state.covered:
            step_s *= BAMBOO_FALLBACK_SLOWDOWN
        throughput = plan.global_batch / step_s * (1.0 - self._tax)
        return terms_choice(strategy, plan, step_s=step_s, throughput_samples_s=throughput,
                            transition_s=sum(terms.values()), terms=terms, rollback=rollback,
                            state=state)

    def start(self) -> Choice:
        """The initial layout, taxed."""
        return self._run("initial", self._initial, BambooState(), {}, False)

    def layout(self, alive: Collection[int]) -> ExecutionPlan | None:
        """The clean layout Bamboo rebuilds on ``alive`` workers, or ``None`` if none fits."""
        num_stages = self._num_stages
        num_microbatches = self._initial.num_microbatches
        usable = min(len(alive), len(self._initial.workers))
        num_pipelines = min(usable // num_stages, num_microbatches)
        if num_pipelines < 1:
            return None
        workers = sorted(alive)[: num_pipelines * num_stages]
        base, extra = divmod(num_microbatches, num_pipelines)
        pipelines = tuple(
            Pipeline(tuple(Stage(workers[s * num_pipelines + p], lo, hi)
                           for s, (lo, hi) in enumerate(self._bounds)),
                     base + (1 if p < extra else 0))
            for p in range(num_pipelines))
        plan = ExecutionPlan(num_layers=self._initial.num_layers, pipelines=pipelines,
                             micro_batch=self._initial.micro_batch,
                             schedule=self._initial.schedule)
        if num_pipelines not in self._steps:
            self._steps[num_pipelines] = self._step_time(plan)
        return plan

    def _rebuild(self, strategy: str, alive: Collection[int], terms: Mapping[str, float],
                 rollback: bool) -> Choice:
        plan = self.layout(alive)
        if plan is None:
            return Choice(strategy=DOWN, plan=None)
        return self._run(strategy, plan, BambooState(), terms, rollback)

    def _restart_terms(self, detect: bool) -> dict[str, float]:
        rec = self._recovery
        terms = {"restart_s": rec.restart_s, "load_s": rec.checkpoint_load_s}
        if detect:
            terms["detect_s"] = rec.detect_s
        return terms

    def _reconfigure_terms(self, detect: bool) -> dict[str, float]:
        terms = {"rendezvous_s": BAMBOO_RENDEZVOUS_S, "load_s": self._recovery.checkpoint_load_s}
        if detect:
            terms["detect_s"] = self._recovery.detect_s
        return terms

    def on_failure(self, base: Choice, failed: frozenset[int], ctx: EventContext) -> Choice:
        """Takeover, reconfiguration or fatal restart, by the rules above."""
        plan = base.plan
        if plan is None:
            return base
        state: BambooState = base.state if base.state is not None else BambooState()
        positions = plan.stage_of_worker
        hit = {positions[w] for w in failed if w in positions} - state.covered
        if not hit:
            return Choice(strategy=KEEP, plan=None)
        covered = set(state.covered)
        fatal = self._num_stages == 1
        for p, s in sorted(hit):
            pred = (p, (s - 1) % self._num_stages)
            succ = (p, (s + 1) % self._num_stages)
            # The predecessor must be alive (not hit now, not already dead and covered);
            # the dead worker must not have been covering its successor, whose only
            # replica it held.
            if pred in hit or pred in covered or succ in covered:
                fatal = True
                break
            covered.add((p, s))
        if fatal:
            return self._rebuild("restart", ctx.alive, self._restart_terms(True), True)
        active = len(positions) - len(covered)
        if active <= 0 or 2 * len(covered) / active > BAMBOO_RECONFIGURE_FRACTION:
            return self._rebuild("reconfigure", ctx.alive, self._reconfigure_terms(True), False)
        return self._run("takeover", plan, BambooState(frozenset(covered)),
                         {"detect_s": self._recovery.detect_s}, False)

    def on_rejoin(self, base: Choice, returned: frozenset[int], ctx: EventContext) -> Choice:
        """Reconfigure when the returned nodes end an overload or add a pipeline."""
        if base.plan is None:
            return self._rebuild("restart", ctx.alive, self._restart_terms(False), True)
        state: BambooState = base.state if base.state is not None else BambooState()
        usable = min(len(ctx.alive), len(self._initial.workers))
        more = min(usable // self._num_stages,
                   self._initial.num_microbatches) > base.plan.num_pipelines
        if state.covered or more:
            return self._rebuild("reconfigure", ctx.alive, self._reconfigure_terms(False), False)
        return Choice(strategy=KEEP, plan=None)

    def priced(self, choice: Choice, slow: Mapping[int, float]) -> Choice:
        """``choice`` at the slow workers' speeds (see ``slow_step_time``)."""
        if self._slow_step_time is None:
            return choice
        return slowed(choice, slow, self._slow_step_time)

