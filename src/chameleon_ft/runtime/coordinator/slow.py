"""The shell's side of fail-slow handling: the step timings and probes it reads for the
control plane, the policy it asks about a slow worker, and the records it writes
(docs/design.md 4.3, "Slow workers"). Each function performs what an effect carries and
decides nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control.slowness import compute_seconds
from chameleon_ft.runtime.report.records import Event

if TYPE_CHECKING:
    from chameleon_ft.runtime.coordinator.shell import Coordinator

Answer = m.Observation | None


def op_times(now_s: float, gen: int, step: int, timings: list[dict[str, Any]]) -> m.OpTimes:
    """A committed step's compute seconds per worker, from the workers' sealed timing
    reports (a report out of bounds is left out: ``slowness.compute_seconds``)."""
    compute = {}
    for t in timings:
        seconds = compute_seconds(t)
        if seconds is not None and isinstance(t.get("worker"), int):
            compute[int(t["worker"])] = seconds
    return m.OpTimes(now_s, gen, step, compute)


def observe_probes(coord: Coordinator) -> None:
    """The newest probes of the slow workers out of the plan, when one moved."""
    want = coord.wanted().probes
    if not want:
        return
    readings = coord.cs.probes(dict(want))
    seqs = tuple(sorted((w, seq) for w, (seq, _) in readings.items()))
    if readings and coord.news("probes", tuple(x for pair in seqs for x in pair), 0):
        coord.feed(m.Probes(coord.now(), readings))


def _do_decide_slow(coord: Coordinator, e: m.DecideSlow) -> Answer:
    ask = getattr(coord.decide_fn(), "slow", None)
    if ask is None:
        return m.SlowDecision(coord.now(), e.worker, e.end, e.gen, None,
                              "the policy given does not answer slow workers")
    t = time.monotonic()
    try:
        decision = ask(e.plan, e.worker, e.factor, e.alive, e.slow, coord.now(), e.end)
    except Exception as exc:  # no answer: the slow worker is kept, training goes on
        return m.SlowDecision(coord.now(), e.worker, e.end, e.gen, None,
                              f"{type(exc).__name__}: {exc}")
    return m.SlowDecision(coord.now(), e.worker, e.end, e.gen, decision,
                          decide_s=time.monotonic() - t)


def _do_slow_event(coord: Coordinator, e: m.SlowEvent) -> Answer:
    end = e.cause == "slow-end"
    began = coord.book.slow_time(coord.cs, e.worker, e.detected_s, end)
    coord.report.failed(Event(
        workers=[e.worker], cause=e.cause, gen=e.gen, step=e.step, fault_at_s=began,
        detected_at_s=e.detected_s,
        detected_after_s=None if began is None else e.detected_s - began,
        factor=round(e.factor, 4), measured=round(e.measured, 4) if end else None))
    return None


def _do_slow_resolved(coord: Coordinator, e: m.SlowResolved) -> Answer:
    event = next((x for x in reversed(coord.report.events)
                  if x.cause == e.cause and x.workers == [e.worker] and not x.strategy), None)
    if event is not None:
        event.strategy, event.reason = e.strategy, e.reason
        event.decision, event.decide_s = dict(e.decision), e.decide_s
    if e.plan is not None:
        for line in e.plan.describe().splitlines():
            coord.log(f"  {line}")
    return None


PERFORM: dict[type, Callable[[Any, Any], Answer]] = {
    m.DecideSlow: _do_decide_slow,
    m.SlowEvent: _do_slow_event,
    m.SlowResolved: _do_slow_resolved,
}
"""The performer of each fail-slow effect."""
