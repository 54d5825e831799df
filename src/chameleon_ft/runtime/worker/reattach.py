"""A worker whose coordinator went away: what it keeps, what it reports to the next one,
and the step it applies late (docs/design.md 4.1, "A coordinator replaced under live
workers").

The worker keeps its layers and optimizer state as of its last committed step (``held``,
with the generation and plan that placed them), and, when it reduced a step and never
read its verdict, that step's gradients (``voted``). The generation in flight is
abandoned as an aborted one is (its groups broken, so no peer waits on them). Once a
coordinator is found on the job's address (``worker.link.find``):

- a later term: every connection is opened again and sealed for it, and the worker
  reports what it holds (:func:`report_of`, written again before each slice of its wait
  for the first directive, so a fenced process of the same id cannot hide it); the
  directive says whether the step it reduced committed (``apply``);
- the same coordinator, whose loop went on: the verdict of the step it reduced is read
  again (the coordinator commits it once every vote is in), and training goes on.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.documents import HeldState, ReattachReport
from chameleon_ft.runtime.worker.channel import Channel, GenerationOver
from chameleon_ft.runtime.worker.groups import close_later
from chameleon_ft.runtime.worker.link import Found, find, process_start

if TYPE_CHECKING:
    from chameleon_ft.runtime.worker.groups import Generation
    from chameleon_ft.runtime.worker.main import Worker

_log = logging.getLogger(__name__)


def report_of(w: Worker) -> ReattachReport:
    """What the worker holds, for the coordinator that took the run over."""
    held = None if w.held_plan is None else HeldState(
        step=w.held_steps, gen=w.held_gen, layers=tuple(sorted(w.held)), plan=w.held_plan)
    pending = None
    if w.voted is not None and w.plan_doc is not None:
        gen, step = w.voted
        pending = HeldState(step=step + 1, gen=gen, layers=tuple(sorted(w.layers)),
                            plan=w.plan_doc)
    pid = os.getpid()
    return ReattachReport(worker=w.id, incarnation=w.incarnation, host=socket.gethostname(),
                          pid=pid, started=process_start(pid) or 0, seen_gen=w.directive_gen,
                          gen=w.directive_gen, members=dict(w.members), held=held,
                          pending=pending)


def apply(w: Worker, ask: Any) -> None:
    """A directive's ``apply``: when it names the step this worker reduced and never read
    the verdict of, that step committed: apply its kept gradients now. Any other vote in
    flight is dropped (its step is redone)."""
    voted, w.voted = w.voted, None
    if voted is None or not ask or (int(ask[0]), int(ask[1])) != voted:
        return
    gen, step = voted
    if not w.ckpt.snapshot_taken(w.storage.for_bytes(w.ckpt.pending_bytes)):
        raise RuntimeError(f"worker {w.id}: the checkpoint's copy of its layers did not "
                           "finish")
    with w.watch.computing():
        for state in w.layers.values():
            state.step(step)
    w.held, w.held_steps = dict(w.layers), step + 1
    w.held_gen, w.held_plan = gen, w.plan_doc
    _log.debug("applied step %d of generation %d, committed while the coordinator was away",
               step, gen)


def recover(w: Worker, cause: BaseException, previous: Generation | None) -> None:
    """The coordinator's store failed (``cause``): abandon the generation in flight, and
    wait (at most the grace: the process exits then) for a coordinator to follow."""
    link = w.link
    link.recovering = True
    link.lose(time.monotonic(), str(cause) or type(cause).__name__)
    _log.warning("worker %d: %s; waiting up to %g s for a coordinator", w.id, link.why,
                 link.grace_s)
    for generation in {id(g): g for g in (w.current, previous) if g is not None}.values():
        generation.break_all()  # no peer waits on this worker's connections
        close_later(generation)
    w._enter(None)
    report = report_of(w)
    while True:
        found = find(link, w.secret, w.job.job_id, w.shared.signer)
        try:
            _follow(w, found, report)
            return
        except (dist.DistError, OSError) as exc:
            link.lose(time.monotonic(), str(exc) or type(exc).__name__)


def _follow(w: Worker, found: Found, report: ReattachReport) -> None:
    """Follow the coordinator found: a later term's (report what this worker holds), or
    the same one going on (read the verdict of the step this worker reduced)."""
    same = found.job.term == w.link.term
    w.shared.signer = found.signer
    w.store = found.raw
    w.store.set_timeout(timedelta(seconds=max(5.0, 2 * w.hang_s)))
    w.chan = Channel(found.raw, w.shared)
    w.kept = [*w.kept[-3:], w.rendezvous]  # groups being closed may still call it
    w.rendezvous = w.chan.rendezvous(max(5.0, 2 * w.hang_s))
    w.faults.chan = w.chan
    w.blobs.port = found.job.blob_port
    w.link.attached(found.job.term)
    w.ckpt.reconnect()
    if w.memory is not None:
        w.memory.reconnect()
    if not same:
        text = report.to_json()
        w.again = lambda: w.chan.reattach(text)
        _log.warning("worker %d: re-attached to the coordinator of term %d", w.id,
                     found.job.term)
        return
    if w.voted is not None:  # the same coordinator: it commits the step once all voted
        gen, step = w.voted
        try:
            verdict = w.chan.await_value(proto.verdict_key(gen, step), gen).decode()
        except GenerationOver:  # it moved on without committing it
            verdict = proto.ABORT
        apply(w, [gen, step] if verdict in (proto.COMMIT, proto.COMMIT_END) else None)
