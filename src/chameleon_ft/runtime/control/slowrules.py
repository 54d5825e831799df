"""The handlers of fail-slow observations: step timings and probes (detection,
``slowness``), the policy's question about a slow worker, and its answer carried out with
the switch machinery of a re-join (docs/design.md 4.3, "Slow workers").

A slow worker keeps training, so nothing here breaks a generation: a declared worker is a
record in the report (cause ``slow``, its measured factor) and a question to the policy
(``decide_slow``); the answer's plan (rebalanced, re-split, a spare in its place, or
without it) becomes a pending switch at the next step boundary, as a re-join's does, two
phases when the answer reroutes first and migrates in the background. When the slowdown
ends (its steps, or its probes once it is out of the plan, measure full speed again) the
end is recorded (``slow-end``) and the policy re-plans (``decide_slow_end``). One question
at a time, asked only while training runs unbroken with no switch pending; an answer that
arrives after the plan moved is dropped and the question asked again.
"""

from __future__ import annotations

from dataclasses import replace

from chameleon_ft.runtime.control import decider
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import slowness as sw
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.control.model import RUNNING, Control, Mode, Settings, mode

Out = tuple[Control, list[m.Effect]]


def out_of_plan(c: Control) -> frozenset[int]:
    """Slow workers outside the running generation: no re-join or recovery uses them
    until they are fast again."""
    return sw.out_of(c.slow, c.run.world)


def on_op_times(c: Control, obs: m.OpTimes, p: Settings) -> Out:
    """A committed step's compute times: declare and clear slow workers, then ask.

    The first step of a generation is left out: it pays for new layers and first-use
    kernels, not the worker's speed."""
    s = c.run
    info = c.gens.get(obs.gen)
    if obs.gen != s.gen or mode(c) not in RUNNING or info is None \
            or obs.step <= info.first_step:
        return c, []
    expected = sw.plan_compute(s.plan, p.layer_costs)
    measured = {w: t for w, t in obs.compute_s.items() if w in expected}
    watch, changes = sw.observe_step(c.slow, p.slow_rule, step=obs.step, now_s=obs.now_s,
                                     measured=measured, expected=expected,
                                     peers=sw.plan_peers(s.plan))
    c = replace(c, slow=watch)
    effects = noticed(c, changes, obs.now_s)
    c, more = ask(c)
    return c, effects + more


def on_probes(c: Control, obs: m.Probes, p: Settings) -> Out:
    """Probes of slow workers out of the plan: clear those at full speed again."""
    if mode(c) not in RUNNING:
        return c, []
    watch, changes = c.slow, []
    for w in sorted(out_of_plan(c) & frozenset(obs.readings)):
        seq, factor = obs.readings[w]
        watch, more = sw.observe_probe(watch, p.slow_rule, w, seq, factor, obs.now_s)
        changes += more
    c = replace(c, slow=watch)
    effects = noticed(c, changes, obs.now_s)
    c, more_effects = ask(c)
    return c, effects + more_effects


def noticed(c: Control, changes: list[sw.Change], now_s: float) -> list[m.Effect]:
    """The records and lines of workers declared slow or fast again."""
    s = c.run
    effects: list[m.Effect] = []
    for x in changes:
        if isinstance(x, sw.Declared):
            effects += [m.SlowEvent(x.worker, "slow", x.factor, s.gen, s.next_step, now_s,
                                    x.factor),
                        m.Log(f"SLOW at step {s.next_step}: worker {x.worker} runs "
                              f"{x.factor:.2f}x slower than its peers (median of its last "
                              f"{x.window} steps)")]
        else:
            effects += [m.SlowEvent(x.worker, "slow-end", x.factor, s.gen, s.next_step, now_s,
                                    x.measured),
                        m.Log(f"worker {x.worker} runs at full speed again ({x.measured:.2f}x; "
                              f"was {x.factor:.2f}x) at step {s.next_step}")]
    return effects


def ask(c: Control) -> Out:
    """Ask the policy about the slow worker due first, when a plan may change: training
    runs unbroken, no switch is pending, no other question is open."""
    s = c.run
    if c.slow_ask is not None or mode(c) is not Mode.TRAINING or s.pending is not None:
        return c, []
    question = sw.next_question(c.slow)
    if question is None:
        return c, []
    worker, mark = question
    end = mark.phase is sw.Phase.END
    if worker not in s.alive:
        return replace(c, slow=sw.forget(c.slow, (worker,))), []
    if not end and worker not in s.plan.workers:  # idle: nothing of the plan runs slower
        return replace(c, slow=sw.answered(c.slow, worker)), []
    slow = c.slow.slow()
    # a worker fast again is no longer out of it; a replacement under the id of a stage
    # the plan reroutes holds nothing (as for a failure, ``st.decision_inputs``): offered,
    # the policy would take it for the stage's own worker and hand it its layers without
    # copying them (it comes back through a re-join, which migrates)
    alive = s.alive - out_of_plan(c) - (s.plan.dead_workers & s.stateless)
    effect = m.DecideSlow(worker, mark.factor, end, s.gen, s.plan, alive,
                          {w: f for w, f in slow.items() if w != worker})
    return replace(c, slow_ask=(worker, end, s.gen)), [effect]


def on_slow_decision(c: Control, obs: m.SlowDecision, p: Settings) -> Out:
    """The policy's answer about a slow worker: keep, or switch at the next boundary."""
    if c.slow_ask != (obs.worker, obs.end, obs.gen):
        return c, []
    c = replace(c, slow_ask=None)
    s = c.run
    cause = "slow-end" if obs.end else "slow"
    if obs.gen != s.gen or mode(c) is not Mode.TRAINING or s.pending is not None:
        return c, [m.Log(f"the answer about {cause} worker {obs.worker} came after the plan "
                         "moved; asking again once it settles")]
    c = replace(c, slow=sw.answered(c.slow, obs.worker))
    if obs.decision is None:
        return c, [m.SlowResolved(obs.worker, cause, "keep", f"no answer: {obs.error}"),
                   m.Log(f"{cause} worker {obs.worker}: no answer ({obs.error}); keep")]
    return _take(c, obs)


def _take(c: Control, obs: m.SlowDecision) -> Out:
    """Carry out an answer: keep, or the pending switch its plan asks for."""
    d = obs.decision
    assert d is not None
    s, w = c.run, obs.worker
    cause = "slow-end" if obs.end else "slow"
    strategy, plan = str(d.strategy), d.plan
    rejoin = (w,) if obs.end and w in s.idle else ()

    def record(taken: str, reason: str, switched: bool) -> list[m.Effect]:
        return [m.SlowResolved(w, cause, taken, reason, d.to_dict(), obs.decide_s,
                               plan if switched else None),
                m.Log(f"{cause} worker {w}: {taken} ({reason})")]

    if plan is None or strategy == "keep" or (plan == s.plan and not d.migration) \
            or (rejoin and w not in plan.workers):
        return c, record("keep", d.reason, False)
    if decider.reloads(d):
        return c, record("keep", f"a reload is not taken for a live worker ({d.reason})",
                         False)
    interim, after = decider.two_phase(d)
    if interim == s.plan:  # rerouting first is what runs now: switch at once
        interim = None
    try:
        run = st.rejoin_planned(s, plan, d.migration, rejoin, interim=interim,
                                switch_after=after)
    except ValueError as exc:
        return c, record("keep", f"its plan is unusable: {exc}", False)
    return replace(c, run=run), record(strategy, d.reason, True)
