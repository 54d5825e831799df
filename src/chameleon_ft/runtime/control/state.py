"""The coordinator's run state as one value, and the transitions that replace it.

Everything the coordinator knows about the run that decides what happens next (the
generation, its plan and migration, which placement the workers' state really has, who is
alive or idle, the pending second phase of a two-phase recovery, the checkpoints, the
retry count, the mode) lives in one frozen :class:`RunState`. Each event is a pure function from the
old state to the new one, so a half-applied change cannot exist and each transition is
tested without processes (tests/unit/test_runtime_state.py). The coordinator does the I/O
that a new state implies: when the generation number changes it ends the old generation
(its abort key, which releases workers blocked in a collective) and publishes the new one.

Pure Python: no torch, no store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.recovery.types import Migration


class Mode(StrEnum):
    """Where the run is. The run's state holds the modes it knows itself (training,
    draining, finished, failed: :attr:`RunState.mode`); the control value refines training
    into joining, relaunching, deciding and recovering
    (:func:`chameleon_ft.runtime.control.model.mode`)."""

    JOINING = "joining"
    """Workers are launched or admitted; nothing is published yet."""
    TRAINING = "training"
    """A generation runs steps."""
    DECIDING = "deciding"
    """A failure broke the generation; the policy is asked."""
    RECOVERING = "recovering"
    """A generation after a failure runs, and has not committed a step yet."""
    RELAUNCHING = "relaunching"
    """Every worker failed: they are relaunched, the checkpoint is reloaded when all are up."""
    DRAINING = "draining"
    """A stop was asked: the step in flight commits or is aborted, then the run ends."""
    FINISHED = "finished"
    """The run ended; the workers upload the final state and leave."""
    FAILED = "failed"
    """Training cannot go on; the workers were told to stop."""


@dataclass(frozen=True)
class Load:
    """Where a generation's workers take their layers' state from, besides what they hold."""

    kind: str
    """``init`` (the model's initial parameters) or ``restore`` (a checkpoint)."""
    step: int = 0
    """Committed steps of the checkpoint (``restore``)."""


INIT = Load("init")


@dataclass(frozen=True)
class PendingSwitch:
    """A plan to switch to at a step boundary, with the migration that prepares it."""

    plan: ExecutionPlan
    migration: Migration | None
    at_step: int
    """Switch when this step commits."""
    rejoin: tuple[int, ...] = ()
    """Repaired (idle) workers the new plan folds back in."""

    @property
    def workers(self) -> frozenset[int]:
        """Every worker the switch needs alive: the new plan's and the migration's."""
        return world_of(self.plan, self.migration)


def world_of(plan: ExecutionPlan, migration: Migration | None) -> frozenset[int]:
    """Workers taking part in a generation: the plan's and every migration sender."""
    world = set(plan.workers)
    if migration is not None:
        for t in migration.transfers:
            world.update((t.src, t.dst))
    return frozenset(world)


@dataclass(frozen=True)
class RunState:
    """Everything the coordinator decides from. Replaced as a whole by each transition."""

    gen: int
    """The current generation (a plan with its process groups under ``gen{g}/``)."""
    plan: ExecutionPlan
    """The plan the current generation runs."""
    state_plan: ExecutionPlan
    """The placement the workers' state matches: the plan of the last generation that
    committed a step (a generation that fails before its first commit leaves the older
    placement intact, and the next decision starts from it)."""
    migration: Migration | None
    """The migration the current generation starts with (done once a step commits)."""
    load: Load | None
    """What the current generation loads before its first step (done once a step commits)."""
    alive: frozenset[int]
    """Workers believed alive: in the plan, migration sources, or idle."""
    idle: frozenset[int]
    """Alive workers outside every plan (repaired and kept idle, or dropped by a plan);
    each later decision may use them, and their death breaks nothing."""
    next_step: int
    """The first step not committed."""
    stateless: frozenset[int] = frozenset()
    """Worker ids whose process died since ``state_plan`` last committed: a replacement
    that took such an id holds none of the state ``state_plan`` places on it."""
    pending: PendingSwitch | None = None
    """The second phase of a two-phase recovery or a re-join, waiting for its step."""
    from_checkpoint: bool = True
    """No step committed since the state was (re)loaded: only a restart is consistent."""
    epoch: int = 0
    """The generation that last (re)loaded the state; checkpoint uploads of earlier
    generations belong to an abandoned timeline and are refused."""
    checkpoints: tuple[int, ...] = (0,)
    """Committed-step counts with a complete checkpoint (0: the initial state), ascending."""
    retries: int = 0
    """Recoveries from errors no death explains since the last commit."""
    mode: Mode = Mode.TRAINING
    """Training, draining, finished or failed (the control value refines training)."""
    reason: str = ""
    """Why training stopped (``FAILED``) or drains."""

    @property
    def holding(self) -> frozenset[int]:
        """Alive workers that hold the state ``state_plan`` places on them."""
        return self.alive - self.stateless

    @property
    def world(self) -> frozenset[int]:
        """Workers taking part in the current generation."""
        return world_of(self.plan, self.migration)

    @property
    def switch_due(self) -> bool:
        """Whether the pending switch happens after the step in flight commits."""
        return self.pending is not None and self.next_step >= self.pending.at_step

    def latest_checkpoint(self, at_most: int | None = None) -> int:
        """The newest complete checkpoint at or before ``at_most`` committed steps."""
        limit = self.next_step if at_most is None else at_most
        return max((c for c in self.checkpoints if c <= limit), default=0)


def start(plan: ExecutionPlan, workers: Iterable[int], *, step: int = 0,
          load: Load = INIT) -> RunState:
    """The state of a run about to publish generation 0 of ``plan``.

    Args:
        plan: the initial plan.
        workers: every worker that joined.
        step: the first step (the checkpoint's committed steps when resuming).
        load: ``INIT``, or ``Load("restore", step)`` when resuming.
    """
    alive = frozenset(workers)
    return RunState(gen=0, plan=plan, state_plan=plan, migration=None, load=load, alive=alive,
                    idle=alive - frozenset(plan.workers), next_step=step,
                    checkpoints=(step,))


def workers_died(state: RunState, dead: Iterable[int]) -> tuple[RunState, bool]:
    """Workers died (exit, heartbeat, own error report).

    Returns:
        The new state and whether the current generation is broken: only the death of a
        worker taking part in it is. An idle worker's death changes nothing else. A
        pending switch that needs a dead worker is dropped (its migration sources or its
        plan are gone); the next decision starts from the running plan.
    """
    gone = frozenset(dead) & state.alive
    if not gone:
        return state, False
    pending = state.pending
    if pending is not None and pending.workers & gone:
        pending = None
    elif pending is not None and set(pending.rejoin) & gone:  # an idle worker it folds in
        pending = replace(pending, rejoin=tuple(w for w in pending.rejoin if w not in gone))
    new = replace(state, alive=state.alive - gone, idle=state.idle - gone, pending=pending,
                  stateless=state.stateless | gone)
    return new, bool(gone & state.world)


def decision_inputs(state: RunState) -> tuple[ExecutionPlan, frozenset[int], frozenset[int]]:
    """What a recovery decision starts from: the placement the state really has, the
    workers of it whose state is gone (dead, or replaced by a process that holds
    nothing), and the workers the policy may use (holders, and idle workers outside the
    placement; a replacement under an id of the placement, live or rerouted, waits for a
    re-join).
    """
    base = state.state_plan
    placed = frozenset(base.workers)
    failed = placed - state.holding
    # a replacement under the id of a stage the placement reroutes is not offered either:
    # the policy would take it for the stage's own worker back and hand it its stage
    # without copying any state (it joins through a re-join, which migrates)
    usable = state.holding | (state.alive - placed - (base.dead_workers & state.stateless))
    return base, failed, usable


@dataclass(frozen=True)
class Recovery:
    """A policy decision, in the terms the state needs."""

    strategy: str
    plan: ExecutionPlan
    """The plan to train on (for reroute-then-dynamic: the final, dynamic plan)."""
    migration: Migration | None = None
    restored_step: int | None = None
    """``restart``: the committed steps of the checkpoint it reloads."""
    interim: ExecutionPlan | None = None
    """``reroute-then-dynamic``: the rerouted plan to train on until the switch."""
    switch_after: int = 1
    """``reroute-then-dynamic``: steps on the interim plan before switching."""


def recovered(state: RunState, rec: Recovery) -> RunState:
    """Start the generation that a recovery decision asks for.

    Any pending switch is replaced: it was planned for a state that no longer exists.

    Raises:
        ValueError: when the plan names a worker that is not alive, or a restart has no
            checkpoint step.
    """
    world = world_of(rec.plan, rec.migration)
    if rec.interim is not None:
        world |= frozenset(rec.interim.workers)
    unknown = world - state.alive
    if unknown:
        raise ValueError(f"the {rec.strategy} plan uses workers {sorted(unknown)} that are "
                         "not alive")
    gen = state.gen + 1
    if rec.strategy == "restart":
        if rec.restored_step is None:
            raise ValueError("a restart needs the checkpoint step it reloads")
        step = rec.restored_step
        return replace(state, gen=gen, plan=rec.plan, migration=None,
                       load=Load("restore", step) if step else INIT, next_step=step,
                       pending=None, from_checkpoint=True, epoch=gen,
                       idle=state.alive - frozenset(rec.plan.workers),
                       checkpoints=tuple(c for c in state.checkpoints if c <= step) or (step,))
    if rec.strategy == "reroute-then-dynamic" and rec.interim is not None:
        pending = PendingSwitch(rec.plan, rec.migration,
                                at_step=state.next_step + max(1, rec.switch_after) - 1)
        return replace(state, gen=gen, plan=rec.interim, migration=None, load=None,
                       pending=pending, idle=state.alive - frozenset(rec.interim.workers))
    return replace(state, gen=gen, plan=rec.plan, migration=rec.migration, load=None,
                   pending=None, idle=state.alive - world)


class RetryAction(StrEnum):
    """What to do about errors that no death explains."""

    RETRY = "retry"
    """Rebuild the groups and redo the generation as it was published."""
    RESTART = "restart"
    """Retries are spent: reload the last checkpoint."""
    STOP = "stop"
    """A restart did not help either: stop with the reason."""


def retry_action(state: RunState, max_retries: int) -> RetryAction:
    """The bounded escalation: ``max_retries`` retries, then one restart, then stop."""
    if state.retries < max_retries:
        return RetryAction.RETRY
    if state.retries == max_retries:
        return RetryAction.RESTART
    return RetryAction.STOP


def retried(state: RunState) -> RunState:
    """Republish the current generation (plan, migration, load) under a new number.

    The workers' state is what it was when the generation started (nothing commits
    before the errors, or the commits made the migration and load part of the state), so
    redoing the same directive is consistent; the plan names only live workers because a
    death would have been a failure, not a retry.

    Raises:
        ValueError: when the generation names a worker that is no longer alive.
    """
    dead = state.world - state.alive
    if dead:
        raise ValueError(f"cannot retry generation {state.gen}: workers {sorted(dead)} are "
                         "dead; that is a failure to recover from")
    return replace(state, gen=state.gen + 1, retries=state.retries + 1)


def escalated(state: RunState, plan: ExecutionPlan, restored_step: int) -> RunState:
    """Retries are spent: restart from a checkpoint, counting it as one more retry."""
    new = recovered(state, Recovery("restart", plan, restored_step=restored_step))
    return replace(new, retries=state.retries + 1)


def software_restart(state: RunState) -> RunState:
    """A job-level software fault (a bug, a communication library's watchdog): no hardware
    is lost, every worker of the running plan reloads the last checkpoint and training
    goes on from it on the same plan (what the simulator models, ``sim.engine``).

    The running plan is the current generation's: a recovery in progress restarts on the
    plan it was moving to (loading the checkpoint replaces its migration), and a pending
    switch is dropped, as a restart drops it.

    Raises:
        ValueError: when training is not running, or the running plan names a worker that
            is not alive (that death is a failure to recover from first).
    """
    if state.mode is not Mode.TRAINING:
        raise ValueError(f"no software restart while {state.mode.value}")
    return recovered(state, Recovery("restart", state.plan,
                                     restored_step=state.latest_checkpoint()))


def committed(state: RunState, step: int) -> RunState:
    """Every worker of the generation reduced ``step`` and the verdict was written.

    Raises:
        ValueError: when ``step`` is not the step in flight.
    """
    if step != state.next_step:
        raise ValueError(f"step {step} committed, but step {state.next_step} was in flight")
    return replace(state, next_step=step + 1, state_plan=state.plan, migration=None,
                   load=None, from_checkpoint=False, retries=0,
                   stateless=state.stateless - frozenset(state.plan.workers))


def switched(state: RunState) -> RunState:
    """The pending switch happens: a new generation on its plan, with its migration.

    Raises:
        ValueError: when nothing is pending.
    """
    pending = state.pending
    if pending is None:
        raise ValueError("no switch is pending")
    # the workers it folds in are idle, so alive already (one that died since is not)
    return replace(state, gen=state.gen + 1, plan=pending.plan, migration=pending.migration,
                   load=None, pending=None,
                   idle=state.alive - world_of(pending.plan, pending.migration))


def rejoin_ready(state: RunState, workers: Iterable[int]) -> RunState:
    """Repaired workers are up; they wait idle until a plan uses them."""
    ready = frozenset(workers)
    return replace(state, alive=state.alive | ready, idle=state.idle | ready)


def rejoin_planned(state: RunState, plan: ExecutionPlan, migration: Migration | None,
                   workers: Iterable[int]) -> RunState:
    """The policy folds idle workers back in at the next step boundary.

    Raises:
        ValueError: when a switch is already pending or the plan needs dead workers.
    """
    if state.pending is not None:
        raise ValueError("a switch is already pending")
    pending = PendingSwitch(plan, migration, at_step=state.next_step,
                            rejoin=tuple(sorted(frozenset(workers) & state.idle)))
    unknown = pending.workers - state.alive
    if unknown:
        raise ValueError(f"the re-join plan uses workers {sorted(unknown)} that are not alive")
    return replace(state, pending=pending)


def checkpoint_acceptable(state: RunState, step: int, gen: int) -> bool:
    """Whether a checkpoint written after ``step`` committed steps by ``gen`` may become
    complete: not from a generation before the last (re)load (an abandoned timeline), not
    ahead of the committed steps, not one that exists."""
    return gen >= state.epoch and step <= state.next_step and step not in state.checkpoints


def checkpoint_complete(state: RunState, step: int, gen: int,
                        keep: int | None = None) -> tuple[RunState, bool]:
    """The checkpoint after ``step`` committed steps from ``gen`` is complete (its
    manifest is written).

    Args:
        state: the run.
        step: its committed steps.
        gen: the generation that wrote it.
        keep: complete checkpoints kept on disk (older ones are deleted, so forgotten).

    Returns:
        The new state and whether the checkpoint was accepted (see
        :func:`checkpoint_acceptable`).
    """
    if not checkpoint_acceptable(state, step, gen):
        return state, False
    done = tuple(sorted((*state.checkpoints, step)))
    if keep is not None:
        done = done[-keep:]
    return replace(state, checkpoints=done), True


def checkpoint_corrupt(state: RunState, step: int) -> RunState:
    """A complete checkpoint turned out corrupt: it is forgotten (never loaded again)."""
    return replace(state, checkpoints=tuple(c for c in state.checkpoints if c != step))


def draining(state: RunState, reason: str) -> RunState:
    """A stop was asked: finish (or abort) the step in flight, checkpoint, stop."""
    if state.mode is not Mode.TRAINING:
        return state
    return replace(state, mode=Mode.DRAINING, reason=reason, pending=None)


def finished(state: RunState) -> RunState:
    """Training is over: the final generation tells every worker to stop."""
    return replace(state, gen=state.gen + 1, mode=Mode.FINISHED, pending=None)


def stopped(state: RunState, reason: str) -> RunState:
    """Training cannot go on."""
    return replace(state, gen=state.gen + 1, mode=Mode.FAILED, reason=reason, pending=None)
