"""The discrete-event loop: one trace, one policy, exact accounting of the work done.

Semantics (docs/design.md section 6, issue 4):

- At each failure the policy decides from the last COMMITTED plan (the one running, or
  the one a transition started from). The step in flight is lost: the engine tracks the
  step phase, so the lost work is exactly the time since the last step boundary.
- The transition (``Choice.stall_s``) makes no progress; then samples accrue at the chosen
  plan's throughput until the next event. A failure during a transition aborts it and
  decides again from the committed plan with every failure since.
- A restart rolls the samples back to the last checkpoint. Checkpoints are taken as the
  runtime takes them, every ``checkpoint_every`` committed steps (``[train]``; a step
  redone after a restart counts once), so a slower plan checkpoints less often in wall
  time; without it, at every multiple of ``checkpoint_interval_s`` of wall time, holding
  the last completed step. With checkpoints in memory (``[recovery] memory_checkpoint``)
  a copy is also taken every ``memory_checkpoint_every`` committed steps; a reload the
  policy reads from memory (``Choice.from_memory``; every software fault, all hosts being
  up) rolls back to the newer of that copy and the checkpoint, one from storage rolls
  back to the checkpoint and the copies in memory restart from it.
- A repair brings a node's workers back and asks the policy whether to use them (a rejoin
  during a transition waits for it to end). A job-level software fault restarts every
  process on the same plan from the checkpoint.
- Time lost is booked by cause in failure-free-equivalent seconds, so the causes add up to
  ``duration_s - samples / failure_free_throughput``. The wall seconds spent training steps
  whose work is kept (at whatever speed) are counted too (``training_s``).
- Fail-slows (``slow`` and ``slow-end`` rows): ``slowrun.py``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

from chameleon_ft.failures import SLOW_KINDS, EventKind, Trace, TraceEvent
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.sim.events import Commit, Respeed, SlowCheck, Switch
from chameleon_ft.sim.policies import DOWN, Choice, EventContext, SimPolicy, software_restart
from chameleon_ft.sim.slowrun import Horizons, SlowRun
from chameleon_ft.spec.recovery import RecoverySpec


@dataclass(frozen=True)
class RunResult:
    """What one policy achieved on one trace."""

    name: str
    """The policy."""
    duration_s: float
    """Simulated time."""
    samples: float
    """Samples trained (committed work) by the end."""
    failure_free_samples_s: float
    """Throughput of the failure-free plan without any policy overhead."""
    time_lost_s: tuple[tuple[str, float], ...]
    """Failure-free-equivalent seconds lost, by cause, sorted by cause."""
    decisions: tuple[tuple[str, int], ...]
    """Decisions taken, by strategy, sorted by strategy."""
    num_software_restarts: int
    """Job-level software faults that restarted the job."""
    timeline: tuple[tuple[float, float], ...]
    """``(time_s, samples_s)`` where the throughput changes; it holds until the next point."""
    training_s: float = 0.0
    """Wall seconds spent running steps whose work was kept (not lost in flight nor rolled
    back), at whatever speed the running plan had."""

    @property
    def avg_throughput_samples_s(self) -> float:
        """Samples per second over the whole duration."""
        return self.samples / self.duration_s

    @property
    def relative_to_failure_free(self) -> float:
        """Average throughput over the failure-free throughput."""
        return self.avg_throughput_samples_s / self.failure_free_samples_s

    @property
    def effective_training_time(self) -> float:
        """Committed work over wall time, the work counted in seconds at the failure-free
        speed (docs/design.md 6): the same figure as :attr:`relative_to_failure_free`,
        under the name the industry reports."""
        return self.samples / self.failure_free_samples_s / self.duration_s

    @property
    def training_time_share(self) -> float:
        """Share of the wall time spent training work that was kept, at any speed (a
        slower degraded plan counts in full): the time-only reading of effective training
        time, at least :attr:`effective_training_time` unless a plan runs faster than the
        failure-free one."""
        return self.training_s / self.duration_s

    @property
    def num_decisions(self) -> int:
        """Every decision the policy took."""
        return sum(n for _, n in self.decisions)


_Item = TraceEvent | Commit | Switch | Respeed | SlowCheck
"""What the event queue holds."""


class _Run(SlowRun):
    """Mutable state of one simulation; private to :func:`simulate`."""

    def __init__(self, trace: Trace, policy: SimPolicy, *, failure_free_samples_s: float,
                 recovery: RecoverySpec, workers_per_node: int, num_workers: int,
                 checkpoint_every_steps: int,
                 memory_load_s: Callable[[ExecutionPlan], float] | None) -> None:
        self.trace = trace
        self.policy = policy
        self.ff = failure_free_samples_s
        self.recovery = recovery
        self.workers_per_node = workers_per_node
        self.alive: set[int] = set(range(num_workers))
        self.now = 0.0
        self.samples = 0.0
        self.committed = policy.start()
        self.pending: Choice | None = None
        self.pending_failed: frozenset[int] = frozenset()
        self.deferred_returned: set[int] = set()
        self.token = 0
        self.run_start_s = 0.0
        self.run_start_samples = 0.0
        self.checkpoint_samples = 0.0
        self.since_checkpoint_s = 0.0
        # Checkpoints by committed steps (0: by wall time, ``checkpoint_interval_s``).
        self.checkpoint_every = checkpoint_every_steps
        self.steps = 0  # committed steps when the running plan started or last stopped
        self.run_start_steps = 0
        self.checkpoint_steps = 0
        # Wall seconds training kept work, now and at the last checkpoint.
        self.training_s = 0.0
        self.checkpoint_training_s = 0.0
        # Copies in memory every ``memory_every`` committed steps (0: none), the newest
        # one's samples, steps and training seconds, and the training since it.
        self.memory_every = (recovery.memory_checkpoint_every
                             if recovery.memory_checkpoint and recovery.checkpoint else 0)
        self.memory_load_s = memory_load_s
        self.memory_samples = 0.0
        self.memory_steps = 0
        self.memory_training_s = 0.0
        self.since_memory_s = 0.0
        self.lost: dict[str, float] = {}
        self.decisions: dict[str, int] = {}
        self.num_software = 0
        self.timeline: list[tuple[float, float]] = []
        self.queue: list[tuple[float, int, _Item]] = []
        self.seq = 0
        self.init_slow()
        self.mark()

    # ------------------------------------------------------------------ bookkeeping
    def _book(self, cause: str, seconds: float) -> None:
        if seconds:
            self.lost[cause] = self.lost.get(cause, 0.0) + seconds

    def _rate(self) -> float:
        if self.pending is not None or self.committed.plan is None:
            return 0.0
        return self.committed.throughput_samples_s

    def mark(self) -> None:
        rate = self._rate()
        if self.timeline and self.timeline[-1][0] == self.now:
            self.timeline[-1] = (self.now, rate)
        elif not self.timeline or self.timeline[-1][1] != rate:
            self.timeline.append((self.now, rate))

    def push(self, time_s: float, item: _Item) -> None:
        heapq.heappush(self.queue, (time_s, self.seq, item))
        self.seq += 1

    def _steps_in_run(self, at_s: float) -> int:
        """Whole steps the running plan completed from its start to ``at_s``."""
        return math.floor((at_s - self.run_start_s) / self.committed.step_s + 1e-9)

    def _completed_samples(self, at_s: float) -> float:
        """Samples at ``at_s`` counting only whole steps of the running plan."""
        return self._samples_at_step(self.run_start_steps + self._steps_in_run(at_s))

    def _samples_at_step(self, step: int) -> float:
        """Samples once the running plan committed ``step`` steps of the job."""
        choice = self.committed
        return self.run_start_samples + (
            (step - self.run_start_steps) * choice.step_s * choice.throughput_samples_s)

    def _last_multiple(self, to_s: float, every: int) -> int:
        """The newest committed-step count by ``to_s`` that is a multiple of ``every``."""
        done = self.run_start_steps + self._steps_in_run(to_s)
        return done - done % every

    def advance(self, to_s: float) -> None:
        """Let time run to ``to_s`` in the current state."""
        dt = to_s - self.now
        if dt <= 0:
            return
        if self.checkpoint_every:
            self._advance_by_steps(to_s, dt)
            self.now = to_s
            return
        interval = self.recovery.checkpoint_interval_s
        checkpoint_s = math.floor(to_s / interval) * interval
        crosses = self.recovery.checkpoint and checkpoint_s > self.now
        if self.pending is not None or self.committed.plan is None:
            self._stalled(dt)
            if crosses:
                # Nothing ran since the last step: the checkpoint holds the current state.
                self.checkpoint_samples = self.samples
                self.since_checkpoint_s = 0.0
                self.checkpoint_training_s = self.training_s
                self.checkpoint_steps = self.steps
        else:
            rate = self._train(dt)
            if crosses:
                # The checkpoint holds the last step completed before it.
                self.checkpoint_samples = self._completed_samples(checkpoint_s)
                self.checkpoint_steps = self.run_start_steps + self._steps_in_run(checkpoint_s)
                self._checkpointed_in_run(rate)
            self._copy_to_memory(to_s, rate)
        self.now = to_s

    def _stalled(self, dt: float) -> None:
        """``dt`` seconds without training: book them to what the job was doing."""
        if self.pending is None:
            self._book("down_s", dt)
        elif self.pending.terms:
            total = self.pending.stall_s
            for cause, seconds in self.pending.terms:
                self._book(cause, dt * seconds / total)
        else:
            self._book("transition_other_s", dt)

    def _train(self, dt: float) -> float:
        """``dt`` seconds of the running plan; returns its throughput."""
        rate = self.committed.throughput_samples_s
        self.samples += rate * dt
        nominal = self.committed.nominal
        if nominal is None:
            self._book("degraded_s", dt * (self.ff - rate) / self.ff)
        else:  # a slowed plan: its shortfall against itself at full speed is the slowdown's
            full = nominal.throughput_samples_s
            self._book("degraded_s", dt * (self.ff - full) / self.ff)
            self._book("slow_s", dt * (full - rate) / self.ff)
        self.since_checkpoint_s += dt
        self.since_memory_s += dt
        self.training_s += dt
        return rate

    def _copy_to_memory(self, to_s: float, rate: float) -> None:
        """The copies in memory after the running plan trained up to ``to_s``: the newest
        was taken when the last multiple of ``memory_every`` committed steps committed."""
        if not self.memory_every:
            return
        last = self._last_multiple(to_s, self.memory_every)
        if last > self.memory_steps:
            self.memory_steps = last
            self.memory_samples = self._samples_at_step(last)
            self.since_memory_s = (self.samples - self.memory_samples) / rate
            self.memory_training_s = self.training_s - self.since_memory_s

    def _checkpointed_in_run(self, rate: float) -> None:
        """A checkpoint of the running plan now holds ``checkpoint_samples``."""
        self.since_checkpoint_s = (self.samples - self.checkpoint_samples) / rate
        self.checkpoint_training_s = self.training_s - self.since_checkpoint_s

    def _advance_by_steps(self, to_s: float, dt: float) -> None:
        """:meth:`advance` when the job checkpoints every ``checkpoint_every`` committed
        steps, as the runtime does: nothing is written while no step commits."""
        if self.pending is not None or self.committed.plan is None:
            self._stalled(dt)
            return
        rate = self._train(dt)
        if not self.recovery.checkpoint:
            return
        self._copy_to_memory(to_s, rate)
        last = self._last_multiple(to_s, self.checkpoint_every)
        if last > self.checkpoint_steps:
            # The newest checkpoint was written when step ``last`` committed.
            self.checkpoint_steps = last
            self.checkpoint_samples = self._samples_at_step(last)
            self._checkpointed_in_run(rate)

    def interrupt(self) -> None:
        """Lose the step in flight of the running plan (if one runs)."""
        if self.pending is not None or self.committed.plan is None:
            return
        self.steps = self.run_start_steps + self._steps_in_run(self.now)
        completed = self._completed_samples(self.now)
        lost = self.samples - completed
        if lost > 0:
            self.samples = completed
            self._book("partial_step_s", lost / self.ff)
            lost_s = lost / self.committed.throughput_samples_s
            self.since_checkpoint_s = max(0.0, self.since_checkpoint_s - lost_s)
            self.since_memory_s = max(0.0, self.since_memory_s - lost_s)
            self.training_s -= lost_s

    def context(self, next_event_s: float) -> EventContext:
        alive = self.alive - self.excluded if self.excluded else self.alive
        return EventContext(alive=frozenset(alive), now_s=self.now,
                            next_event_in_s=next_event_s - self.now,
                            since_checkpoint_s=self.since_checkpoint_s,
                            since_memory_checkpoint_s=self.since_memory_s)

    def apply(self, choice: Choice, *, decided: bool = True) -> None:
        """Start the transition to ``choice`` (or go down); count it if a policy decided it."""
        if decided:
            self.decisions[choice.strategy] = self.decisions.get(choice.strategy, 0) + 1
        if choice.rollback:
            self._roll_back(choice.from_memory)
        self.token += 1
        if choice.plan is None:
            self.committed = Choice(strategy=DOWN, plan=None)
            self.pending = None
            self.pending_failed = frozenset()
            return
        self.pending = choice
        if choice.stall_s <= 0:
            self.commit()
        else:
            self.push(self.now + choice.stall_s, Commit(self.now + choice.stall_s, self.token))

    def _roll_back(self, from_memory: bool) -> None:
        """Discard the work since the checkpoint the reload reads: the newer of the copy in
        memory and the checkpoint when ``from_memory``, else the checkpoint (the copies in
        memory then start over from it)."""
        if from_memory and self.memory_every and self.memory_samples >= self.checkpoint_samples:
            lost = self.samples - self.memory_samples
            if lost > 0:
                self._book("lost_work_s", lost / self.ff)
                self.samples = self.memory_samples
            self.training_s = self.memory_training_s
            self.steps = self.memory_steps
            self.since_memory_s = 0.0
            self.since_checkpoint_s = self.training_s - self.checkpoint_training_s
            return
        lost = self.samples - self.checkpoint_samples
        if lost > 0:
            self._book("lost_work_s", lost / self.ff)
            self.samples = self.checkpoint_samples
        self.since_checkpoint_s = 0.0
        self.training_s = self.checkpoint_training_s
        self.steps = self.checkpoint_steps
        self.memory_samples = self.checkpoint_samples
        self.memory_training_s = self.checkpoint_training_s
        self.memory_steps = self.checkpoint_steps
        self.since_memory_s = 0.0

    def commit(self) -> None:
        """The pending transition ends; its plan runs from now."""
        assert self.pending is not None
        self.committed = self.priced(self.pending)
        self.pending = None
        self.pending_failed = frozenset()
        self.run_start_s = self.now
        self.run_start_samples = self.samples
        self.run_start_steps = self.steps
        self._schedule_switch()
        if self.slow or self.deferred_checks:
            self.after_commit()

    def _schedule_switch(self) -> None:
        """For a two-phase choice: switch at the first step boundary after the migration."""
        running = self.committed
        if running.then is None:
            return
        done_s = self.now + running.then_after_s
        steps = math.ceil((done_s - self.run_start_s) / running.step_s - 1e-9)
        at_s = self.run_start_s + max(steps, 0) * running.step_s
        self.push(at_s, Switch(at_s, self.token))

    def on_switch(self, switch: Switch) -> None:
        """Second phase of a two-phase recovery: pause briefly, then run the final plan."""
        then = self.committed.then
        if switch.token != self.token or self.pending is not None or then is None:
            return  # a later event changed the plan
        self.interrupt()
        self.apply(then, decided=False)

    # ------------------------------------------------------------------ events
    def on_failure(self, event: TraceEvent, next_event_s: float) -> None:
        hit = set(event.workers(self.workers_per_node)) & self.alive
        self.alive -= hit
        self.deferred_returned -= hit
        if self.speed_seq:
            self.died(hit)
        base_plan = self.committed.plan
        if base_plan is None:
            if self.pending is not None and self.pending.plan is not None and (
                    hit & set(self.pending.plan.workers)):
                # The job was restarting from down on a worker that just died: start over.
                self.token += 1
                self.pending = None
                self.rejoin(set(self.alive), next_event_s)
            return
        # which workers each plan runs: the plans' own tables (no copies of thousands)
        running = base_plan.stage_of_worker
        bringing = (self.pending.plan.stage_of_worker
                    if self.pending is not None and self.pending.plan is not None else {})
        if not any(w in running or w in bringing for w in hit):
            return  # only idle workers died: nothing runs differently
        failed = {w for w in self.pending_failed | hit if w in running}
        self.interrupt()
        if not failed:
            # Only workers the aborted transition was bringing in died: resume the old plan.
            self.token += 1
            self.pending = self.committed
            self.commit()
            return
        choice = self.policy.on_failure(self.committed, frozenset(failed),
                                        self.context(next_event_s))
        if choice.keep:
            return
        self.apply(choice)
        if self.pending is not None:
            self.pending_failed = frozenset(failed)

    def on_software(self) -> None:
        if self.committed.plan is None and self.pending is None:
            return
        self.num_software += 1
        self.interrupt()
        failed = self.pending_failed
        if self.pending is not None:
            # The transition in progress starts over after the restart.
            base = self.pending
        else:
            running = self.committed
            if running.nominal is not None:
                running = running.nominal  # priced again at the speeds of the restart
            base = Choice(strategy="restart", plan=running.plan, step_s=running.step_s,
                          throughput_samples_s=running.throughput_samples_s,
                          state=running.state)
        reload_s = None
        if self.memory_every and self.memory_load_s is not None and base.plan is not None:
            reload_s = self.memory_load_s(base.plan)  # every host is up: read from memory
        self.apply(software_restart(base, self.recovery, memory_load_s=reload_s), decided=False)
        if self.pending is not None:
            self.pending_failed = failed

    def on_repair(self, event: TraceEvent, next_event_s: float) -> None:
        returned = set(event.workers(self.workers_per_node)) - self.alive
        self.alive |= returned
        if self.pending is not None:
            self.deferred_returned |= returned
            return
        self.rejoin(returned, next_event_s)

    def rejoin(self, returned: set[int], next_event_s: float) -> None:
        if not returned:
            return
        choice = self.policy.on_rejoin(self.committed, frozenset(returned),
                                       self.context(next_event_s))
        if choice.keep:
            self.decisions[choice.strategy] = self.decisions.get(choice.strategy, 0) + 1
            return
        if (choice.stall_s == 0 and choice.plan == self.committed.plan
                and self.pending is None and not choice.rollback):
            # Reroute-then-dynamic onto the running plan: training goes on while state is
            # copied in the background; the step in flight is not lost.
            self.decisions[choice.strategy] = self.decisions.get(choice.strategy, 0) + 1
            self.token += 1
            self.committed = self.priced(choice)
            self._schedule_switch()
            return
        self.interrupt()
        self.apply(choice)

    def on_commit(self, commit: Commit, next_event_s: float) -> None:
        if commit.token != self.token or self.pending is None:
            return  # an aborted transition
        self.commit()
        if self.deferred_returned:
            plan = self.committed.plan
            used = set(plan.workers) if plan is not None else set()
            returned = (self.deferred_returned & self.alive) - used
            self.deferred_returned = set()
            self.rejoin(returned, next_event_s)


def simulate(trace: Trace, policy: SimPolicy, *, failure_free_samples_s: float,
             recovery: RecoverySpec, num_workers: int, workers_per_node: int,
             progress: Callable[[int], None] | None = None,
             checkpoint_every_steps: int = 0,
             memory_load_s: Callable[[ExecutionPlan], float] | None = None) -> RunResult:
    """Replay ``trace`` against ``policy``.

    Args:
        trace: the failure trace (validated against the cluster).
        policy: the policy; its ``start()`` gives the failure-free plan.
        failure_free_samples_s: the failure-free throughput, the yardstick of lost time.
        recovery: checkpoint interval and the software-restart costs.
        num_workers: workers of the cluster.
        workers_per_node: workers per node.
        progress: called with the number of trace events handled so far, now and then.
        checkpoint_every_steps: checkpoint every this many committed steps, as the runtime
            does (``[train] checkpoint_every``); 0: every ``recovery.checkpoint_interval_s``
            of wall time.
        memory_load_s: with ``recovery.memory_checkpoint``, a plan's read of its state
            from memory (a software fault's reload); ``None``: from storage.

    Returns:
        The policy's result.

    Raises:
        ValueError: for a non-positive failure-free throughput or a negative cadence.
    """
    if not failure_free_samples_s > 0:
        raise ValueError(f"failure-free throughput must be positive, got {failure_free_samples_s}")
    if isinstance(checkpoint_every_steps, bool) or checkpoint_every_steps < 0:
        raise ValueError(f"checkpoint_every: must be an integer >= 0, got "
                         f"{checkpoint_every_steps!r}")
    run = _Run(trace, policy, failure_free_samples_s=failure_free_samples_s, recovery=recovery,
               workers_per_node=workers_per_node, num_workers=num_workers,
               checkpoint_every_steps=checkpoint_every_steps, memory_load_s=memory_load_s)
    _replay(run, trace, progress)
    run.advance(trace.duration_s)
    if progress is not None:
        progress(len(trace.events))
    return RunResult(
        name=policy.name, duration_s=trace.duration_s, samples=run.samples,
        failure_free_samples_s=failure_free_samples_s,
        time_lost_s=tuple(sorted(run.lost.items())),
        decisions=tuple(sorted(run.decisions.items())),
        num_software_restarts=run.num_software, timeline=tuple(run.timeline),
        training_s=run.training_s)


def _replay(run: _Run, trace: Trace, progress: Callable[[int], None] | None) -> None:
    """The event loop: every trace event, commit and switch of ``run`` in time order until
    the trace's end (``progress`` told every 64 trace events)."""
    events = trace.events
    for event in events:
        run.push(event.time_s, event)
    handled = 0  # trace events popped so far
    horizons = Horizons(trace) if trace.has_slow else None

    def next_trace_s() -> float:
        """Time of the next trace event not yet handled (the oracle's true horizon; with
        fail-slows, the next one that is not a speed change)."""
        if horizons is not None:
            return horizons.next_change_s(handled)
        return events[handled].time_s if handled < len(events) else trace.duration_s

    while run.queue:
        time_s, _, item = heapq.heappop(run.queue)
        if time_s >= trace.duration_s:
            break
        run.advance(time_s)
        if isinstance(item, Commit):
            run.on_commit(item, next_trace_s())
        elif isinstance(item, Switch):
            run.on_switch(item)
        elif isinstance(item, Respeed):
            run.on_respeed(item)
        elif isinstance(item, SlowCheck):
            assert horizons is not None
            run.on_slow_check(item, min(next_trace_s(),
                                        horizons.next_speed_s(item.worker, time_s)))
        else:
            handled += 1
            if item.kind == EventKind.REPAIR:
                run.on_repair(item, next_trace_s())
            elif item.kind == EventKind.SOFTWARE:
                run.on_software()
            elif item.kind in SLOW_KINDS:
                run.on_speed(item)
            else:
                run.on_failure(item, next_trace_s())
            if progress is not None and handled % 64 == 0:
                progress(handled)
        run.mark()
