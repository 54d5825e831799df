"""The handlers of :func:`chameleon_ft.runtime.control.machine.step` for members coming
and going: launches and their failures, registrations, join requests (which slots are
read, waited for or given up: :mod:`~chameleon_ft.runtime.control.slots`; each request
admitted or refused here), replayed repairs.
"""

from __future__ import annotations

from dataclasses import replace

from chameleon_ft.runtime.control import members as mb
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import slots as sl
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.control.model import PUBLISHED, Control, Mode, Settings, mode
from chameleon_ft.runtime.control.rules import (
    Out,
    fail,
    new_generation,
    restart_everything,
)
from chameleon_ft.runtime.protocol import JOIN_SLOTS_KEY, REPLAYED, join_request_key


def on_launched(c: Control, obs: m.Launched, p: Settings) -> Out:
    """Processes now hold these ids (a launch, or an admitted remote worker)."""
    members = mb.launched(c.members, obs.incarnations, local=obs.local,
                          replacement=obs.replacement, now_s=obs.now_s)
    return replace(c, members=members), []


def on_launch_failed(c: Control, obs: m.LaunchFailed, p: Settings) -> Out:
    """Processes could not be started: the first workers or a relaunch of all of them
    cannot go on; a repair counts as a failed start of its worker id (given up after a
    few, like a replacement that keeps dying)."""
    k = mode(c)
    why = f"could not start worker(s) {list(obs.workers)}: {obs.reason}"
    if k in (Mode.JOINING, Mode.RELAUNCHING):
        return fail(c, why, bad_input=k is Mode.JOINING)
    members, logs = mb.start_failed(c.members, obs.workers)
    return replace(c, members=members), [m.Log(f"warning: {why}"), *(m.Log(x) for x in logs)]


def on_registered(c: Control, obs: m.Registered, p: Settings) -> Out:
    """Members announced themselves: the first generation starts when all are there;
    a replacement comes up idle."""
    members = mb.registered(c.members, obs.workers)
    c = replace(c, members=members)
    workers = [w for w in obs.workers if w in members.by_worker
               and members.by_worker[w].registered and not members.by_worker[w].gone]
    k = mode(c)
    if k is Mode.JOINING:
        if sum(1 for x in members.by_worker.values() if x.registered) < p.num_workers:
            return c, []
        c = replace(c, joining_until_s=None)
        return new_generation(c, c.run, obs.now_s, p)
    effects: list[m.Effect] = []
    up = [w for w in sorted(workers) if members.by_worker[w].replacement
          and w not in c.run.alive]
    if up:
        c = replace(c, members=mb.made_ready(c.members, up), run=st.rejoin_ready(c.run, up))
        for w in up:
            effects += [m.StartFrom(w, c.members.incarnation(w), c.run.gen + 1),
                        m.Log(f"worker {w} (repaired) is up; idle until a plan uses it")]
    if k is Mode.RELAUNCHING and frozenset(p.initial_plan.workers) <= c.run.alive:
        c, more = restart_everything(c, obs.now_s, p)
        effects += more
    return c, effects


def on_join_slots(c: Control, obs: m.JoinSlots, p: Settings) -> Out:
    """The reserved count moved (or slots not yet written are due again): read the slots
    of the window; a flood beyond it is skipped and counted."""
    look = sl.look(c.joins, obs.reserved, obs.now_s)
    effects: list[m.Effect] = []
    if look.skipped:
        effects.append(m.Refused(JOIN_SLOTS_KEY, f"{look.skipped} reserved slots skipped",
                                 "join-flood"))
    if look.due:
        effects.append(m.ReadJoins(look.due))
    return replace(c, joins=look.window), effects


def on_joins(c: Control, obs: m.JoinRequests, p: Settings) -> Out:
    """The join slots read: each request gets a free id, a dead one (re-join), or a
    refusal, in the order read; an unwritten slot is waited for (it holds up no other)
    and given up at the hang deadline. An admitted joiner holds its id at once (with the
    incarnation the shell drew), so two joiners of one poll never get the same id."""
    window, taken, given_up = sl.settle(c.joins, obs.found, now_s=obs.now_s, hang_s=p.hang_s)
    c = replace(c, joins=window)
    effects: list[m.Effect] = [m.Refused(join_request_key(i), "reserved, never written",
                                         "join-slot") for i in given_up]
    for item in taken:
        c, more = _answer(c, item, obs.now_s, p)
        effects += more
    return c, effects


def _answer(c: Control, item: m.Joiner | str, now_s: float, p: Settings) -> Out:
    if item == REPLAYED:  # refused and counted as it was read; its joiner was answered
        return c, []
    if not isinstance(item, m.Joiner):
        return c, [m.Reply(None, reason="malformed join request")]
    if item.refusal is not None:
        return c, [m.Reply(None, reason=item.refusal, request=item.request)]
    answer = mb.admit(c.members, alive=c.run.alive, num_local=p.num_local,
                      num_workers=p.num_workers, rejoin=p.rejoin,
                      started=mode(c) is not Mode.JOINING, now_s=now_s,
                      join_timeout_s=p.join_timeout_s)
    if answer.worker is None:
        return c, [m.Reply(None, reason=answer.reason, request=item.request)]
    members = mb.launched(c.members, {answer.worker: item.incarnation}, local=False,
                          replacement=answer.replacement, now_s=now_s)
    return replace(c, members=members), [
        m.Reply(answer.worker, answer.replacement, request=item.request,
                incarnation=item.incarnation, alive=c.run.alive)]


def on_relaunch(c: Control, obs: m.Relaunch, p: Settings) -> Out:
    """A replayed repair: relaunch the named local workers whose process is gone (while a
    generation is published: joining and relaunching start every worker anyway)."""
    if mode(c) not in PUBLISHED:
        return c, []
    ids = tuple(w for w in obs.workers if w < p.num_local and w not in c.run.alive
                and w in c.members.by_worker and c.members.by_worker[w].gone)
    if not ids:
        return c, []
    return c, [m.Launch(ids, replacement=True),
               m.Log(f"trace: relaunched worker(s) {list(ids)} (repair); idle until a plan "
                     "uses them")]
