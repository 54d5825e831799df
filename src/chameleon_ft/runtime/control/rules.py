"""The handlers of :func:`chameleon_ft.runtime.control.machine.step` for the running
generation: time, deaths, error reports, readiness, votes, decisions, signals and the
replayed trace (members coming and going: :mod:`.joining`; checkpoints: :mod:`.saving`).

Each takes the control value, the observation and the job's settings and returns the new
value and the effects, in order. Shared moves (a new generation, a failure, the end of the
run) are functions of their own, so each rule is written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from chameleon_ft.runtime.control import checkpoints as ck
from chameleon_ft.runtime.control import decider, detector, saving
from chameleon_ft.runtime.control import members as mb
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.control.model import (
    PUBLISHED,
    RUNNING,
    Control,
    GenInfo,
    Mode,
    Settings,
    final_holders,
    incarnations,
    mode,
)

FINAL_ATTEMPT_SLACK = 2
"""The workers wait for the final checkpoint's attempts plus this many hang deadlines."""

Out = tuple[Control, list[m.Effect]]


# ---------------------------------------------------------------------- shared moves
def new_generation(c: Control, run: st.RunState, now_s: float, p: Settings) -> Out:
    """Publish ``run``'s generation (whatever made it): drop checkpoint assemblies of
    abandoned timelines, record the generation, reset what detection remembers."""
    collective_s, raised = p.deadline_of(run.plan, run.migration)
    c, effects = saving.drop_timelines(replace(c, run=run), run.epoch)
    if raised is not None:
        effects.insert(0, m.Log(raised))
    world = tuple(sorted(run.world))
    effects.append(m.Publish(run.gen, run.plan, run.migration, run.load, run.next_step, world,
                             incarnations(c, run.alive), collective_s, run.idle))
    gens = dict(c.gens)
    gens[run.gen] = GenInfo(published_s=now_s, collective_s=collective_s, world=world,
                            first_step=run.next_step, last_step=run.next_step - 1)
    return replace(c, gens=gens, watch=detector.Watch(gen=run.gen), ready_s=None,
                   last_commit_s=None), effects


def fail(c: Control, reason: str, *, bad_input: bool = False) -> Out:
    """Training cannot go on: the final generation tells every worker to stop, uploading
    nothing; the report gives the reason."""
    run = st.stopped(c.run, reason)
    return replace(c, run=run, ask=None, joining_until_s=None, relaunching_until_s=None,
                   closed=True), [
        m.Stop(gen=run.gen, step=run.next_step, final={}, reason=reason, failed=True,
               bad_input=bad_input)]


def finish(c: Control, now_s: float, p: Settings) -> Out:
    """Every step committed, or a drain ended: the final generation tells the workers whose
    state is at the committed step to write it (unless a checkpoint of that step is
    complete or being written), then to leave once it is complete."""
    interrupted = c.run.mode is Mode.DRAINING and not c.trace_ended
    reason = c.run.reason
    holders = final_holders(c.run, p.num_layers)
    run = st.finished(c.run)
    c, before, write = saving.start_final(replace(c, run=run, ask=None), holders, run.gen,
                                          now_s, p)
    wait_s = len(ck.FINAL_ATTEMPTS) * p.checkpoint_deadline_s + \
        FINAL_ATTEMPT_SLACK * p.hang_s
    stop = m.Stop(gen=run.gen, step=run.next_step, final=holders, reason=reason,
                  interrupted=interrupted, write=write, final_timeout_s=wait_s)
    done = [e for e in before if isinstance(e, m.FinalDone)]
    return c, [*(e for e in before if not isinstance(e, m.FinalDone)), stop, *done]


def _since_checkpoint(c: Control, now_s: float) -> float | None:
    done = c.checkpoint_times.get(c.run.latest_checkpoint())
    return None if done is None else now_s - done


def deaths(c: Control, dead: Mapping[int, str], now_s: float, p: Settings) -> Out:
    """Workers died: fence them, abort the generation if they were in it, and recover."""
    s = c.run
    failed = frozenset(dead) & s.alive
    if not failed:
        return c, []
    if mode(c) is Mode.RELAUNCHING:
        return fail(c, "every worker failed, and a relaunched one died while starting")
    gens = dict(c.gens)
    if any(not dead[w].startswith(("exit", "error")) for w in failed):
        # silent (stopped, cut off) or stuck, not gone: its peers' group set-up may retry
        # for five deadlines, so nobody stuck in those set-ups is waited for
        gens = {g: replace(i, silent=True) if failed & set(i.world) else i
                for g, i in gens.items()}
    run, broken = st.workers_died(s, failed)
    members, logs = mb.died(c.members, failed)
    fenced = incarnations(c, failed)
    beats = {k: v for k, v in c.beats.items() if k[0] not in failed}
    c = replace(c, run=run, members=members, gens=gens, beats=beats)
    cause = "; ".join(f"w{w}: {dead[w]}" for w in sorted(failed))
    workers = tuple(sorted(failed))
    effects: list[m.Effect] = [m.Fence(workers, fenced), *(m.Log(x) for x in logs)]
    c, more = saving.writers_gone(c, failed, now_s, p)
    effects += more
    if not broken:
        return c, [*effects, m.Failure(workers, cause, s.gen, s.next_step, now_s, idle=True,
                                       strategy="none",
                                       reason="only idle workers died; training went on"),
                   m.Log(f"idle worker(s) {list(workers)} died ({cause}); training goes on")]
    effects += [m.Abort(s.gen, s.next_step),
                m.Failure(workers, cause, s.gen, s.next_step, now_s)]
    if run.mode is Mode.DRAINING:
        c, more = finish(c, now_s, p)
        return c, [*effects, m.Resolved("none", "stopping: the drain ends here"), *more]
    if not run.alive:
        c, more = relaunch_everything(c, now_s, p)
        return c, effects + more
    c, more = decide(replace(c, recovering=True), now_s, p)
    return c, effects + more


def decide(c: Control, now_s: float, p: Settings) -> Out:
    """Ask the policy, or decide without it (keep an intact placement, reload again)."""
    request = decider.request(c.run)
    if isinstance(request, decider.Decided):
        return recover(c, None, request.decision, now_s, 0.0, p)
    return replace(c, ask=request), [m.Decide(request, _since_checkpoint(c, now_s))]


def recover(c: Control, ask: decider.Ask | None, decision: decider.DecisionLike,
            now_s: float, decide_s: float, p: Settings) -> Out:
    """Start the generation a decision asks for."""
    c = replace(c, ask=None)
    out = decider.recovery(c.run, ask, decision)
    if isinstance(out, decider.Stop):
        c, effects = fail(c, out.reason)
        return c, [m.Resolved(str(decision.strategy), decision.reason, decision.to_dict(),
                              decide_s), *effects]
    taken, rec = out
    s = c.run
    lost = s.next_step - rec.restored_step if rec.restored_step is not None else 0
    try:
        run = st.recovered(s, rec)
    except ValueError as exc:
        return fail(c, f"the policy's plan is unusable: {exc}")
    doc = taken.to_dict()
    resolved = m.Resolved(str(taken.strategy), taken.reason, doc, decide_s, lost,
                          plan=taken.plan, candidates=tuple(doc.get("candidates") or ()))
    c, effects = new_generation(c, run, now_s, p)
    return c, [resolved, *effects]


def relaunch_everything(c: Control, now_s: float, p: Settings) -> Out:
    """No worker is left: relaunch every local one and wait (with remote replacements)
    for the initial plan's workers, then reload the last checkpoint."""
    if not p.rejoin:
        return fail(c, "every worker failed (with [train] rejoin the coordinator would "
                       "relaunch them and reload the last checkpoint)")
    local = tuple(w for w in range(p.num_local) if w not in c.run.alive)
    return replace(c, relaunching_until_s=now_s + p.join_timeout_s, recovering=True), [
        m.Log("every worker failed: relaunching them and reloading the last checkpoint"),
        m.Launch(local, replacement=True)]


def restart_everything(c: Control, now_s: float, p: Settings) -> Out:
    """Every worker of the initial plan is back: reload the last checkpoint on it."""
    restored = c.run.latest_checkpoint()
    lost = c.run.next_step - restored
    run = st.recovered(c.run, st.Recovery("restart", p.initial_plan, restored_step=restored))
    c, effects = new_generation(replace(c, relaunching_until_s=None), run, now_s, p)
    return c, [m.Resolved("restart", "every worker failed: all relaunched, the last "
                          "checkpoint reloaded", lost_steps=lost), *effects]


# ---------------------------------------------------------------------- observations
def on_tick(c: Control, obs: m.Tick, p: Settings) -> Out:
    """Deadlines: joining, relaunching, draining, checkpoints; errors that stay
    unexplained; repairs."""
    now = obs.now_s
    c, effects = saving.expire(c, now, p)
    c, more = _deadlines(c, now, p)
    return c, effects + more


def _deadlines(c: Control, now: float, p: Settings) -> Out:
    k = mode(c)
    if k is Mode.JOINING and c.joining_until_s is not None and now > c.joining_until_s:
        joined = sum(1 for x in c.members.by_worker.values() if x.registered)
        return fail(c, f"workers: only {joined} of the {p.num_workers} workers the layout "
                       f"needs joined within {p.join_timeout_s:g} s{p.join_hint}",
                    bad_input=True)
    if k is Mode.RELAUNCHING and c.relaunching_until_s is not None \
            and now > c.relaunching_until_s:
        missing = sorted(frozenset(p.initial_plan.workers) - c.run.alive)
        return fail(c, f"every worker failed; workers {missing} were not back within "
                       f"{p.join_timeout_s:g} s")
    if k is Mode.DRAINING and c.drain_since_s is not None \
            and now - c.drain_since_s > p.drain_grace_s:
        s = c.run
        c, effects = finish(c, now, p)
        return c, [m.Abort(s.gen, s.next_step),
                   m.Log(f"the step in flight ({s.next_step}) did not finish in time: "
                         "aborted"), *effects]
    if k in RUNNING and detector.unexplained_due(c.watch, now_s=now, hang_s=p.hang_s,
                                                 heartbeat_s=p.heartbeat_s):
        info = c.gens.get(c.run.gen)
        world = info.world if info is not None else tuple(sorted(c.run.world))
        return c, [m.ProbeAbsent(c.run.gen, incarnations(c, world))]
    if k is Mode.TRAINING:
        return repairs(c, p)
    return c, []


def repairs(c: Control, p: Settings) -> Out:
    """Relaunch dead local workers (``[train] rejoin``) once training runs again; a failure
    trace brings them back with its repair rows instead."""
    if not p.rejoin or p.replay or c.run.mode is not Mode.TRAINING:
        return c, []
    ids = tuple(mb.to_relaunch(c.members, c.run.alive, p.num_local))
    if not ids:
        return c, []
    return c, [m.Launch(ids, replacement=True),
               *(m.Log(f"relaunched worker {w} (repair); it rejoins when ready") for w in ids)]


def on_exits(c: Control, obs: m.Exits, p: Settings) -> Out:
    """Local processes exited: alive workers are dead; others failed to start."""
    statuses = {w: code for w, code in obs.statuses.items()
                if w in c.members.by_worker and not c.members.by_worker[w].gone}
    k = mode(c)
    if k is Mode.JOINING:
        return _start_failed(c, statuses)
    if k is Mode.RELAUNCHING and statuses:
        return fail(c, "every worker failed, and a relaunched one died while starting")
    dead = detector.exits(statuses, c.run.alive)
    starting = [w for w in statuses if w not in c.run.alive]
    members, logs = mb.died(c.members, starting)
    c = replace(c, members=members)
    effects: list[m.Effect] = [m.Log(x) for x in logs]
    c, more = deaths(c, dead, obs.now_s, p)
    return c, effects + more


def _start_failed(c: Control, statuses: Mapping[int, int]) -> Out:
    """Workers died before the first generation: start them again, a few times."""
    members, _ = mb.died(c.members, statuses, starting=True)
    c = replace(c, members=members)
    for w, code in sorted(statuses.items()):
        starts = members.failed_starts.get(w, 0)
        if starts >= mb.MAX_FAILED_STARTS:
            return fail(c, f"worker {w} exited with status {code} while starting, {starts} "
                           "times; see its output above", bad_input=True)
    effects: list[m.Effect] = [
        m.Log(f"worker {w} exited with status {code} while starting; starting it again")
        for w, code in sorted(statuses.items())]
    if statuses:
        effects.append(m.Launch(tuple(sorted(statuses)), replacement=False))
    return c, effects


def on_beats(c: Control, obs: m.Beats, p: Settings) -> Out:
    """Heartbeats: hung workers and suspects whose heartbeat stalled are dead (no process
    holds a worker id before the first workers joined)."""
    if mode(c) is Mode.JOINING:
        return c, []
    counts = {w: v for w, v in obs.counts.items() if w in c.run.alive}
    beats, dead = detector.check_beats(c.beats, counts, suspects=c.watch.suspects,
                                       now_s=obs.now_s, hang_s=p.hang_s,
                                       heartbeat_s=p.heartbeat_s)
    return deaths(replace(c, beats=beats), dead, obs.now_s, p)


def on_errors(c: Control, obs: m.Errors, p: Settings) -> Out:
    """The generation's error reports: fatal ones are deaths, others make suspects, and a
    checkpoint the generation loads found corrupt is set aside before the deaths are
    answered (a restart decided for them must not load it again)."""
    if obs.gen != c.run.gen or obs.gen != c.watch.gen or mode(c) not in PUBLISHED:
        return c, []
    seen = detector.read_errors(c.watch, obs.reports, alive=c.run.alive, now_s=obs.now_s)
    c, effects = set_aside(replace(c, watch=seen.watch), seen.corrupt)
    marked = [e for e in effects if isinstance(e, m.MarkCorrupt)]
    c, more = deaths(c, seen.deaths, obs.now_s, p)
    effects += more
    if marked and c.run.gen == obs.gen and mode(c) in RUNNING:
        c, more = corrupt_fallback(c, marked[0], obs.now_s, p)  # nobody died meanwhile
        effects += more
    return c, [*(m.Log(x) for x in seen.logs), *effects]


def on_ready(c: Control, obs: m.Ready, p: Settings) -> Out:
    """Every member of the running generation is ready: older generations are over."""
    if obs.gen != c.run.gen or c.ready_s is not None or mode(c) not in PUBLISHED \
            or obs.count < len(c.run.world):
        return c, []
    retired = tuple((g, i.first_step, i.last_step, i.world) for g, i in sorted(c.gens.items())
                    if g < obs.gen)
    gens = {g: i for g, i in c.gens.items() if g >= obs.gen}
    c = replace(c, ready_s=obs.now_s, gens=gens)
    return c, [m.Retire(retired)] if retired else []


def on_reduced(c: Control, obs: m.Reduced, p: Settings) -> Out:
    """Every worker of the plan reduced the step in flight: commit it (a step that commits
    shows the generation works: earlier error reports were stale), its checkpoint expected
    first when one is due."""
    s = c.run
    if obs.gen != s.gen or obs.step != s.next_step or mode(c) not in RUNNING \
            or obs.count < len(s.plan.workers):
        return c, []  # not every vote yet; or a broken generation's, which was aborted
    draining = s.mode is Mode.DRAINING
    end = s.switch_due or draining
    info = c.gens.get(s.gen)
    start = c.last_commit_s if c.last_commit_s is not None else (
        c.ready_s if c.ready_s is not None else (info.published_s if info else obs.now_s))
    forget = info is not None and obs.step - 1 >= info.first_step
    c, effects = saving.on_commit(c, obs.step, s.gen, obs.now_s, p)
    effects.append(m.Commit(s.gen, obs.step, end, start, tuple(sorted(s.plan.workers)),
                            forget, recovered=c.recovering))
    gens = dict(c.gens)
    if info is not None:
        gens[s.gen] = replace(info, last_step=obs.step)
    c = replace(c, run=st.committed(s, obs.step), last_commit_s=obs.now_s, gens=gens,
                recovering=False, members=mb.proven(c.members, s.plan.workers),
                watch=replace(c.watch, unexplained_since_s=None, suspects=frozenset()))
    if draining or c.run.next_step >= p.steps:
        c, more = finish(c, obs.now_s, p)
        return c, effects + more
    if end:
        return switch(c, obs.now_s, p, effects)
    question = decider.rejoin_question(c.run)
    if question is None or question == c.rejoin_asked:
        return c, effects
    return replace(c, rejoin_asked=question), [*effects,
                                               m.DecideRejoin(*question, alive=c.run.alive)]


def switch(c: Control, now_s: float, p: Settings, effects: list[m.Effect]) -> Out:
    """The pending plan change happens at this boundary: migrate, then train on it."""
    pending = c.run.pending
    assert pending is not None
    moves = len(pending.migration.transfers) if pending.migration else 0
    effects = [*effects, m.Log(f"switching plans after step {c.run.next_step - 1} "
                               f"({moves} transfers)"),
               *(m.Log(f"  {line}") for line in pending.plan.describe().splitlines())]
    c, more = new_generation(c, st.switched(c.run), now_s, p)
    return c, effects + more


def on_rejoin_decision(c: Control, obs: m.RejoinDecision, p: Settings) -> Out:
    """The policy's answer about idle workers: keep them idle, or switch at the next
    boundary to a plan that uses them."""
    s = c.run
    if obs.decision is None:
        return c, [m.Log(f"rejoin of {sorted(s.idle)} not possible: {obs.error}")]
    decision = obs.decision
    strategy = decider.rejoin_strategy(s, decision)
    effects: list[m.Effect] = [
        m.Rejoined(tuple(sorted(s.idle)), s.next_step, strategy, decision.reason),
        m.Log(f"idle worker(s) {sorted(s.idle)}: {strategy} ({decision.reason})")]
    if strategy == "keep" or decision.plan is None:
        return c, effects
    try:
        run = st.rejoin_planned(s, decision.plan, decision.migration, s.idle)
    except ValueError as exc:
        return c, [*effects, m.Log(f"rejoin plan unusable: {exc}")]
    return replace(c, run=run), effects


def set_aside(c: Control, corrupt: Mapping[int, str]) -> Out:
    """A worker found the checkpoint the running generation loads corrupt: forget it (it
    is never loaded again) and have it set aside on disk."""
    s = c.run
    if s.load is None or s.load.kind != "restore" or s.load.step not in corrupt:
        return c, []
    bad = s.load.step
    return replace(c, run=st.checkpoint_corrupt(s, bad)), [m.MarkCorrupt(bad, corrupt[bad])]


def corrupt_fallback(c: Control, bad: m.MarkCorrupt, now_s: float, p: Settings) -> Out:
    """The running generation loads a checkpoint just set aside as corrupt: load the newest
    one before it instead, on the same plan."""
    s = c.run
    run = st.recovered(s, st.Recovery("restart", s.plan,
                                      restored_step=s.latest_checkpoint(bad.step - 1)))
    effects: list[m.Effect] = [
        m.Abort(s.gen, s.next_step),
        m.Log(f"warning: the checkpoint after {bad.step} steps is corrupt ({bad.reason}); "
              f"loading the one after {run.next_step} steps instead")]
    c, more = new_generation(replace(c, recovering=True), run, now_s, p)
    return c, effects + more


def on_stop(c: Control, obs: m.StopAsked, p: Settings) -> Out:
    """SIGINT/SIGTERM: drain a running generation; give up joining or relaunching."""
    k = mode(c)
    if k in (Mode.JOINING, Mode.RELAUNCHING):
        return fail(c, f"interrupted ({obs.signal}) while workers were "
                       f"{'joining' if k is Mode.JOINING else 'being relaunched'}")
    if c.run.mode is not Mode.TRAINING:
        return c, []
    c = replace(c, run=st.draining(c.run, obs.signal), drain_since_s=obs.now_s)
    return c, [m.Log(f"{obs.signal} received: finishing the step in flight, then writing a "
                     "checkpoint and stopping")]


def on_trace_end(c: Control, obs: m.TraceEnd, p: Settings) -> Out:
    """A replayed trace ended: stop at the next step boundary, as a drain does (not
    reported as an interruption)."""
    if c.run.mode is not Mode.TRAINING or mode(c) is Mode.JOINING:
        return c, []
    c = replace(c, run=st.draining(c.run, "end of trace"), drain_since_s=obs.now_s,
                trace_ended=True)
    return c, [m.Log("end of trace: stopping at the next step boundary")]


def on_software(c: Control, obs: m.SoftwareFault, p: Settings) -> Out:
    """A replayed job-level fault: abort the step in flight; the running plan reloads the
    last checkpoint in the running processes (a generation must run: one broken by a
    failure is being recovered already)."""
    if mode(c) not in RUNNING:
        return c, []
    s = c.run
    try:
        run = st.software_restart(s)
    except ValueError as exc:
        return c, [m.Log(f"trace: software fault not applied: {exc}")]
    lost = s.next_step - run.next_step
    effects: list[m.Effect] = [
        m.Abort(s.gen, s.next_step),
        m.Failure((), "software fault (every worker reloads the checkpoint)", s.gen,
                  s.next_step, obs.now_s, strategy="restart",
                  reason="a job-level software fault: the running plan restarts from the "
                         f"checkpoint after {run.next_step} steps", lost_steps=lost),
        m.Log(f"FAILURE at step {s.next_step}: software fault; restarting the plan from the "
              f"checkpoint after {run.next_step} steps")]
    c, more = new_generation(replace(c, recovering=True), run, obs.now_s, p)
    return c, effects + more


def on_decision(c: Control, obs: m.Decision, p: Settings) -> Out:
    """The policy answered the question in :attr:`Control.ask`."""
    if c.ask is None:
        return c, []
    return recover(c, c.ask, obs.decision, obs.now_s, obs.decide_s, p)


def on_absent(c: Control, obs: m.Absent, p: Settings) -> Out:
    """Errors went unexplained: wait for members still in an older set-up, declare absent
    members failed, or redo the generation (boundedly)."""
    s = c.run
    if obs.gen != s.gen or mode(c) not in RUNNING:
        return c, []
    verdict = detector.judge_unexplained(
        obs.setup, world=s.world, gen=s.gen,
        generations={g: (i.published_s, i.collective_s) for g, i in c.gens.items()
                     if not i.silent},
        now_s=obs.now_s, slack_s=p.hang_s)
    if isinstance(verdict, detector.WaitForSetup):
        return _wait_for_setup(c, verdict, obs.now_s, p)
    if isinstance(verdict, detector.AbsentFailed):
        return deaths(c, {w: f"did not join generation {s.gen}'s groups within the deadline"
                          for w in verdict.workers}, obs.now_s, p)
    return _retry(c, obs.now_s, p)


def _wait_for_setup(c: Control, verdict: detector.WaitForSetup, now_s: float,
                    p: Settings) -> Out:
    new = sorted(set(verdict.until_s) - c.watch.waits_logged)
    watch = replace(c.watch, recheck_at_s=now_s + p.heartbeat_s,
                    waits_logged=c.watch.waits_logged | frozenset(new))
    effects: list[m.Effect] = []
    if new:
        longest = max(verdict.until_s[w] for w in new) - now_s
        effects.append(m.Log(
            f"generation {c.run.gen}: worker(s) {new} still inside an older generation's "
            "group set-up (gloo's set-up cannot be interrupted); waiting for it to end, at "
            f"most {longest:.1f} s more"))
    return replace(c, watch=watch), effects


def _retry(c: Control, now_s: float, p: Settings) -> Out:
    """Every member joined and still errors no death explains: the generation's own."""
    s = c.run
    summary = "; ".join(dict.fromkeys(c.watch.messages))[:300]
    effects: list[m.Effect] = [m.Abort(s.gen, s.next_step)]
    out = decider.escalation(s, p.max_retries)
    if isinstance(out, decider.Stop):
        c, more = fail(c, f"{out.reason}: {summary}")
        return c, effects + more
    if out.epoch == s.epoch:
        effects.append(m.Log(
            f"generation {s.gen}: errors no death explains ({summary}); rebuilding the "
            f"groups and redoing step {s.next_step} (retry {s.retries + 1} of "
            f"{p.max_retries})"))
    else:
        effects.append(m.Log(
            f"generation {s.gen}: errors persist after {s.retries} retries ({summary}); "
            f"restarting from the checkpoint after {out.next_step} steps"))
    c, more = new_generation(c, out, now_s, p)
    return c, effects + more


def on_shell_failed(c: Control, obs: m.ShellFailed, p: Settings) -> Out:
    """The shell cannot go on: stop training through the failure path with its reason."""
    return fail(c, obs.reason, bad_input=obs.bad_input)
