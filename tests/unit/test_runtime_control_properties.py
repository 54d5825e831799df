"""The control plane's step under generated observation sequences (hypothesis).

The table-driven tests (``test_runtime_control.py``) cover the cases we thought of; here
hypothesis draws sequences of everything the shell can observe (deaths, error reports of
every kind, corrupt checkpoints, joins, commits, checkpoints, signals, replayed trace rows,
timeouts, ticks), in any order and grouping, answers the machine's questions the way a
shell would (a policy stub that may also return unusable plans), and checks after every
step what must always hold:

- the step never raises;
- every death of a worker in the running generation is answered in the same step (a
  decision asked or made, a new generation, a relaunch, or the end of the run);
- no worker is in two places (idle and in the generation; a member and dead);
- whenever a generation runs, its plan and migration name only live workers;
- the mode changes only along declared transitions, the generation never goes back, a
  run that ended stays ended and emits nothing but checkpoint bookkeeping, and it ends
  (``Stop``) at most once;
- at most ``keep_checkpoints`` complete checkpoints (and the one loaded) are remembered;
- the join slots read at once and waited for are bounded, whatever the counter says.

A third of the examples also answer the machine's questions late, after later
observations (beyond the shell's contract, which feeds answers first): there only "never
raises" is checked. What the properties found, each now a row of the tables too: a corrupt
checkpoint and a fatal error in one poll during a reload (``ValueError`` out of the step),
an idle worker that died before a re-join's switch brought back to life by it, a step
committed after its generation was broken, a software fault and unexplained errors acted
on while the first workers were joining, a late registration of a dead member.

Deterministic (``derandomize``) and bounded, so it runs in a few seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.plan import Pipeline, Stage
from chameleon_ft.recovery.types import Migration, Transfer
from chameleon_ft.runtime.control import machine, slots
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.control.model import RUNNING, Control, Mode, Settings, initial, mode
from chameleon_ft.runtime.protocol import MALFORMED, MISSING, REPLAYED, ErrorReport

PLAN = ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=4)


def two_stage(*pipelines: tuple[int, int]) -> ExecutionPlan:
    """Pipelines of two stages (layers 0-1 and 2-3) on the given worker pairs."""
    pipes = tuple(Pipeline((Stage(a, 0, 2), Stage(b, 2, 4)), 4 // len(pipelines))
                  for a, b in pipelines)
    return ExecutionPlan(num_layers=4, pipelines=pipes)


@dataclass(frozen=True)
class Decision:
    """A decision as a policy returns one."""

    strategy: str
    plan: ExecutionPlan | None
    migration: Any = None
    reason: str = "generated"
    candidates: tuple[Any, ...] = ()
    rollback: str | None = None
    chosen: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "candidates": []}


@dataclass(frozen=True)
class Candidate:
    strategy: str
    plan: ExecutionPlan
    feasible: bool = True


@dataclass(frozen=True)
class TwoPhase:
    interim_plan: ExecutionPlan
    interim_step_s: float = 1.0
    interim_s: float = 2.0


KINDS = (["reduced"] * 6 + ["tick"] * 4 + ["exits"] * 3 + ["errors"] * 5 + ["beats"] * 2
         + ["registered"] * 2 + ["ready", "checkpoint", "checkpoint", "stale-vote", "join",
                                 "relaunch", "software", "absent", "rejoin", "launched",
                                 "signal", "trace-end", "crash"])
"""What the shell observes, weighted so that runs commit, fail and recover often before a
signal or a trace's end stops them."""
DELAYS = [0.001] * 4 + [0.05] * 3 + [0.5, 1.95, 3.0, 15.0]
"""Time between observations: mostly a poll, sometimes past the hang or join deadlines."""

ANSWERED_BY = (m.Decide, m.Publish, m.Stop, m.Launch, m.Resolved)
AFTER_THE_END = (m.SaveCheckpoint, m.DropCheckpoint, m.ExpectCheckpoint, m.AskFinal,
                 m.FinalDone, m.Log)
"""What a run that ended still does: its final checkpoint."""
"""Effects that answer a death in the running generation."""


@functools.cache
def _below(n: int) -> hs.SearchStrategy[int]:
    return hs.integers(0, n - 1)


class Driver:
    """Feeds drawn observations, answers the machine's questions like a shell, and checks
    the invariants after every step. Every choice is an index into a list (strategies
    built once), which keeps an example cheap."""

    def __init__(self, data: hs.DataObject, settings_: Settings, late: bool = False,
                 resumed: bool = False) -> None:
        self.data, self.p = data, settings_
        self.late = late
        """Answers may come after later observations (the shell never does this: it feeds
        them first). Only the step's never raising is checked then."""
        start = st.start(settings_.initial_plan, range(settings_.num_workers))
        if resumed:  # a resumed run: it loads the checkpoint after 10 steps (4 is older)
            start = replace(st.start(settings_.initial_plan, range(settings_.num_workers),
                                     step=10, load=st.Load("restore", 10)), checkpoints=(4, 10))
        self.c = initial(start, now_s=0.0, settings=settings_)
        self.now = 0.0
        self.answers: list[m.Observation] = []
        self.beats: dict[int, int] = {}
        self.stops = 0
        self.seq = 0
        self.history: list[tuple[m.Observation, list[m.Effect]]] = []
        self.writing: list[tuple[int, int]] = []
        """Checkpoints expected (their layers arrive in later observations)."""
        self.joiners = 0
        self.reserved = 0
        """Join slots reserved so far."""
        self.honest = False
        """Every join slot read holds a request with a good proof."""

    def index(self, n: int) -> int:
        return int(self.data.draw(_below(n))) if n > 1 else 0

    def pick(self, options: Sequence[Any]) -> Any:
        return options[self.index(len(options))]

    def some(self, options: Sequence[Any], most: int) -> list[Any]:
        return [self.pick(options) for _ in range(self.index(most + 1))]

    # ------------------------------------------------------------------ the shell's side
    def feed(self, obs: m.Observation) -> None:
        before = self.c
        self.c, effects = machine.step(self.c, obs, self.p)
        self.history.append((obs, effects))
        try:
            self.check(before, obs, effects)
        except AssertionError:
            for seen, out in self.history[-12:]:  # pytest shows it with the failure
                print(f"{seen}\n    -> {out}")
            raise
        for effect in effects:
            self.answer(effect)

    def answer(self, e: m.Effect) -> None:
        now = self.now
        if isinstance(e, m.Launch):
            self.seq += 1
            if self.index(8) == 7:  # the OS refused
                self.answers.append(m.LaunchFailed(now, e.workers, "OSError: no", e.replacement))
                return
            self.answers.append(m.Launched(now, {w: f"i{w}-{self.seq}" for w in e.workers},
                                           local=True, replacement=e.replacement))
        elif isinstance(e, m.Decide):
            self.answers.append(m.Decision(now, self.policy(e.ask.usable), 0.0))
        elif isinstance(e, m.DecideRejoin):
            plan = self.plan_over(sorted(self.c.run.alive))
            self.answers.append(m.RejoinDecision(now, None if plan is None else
                                                 Decision("dynamic", plan)))
        elif isinstance(e, m.ProbeAbsent):
            world = sorted(self.c.run.world) or [0]
            absent = {self.pick(world): self.pick([None, 0, e.gen - 1, e.gen])
                      for _ in range(self.index(3))}
            self.answers.append(m.Absent(now, e.gen, absent))
        elif isinstance(e, m.ExpectCheckpoint):
            self.writing.append((e.step, e.gen))
        elif isinstance(e, m.ReadJoins):
            self.answers.append(m.JoinRequests(now, tuple((i, self.joiner()) for i in e.slots)))
        elif isinstance(e, m.SaveCheckpoint) and e.accepted:
            if self.index(2):
                self.answers.append(m.CheckpointFailed(now, e.step, e.gen, "disk full"))
            else:
                self.answers.append(m.CheckpointDone(now, e.step, e.gen))

    def plan_over(self, workers: list[int]) -> ExecutionPlan | None:
        if not workers:
            return None
        return two_stage(*[(self.pick(workers), self.pick(workers))
                           for _ in range(1 + self.index(2))])

    def policy(self, usable: frozenset[int]) -> Decision:
        """What a policy may answer, usable plans or not."""
        kind = self.pick(["restart", "reroute", "dynamic", "none", "bad", "two-phase",
                          "rollback", "keep"])
        plan = self.plan_over(sorted(usable))
        if kind == "none" or plan is None:
            return Decision("restart", None, reason="nothing fits")
        if kind == "bad":  # a plan naming a worker that is not usable
            return Decision("dynamic", two_stage((0, 9)))
        if kind == "two-phase":
            interim = self.plan_over(sorted(usable)) or plan
            return Decision("reroute-then-dynamic", plan, chosen=TwoPhase(interim))
        if kind == "rollback":
            return Decision("swap", plan, rollback="storage")
        migration = None
        if kind == "dynamic" and len(usable) > 1:
            a, b = sorted(usable)[:2]
            migration = Migration(slots=(), moved_bytes=1.0, rounds=((0,),), time_s=0.1,
                                  transfers=(Transfer(layer=2, src=a, dst=b, part=0,
                                                      num_parts=1, num_bytes=1.0),))
        return Decision(kind, plan, migration,
                        candidates=(Candidate("restart", plan),))

    # ------------------------------------------------------------------ observations
    def observation(self) -> m.Observation:
        self.now += self.pick(DELAYS)
        now, s, c = self.now, self.c.run, self.c
        ids = list(range(self.p.num_workers))
        kind = self.pick(KINDS)
        if kind in ("signal", "trace-end", "crash") and self.index(4):
            kind = "tick"  # rarer still: most runs should fail and recover first
        gen = self.pick([s.gen, s.gen, s.gen, max(0, s.gen - 1), s.gen + 1])
        if kind == "reduced":
            return m.Reduced(now, s.gen, s.next_step, self.pick([len(s.plan.workers), 1]))
        if kind == "stale-vote":
            return m.Reduced(now, gen, s.next_step + self.pick([0, -1, 1]), 9)
        if kind == "tick":
            return m.Tick(now)
        if kind == "exits":
            return m.Exits(now, {w: self.pick([-9, 1, 0])
                                 for w in [self.pick(ids), *self.some(ids, 3)]})
        if kind == "beats":
            counts = {}
            for w in sorted(s.alive):
                if w in c.members.by_worker and self.index(2):
                    self.beats[w] = self.beats.get(w, 0) + 1
                counts[w] = (c.members.by_worker[w].incarnation
                             if w in c.members.by_worker else "?", self.beats.get(w, 0))
            return m.Beats(now, counts)
        if kind == "errors":
            return m.Errors(now, gen, tuple(self.slot() for _ in range(1 + self.index(3))))
        if kind == "registered":
            return m.Registered(now, tuple(sorted({w for w in self.some(ids, len(ids))
                                                   if w in c.members.by_worker})))
        if kind == "ready":
            return m.Ready(now, gen, self.pick([len(s.world), 0, 9]))
        if kind == "checkpoint":
            return self.checkpoint(now, gen)
        if kind == "join":
            return self.joins(now)
        if kind == "crash":
            return m.ShellFailed(now, "OSError: No space left on device")
        if kind == "signal":
            return m.StopAsked(now, "SIGTERM")
        if kind == "relaunch":
            return m.Relaunch(now, tuple(sorted(set(self.some(ids, len(ids))))))
        if kind == "software":
            return m.SoftwareFault(now)
        if kind == "trace-end":
            return m.TraceEnd(now)
        if kind == "absent":
            return m.Absent(now, gen, {self.pick(ids): self.pick([None, 0, gen - 1, gen])
                                       for _ in range(self.index(3))})
        if kind == "rejoin":
            return m.RejoinDecision(now, Decision("dynamic", self.plan_over(ids)))
        return m.Launched(now, {w: f"x{w}" for w in self.some(ids, 2)},
                          local=bool(self.index(2)), replacement=True)

    def checkpoint(self, now: float, gen: int) -> m.Observation:
        """Progress of a checkpoint being written (mostly), or of any."""
        s = self.c.run
        step, gen = self.pick(self.writing) if self.writing and self.index(4) else \
            (self.index(s.next_step + 1), gen)
        made = self.pick(["layers", "layers", "done", "failed"])
        if made == "layers":
            return m.CheckpointLayers(now, step, gen,
                                      frozenset(self.some(range(self.p.num_layers), 4)))
        if made == "done":
            return m.CheckpointDone(now, step, gen)
        return m.CheckpointFailed(now, step, gen, "No space left on device")

    def joins(self, now: float) -> m.Observation:
        """The reserved count: the same (a recheck), one to three more, or a flood; or the
        slots read late (a stranger's slot replayed, or never asked for)."""
        if self.index(6) == 5:
            return m.JoinRequests(now, tuple((self.index(self.reserved + 2), self.joiner())
                                             for _ in range(1 + self.index(2))))
        self.reserved += self.pick([0, 1, 2, 3, 3, 1000])
        return m.JoinSlots(now, self.reserved)

    def joiner(self) -> m.Joiner | str:
        """What one join slot holds when read."""
        self.joiners += 1
        good = m.Joiner(f"req{self.joiners}", f"j{self.joiners}")
        if self.honest:
            return good
        return self.pick([good, good, m.Joiner(f"req{self.joiners}", f"j{self.joiners}",
                                               "bad proof"), MISSING, MALFORMED, REPLAYED])

    def slot(self) -> Any:
        """One error report: malformed, or a report of any kind."""
        s = self.c.run
        shape = self.index(4)
        if shape == 3:
            return MALFORMED
        corrupt = None
        if shape == 2:  # mostly the checkpoint being loaded
            loading = [s.load.step] * 3 if s.load is not None else []
            corrupt = self.pick([*s.checkpoints, *loading])
        workers = range(self.p.num_workers)
        return ErrorReport(worker=self.pick(workers), fatal=bool(self.index(2)),
                           peer=self.pick([None, *workers]),
                           message=self.pick(["x", "", "recv failed\ntrace"]),
                           corrupt_step=corrupt)

    # ------------------------------------------------------------------ the invariants
    def check(self, before: Control, obs: m.Observation, effects: list[m.Effect]) -> None:
        internal = [e.text for e in effects if isinstance(e, m.Log) and "internal" in e.text]
        if self.late:  # beyond the shell's contract: the step only has to take it
            assert not [x for x in internal if "undeclared" not in x], internal
            return
        c, s = self.c, self.c.run
        k, was = mode(c), mode(before)
        assert not internal, (internal, obs)
        edge = machine.transition(was, obs, k)
        assert edge is None or edge in machine.TRANSITIONS, edge
        assert s.gen >= before.run.gen
        if was in (Mode.FINISHED, Mode.FAILED):  # only the final checkpoint goes on
            assert k is was and s.gen == before.run.gen
            assert all(isinstance(e, AFTER_THE_END) for e in effects), effects
        if before.closed:  # nothing is waited for any more: nothing happens
            assert c == before and not effects, (obs, effects)
        if c.final is not None:  # the final checkpoint's attempt is followed
            assert c.final.key in c.expected or c.final.attempt == 0, (c.final, c.expected)
        self.stops += sum(isinstance(e, m.Stop) for e in effects)
        assert self.stops <= 1
        assert s.idle <= s.alive
        # the plan names live workers whenever a generation runs, none of them idle
        if k in RUNNING:
            assert not s.idle & s.world, (s.idle, s.world)
            assert s.world <= s.alive, (s.world, s.alive, obs)
            for w in s.alive:  # no worker in two places: each alive one has one process
                member = c.members.by_worker.get(w)
                assert member is not None and not member.gone, (w, member)
            if s.pending is not None:
                assert s.pending.workers <= s.alive, (s.pending, s.alive)
        # every death in the running generation is answered
        for e in effects:
            if isinstance(e, m.Failure) and not e.idle and e.workers:
                assert any(isinstance(x, ANSWERED_BY) for x in effects), effects
        assert list(s.checkpoints) == sorted(set(s.checkpoints))
        # the join slots looked at are bounded, whatever the counter says
        assert len(c.joins.pending) <= slots.MAX_PENDING
        for e in effects:
            if isinstance(e, m.ReadJoins):
                assert len(e.slots) <= slots.MAX_BACKLOG + slots.MAX_PENDING
        if self.p.keep_checkpoints is not None:
            assert len(s.checkpoints) <= self.p.keep_checkpoints + 1


SETTINGS = hs.builds(
    lambda workers, remote, rejoin, replay: Settings(
        steps=30, num_workers=workers, num_local=workers - remote, num_layers=4, hang_s=2.0,
        heartbeat_s=0.1, max_retries=1, rejoin=rejoin, join_timeout_s=10.0,
        initial_plan=PLAN, replay=replay, keep_checkpoints=2, checkpoint_every=2,
        checkpoint_deadline_s=5.0),
    workers=hs.sampled_from([4, 5]), remote=hs.sampled_from([0, 2]), rejoin=hs.booleans(),
    replay=hs.booleans())


@settings(max_examples=300, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=hs.data(), settings_=SETTINGS, late=hs.sampled_from([False, False, True]),
       resumed=hs.sampled_from([True, False]))
def test_the_step_never_raises_and_keeps_its_invariants(data: hs.DataObject,
                                                        settings_: Settings,
                                                        late: bool, resumed: bool) -> None:
    run = Driver(data, settings_, late, resumed)
    run.feed(m.Launched(0.0, {w: f"i{w}" for w in range(settings_.num_local)}, local=True,
                        replacement=False))
    if data.draw(hs.integers(0, 7)) < 7:  # usually they join; sometimes the deadline decides
        run.honest, run.reserved = True, settings_.num_workers - settings_.num_local
        run.feed(m.JoinSlots(0.0, run.reserved))
        while run.answers:
            run.feed(run.answers.pop(0))
        run.honest = False
        run.feed(m.Registered(0.0, tuple(sorted(run.c.members.by_worker))))
    for _ in range(data.draw(hs.integers(5, 60))):
        # the shell feeds the answers to a step's questions before it observes anything
        # else; late, some come after later observations
        while run.answers and (not late or data.draw(hs.integers(0, 2))):
            run.feed(run.answers.pop(0))
        run.feed(run.observation())
    while run.answers:
        run.feed(run.answers.pop(0))


def test_a_corrupt_checkpoint_and_a_fatal_error_in_one_poll_during_a_reload() -> None:
    """During a reload, one worker found the checkpoint corrupt and another reported a
    fatal error in the same poll: the deaths were applied, then the corrupt fallback
    restarted on a plan still naming the dead worker, and ``ValueError`` left the step."""
    p = Settings(steps=20, num_workers=4, num_local=4, num_layers=4, hang_s=2.0,
                 heartbeat_s=0.1, max_retries=1, rejoin=False, join_timeout_s=10.0,
                 initial_plan=PLAN)
    c = initial(replace(st.start(PLAN, range(4), step=10, load=st.Load("restore", 10)),
                        checkpoints=(4, 10)), now_s=0.0, settings=p)
    c, _ = machine.step(c, m.Launched(0.0, {w: f"i{w}" for w in range(4)}, local=True,
                                      replacement=False), p)
    c, _ = machine.step(c, m.Registered(0.0, (0, 1, 2, 3)), p)
    corrupt = ErrorReport(0, False, None, "layer1.bin does not match", corrupt_step=10)
    fatal = ErrorReport(1, True, None, "RuntimeError: boom")
    c, effects = machine.step(c, m.Errors(0.1, 0, (corrupt, fatal)), p)
    assert m.MarkCorrupt(10, "layer1.bin does not match") in effects
    assert 10 not in c.run.checkpoints and 1 not in c.run.alive
    (decide,) = [e for e in effects if isinstance(e, m.Decide)]
    assert decide.ask.restart_only and decide.ask.failed == {1}
    restart = two_stage((0, 2), (3, 2))
    c, effects = machine.step(c, m.Decision(0.2, Decision("restart", restart), 0.0), p)
    assert c.run.plan == restart and c.run.load == st.Load("restore", 4)
    assert mode(c) is Mode.RECOVERING


def test_a_defect_in_a_rule_ends_the_run_through_the_failure_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last guard: a rule that raises (a defect the properties above did not find)
    stops the run with the reason (every worker told to stop, the report written), not the
    coordinator with a traceback."""
    p = Settings(steps=20, num_workers=4, num_local=4, num_layers=4, hang_s=2.0,
                 heartbeat_s=0.1, max_retries=1, rejoin=False, join_timeout_s=10.0,
                 initial_plan=PLAN)
    c = initial(st.start(PLAN, range(4)), now_s=0.0, settings=p)
    c, _ = machine.step(c, m.Launched(0.0, {w: f"i{w}" for w in range(4)}, local=True,
                                      replacement=False), p)
    c, _ = machine.step(c, m.Registered(0.0, (0, 1, 2, 3)), p)

    def broken(*_args: Any) -> Any:
        raise KeyError("a defect")

    monkeypatch.setitem(machine.HANDLERS, m.Tick, broken)
    c, effects = machine.step(c, m.Tick(1.0), p)
    (stop,) = [e for e in effects if isinstance(e, m.Stop)]
    assert stop.failed and "internal error in the control plane (KeyError" in stop.reason
    assert mode(c) is Mode.FAILED
    assert machine.step(c, m.Tick(2.0), p) == (c, [])
