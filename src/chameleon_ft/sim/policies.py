"""The policies the simulator compares, behind one small interface.

A policy turns an event (failure or repair) and the last committed plan into a
:class:`Choice`: the plan to run next, its speed, the stall before it runs, and whether
the job rolls back to its last checkpoint. The engine owns time and accounting; policies
own only the decision.

- ``chameleon``, ``reroute``, ``recycle``, ``dynamic``, ``restart``, ``shrink``,
  ``swap``: the planner's decision under that policy (Eq. 8 with an estimated horizon for
  ``chameleon``; ``swap`` puts idle workers, the warm spares, in the failed workers'
  places and restarts when too few are idle); ``oobleck`` is in ``peers.py``.
- ``oracle``: the planner's candidates scored by Eq. 8 with the TRUE time to the next
  event of the trace, an upper bound on what any choice among the same candidates does
  over that window.
- ``bamboo``: redundant computation modelled from published figures (docs/design.md,
  "Sources of the defaults"); the constants and rules are documented on
  :class:`BambooPolicy`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.spec.recovery import RecoverySpec
from chameleon_ft.spec.scenario import POLICY_NAMES

KEEP = "keep"
"""Strategy name of a rejoin decision that leaves the plan as it is."""
DOWN = "down"
"""Strategy name when no plan can run: the job waits for hardware to come back."""


@dataclass(frozen=True)
class Choice:
    """What a policy decided, in the engine's terms."""

    strategy: str
    """The strategy taken (``reroute``, ``dynamic``, ``restart``, ``shrink``, ``keep``...)."""
    plan: ExecutionPlan | None
    """The plan that runs after the stall; ``None`` when nothing can run (job down)."""
    step_s: float = 0.0
    """Step time of ``plan``."""
    throughput_samples_s: float = 0.0
    """Samples per second while ``plan`` runs."""
    stall_s: float = 0.0
    """Seconds without progress before ``plan`` runs (the transition, minus rolled-back work)."""
    terms: tuple[tuple[str, float], ...] = ()
    """The stall by cause (``detect_s``, ``comm_s``, ``restart_s``...), summing to ``stall_s``."""
    rollback: bool = False
    """Restart from the last checkpoint: the engine discards the work done since it."""
    from_memory: bool = False
    """With ``rollback``: the checkpoint is read from other hosts' memory (``[recovery]
    memory_checkpoint``), so only the work since the last copy there is discarded."""
    state: Any = field(default=None, compare=False)
    """Policy-private data carried to the next decision (Bamboo's covered stages)."""
    then: Choice | None = None
    """A second phase: after ``plan`` has run ``then_after_s`` (rounded up to whole steps),
    switch to this choice (its ``stall_s`` is the switch pause). For reroute-then-dynamic."""
    then_after_s: float = 0.0
    """How long ``plan`` runs before ``then`` takes over."""

    @property
    def keep(self) -> bool:
        """Whether the plan stays as it is (no interruption, no transition)."""
        return self.strategy == KEEP


@dataclass(frozen=True)
class EventContext:
    """What the engine knows at an event, handed to the policy."""

    alive: frozenset[int]
    """Every live worker after the event, idle ones too."""
    now_s: float
    """Simulated time of the event."""
    next_event_in_s: float
    """True time until the next trace event (or the end); only the oracle may look."""
    since_checkpoint_s: float
    """Training time done since the last checkpoint (what a restart would redo)."""
    since_memory_checkpoint_s: float = 0.0
    """Training time done since the last copy of the state in memory (what a reload from
    memory would redo; ``[recovery] memory_checkpoint``)."""


class SimPolicy(Protocol):
    """The interface the engine drives."""

    name: str

    def start(self) -> Choice:
        """The failure-free plan at time 0."""
        ...

    def on_failure(self, base: Choice, failed: frozenset[int], ctx: EventContext) -> Choice:
        """Decide after ``failed`` workers (of ``base.plan``) died."""
        ...

    def on_rejoin(self, base: Choice, returned: frozenset[int], ctx: EventContext) -> Choice:
        """Decide whether to use the ``returned`` workers (``keep`` leaves ``base`` running)."""
        ...


def terms_choice(strategy: str, plan: ExecutionPlan | None, *, step_s: float,
                 throughput_samples_s: float, transition_s: float, terms: Mapping[str, float],
                 rollback: bool, state: Any = None, from_memory: bool = False) -> Choice:
    """Build a :class:`Choice` from a priced candidate.

    With ``rollback`` the candidate's ``lost_s`` term (its estimate of the work lost since
    the checkpoint) is left out of the stall: the engine charges the exact lost work. So is
    ``lost_step_s`` (the expected step in flight): the engine charges the exact partial
    step of every failure.

    Args:
        strategy: the strategy name.
        plan: the plan, or ``None``.
        step_s: its step time.
        throughput_samples_s: its throughput.
        transition_s: the candidate's whole transition.
        terms: the transition by cause.
        rollback: whether the job restarts from its checkpoint.
        state: policy-private data.
        from_memory: with ``rollback``, the checkpoint is read from memory.

    Returns:
        The choice, with a ``transition_other_s`` term for any part the terms do not name.
    """
    named = {k: float(v) for k, v in terms.items() if v}
    stall_s = float(transition_s) - named.pop("lost_step_s", 0.0)
    if rollback:
        stall_s -= named.pop("lost_s", 0.0)
    stall_s = max(stall_s, 0.0)
    rest = stall_s - sum(named.values())
    if rest > 1e-9 * max(1.0, stall_s):
        named["transition_other_s"] = rest
    return Choice(strategy=strategy, plan=plan, step_s=float(step_s),
                  throughput_samples_s=float(throughput_samples_s), stall_s=stall_s,
                  terms=tuple(sorted(named.items())), rollback=rollback, state=state,
                  from_memory=rollback and from_memory)


def software_restart(base: Choice, recovery: RecoverySpec, *,
                     memory_load_s: float | None = None) -> Choice:
    """A job-level software fault: every process restarts from the checkpoint, same plan.

    Args:
        base: the running (or pending) choice.
        recovery: detection, restart and load times.
        memory_load_s: the plan's read of its state from other hosts' memory, when the
            job keeps copies there (every host is up after a software fault); ``None``:
            the checkpoint is read from storage (``checkpoint_load_s``).

    Returns:
        ``base`` with a restart stall in front and a rollback.
    """
    load_s = recovery.checkpoint_load_s if memory_load_s is None else memory_load_s
    terms = dict(base.terms)
    for name, value in (("detect_s", recovery.detect_s), ("restart_s", recovery.restart_s),
                        ("load_s", load_s)):
        terms[name] = terms.get(name, 0.0) + value
    stall_s = base.stall_s + recovery.detect_s + recovery.restart_s + load_s
    return replace(base, stall_s=stall_s, terms=tuple(sorted(terms.items())), rollback=True,
                   from_memory=memory_load_s is not None)


# ----------------------------------------------------------------------- planner policies
class PlannerLike(Protocol):
    """The part of ``chameleon_ft.policy.Planner`` the simulator uses."""

    @property
    def initial_plan(self) -> ExecutionPlan: ...

    @property
    def failure_free(self) -> Any: ...

    def decide(self, plan: ExecutionPlan, failed: Collection[int], *,
               alive: Collection[int] | None = None, now_s: float = 0.0,
               horizon_s: float | None = None, policy: str | None = None,
               since_checkpoint_s: float | None = None, compare: bool = True,
               detail: bool = True, hide_search: bool = False,
               since_memory_checkpoint_s: float | None = None) -> Any: ...

    def decide_rejoin(self, plan: ExecutionPlan, returned: Collection[int], *,
                      alive: Collection[int] | None = None, now_s: float = 0.0,
                      horizon_s: float | None = None, policy: str | None = None,
                      detail: bool = True, hide_search: bool = False) -> Any: ...


def decision_choice(decision: Any, recovery: RecoverySpec) -> Choice:
    """Turn a planner ``Decision`` into a :class:`Choice`.

    The simulator asks the planner to price plan search as hidden (``hide_search``): a
    simulation must not depend on how fast this machine searched (a replay would differ
    in the last digits, and near-ties could flip), and docs/design.md 3.5 precomputes plans
    for likely failures while training is healthy.

    Args:
        decision: a ``chameleon_ft.policy.Decision``.
        recovery: the job's recovery settings.

    Returns:
        The choice; ``keep`` for a rejoin not worth it.
    """
    chosen = decision.chosen
    strategy = str(chosen.strategy)
    if strategy == KEEP:
        return Choice(strategy=KEEP, plan=None)
    rollback = chosen.rollback is not None
    from_memory = str(chosen.rollback) == "memory"
    if chosen.interim_step_s is None:
        return terms_choice(strategy, chosen.plan, step_s=chosen.step_s,
                            throughput_samples_s=chosen.throughput_samples_s,
                            transition_s=chosen.transition_s, terms=chosen.terms,
                            rollback=rollback, from_memory=from_memory)
    # Two phases: the interim (rerouted) plan runs while state migrates in the background,
    # then a short switch to the final plan.
    final = terms_choice(strategy, chosen.plan, step_s=chosen.step_s,
                         throughput_samples_s=chosen.throughput_samples_s,
                         transition_s=chosen.switch_s, terms=chosen.switch_terms,
                         rollback=False)
    first = terms_choice(strategy, chosen.interim_plan, step_s=chosen.interim_step_s,
                         throughput_samples_s=decision.plan.global_batch / chosen.interim_step_s,
                         transition_s=chosen.transition_s, terms=chosen.terms,
                         rollback=rollback)
    return replace(first, then=final, then_after_s=chosen.interim_s)


class PlannerPolicy:
    """A policy backed by the planner: ``chameleon``, a fixed strategy, or ``oracle``."""

    def __init__(self, name: str, planner: PlannerLike, recovery: RecoverySpec) -> None:
        """Wrap ``planner`` as the policy ``name``.

        Args:
            name: ``chameleon``, ``reroute``, ``dynamic``, ``restart``, ``shrink`` or
                ``oracle`` (chameleon's candidates scored with the true horizon).
            planner: the job's planner (it caches decisions per failure pattern).
            recovery: restart and load times, for restarting a job that was down.
        """
        self.name = name
        self._planner = planner
        self._policy = "chameleon" if name == "oracle" else name
        self._oracle = name == "oracle"
        self._recovery = recovery

    def start(self) -> Choice:
        """The initial plan at its failure-free speed."""
        est = self._planner.failure_free
        return Choice(strategy="initial", plan=self._planner.initial_plan, step_s=est.step_s,
                      throughput_samples_s=est.throughput_samples_s)

    def _horizon(self, ctx: EventContext) -> float | None:
        return max(ctx.next_event_in_s, 1e-9) if self._oracle else None

    def on_failure(self, base: Choice, failed: frozenset[int], ctx: EventContext) -> Choice:
        """The planner's decision from ``base.plan``."""
        if base.plan is None:
            return base
        try:
            decision = self._planner.decide(
                base.plan, failed, alive=ctx.alive,
                now_s=ctx.now_s, horizon_s=self._horizon(ctx), policy=self._policy,
                since_checkpoint_s=ctx.since_checkpoint_s, compare=False, detail=False,
                hide_search=True, since_memory_checkpoint_s=ctx.since_memory_checkpoint_s)
        except ValueError:
            # No feasible recovery (too few workers, or a layer lost without checkpoints):
            # the job waits for hardware to come back.
            return Choice(strategy=DOWN, plan=None)
        return decision_choice(decision, self._recovery)

    def on_rejoin(self, base: Choice, returned: frozenset[int], ctx: EventContext) -> Choice:
        """The planner's rejoin decision, or a restart from the checkpoint when down."""
        if base.plan is not None:
            if self._policy not in ("chameleon", "dynamic", "reroute", "recycle", "shrink"):
                # Planner.decide_rejoin: restart keeps the plan (reroute and recycle give
                # returned workers their stages back, shrink re-admits whole replicas,
                # dynamic re-plans). Answering here skips pricing a plan it would not take.
                return Choice(strategy=KEEP, plan=None)
            decision = self._planner.decide_rejoin(
                base.plan, returned, alive=ctx.alive,
                now_s=ctx.now_s, horizon_s=self._horizon(ctx), policy=self._policy,
                detail=False, hide_search=True)
            return decision_choice(decision, self._recovery)
        # The job was down: it can only restart from its checkpoint on what is alive now.
        initial = self._planner.initial_plan
        missing = frozenset(initial.workers) - ctx.alive
        if not missing:
            start = self.start()
            rec = self._recovery
            return terms_choice("restart", initial, step_s=start.step_s,
                                throughput_samples_s=start.throughput_samples_s,
                                transition_s=rec.restart_s + rec.checkpoint_load_s,
                                terms={"restart_s": rec.restart_s,
                                       "load_s": rec.checkpoint_load_s},
                                rollback=True)
        try:
            decision = self._planner.decide(
                initial, missing, alive=ctx.alive,
                now_s=ctx.now_s, horizon_s=self._horizon(ctx), policy="restart",
                since_checkpoint_s=0.0, compare=False, detail=False, hide_search=True)
        except ValueError:
            return Choice(strategy=DOWN, plan=None)
        return decision_choice(decision, self._recovery)


# ----------------------------------------------------------------------- Bamboo
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


class BambooPolicy:
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
                 tax: float = BAMBOO_TAX, name: str = "bamboo") -> None:
        """Model Bamboo on a job.

        Args:
            initial: the failure-free plan (its layout is Bamboo's pipeline layout).
            failure_free_step_s: the step time of ``initial`` without redundancy.
            step_time: step time of a plan (the estimator), called once per pipeline count.
            recovery: detection, restart and load times.
            tax: the steady throughput tax.
            name: the policy name in reports.
        """
        self.name = name
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


def policy_names(names: Sequence[str]) -> tuple[str, ...]:
    """Check a list of policy names.

    Raises:
        ValueError: for an unknown or repeated name.
    """
    out = []
    for name in names:
        name = name.strip()
        if name not in POLICY_NAMES:
            raise ValueError(f"--policies: unknown policy {name!r}; choose from "
                             f"{', '.join(POLICY_NAMES)}")
        if name in out:
            raise ValueError(f"--policies: {name!r} is listed twice")
        out.append(name)
    if not out:
        raise ValueError("--policies: name at least one policy")
    return tuple(out)
