"""What the coordinator does for each effect of the control plane, and the I/O around the
run's start (announcing the job) and joins.

Each ``_do_*`` function performs one kind of :mod:`~chameleon_ft.runtime.control.messages`
effect; none decides anything: where an effect needs an answer (a launch's incarnations,
the policy's decision, which members are absent), the answer goes back into the control
plane as an observation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from chameleon_ft.runtime import auth
from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.coordinator.admission import JoinDesk
from chameleon_ft.runtime.coordinator.launcher import ChildError, run_in_child
from chameleon_ft.runtime.report.records import Event, StepRecord, step_metrics
from chameleon_ft.runtime.step_sync import extra_groups, step_reductions
from chameleon_ft.runtime.storage.checkpoint import CheckpointError, writer_of
from chameleon_ft.runtime.traffic import directive_ops
from chameleon_ft.runtime.workload.bundle import Workload, seal_workload
from chameleon_ft.runtime.workload.models import (
    probe_outputs,
    targets_per_sample,
    tied_parameters,
)
from chameleon_ft.runtime.workload.precision import torch_dtype

if TYPE_CHECKING:
    from chameleon_ft.runtime.coordinator.shell import Coordinator

CHECKPOINT_LOG_S = 10.0
"""At most one "checkpoint written" line per this many seconds."""


# ---------------------------------------------------------------------- the start
def job_info(coord: Coordinator) -> proto.JobInfo:
    """What every worker needs to know of the job (published in the store)."""
    job, train = coord.job, coord.train
    x, y = job.data.microbatch(0, 0, coord.config.job.micro_batch)
    boundaries = [[list(shape), str(out_dtype).removeprefix("torch.")]
                  for shape, out_dtype in _boundaries(coord, x)]
    return proto.JobInfo(
        job_name=job.job_name, job_id=job.job_id, nonce=job.nonce,
        num_workers=job.num_workers, num_layers=job.num_layers, dtype=train.dtype,
        micro_batch=coord.config.job.micro_batch, global_batch=coord.config.job.global_batch,
        heartbeat_s=train.heartbeat_s, hang_timeout_s=job.hang_s, backend=coord.backend,
        data_digest=Workload.data_digest(job.data), checkpoint_every=train.checkpoint_every,
        control_timeout_s=max(train.join_timeout_s, 10 * job.hang_s),
        blob_port=coord.bulk.port, boundaries=boundaries,
        targets_per_sample=targets_per_sample(y),
        workload=seal_workload(job.workload, job.secret),
        checkpoint_dir=str(job.ckpt.root), device=coord.device,
        storage_gb_per_s=train.storage_gb_per_s, bulk_gb_per_s=train.bulk_gb_per_s,
        memory_copies=coord.config.recovery.memory_checkpoint,
        workers_per_node=coord.config.workers_per_node, nccl_semantics=coord.nccl_semantics)


PROBE_S = 600.0
"""How long the child learning the stage boundaries' shapes may take (a model that
cannot be built on meta is built on the CPU, layer by layer)."""


def _boundaries(coord: Coordinator, x: Any) -> list[tuple[tuple[int, ...], Any]]:
    """Every layer's output shape and dtype (:func:`probe_outputs`), learnt by a child
    process: building layers, even on meta, imports much of torch (about 80 MB the
    coordinator would keep for the whole run). A model the child cannot take (it does not
    pickle) is probed here."""
    job, dtype = coord.job, torch_dtype(coord.train.dtype)
    try:
        return run_in_child(probe_outputs, (job.model, x, dtype), limit_s=PROBE_S,
                            name="chameleon-probe", preload=coord.launcher.preload)
    except ChildError:
        return probe_outputs(job.model, x, dtype)


STORE_VALUE_BYTES = 8 << 20
"""The largest value the store carries (torch's ``TCPStore``)."""


def announce(coord: Coordinator) -> None:
    """Publish the job and its faults; say where it listens.

    Raises:
        ValueError: when the objects given to ``train`` are too large to send the workers.
    """
    job = coord.job
    info = job_info(coord)
    size = len(info.to_json())
    if size > STORE_VALUE_BYTES - (64 << 10):
        raise ValueError(f"workload: the model, data and optimizer objects given to train() "
                         f"pickle to {size / 2**20:.1f} MiB; the workers receive at most "
                         f"{STORE_VALUE_BYTES >> 20} MiB through the store: give file paths or "
                         "small factories that load the data on the workers")
    coord.cs.set_job(info)
    coord.book.publish(coord.cs)
    coord.desk = JoinDesk(coord.cs, token=job.token, job_name=job.job_name, job_id=job.job_id,
                          nonce=job.nonce, hang_s=job.hang_s)
    coord.log(f"coordinator listening on {coord.host}:{coord.port}; job {job.job_name!r}, "
              f"{job.num_local} local workers, {job.num_workers - job.num_local} to join")
    for note in job.notes:
        coord.log(note)
    if job.announce_token:
        coord.log(f"job token: {job.token}  (give it to remote workers: --token or "
                  f"{auth.TOKEN_ENV})")
    if job.resumed_from is not None:
        coord.log(f"resuming from {job.resumed_from.folder} ({job.resumed_from.step} steps)")


def admit_joins(coord: Coordinator, now_s: float) -> None:
    """Answer join requests from other hosts (any time during the run)."""
    for item in coord.desk.requests(now_s):
        if item.request is None:
            if coord.report.refuse({"reason": "malformed join request", "at_s": now_s},
                                   "malformed"):
                coord.log("refused a join request: malformed (further ones are counted, "
                          "not logged)")
            continue
        coord._request = item.request
        try:
            coord.feed(m.JoinAsked(now_s, item.refusal))
        finally:
            coord._request = None


def newly_registered(coord: Coordinator) -> tuple[int, ...]:
    """Members that announced themselves since the last look."""
    return tuple(w for w, x in sorted(coord.ctl.members.by_worker.items())
                 if not x.registered and not x.gone
                 and coord.cs.registered(w, x.incarnation))


# ---------------------------------------------------------------------- effects
def _do_publish(coord: Coordinator, e: m.Publish) -> None:
    from chameleon_ft.perf import Topology, build_schedule

    s = coord.state
    info = coord.ctl.gens[e.gen]
    sched = build_schedule(s.plan, coord.job.profile, Topology.from_config(coord.config))
    ops = directive_ops(sched.ops)
    rounds = [[[list(b.workers), list(b.layers)] for b in rnd] for rnd in sched.sync_rounds]
    migration = None
    if s.migration is not None and s.migration.transfers:
        migration = {"transfers": [[t.layer, t.src, t.dst, t.part, t.num_parts]
                                   for t in s.migration.transfers],
                     "rounds": [list(r) for r in s.migration.rounds]}
    world = sorted(s.world)
    members = coord.ctl.members
    directive = {
        "action": "train", "gen": s.gen, "plan": s.plan.to_dict(), "step": s.next_step,
        "steps": coord.train.steps, "world": world, "ops": ops, "rounds": rounds,
        "migration": migration,
        "load": None if s.load is None else {"kind": s.load.kind, "step": s.load.step},
        "incarnations": {str(w): members.incarnation(w) for w in sorted(s.alive)},
        "collective_timeout_s": info.collective_s,
        **step_reductions(s.plan, tied_parameters(coord.job.model),
                          coord.config.optimizer.clip_grad_norm)}
    coord.hooks.before_publish(coord, directive)
    groups = [(proto.world_prefix(s.gen), len(world)),
              (proto.reverse_world_prefix(s.gen), len(world))]
    groups += [(proto.bucket_prefix(s.gen, b), len(b))
               for b in sorted({tuple(b[0]) for rnd in rounds for b in rnd if len(b[0]) > 1}
                               | set(extra_groups(directive)))]
    coord.cs.publish(s.gen, directive, groups)
    precompute = getattr(coord.decide_fn(), "precompute", None)
    if precompute is not None:
        precompute(s.plan, idle=s.idle)


def _do_commit(coord: Coordinator, e: m.Commit) -> None:
    coord.cs.commit(e.gen, e.step, end=e.end)
    now = coord.now()
    workers = list(e.workers)
    loss = math.fsum(v for _, v in sorted(coord.cs.take_losses(e.gen, e.step, workers)))
    timings = coord.cs.take_timings(e.gen, e.step, workers)
    if e.forget_previous:
        coord.cs.forget_step(e.gen, e.step - 1)
    grad_norm, lr = step_metrics(timings)
    coord.report.committed(StepRecord(e.step, loss, now - e.start_s, e.gen, now,
                                      len(workers), grad_norm, lr), timings)
    every = coord.train.checkpoint_every
    if every > 0 and (e.step + 1) % every == 0:
        plan = coord.state.state_plan  # the plan that committed the step
        coord.bulk.expect(e.step + 1, e.gen, now + coord.job.checkpoint_deadline_s(), now,
                          {i: writer_of(plan.holders(i), i) for i in range(plan.num_layers)})
    coord.hooks.on_commit(coord, e.step)


def _do_fence(coord: Coordinator, e: m.Fence) -> None:
    coord.launcher.kill(e.workers)
    for w in e.workers:
        p = coord.launcher.procs.get(w)
        if p is not None:
            coord.cs.forget_heartbeat(w, p.incarnation)


def _do_launch(coord: Coordinator, e: m.Launch) -> None:
    incarnations = coord.launcher.launch(e.workers, replacement=e.replacement)
    coord.feed(m.Launched(coord.now(), incarnations, local=True, replacement=e.replacement))


def _do_reply(coord: Coordinator, e: m.Reply) -> None:
    request = coord._request
    assert request is not None, "a reply without a request in hand"
    if e.worker is None:
        coord.desk.reply(request, auth.JoinReply(ok=False, reason=e.reason))
        if coord.report.refuse({"host": request.host, "reason": e.reason,
                                "at_s": coord.now()}, request.host):
            coord.log(f"refused a worker from {request.host} ({request.address}): "
                      f"{e.reason}")
        return
    incarnation, index = coord.launcher.admitted(e.worker, request.host, coord.state.alive,
                                                 request.local_index)
    coord.desk.reply(request, auth.JoinReply(ok=True, worker=e.worker, incarnation=incarnation,
                                             replacement=e.replacement, local_index=index))
    coord.feed(m.Launched(coord.now(), {e.worker: incarnation}, local=False,
                          replacement=e.replacement))
    coord.log(f"admitted worker {e.worker} from {request.host} ({request.address})"
              + (" as a replacement" if e.replacement else ""))


def _do_failure(coord: Coordinator, e: m.Failure) -> None:
    fault_at = coord.book.fault_time(coord.cs, e.workers, e.detected_s) if e.workers \
        else e.detected_s
    event = Event(workers=list(e.workers), cause=e.cause, gen=e.gen, step=e.step,
                  fault_at_s=fault_at, detected_at_s=e.detected_s,
                  detected_after_s=None if fault_at is None else e.detected_s - fault_at,
                  strategy=e.strategy, reason=e.reason, lost_steps=e.lost_steps, idle=e.idle)
    coord.report.events.append(event)
    if e.idle:
        return
    if e.workers:
        detected = "" if event.detected_after_s is None else \
            f" {event.detected_after_s:.3f} s after the fault"
        coord.log(f"FAILURE at step {e.step}: {e.cause}; detected{detected}")
    coord.hooks.on_failure(coord, event)


def _do_resolved(coord: Coordinator, e: m.Resolved) -> None:
    event = coord.report.events[-1]
    event.strategy, event.reason = e.strategy, e.reason
    event.decision, event.decide_s = dict(e.decision), e.decide_s
    event.lost_steps = e.lost_steps
    if e.plan is None:
        return
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


def _do_decide(coord: Coordinator, e: m.Decide) -> None:
    ask = e.ask
    t = time.monotonic()
    decision = coord.decide_fn()(ask.base, ask.failed, ask.usable, coord.now(),
                                 e.since_checkpoint_s)
    coord.feed(m.Decision(coord.now(), decision, time.monotonic() - t))


def _do_decide_rejoin(coord: Coordinator, e: m.DecideRejoin) -> None:
    rejoin = getattr(coord.decide_fn(), "rejoin", None)
    if rejoin is None:
        return
    try:
        decision = rejoin(e.plan, e.idle, coord.state.alive, coord.now())
    except ValueError as exc:
        coord.feed(m.RejoinDecision(coord.now(), None, str(exc)))
        return
    coord.feed(m.RejoinDecision(coord.now(), decision))


def _do_probe(coord: Coordinator, e: m.ProbeAbsent) -> None:
    info = coord.ctl.gens.get(e.gen)
    world = list(info.world) if info is not None else sorted(coord.state.world)
    members = coord.ctl.members
    absent = coord.cs.absent(e.gen, {w: members.incarnation(w) for w in world
                                     if w in members.by_worker})
    coord.feed(m.Absent(coord.now(), e.gen, absent))


def _do_save(coord: Coordinator, e: m.SaveCheckpoint) -> None:
    meta = {"config": coord.job.digest, "job": coord.job.job_name,
            "dtype": coord.train.dtype, "num_layers": coord.job.num_layers}
    try:
        manifest = coord.bulk.save(e.step, e.gen, accepted=e.accepted,
                                   plan=coord.state.state_plan.to_dict(), meta=meta,
                                   store=coord.cs)
    except (OSError, CheckpointError) as exc:
        reason = f"manifest not written: {getattr(exc, 'strerror', None) or exc}"
        coord.feed(m.CheckpointFailed(coord.now(), e.step, e.gen, reason))
        return
    if manifest is None:
        return
    manifest, record = manifest
    coord.report.checkpoint_writes.append(
        record | {"complete_after_s": coord.now() - record["committed_at_s"]})
    coord.feed(m.CheckpointDone(coord.now(), e.step, e.gen))
    if coord.now() - coord.checkpoint_logged_s >= CHECKPOINT_LOG_S:
        coord.checkpoint_logged_s = coord.now()
        coord.log(f"checkpoint after {e.step} steps written to {manifest.folder}")


def _do_drop(coord: Coordinator, e: m.DropCheckpoint) -> None:
    coord.bulk.drop(e.step, e.gen, coord.cs)
    coord.report.dropped.append({"step": e.step, "gen": e.gen, "reason": e.reason,
                                 "at_s": coord.now()})


def _do_mark_corrupt(coord: Coordinator, e: m.MarkCorrupt) -> None:
    coord.job.ckpt.mark_corrupt(e.step, e.reason)
    coord.report.corrupt.append({"step": e.step, "reason": e.reason, "at_s": coord.now()})


def _do_retire(coord: Coordinator, e: m.Retire) -> None:
    for gen, first, last, world in e.gens:
        coord.cs.retire(gen, first, last, list(world))


def _do_rejoined(coord: Coordinator, e: m.Rejoined) -> None:
    coord.report.rejoins.append({"workers": list(e.workers), "step": e.step,
                                 "strategy": e.strategy, "reason": e.reason})


def _do_stop(coord: Coordinator, e: m.Stop) -> None:
    """The final generation: every worker leaves; unless the run failed, the holders of
    the final state write its checkpoint first (when none holds the final step yet)."""
    coord.stopped = e
    write = not e.failed and e.step not in coord.job.ckpt.steps() and \
        not coord.bulk.is_pending(e.step)
    timeout_s = coord.job.checkpoint_deadline_s()
    if write:
        coord.bulk.expect(e.step, e.gen, coord.now() + timeout_s, coord.now())
    coord.cs.publish(e.gen, {"action": "stop", "gen": e.gen, "step": e.step,
                             "final": {str(i): list(ws) for i, ws in e.final.items()},
                             "write": write, "failed": e.failed, "reason": e.reason,
                             "final_timeout_s": 2 * timeout_s}, [])


_PERFORM: dict[type, Callable[[Any, Any], None]] = {
    m.Log: lambda coord, e: coord.log(e.text),
    m.Publish: _do_publish,
    m.Abort: lambda coord, e: coord.cs.abort(e.gen, e.step),
    m.Commit: _do_commit,
    m.Fence: _do_fence,
    m.Launch: _do_launch,
    m.Reply: _do_reply,
    m.StartFrom: lambda coord, e: coord.cs.start_from(
        e.worker, coord.ctl.members.incarnation(e.worker), e.gen),
    m.Failure: _do_failure,
    m.Resolved: _do_resolved,
    m.Decide: _do_decide,
    m.DecideRejoin: _do_decide_rejoin,
    m.ProbeAbsent: _do_probe,
    m.SaveCheckpoint: _do_save,
    m.DropCheckpoint: _do_drop,
    m.MarkCorrupt: _do_mark_corrupt,
    m.DropTimelines: lambda coord, e: coord.bulk.drop_before(e.epoch),
    m.Retire: _do_retire,
    m.Rejoined: _do_rejoined,
    m.Stop: _do_stop,
}


def perform(coord: Coordinator, effect: m.Effect) -> None:
    """Do what one effect says."""
    _PERFORM[type(effect)](coord, effect)
