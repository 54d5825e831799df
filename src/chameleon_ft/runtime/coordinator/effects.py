"""What the coordinator does for each effect of the control plane.

Each ``_do_*`` function performs one kind of :mod:`~chameleon_ft.runtime.control.messages`
effect from the data the effect carries (never from a newer control value) and decides
nothing. Where an effect needs an answer (a launch's incarnations, the policy's decision,
which members are absent, whether a manifest was written), the function returns it as an
observation; the shell feeds it to the control plane once every effect of the step was
performed, so performing never re-enters the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from chameleon_ft.runtime import auth
from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.coordinator import slow
from chameleon_ft.runtime.report.records import Event, StepRecord, step_metrics
from chameleon_ft.runtime.step_sync import extra_groups, step_reductions
from chameleon_ft.runtime.storage.checkpoint import CheckpointError
from chameleon_ft.runtime.traffic import directive_ops
from chameleon_ft.runtime.workload.models import tied_parameters

if TYPE_CHECKING:
    from chameleon_ft.runtime.coordinator.shell import Coordinator

CHECKPOINT_LOG_S = 10.0
"""At most one "checkpoint written" line per this many seconds."""

Answer = m.Observation | None


def _groups(gen: int, world: Sequence[int], rounds: list[Any], directive: dict[str, Any],
            tp: int) -> list[tuple[str, int]]:
    """Every group of a generation as ``(prefix, size)`` (its rendezvous keys are deleted
    when it retires): the world groups and buckets, once per tensor-parallel plane, and
    each worker's tensor-parallel group (design 4.11)."""
    size = len(world)
    groups = [(proto.world_prefix(gen), size), (proto.reverse_world_prefix(gen), size)]
    groups += [(proto.bucket_prefix(gen, b), len(b))
               for b in sorted({tuple(b[0]) for rnd in rounds for b in rnd if len(b[0]) > 1}
                               | set(extra_groups(directive)))]
    if tp == 1:
        return groups
    planes = [(proto.in_plane(prefix, r), n) for r in range(tp) for prefix, n in groups]
    return planes + [(proto.tp_prefix(gen, w), tp) for w in world]


def _do_publish(coord: Coordinator, e: m.Publish) -> Answer:
    from chameleon_ft.perf import Topology, build_schedule

    sched = build_schedule(e.plan, coord.job.profile, Topology.from_config(coord.config))
    rounds = [[[list(b.workers), list(b.layers)] for b in rnd] for rnd in sched.sync_rounds]
    migration = None
    if e.migration is not None and e.migration.transfers:
        migration = {"transfers": [[t.layer, t.src, t.dst, t.part, t.num_parts]
                                   for t in e.migration.transfers],
                     "rounds": [list(r) for r in e.migration.rounds]}
    directive = {
        "action": "train", "gen": e.gen, "plan": e.plan.to_dict(), "step": e.step,
        "steps": coord.train.steps, "world": list(e.world), "ops": directive_ops(sched.ops),
        "rounds": rounds, "migration": migration,
        "load": None if e.load is None else {"kind": e.load.kind, "step": e.load.step},
        "incarnations": {str(w): inc for w, inc in sorted(e.incarnations.items())},
        "collective_timeout_s": e.collective_s, "probe": sorted(e.probe),
        "apply": None if e.apply is None else list(e.apply),
        **step_reductions(e.plan, tied_parameters(coord.job.model),
                          coord.config.optimizer.clip_grad_norm)}
    coord.hooks.before_publish(coord, directive)
    coord.cs.publish(e.gen, directive, _groups(e.gen, e.world, rounds, directive,
                                              coord.config.job.tp))
    precompute = getattr(coord.decide_fn(), "precompute", None)
    if precompute is not None:
        precompute(e.plan, idle=e.idle)
    return None


def _do_commit(coord: Coordinator, e: m.Commit) -> Answer:
    coord.cs.commit(e.gen, e.step, end=e.end)
    now = coord.now()
    workers = list(e.workers)
    loss = math.fsum(v for _, v in sorted(coord.cs.take_losses(e.gen, e.step, workers)))
    timings = coord.cs.take_timings(e.gen, e.step, workers)
    if e.forget_previous:
        coord.cs.forget_step(e.gen, e.step - 1)
    grad_norm, lr = step_metrics(timings)
    times = slow.op_times(now, e.gen, e.step, timings)
    coord.report.committed(StepRecord(e.step, loss, now - e.start_s, e.gen, now,
                                      len(workers), grad_norm, lr), timings,
                           recovered=e.recovered)
    coord.hooks.on_commit(coord, e.step)
    return times


def _do_fence(coord: Coordinator, e: m.Fence) -> Answer:
    coord.launcher.kill(e.workers)
    for w, incarnation in sorted(e.incarnations.items()):
        coord.cs.forget_process(w, incarnation)
    return None


def _do_launch(coord: Coordinator, e: m.Launch) -> Answer:
    try:
        incarnations = coord.launcher.launch(e.workers, replacement=e.replacement)
    except Exception as exc:  # the OS refused a process, an address, a pipe
        return m.LaunchFailed(coord.now(), e.workers, f"{type(exc).__name__}: {exc}",
                              e.replacement)
    if e.workers and e.workers == tuple(range(coord.job.num_local)) and not e.replacement:
        pids = " ".join(map(str, coord.launcher.pids(e.workers)))
        coord.log(f"launched workers 0-{len(e.workers) - 1} (pids {pids})")
    return m.Launched(coord.now(), incarnations, local=True, replacement=e.replacement)


def _do_reply(coord: Coordinator, e: m.Reply) -> Answer:
    request = e.request
    if request is None:  # malformed: nobody to answer
        if coord.report.refuse({"reason": e.reason, "at_s": coord.now()}, "malformed"):
            coord.log(f"refused a join request: {e.reason.removesuffix(' join request')} "
                      "(further ones are counted, not logged)")
        return None
    if e.worker is None:
        coord.desk.reply(request, auth.JoinReply(ok=False, reason=e.reason))
        if coord.report.refuse({"host": request.host, "reason": e.reason,
                                "at_s": coord.now()}, request.host):
            coord.log(f"refused a worker from {request.host} ({request.address}): "
                      f"{e.reason}")
        return None
    index = coord.launcher.admitted(e.worker, request.host, e.incarnation, e.alive,
                                    request.local_index)
    coord.desk.reply(request, auth.JoinReply(ok=True, worker=e.worker,
                                             incarnation=e.incarnation,
                                             replacement=e.replacement, local_index=index))
    coord.log(f"admitted worker {e.worker} from {request.host} ({request.address})"
              + (" as a replacement" if e.replacement else ""))
    return None


def _do_failure(coord: Coordinator, e: m.Failure) -> Answer:
    fault_at = coord.book.fault_time(coord.cs, e.workers, e.detected_s) if e.workers \
        else e.detected_s
    event = Event(workers=list(e.workers), cause=e.cause, gen=e.gen, step=e.step,
                  fault_at_s=fault_at, detected_at_s=e.detected_s,
                  detected_after_s=None if fault_at is None else e.detected_s - fault_at,
                  strategy=e.strategy, reason=e.reason, lost_steps=e.lost_steps, idle=e.idle)
    coord.report.failed(event)
    if e.idle:
        return None
    if e.workers:
        detected = "" if event.detected_after_s is None else \
            f" {event.detected_after_s:.3f} s after the fault"
        coord.log(f"FAILURE at step {e.step}: {e.cause}; detected{detected}")
    coord.hooks.on_failure(coord, event)
    return None


def _do_resolved(coord: Coordinator, e: m.Resolved) -> Answer:
    event = next(x for x in reversed(coord.report.events) if not x.slow)
    event.strategy, event.reason = e.strategy, e.reason
    event.decision, event.decide_s = dict(e.decision), e.decide_s
    event.lost_steps = e.lost_steps
    if e.plan is None:
        return None
    coord.log(f"decision: {e.strategy} ({e.reason})")
    for c in e.candidates:
        if isinstance(c, dict):
            step, tr = c.get("step_s"), c.get("transition_s")
            ok = "" if c.get("feasible", True) else " (infeasible)"
            coord.log(f"  candidate {c.get('strategy')}: step "
                      f"{step if step is None else round(step, 4)} s, transition "
                      f"{tr if tr is None else round(tr, 3)} s{ok}")
    for line in e.plan.describe().splitlines():
        coord.log(f"  {line}")
    return None


def _do_decide(coord: Coordinator, e: m.Decide) -> Answer:
    ask = e.ask
    t = time.monotonic()
    try:
        decision = coord.decide_fn()(ask.base, ask.failed, ask.usable, coord.now(),
                                     e.since_checkpoint_s)
    except Exception as exc:  # the policy's own defect: training stops with the reason
        return m.ShellFailed(coord.now(), f"the recovery policy raised "
                                          f"{type(exc).__name__}: {exc}")
    return m.Decision(coord.now(), decision, time.monotonic() - t)


def _do_decide_rejoin(coord: Coordinator, e: m.DecideRejoin) -> Answer:
    rejoin = getattr(coord.decide_fn(), "rejoin", None)
    if rejoin is None:
        return None
    try:
        decision = rejoin(e.plan, e.idle, e.alive, coord.now())
    except Exception as exc:  # no re-join then: the idle workers wait
        return m.RejoinDecision(coord.now(), None, f"{type(exc).__name__}: {exc}")
    return m.RejoinDecision(coord.now(), decision)


def _do_probe(coord: Coordinator, e: m.ProbeAbsent) -> Answer:
    return m.Absent(coord.now(), e.gen, coord.cs.absent(e.gen, dict(e.incarnations)))


def _do_save(coord: Coordinator, e: m.SaveCheckpoint) -> Answer:
    meta = {"config": coord.job.digest, "job": coord.job.job_name,
            "dtype": coord.train.dtype, "num_layers": coord.job.num_layers}
    plan = {} if e.plan is None else e.plan.to_dict()
    try:
        saved = coord.bulk.save(e.step, e.gen, accepted=e.accepted, plan=plan, meta=meta,
                                store=coord.cs)
    except (OSError, CheckpointError) as exc:
        reason = f"manifest not written: {getattr(exc, 'strerror', None) or exc}"
        return m.CheckpointFailed(coord.now(), e.step, e.gen, reason)
    if saved is None:
        return None
    manifest, record = saved
    coord.report.checkpoint_written(
        record | {"complete_after_s": coord.now() - record["committed_at_s"]})
    if e.fallback or coord.now() - coord.checkpoint_logged_s >= CHECKPOINT_LOG_S:
        coord.checkpoint_logged_s = coord.now()
        coord.log(f"checkpoint after {e.step} steps written to {manifest.folder}")
    return m.CheckpointDone(coord.now(), e.step, e.gen)


def _do_drop(coord: Coordinator, e: m.DropCheckpoint) -> Answer:
    coord.bulk.drop(e.step, e.gen, coord.cs)
    if not e.quiet:
        coord.report.dropped_checkpoint({"step": e.step, "gen": e.gen, "reason": e.reason,
                                         "at_s": coord.now()})
    return None


def _do_mark_corrupt(coord: Coordinator, e: m.MarkCorrupt) -> Answer:
    coord.job.ckpt.mark_corrupt(e.step, e.reason)
    coord.report.corrupt.append({"step": e.step, "reason": e.reason, "at_s": coord.now()})
    return None


def _do_retire(coord: Coordinator, e: m.Retire) -> Answer:
    for gen, first, last, world in e.gens:
        coord.cs.retire(gen, first, last, list(world))
    return None


def _do_stop(coord: Coordinator, e: m.Stop) -> Answer:
    """The final generation: every worker leaves; unless the run failed, the holders of
    the final state write its checkpoint first when the control plane asks (``write``)."""
    coord.stopped = e
    coord.cs.publish(e.gen, {"action": "stop", "gen": e.gen, "step": e.step,
                             "final": {str(i): list(ws) for i, ws in e.final.items()},
                             "write": e.write, "failed": e.failed, "reason": e.reason,
                             "final_timeout_s": e.final_timeout_s,
                             "apply": None if e.apply is None else list(e.apply)}, [])
    return None


def _do_ask_final(coord: Coordinator, e: m.AskFinal) -> Answer:
    coord.cs.final_more(e.gen, e.worker, list(e.layers), attempt=e.attempt, upload=e.upload)
    return None


def _do_final_done(coord: Coordinator, e: m.FinalDone) -> Answer:
    coord.final = e
    coord.cs.final_done(e.gen)  # the workers leave, whatever happened
    return None


def _logged(coord: Coordinator, text: str) -> Answer:
    coord.log(text)
    return None


_PERFORM: dict[type, Callable[[Any, Any], Answer]] = {
    m.Log: lambda coord, e: _logged(coord, e.text),
    m.Publish: _do_publish,
    m.Abort: lambda coord, e: coord.cs.abort(e.gen, e.step),
    m.Commit: _do_commit,
    m.ExpectCheckpoint: lambda coord, e: coord.bulk.expect(e.step, e.gen, e.committed_s,
                                                           fallback=e.fallback),
    m.Fence: _do_fence,
    m.Launch: _do_launch,
    m.Reply: _do_reply,
    m.ReadJoins: lambda coord, e: m.JoinRequests(coord.now(), coord.desk.take(e.slots)),
    m.Refused: lambda coord, e: coord.cs.refusals.refuse(e.key, None, e.why, kind=e.kind),
    m.StartFrom: lambda coord, e: coord.cs.start_from(e.worker, e.incarnation, e.gen),
    m.Failure: _do_failure,
    m.Resolved: _do_resolved,
    m.Decide: _do_decide,
    m.DecideRejoin: _do_decide_rejoin,
    m.ProbeAbsent: _do_probe,
    m.SaveCheckpoint: _do_save,
    m.DropCheckpoint: _do_drop,
    m.MarkCorrupt: _do_mark_corrupt,
    m.DropTimelines: lambda coord, e: coord.bulk.refuse_before(e.epoch),
    m.Retire: _do_retire,
    m.Rejoined: lambda coord, e: coord.report.rejoined(
        {"workers": list(e.workers), "step": e.step, "strategy": e.strategy,
         "reason": e.reason}),
    m.Stop: _do_stop,
    m.AskFinal: _do_ask_final,
    m.FinalDone: _do_final_done,
    **slow.PERFORM,
    m.Reattached: lambda coord, e: coord.takeover.reattached(coord, e),
}

_CALLS = {m.Decide: "a call of the recovery policy (Decide)",
          m.DecideRejoin: "a call of the recovery policy (DecideRejoin)",
          m.Launch: "starting worker processes (Launch)"}


def describe(effect: m.Effect) -> str:
    """What the loop does while it performs ``effect`` (the watchdog names it)."""
    return _CALLS.get(type(effect), f"performing {type(effect).__name__}")


def perform(coord: Coordinator, effect: m.Effect) -> Answer:
    """Do what one effect says; returns its answer, if it has one."""
    return _PERFORM[type(effect)](coord, effect)
