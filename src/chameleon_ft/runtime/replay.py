"""Replay a failure trace on the real runtime (``chameleon train --trace FILE.csv``).

The trace is the simulator's CSV (``time_s,event,target``, :mod:`chameleon_ft.sim.traces`)
with times in wall-clock seconds from the start of the first step (the moment every worker
of the first generation is ready). The coordinator calls :meth:`TraceDriver.poll` from its
loop; each row that is due becomes one action on the run:

- ``worker-fail``, ``node-fail``, ``group-fail``: the named workers (a node's workers are
  ``n*W .. (n+1)*W-1``) are SIGKILLed; the coordinator notices the exits as it notices any
  death and the policy recovers;
- ``software``: a job-level fault, modelled as the simulator models it: no hardware is
  lost, every worker of the running plan reloads the last checkpoint
  (:func:`chameleon_ft.runtime.control.state.software_restart`);
- ``repair``: the named nodes' dead workers are relaunched; they come up idle and the
  policy decides whether to fold them back in (the trace's repairs replace the automatic
  relaunch of ``[train] rejoin``);
- ``end``: training stops at the next step boundary.

The report's ``throughput_samples_s`` is the global batch times the committed steps whose
commit came by ``end`` (a step redone after a restart counts once, the steps a restart
threw away not at all), over the trace's duration.

The driver itself does no I/O: it asks a :class:`TraceTarget` (the coordinator) to act, so
its event handling is tested without processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from chameleon_ft.failures import EventKind, Trace, trace_from_csv, validate_trace
from chameleon_ft.runtime.control.state import RunState


class ActionKind(StrEnum):
    """What the runtime does for a row of the trace."""

    KILL = "kill"
    """SIGKILL the named workers' processes."""
    RELAUNCH = "relaunch"
    """Start replacements for the named workers that are dead."""
    SOFTWARE = "software"
    """Every worker of the running plan reloads the last checkpoint."""
    END = "end"
    """Stop at the next step boundary."""


@dataclass(frozen=True, kw_only=True)
class Action:
    """One row of the trace, in the runtime's terms."""

    at_s: float
    """Trace time: seconds after the first step started."""
    kind: ActionKind
    """What to do."""
    workers: tuple[int, ...] = ()
    """The workers it concerns (every worker of the named nodes for node rows)."""
    row: int = 0
    """The trace row (1-based, after the header; the ``end`` row after the last event)."""
    event: str = ""
    """The trace's event kind (``worker-fail``, ``repair``...)."""


def actions_of(trace: Trace, workers_per_node: int) -> tuple[Action, ...]:
    """The runtime actions of a trace, in time order, ending with its ``end``.

    Args:
        trace: a validated trace.
        workers_per_node: workers per node (``devices_per_node / tp``).

    Returns:
        One action per trace event, then the end.
    """

    kinds = {EventKind.WORKER_FAIL: ActionKind.KILL, EventKind.NODE_FAIL: ActionKind.KILL,
             EventKind.GROUP_FAIL: ActionKind.KILL, EventKind.REPAIR: ActionKind.RELAUNCH,
             EventKind.SOFTWARE: ActionKind.SOFTWARE}
    out: list[Action] = []
    for row, event in enumerate(trace.events, start=1):
        out.append(Action(at_s=event.time_s, kind=kinds[event.kind],
                          workers=event.workers(workers_per_node),
                          row=row, event=event.kind.value))
    out.append(Action(at_s=trace.duration_s, kind=ActionKind.END, row=len(trace.events) + 1,
                      event=EventKind.END.value))
    return tuple(out)


def load_trace(path: str | Path, *, num_nodes: int, workers_per_node: int) -> Trace:
    """Read and validate a trace file for a cluster.

    Args:
        path: the CSV file.
        num_nodes: nodes of the job's cluster.
        workers_per_node: workers per node.

    Returns:
        The trace.

    Raises:
        ValueError: ``--trace: ...`` for a file that cannot be read, a malformed row, a
            worker or node outside the cluster, events out of order, no ``end`` row, or
            fail-slow rows (the runtime injects slowdowns with ``--fault``, not from traces).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--trace: cannot read {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--trace: {str(path)!r} is not a text file") from None
    try:
        trace = trace_from_csv(text, num_nodes=num_nodes, workers_per_node=workers_per_node)
    except ValueError as exc:
        raise ValueError(f"--trace: {path}: {exc}") from None
    slow = next((row for row, e in enumerate(trace.events, start=1)
                 if e.kind in (EventKind.SLOW, EventKind.SLOW_END)), None)
    if slow is not None:
        raise ValueError(f"--trace: {path}: row {slow} is a fail-slow; the runtime does not "
                         "replay slow and slow-end rows: drop them, and inject slowdowns with "
                         "--fault rank=R,step=S,kind=slow,factor=F,steps=N")
    return trace


class TraceTarget(Protocol):
    """What the driver needs from the run it drives (the coordinator)."""

    ready_s: float | None
    """When the current generation's workers were all ready (run clock), if they are."""

    @property
    def state(self) -> RunState:
        """The run's state (who is alive, which placement the state has)."""
        ...

    def now(self) -> float:
        """The run clock, seconds."""
        ...

    def kill_workers(self, workers: Sequence[int]) -> list[int]:
        """SIGKILL these workers now; returns those signalled."""
        ...

    def relaunch_workers(self, workers: Sequence[int]) -> list[int]:
        """Relaunch those of these workers that are dead now; returns those relaunched."""
        ...

    def software_fault(self) -> bool:
        """Reload the last checkpoint on the running plan; returns whether it happened."""
        ...

    def stop_at_boundary(self, reason: str) -> None:
        """Stop training at the next step boundary."""
        ...


@dataclass
class Done:
    """What the driver did for one action."""

    action: Action
    done_at_s: float
    """Trace time it was applied (at or a poll after ``action.at_s``)."""
    workers: tuple[int, ...] = ()
    """The workers it acted on (killed or relaunched)."""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"row": self.action.row, "event": self.action.event,
                "kind": self.action.kind.value, "at_s": self.action.at_s,
                "done_at_s": self.done_at_s, "target": list(self.action.workers),
                "workers": list(self.workers), "note": self.note}


class TraceDriver:
    """Applies a trace's rows to a run as their times come.

    Args:
        trace: the validated trace.
        workers_per_node: workers per node of the job.
        path: where the trace came from (for the report).
    """

    def __init__(self, trace: Trace, workers_per_node: int, path: str = "") -> None:
        self.trace = trace
        self.workers_per_node = workers_per_node
        self.path = path
        self.actions = actions_of(trace, workers_per_node)
        self.next_index = 0
        self.origin_s: float | None = None
        """Run clock of trace time 0 (the first step's start), once known."""
        self.killed: set[int] = set()
        """Workers the trace killed and no repair brought back yet."""
        self.waiting: set[int] = set()
        """Repaired workers whose death the run has not processed yet: relaunched later."""
        self.done: list[Done] = []
        self.ended_at_s: float | None = None
        """Run clock when the ``end`` row was applied."""
        self.repairs: list[dict[str, Any]] = []
        """Each relaunched worker: trace times of the relaunch, of its being up (alive,
        idle) and of the first commit of a plan that uses it (None until then)."""

    @property
    def end_s(self) -> float:
        """The trace's duration: when training stops."""
        return self.trace.duration_s

    @property
    def ended(self) -> bool:
        """Whether the ``end`` row was applied."""
        return self.ended_at_s is not None

    def check_job(self, *, num_nodes: int, workers_per_node: int, num_workers: int,
                  num_local: int, resume: bool) -> None:
        """Refuse a replay the run cannot carry out.

        Raises:
            ValueError: ``--trace: ...`` when the trace does not fit the cluster, some
                workers are remote (the coordinator can neither kill nor relaunch them),
                or the run resumes (its trace clock would start in the middle).
        """
        if workers_per_node != self.workers_per_node:
            raise ValueError(f"--trace: read for {self.workers_per_node} workers per node, "
                             f"the job has {workers_per_node}")
        try:
            validate_trace(self.trace, num_nodes=num_nodes, workers_per_node=workers_per_node)
        except ValueError as exc:
            raise ValueError(f"--trace: {exc}") from None
        if num_local < num_workers:
            raise ValueError(f"--trace: a replay kills and relaunches workers itself; launch "
                             f"every worker here (now {num_local} of {num_workers} local)")
        if resume:
            raise ValueError("--trace: a replay starts its clock at the first step; it "
                             "cannot continue a run (--resume)")

    def now_s(self, target: TraceTarget) -> float | None:
        """Trace time, or None before the first step started."""
        if self.origin_s is None:
            return None
        return target.now() - self.origin_s

    def poll(self, target: TraceTarget) -> None:
        """Apply every row whose time has come (called from the coordinator's loop)."""
        if self.origin_s is None:
            if target.ready_s is None:
                return
            self.origin_s = target.ready_s
        now = target.now() - self.origin_s
        self._watch_repairs(target, now)
        if self.waiting and not self.ended:
            self._relaunch_waiting(target, now)
        while self.next_index < len(self.actions) and not self.ended:
            action = self.actions[self.next_index]
            if action.at_s > now:
                return
            self.next_index += 1
            self._apply(target, action, now)

    def _watch_repairs(self, target: TraceTarget, now: float) -> None:
        """Time how long each relaunched worker takes to be up and to be trained on."""
        state = target.state
        for r in self.repairs:
            if r["closed"]:
                continue
            w = r["worker"]
            if r["up_at_s"] is None and w in state.alive:
                r["up_at_s"] = now
            # trained on: a plan that uses it committed a step (it holds that plan's state)
            if r["up_at_s"] is not None and w in state.state_plan.workers and \
                    w not in state.stateless:
                r["in_plan_at_s"] = now
                r["closed"] = True

    def _close_repairs(self, workers: Iterable[int]) -> None:
        """The workers died (or are relaunched again): their open repair records end."""
        gone = set(workers)
        for r in self.repairs:
            if r["worker"] in gone:
                r["closed"] = True

    def _relaunched(self, workers: Sequence[int], now: float) -> None:
        self._close_repairs(workers)
        self.repairs.extend({"worker": w, "relaunched_at_s": now, "up_at_s": None,
                             "in_plan_at_s": None, "closed": False} for w in workers)

    def _relaunch_waiting(self, target: TraceTarget, now: float) -> None:
        launched = target.relaunch_workers(sorted(self.waiting))
        self._relaunched(launched, now)
        if launched:
            self.waiting -= set(launched)
            self.killed -= set(launched)
            self.done.append(Done(Action(at_s=now, kind=ActionKind.RELAUNCH,
                                         workers=tuple(launched), event="repair"), now,
                                  tuple(launched), "relaunched once its death was processed"))

    def _apply(self, target: TraceTarget, action: Action, now: float) -> None:
        done = Done(action, now)
        if action.kind is ActionKind.KILL:
            # a repair still waiting to relaunch one of them is overtaken by this failure
            self.waiting -= set(action.workers)
            self._close_repairs(action.workers)
            done.workers = tuple(target.kill_workers(list(action.workers)))
            self.killed |= set(action.workers)
            if len(done.workers) < len(action.workers):
                done.note = "no running process: " + " ".join(
                    str(w) for w in action.workers if w not in done.workers)
        elif action.kind is ActionKind.RELAUNCH:
            launched = target.relaunch_workers(list(action.workers))
            self._relaunched(launched, now)
            done.workers = tuple(launched)
            self.killed -= set(launched)
            # killed by the trace, but the run has not seen the exit yet: relaunch later
            later = (set(action.workers) & self.killed) - set(launched)
            self.waiting |= later
            if later:
                done.note = "relaunch after the death is processed: " + " ".join(
                    str(w) for w in sorted(later))
        elif action.kind is ActionKind.SOFTWARE:
            if not target.software_fault():
                done.note = "not applied: a failure is being recovered from"
        else:
            self.ended_at_s = target.now()
            target.stop_at_boundary("end of trace")
        self.done.append(done)

    def report(self, commit_times_s: Iterable[float], global_batch: int) -> dict[str, Any]:
        """The replay's part of the run report.

        Args:
            commit_times_s: run clock of each committed step that counts (one per step
                number; steps a restart threw away excluded).
            global_batch: samples per step.

        Returns:
            ``throughput_samples_s`` (samples committed by ``end`` over the trace's
            duration; when the run stopped before ``end`` (``[train] steps`` ran out),
            over the time to its last commit) and ``trace`` (the actions with the times
            they were applied, and how long each relaunched worker took to be up and to
            be trained on).
        """
        times = sorted(commit_times_s)
        origin = self.origin_s
        if origin is None:
            counted, span = 0, 0.0
        elif self.ended:
            cutoff = origin + self.end_s
            counted, span = sum(1 for t in times if t <= cutoff), self.end_s
        else:
            counted = len(times)
            span = (times[-1] - origin) if times else 0.0
        samples = counted * global_batch
        return {
            "throughput_samples_s": samples / span if span > 0 else 0.0,
            "trace": {
                "path": self.path, "end_s": self.end_s, "end_reached": self.ended,
                "first_step_at_s": origin, "committed_steps": counted,
                "committed_samples": samples, "measured_s": span,
                "actions": [d.to_dict() for d in self.done],
                "repairs": [{k: v for k, v in r.items() if k != "closed"}
                            for r in self.repairs],
            },
        }
