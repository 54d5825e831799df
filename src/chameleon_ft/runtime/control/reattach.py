"""A coordinator that took a run over from one that went away: the run's state rebuilt
from what its live workers report (pure; docs/design.md 4.1, "A coordinator replaced
under live workers").

While the control value's ``taking`` is set (mode ``reattaching``) the shell reads each
worker id's report (:class:`Report`: its process, the newest generation it followed, the
state it holds) and feeds what it read (:class:`~.messages.Reports`). The run is taken
over once every member of the newest generation any reporter followed has reported, or at
the deadline (``Settings.reattach_s``; members that did not report by then are dead, and
the failure path recovers from them as from any death):

- the committed step is the newest any worker holds; a worker that reduced that step's
  predecessor and never read its verdict applies its kept gradients first (the previous
  coordinator committed it: another worker holds the step after it);
- the placement is the plan of the newest generation whose every reporting worker holds
  its layers at that step (each worker keeps its previous stage's layers until the next
  commit, so the placement of the last commit always qualifies unless state was lost);
- an intact placement trains on at once in a new generation of the new term; lost or stale
  state goes through the policy, as a failure does.

When nobody reports, the run resumes from its newest complete checkpoint with fresh
workers (or fails when there is none).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.runtime.control import detector, rules
from chameleon_ft.runtime.control import members as mb
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.control.model import Control, Mode, Settings, mode
from chameleon_ft.runtime.control.reports import Held, Report, Taking

__all__ = ["Held", "Report", "Taking", "accepted", "complete", "named", "on_reports",
           "on_stop", "on_tick", "start", "take_over"]

Out = tuple[Control, list[m.Effect]]

MAX_PROCESSES = 4
"""Processes whose reports are kept per worker id (a fenced process and its replacement
may both report; the newest directive says which one holds the id)."""


def start(c: Control, now_s: float, p: Settings) -> Control:
    """The control value of a coordinator that takes a run over: it waits for reports (no
    worker is launched, nothing is published)."""
    return replace(c, taking=Taking(until_s=now_s + p.reattach_s), joining_until_s=None)


def named(taking: Taking) -> Mapping[int, str]:
    """The incarnations named by the newest directive any reporter read (empty: none
    read one)."""
    newest = max((r for by in taking.reports.values() for r in by.values()),
                 key=lambda r: (r.gen, r.worker), default=None)
    return newest.members if newest is not None and newest.gen >= 0 else {}


def accepted(taking: Taking) -> dict[int, Report]:
    """The report that counts for each worker id: its named process's; for an id the
    newest directive does not name (a repair started after it), its newest."""
    names = named(taking)
    out: dict[int, Report] = {}
    for w, by in sorted(taking.reports.items()):
        if w in names:
            if names[w] in by:
                out[w] = by[names[w]]
            continue
        out[w] = max(by.values(), key=lambda r: (r.gen, r.seen_gen, r.incarnation))
    return out


def complete(taking: Taking, num_workers: int) -> bool:
    """Whether every member of the newest generation reported (every worker id, when no
    reporter read a directive)."""
    expected = set(named(taking)) or set(range(num_workers))
    return expected <= set(accepted(taking))


def on_reports(c: Control, obs: m.Reports, p: Settings) -> Out:
    """Reports read: keep them (bounded per id); take the run over once complete."""
    taking = c.taking
    if taking is None:
        return c, []
    reports = {w: dict(by) for w, by in taking.reports.items()}
    for r in obs.reports:
        if not 0 <= r.worker < p.num_workers:
            continue
        by = reports.setdefault(r.worker, {})
        by.pop(r.incarnation, None)
        by[r.incarnation] = r
        while len(by) > MAX_PROCESSES:
            del by[next(iter(by))]
    c = replace(c, taking=replace(taking, reports=reports))
    if c.taking is not None and complete(c.taking, p.num_workers):
        return take_over(c, obs.now_s, p)
    return c, []


def on_tick(c: Control, obs: m.Tick, p: Settings) -> Out:
    """The deadline: take the run over with the reports there are."""
    if c.taking is None or obs.now_s < c.taking.until_s:
        return c, []
    return take_over(c, obs.now_s, p)


def on_stop(c: Control, obs: m.StopAsked, p: Settings) -> Out:
    """SIGINT/SIGTERM while workers re-attach: nothing runs yet, stop."""
    return rules.fail(c, f"interrupted ({obs.signal}) while workers were re-attaching")


def take_over(c: Control, now_s: float, p: Settings) -> Out:
    """The run's state from the reports: train on, recover, or resume from the checkpoint."""
    taking = c.taking
    assert taking is not None
    chosen = accepted(taking)
    if not chosen:
        return _fallback(c, now_s, p)
    names = named(taking)
    run, apply, holding = _state(c.run, chosen, names)
    c = replace(c, taking=None, run=run, members=_members(chosen, names, now_s, p),
                watch=detector.Watch(gen=run.gen), beats={}, gens={}, joining_until_s=None,
                relaunching_until_s=None, ready_s=None, last_commit_s=None, recovering=False,
                apply=apply, checkpoint_times={run.latest_checkpoint(): now_s})
    records = tuple((w, r.incarnation, r.pid, r.host) for w, r in sorted(chosen.items()))
    effects: list[m.Effect] = [
        m.Reattached(run.next_step, records),
        m.Log(f"took the run over at step {run.next_step}: re-attached worker(s) "
              f"{sorted(chosen)}" + (f"; they apply step {apply[1]} first, which the "
                                     "previous coordinator committed" if apply else ""))]
    missing = {w: f"did not report to the new coordinator within {p.reattach_s:g} s"
               for w in sorted(names) if w not in chosen}
    c, more = rules.deaths(c, missing, now_s, p)
    effects += more
    if mode(c) is not Mode.TRAINING or c.run.gen != run.gen:
        return c, effects  # the deaths were answered (a decision, a relaunch, the end)
    lost = tuple(w for w in sorted(c.run.plan.workers) if w not in holding)
    if lost:
        s = c.run
        effects += [m.Failure(lost, "state lost while the coordinator was away", s.gen,
                              s.next_step, now_s),
                    m.Log(f"worker(s) {list(lost)} do not hold their layers after "
                          f"{s.next_step} steps: recovering")]
        c, more = rules.decide(replace(c, recovering=True), now_s, p)
        return c, effects + more
    if c.run.next_step >= p.steps:
        c, more = rules.finish(c, now_s, p)
        return c, effects + more
    c, more = rules.new_generation(c, replace(c.run, gen=c.run.gen + 1), now_s, p)
    return c, effects + more


def _fallback(c: Control, now_s: float, p: Settings) -> Out:
    """Nobody reported: resume from the newest complete checkpoint with fresh workers."""
    if not p.resume_fallback:
        return rules.fail(c, f"--resume: no worker of the run reported "
                          f"within {p.reattach_s:g} s, and there is no complete checkpoint "
                          "to resume from", bad_input=True)
    c = replace(c, taking=None, joining_until_s=now_s + p.join_timeout_s)
    effects: list[m.Effect] = [m.Reattached(c.run.next_step, ()),
                               m.Log(f"no worker of the run reported within "
                                     f"{p.reattach_s:g} s: resuming from its checkpoint")]
    if p.num_local:
        effects.append(m.Launch(tuple(range(p.num_local)), replacement=False))
    return c, effects


def _state(start: st.RunState, chosen: Mapping[int, Report],
           names: Mapping[int, str]) -> tuple[st.RunState, tuple[int, int] | None,
                                              frozenset[int]]:
    """The run's state, the step to apply first (``(gen, step)``), and the workers of its
    plan that hold their layers at its committed step."""
    seen = max(max(r.seen_gen, r.gen) for r in chosen.values())
    alive = frozenset(names) | frozenset(chosen)
    held = {w: r.held for w, r in chosen.items() if r.held is not None}
    if not held:  # nothing was ever loaded: the resume state, on the workers there are
        return replace(start, gen=seen, alive=alive, epoch=seen + 1,
                       idle=alive - frozenset(start.plan.workers)), None, alive
    step = max(h.step for h in held.values())
    committed = {h.gen for h in held.values() if h.step == step}
    apply = None
    for w, r in chosen.items():
        if r.pending is not None and r.pending.step == step and r.pending.gen in committed \
                and (w not in held or held[w].step < step):
            held[w], apply = r.pending, (r.pending.gen, step - 1)
    plan = _placement(held, step)
    holding = frozenset(w for w in plan.workers if w in held and held[w].covers(plan, w, step))
    checkpoints = tuple(x for x in start.checkpoints if x <= step) or (0,)
    run = st.RunState(gen=seen, plan=plan, state_plan=plan, migration=None, load=None,
                      alive=alive, idle=alive - frozenset(plan.workers), next_step=step,
                      stateless=frozenset(plan.workers) - holding, from_checkpoint=False,
                      epoch=seen + 1, checkpoints=checkpoints)
    return run, apply, holding


def _placement(held: Mapping[int, Held], step: int) -> ExecutionPlan:
    """The plan of the newest generation whose reporting workers all hold their layers at
    ``step`` (else the newest plan: the failure path decides from it)."""
    plans = sorted({(h.gen, h.plan) for h in held.values() if h.step == step},
                   key=lambda gp: -gp[0])
    for _, plan in plans:
        if all(held[w].covers(plan, w, step) for w in plan.workers if w in held):
            return plan
    return plans[0][1]


def _members(chosen: Mapping[int, Report], names: Mapping[int, str], now_s: float,
             p: Settings) -> mb.Members:
    """The re-attached processes hold their ids; a named one that did not report is about
    to be declared dead; every other id is gone (repaired with ``[train] rejoin``)."""
    by: dict[int, mb.Member] = {}
    for w in range(p.num_workers):
        if w in chosen:
            by[w] = mb.Member(w, chosen[w].incarnation, local=chosen[w].local,
                              registered=True, proven=True, handed_at_s=now_s)
        elif w in names:
            by[w] = mb.Member(w, names[w], local=False, registered=True, proven=True,
                              handed_at_s=now_s)
        else:
            by[w] = mb.Member(w, "", local=w < p.num_local, gone=True, handed_at_s=now_s)
    return mb.Members(by_worker=by, failed_starts={})
