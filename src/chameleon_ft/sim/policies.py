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
- ``bamboo`` (``bamboo.py``): redundant computation modelled from published figures
  (docs/design.md, "Sources of the defaults").
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from chameleon_ft.plan import ExecutionPlan
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
    nominal: Choice | None = field(default=None, compare=False, repr=False)
    """The same choice at full speed, when this one is priced at slow workers' speeds
    (:func:`slowed`); ``None``: nothing in ``plan`` runs slow."""

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
    """The interface the engine drives; a trace with fail-slows also asks
    :class:`SlowPolicy`'s methods."""

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


class SlowPolicy(Protocol):
    """What the engine asks a policy about fail-slows (every policy here answers)."""

    def priced(self, choice: Choice, slow: Mapping[int, float]) -> Choice:
        """``choice`` at the speeds of the ``slow`` workers (worker -> factor)."""
        ...

    def on_slow(self, base: Choice, worker: int, factor: float, slow: Mapping[int, float],
                ctx: EventContext) -> Choice:
        """Answer ``worker`` of ``base.plan`` running ``factor`` times slower (``slow``:
        every slow worker, it included); ``keep`` leaves ``base`` running."""
        ...

    def on_slow_end(self, base: Choice, worker: int, slow: Mapping[int, float],
                    ctx: EventContext) -> Choice:
        """Answer ``worker`` of ``base.plan`` running at full speed again (``slow``: the
        workers still slow)."""
        ...


def slowed(choice: Choice, slow: Mapping[int, float],
           step_s: Callable[[ExecutionPlan, Mapping[int, float]], float]) -> Choice:
    """``choice`` at the ``slow`` workers' speeds: its step stretched by what the slow
    workers cost its plan by ``step_s(plan, slow)`` (the estimator at those speeds) over
    ``step_s(plan, {})``; the full-speed choice itself when none of them runs in it.

    Args:
        choice: a choice (priced at full speed, or already slowed).
        slow: worker -> factor of every slow worker.
        step_s: a plan's step seconds at the given factors.

    Returns:
        The choice to run; its ``nominal`` is the full-speed one.
    """
    base = choice.nominal if choice.nominal is not None else choice
    plan = base.plan
    if plan is None or not any(w in plan.stage_of_worker for w in slow):
        return base
    ratio = step_s(plan, slow) / step_s(plan, {})
    return replace(base, step_s=base.step_s * ratio,
                   throughput_samples_s=base.throughput_samples_s / ratio, nominal=base)


def fail_stop(policy: SimPolicy, recovery: RecoverySpec, base: Choice, worker: int,
              ctx: EventContext) -> Choice:
    """A peer's answer to a slow worker: none with ``slow_policy = "keep"``, else the
    worker treated as dead (the common practice, a fail-slow handled as a fail-stop),
    through the policy's own failure path."""
    if recovery.slow_policy == "keep" or base.plan is None:
        return Choice(strategy=KEEP, plan=None)
    return policy.on_failure(base, frozenset({worker}), replace(ctx, alive=ctx.alive - {worker}))


class FailStopOnSlow:
    """For a peer with no answer to a slow worker but its failure path (:func:`fail_stop`)
    and nothing to do when the worker runs at full speed again. Its class has
    ``_recovery`` and ``on_failure``."""

    _recovery: RecoverySpec

    def on_slow(self, base: Choice, worker: int, factor: float, slow: Mapping[int, float],
                ctx: EventContext) -> Choice:
        """``worker`` treated as dead (:func:`fail_stop`), or ``keep``."""
        policy: Any = self  # a SimPolicy: the class that mixes this in has on_failure
        return fail_stop(policy, self._recovery, base, worker, ctx)

    def on_slow_end(self, base: Choice, worker: int, slow: Mapping[int, float],
                    ctx: EventContext) -> Choice:
        """Nothing to do: the worker runs at full speed again."""
        return Choice(strategy=KEEP, plan=None)


class PlannerPriced:
    """For a policy whose plans are priced at the slow workers' speeds by its own
    planner's estimate (``estimate_slow``). Its class has ``_planner``."""

    _planner: Any

    def priced(self, choice: Choice, slow: Mapping[int, float]) -> Choice:
        """``choice`` at the slow workers' speeds (the planner's estimate)."""
        return slowed(choice, slow, self._step_s)

    def _step_s(self, plan: ExecutionPlan, slow: Mapping[int, float]) -> float:
        return float(self._planner.estimate_slow(plan, slow).step_s)


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

    def decide_slow(self, plan: ExecutionPlan, worker: int, factor: float, *,
                    alive: Collection[int] | None = None,
                    slow: Mapping[int, float] | None = None, now_s: float = 0.0,
                    horizon_s: float | None = None, policy: str | None = None,
                    slow_policy: str | None = None, hide_search: bool = False,
                    since_checkpoint_s: float | None = None,
                    since_memory_checkpoint_s: float | None = None) -> Any: ...

    def decide_slow_end(self, plan: ExecutionPlan, worker: int, *,
                        alive: Collection[int] | None = None,
                        slow: Mapping[int, float] | None = None, now_s: float = 0.0,
                        horizon_s: float | None = None, policy: str | None = None,
                        slow_policy: str | None = None, hide_search: bool = False) -> Any: ...

    def estimate_slow(self, plan: ExecutionPlan, slow: Mapping[int, float]) -> Any: ...


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


class PlannerPolicy(PlannerPriced):
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

    def on_slow(self, base: Choice, worker: int, factor: float, slow: Mapping[int, float],
                ctx: EventContext) -> Choice:
        """The planner's answer to a slow worker (``Planner.decide_slow``)."""
        if base.plan is None:
            return Choice(strategy=KEEP, plan=None)
        try:
            decision = self._planner.decide_slow(
                base.plan, worker, factor, alive=ctx.alive, slow=slow, now_s=ctx.now_s,
                horizon_s=self._horizon(ctx), policy=self._policy, hide_search=True,
                since_checkpoint_s=ctx.since_checkpoint_s,
                since_memory_checkpoint_s=ctx.since_memory_checkpoint_s)
        except ValueError:
            return Choice(strategy=KEEP, plan=None)
        return decision_choice(decision, self._recovery)

    def on_slow_end(self, base: Choice, worker: int, slow: Mapping[int, float],
                    ctx: EventContext) -> Choice:
        """The planner's answer to a slowdown's end (``Planner.decide_slow_end``)."""
        if base.plan is None:
            return Choice(strategy=KEEP, plan=None)
        decision = self._planner.decide_slow_end(
            base.plan, worker, alive=ctx.alive, slow=slow, now_s=ctx.now_s,
            horizon_s=self._horizon(ctx), policy=self._policy, hide_search=True)
        return decision_choice(decision, self._recovery)


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
