"""The control plane without processes: sequences of observations in, effects out.

Each test drives :func:`chameleon_ft.runtime.control.machine.step` the way the coordinator
does and reads the effects. The first group reproduces the defects found by reading the
coordinator before it was split into a pure control plane and a shell (each failed on
that code); the second walks every recovery path the multi-process tests cover; the last
checks that every transition the machine declares happens in some scenario.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import pytest

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.plan import Pipeline, Stage
from chameleon_ft.recovery.types import Migration, Transfer
from chameleon_ft.runtime.control import machine, slots
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.control.members import MAX_FAILED_STARTS
from chameleon_ft.runtime.control.model import Mode, Settings, initial, mode
from chameleon_ft.runtime.protocol import MALFORMED, MISSING, ErrorReport

PLAN = ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=4)
"""2 pipelines x 2 stages over 4 layers; stage s of pipeline p on worker s * 2 + p."""


def two_stage(*pipelines: tuple[int, int]) -> ExecutionPlan:
    """Pipelines of two stages (layers 0-1 and 2-3) on the given worker pairs."""
    pipes = tuple(Pipeline((Stage(a, 0, 2), Stage(b, 2, 4)), 4 // len(pipelines))
                  for a, b in pipelines)
    return ExecutionPlan(num_layers=4, pipelines=pipes)


SETTINGS = Settings(steps=100, num_workers=4, num_local=4, num_layers=4, hang_s=2.0,
                heartbeat_s=0.1, max_retries=2, rejoin=False, join_timeout_s=10.0,
                initial_plan=PLAN)

SEEN: set[tuple[Mode, str, Mode]] = set()
"""Every mode change any scenario made (checked against the declared transitions)."""


@dataclass(frozen=True)
class Chosen:
    """A decision as the policy returns one (with its candidates)."""

    strategy: str
    plan: ExecutionPlan | None
    migration: Any = None
    reason: str = "test"
    candidates: tuple[Any, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "candidates": []}


@dataclass(frozen=True)
class Candidate:
    strategy: str
    plan: ExecutionPlan
    feasible: bool = True


class Run:
    """A control value driven through observations; every effect is kept."""

    def __init__(self, settings: Settings = SETTINGS, workers: int = 4, step: int = 0) -> None:
        self.p = settings
        load = st.Load("restore", step) if step else st.INIT
        self.c = initial(st.start(settings.initial_plan, range(workers), step=step, load=load),
                         now_s=0.0, settings=settings)
        self.effects: list[m.Effect] = []
        self.now = 0.0
        self.joiners = 0
        self.reserved = 0
        """Join slots reserved so far."""

    def feed(self, obs: m.Observation) -> list[m.Effect]:
        before = mode(self.c)
        self.c, out = machine.step(self.c, obs, self.p)
        edge = machine.transition(before, obs, mode(self.c))
        if edge is not None:
            assert edge in machine.TRANSITIONS, f"undeclared transition {edge}"
            SEEN.add(edge)
        self.effects += out
        return out

    def at(self, dt: float = 0.01) -> float:
        self.now += dt
        return self.now

    def launch(self, workers: Iterable[int], *, replacement: bool = False,
               local: bool = True) -> list[m.Effect]:
        return self.feed(m.Launched(self.at(), {w: f"inc{w}-{self.now}" for w in workers},
                                    local=local, replacement=replacement))

    def start(self) -> Run:
        """Launch and register every worker: generation 0 is published."""
        self.launch(range(self.p.num_local))
        out = self.feed(m.Registered(self.at(), tuple(range(self.p.num_workers))))
        assert 0 in published(out)
        return self

    def commit(self, steps: int = 1) -> list[m.Effect]:
        out: list[m.Effect] = []
        for _ in range(steps):
            s = self.c.run
            if self.c.ready_s is None:
                out += self.feed(m.Ready(self.at(), s.gen, len(s.world)))
            out += self.feed(m.Reduced(self.at(), s.gen, s.next_step, len(s.plan.workers)))
        return out

    def join(self, refusal: str | None = None) -> m.Reply:
        """A join request in the next slot; returns the answer."""
        self.joiners += 1
        joiner = m.Joiner(f"request {self.joiners}", f"r{self.joiners}", refusal)
        (reply,) = of(self.slots(joiner), m.Reply)
        return reply  # type: ignore[no-any-return]

    def slots(self, *held: m.Joiner | str) -> list[m.Effect]:
        """Join slots reserved with what each holds, read as the control plane asks (the
        shell's part played here); returns the effects of the read."""
        self.reserved += len(held)
        (read,) = of(self.feed(m.JoinSlots(self.at(), self.reserved)), m.ReadJoins)
        assert read.slots == tuple(range(self.reserved - len(held), self.reserved))
        return self.feed(m.JoinRequests(self.at(), tuple(zip(read.slots, held, strict=True))))

    def kill(self, *workers: int) -> list[m.Effect]:
        return self.feed(m.Exits(self.at(), {w: -9 for w in workers}))

    def answer(self, decision: Any) -> list[m.Effect]:
        return self.feed(m.Decision(self.at(), decision, 0.01))


def of(effects: Iterable[m.Effect], kind: type) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


def published(effects: Iterable[m.Effect]) -> list[int]:
    """The generations published."""
    return [e.gen for e in of(effects, m.Publish)]


def logs(effects: Iterable[m.Effect]) -> str:
    return "\n".join(e.text for e in of(effects, m.Log))


def _mig(layer: int, src: int, dst: int) -> Migration:
    return Migration(slots=(), moved_bytes=1.0, rounds=((0,),), time_s=0.1,
                     transfers=(Transfer(layer=layer, src=src, dst=dst, part=0, num_parts=1,
                                         num_bytes=1.0),))


def _with_rejoined_worker() -> Run:
    """A run whose last switch folded repaired worker 4 in (nothing committed since)."""
    run = Run(replace(SETTINGS, num_workers=5, num_local=5), workers=5).start()
    run.commit(2)
    run.feed(m.RejoinDecision(run.at(), None, "unused"))
    plan = two_stage((0, 2), (1, 4))
    run.c = replace(run.c, run=st.rejoin_planned(run.c.run, plan, _mig(2, 3, 4), ()))
    run.commit()  # the switch
    assert run.c.run.plan == plan and mode(run.c) is Mode.TRAINING
    return run


# ---------------------------------------------------------------------- defects
def test_a_replacement_that_keeps_dying_after_it_joined_is_given_up() -> None:
    """A repaired worker that died after it was up was relaunched for ever (only deaths
    before ``ready`` counted), each cycle a failure and a recovery."""
    run = Run(replace(SETTINGS, rejoin=True), workers=4).start()
    run.commit(2)
    run.kill(3)
    run.answer(Chosen("reroute", two_stage((0, 2), (1, 2))))
    run.commit()
    launches = 0
    for cycle in range(MAX_FAILED_STARTS + 2):
        out = run.feed(m.Tick(run.at()))
        relaunched = [e for e in of(out, m.Launch) if 3 in e.workers]
        if cycle >= MAX_FAILED_STARTS:
            assert not relaunched, f"relaunched again in cycle {cycle}"
            continue
        assert relaunched, f"no repair in cycle {cycle}"
        launches += 1
        run.launch([3], replacement=True)
        run.feed(m.Registered(run.at(), (3,)))
        assert 3 in run.c.run.idle
        out = run.kill(3)  # up, idle, then dead again before any plan used it
        assert of(out, m.Failure)[0].idle
    assert launches == MAX_FAILED_STARTS
    assert "no more repairs of this worker" in logs(run.effects)


def test_a_repair_that_trained_resets_the_count() -> None:
    run = Run(replace(SETTINGS, rejoin=True)).start()
    run.commit()
    for _ in range(MAX_FAILED_STARTS + 1):
        run.kill(3)
        run.answer(Chosen("reroute", two_stage((0, 2), (1, 2))))
        run.commit()
        assert any(3 in e.workers for e in of(run.feed(m.Tick(run.at())), m.Launch))
        run.launch([3], replacement=True)
        run.feed(m.Registered(run.at(), (3,)))
        run.feed(m.RejoinDecision(run.at(), Chosen("dynamic", PLAN)))
        run.commit()  # the switch
        run.commit()  # a plan using the replacement committed: the repair worked
        assert run.c.members.failed_starts.get(3, 0) == 0


def test_a_failure_right_after_a_reload_reloads_again_never_keeps() -> None:
    """``keep`` was decided before the reload guard: after a reload on a plan using a
    repaired worker, that worker's death republished the older placement without loading,
    and workers whose held state was the reload's crashed."""
    run = _with_rejoined_worker()
    reloaded = run.c.run.plan
    run.feed(m.SoftwareFault(run.at()))  # reload the checkpoint on the plan using 4
    assert run.c.run.from_checkpoint and run.c.run.plan == reloaded
    assert run.c.run.state_plan == PLAN and 3 in run.c.run.holding  # the older placement
    out = run.kill(4)
    assert not any(e.strategy == "keep" for e in of(out, m.Resolved))
    (ask,) = [e.ask for e in of(out, m.Decide)]
    assert ask.restart_only and ask.base == reloaded and ask.failed == {4}
    out = run.answer(Chosen("dynamic", two_stage((0, 2), (1, 2)), candidates=(
        Candidate("restart", two_stage((0, 1), (2, 1))),)))
    (resolved,) = of(out, m.Resolved)
    assert resolved.strategy == "restart" and run.c.run.plan == two_stage((0, 1), (2, 1))
    assert run.c.run.load == st.INIT and run.c.run.from_checkpoint  # no checkpoint yet: step 0


def test_two_remote_joiners_never_get_the_same_dead_id() -> None:
    params = replace(SETTINGS, num_local=2, rejoin=True)
    run = Run(params)
    run.launch(range(2))
    assert [run.join().worker for _ in range(2)] == [2, 3]
    run.feed(m.Registered(run.at(), (0, 1, 2, 3)))
    run.commit()
    run.feed(m.Beats(run.at(), {w: (run.c.members.incarnation(w), 1) for w in range(4)}))
    run.now += 3.0  # worker 3's heartbeat stops: it is dead
    run.feed(m.Beats(run.at(), {w: (run.c.members.incarnation(w), 1 + (w != 3))
                                for w in range(4)}))
    assert 3 not in run.c.run.alive
    run.answer(Chosen("reroute", two_stage((0, 2), (1, 2))))
    first = run.join()
    assert first.worker == 3 and first.replacement and first.incarnation
    assert run.c.members.incarnation(3) == first.incarnation  # held at once
    second = run.join()
    assert second.worker is None and "already has" in second.reason
    # a joiner that never registers gives its id back after the join deadline
    run.now += params.join_timeout_s + 1
    third = run.join()
    assert third.worker == 3
    # two joiners in one poll: one id each
    run.kill(2)
    run.answer(Chosen("reroute", two_stage((0, 1), (1, 0))))
    run.now += params.join_timeout_s + 1
    out = run.slots(m.Joiner("a", "ra"), MISSING, m.Joiner("b", "rb"))
    # the unwritten slot holds up nobody; it is waited for
    assert [r.worker for r in of(out, m.Reply)] == [2, 3] and not of(out, m.Refused)
    unwritten = run.reserved - 2
    assert list(run.c.joins.pending) == [unwritten]
    run.now += SETTINGS.hang_s + 0.1
    (read,) = of(run.feed(m.JoinSlots(run.at(), run.reserved)), m.ReadJoins)
    assert read.slots == (unwritten,)  # looked at again
    out = run.feed(m.JoinRequests(run.at(), ((unwritten, MISSING),)))
    assert [(e.kind, e.why) for e in of(out, m.Refused)] == [
        ("join-slot", "reserved, never written")] and not run.c.joins.pending


def test_a_fully_reduced_step_commits_even_when_errors_went_unexplained() -> None:
    """The unexplained-errors check ran before the commit check: a step every worker had
    reduced could be aborted. A commit shows the generation works."""
    run = Run().start()
    run.commit()
    report = ErrorReport(worker=0, fatal=False, peer=None, message="slow peer")
    run.feed(m.Errors(run.at(), run.c.run.gen, (report,)))
    run.now += 10.0  # long past the deadline for unexplained errors
    out = run.feed(m.Reduced(run.at(), run.c.run.gen, run.c.run.next_step, 4))
    assert of(out, m.Commit) and not of(out, m.Abort)
    assert not of(run.feed(m.Tick(run.at())), m.ProbeAbsent)


def test_a_checkpoint_completed_before_a_death_is_the_one_a_restart_reloads() -> None:
    """Completed checkpoints were collected only after a failure's decision, so a restart
    rewound further than it had to (the shell now feeds them first)."""
    run = Run().start()
    run.commit(10)
    run.feed(m.CheckpointDone(run.at(), 10, run.c.run.gen))
    run.kill(0, 2)  # both replicas of stage 0: only a restart is possible
    out = run.answer(Chosen("restart", two_stage((1, 3))))
    assert run.c.run.next_step == 10 and run.c.run.load == st.Load("restore", 10)
    assert of(out, m.Resolved)[0].lost_steps == 0


def test_a_run_that_cannot_go_on_tells_its_workers_to_stop() -> None:
    """No stop directive was published when training could not go on: workers waited for
    their deadline and no report was written."""
    run = Run().start()
    run.commit()
    run.kill(0, 2)
    out = run.answer(Chosen("restart", None, reason="nothing fits"))
    (stop,) = of(out, m.Stop)
    assert stop.failed and "nothing fits" in stop.reason and stop.final == {}
    assert mode(run.c) is Mode.FAILED and stop.gen == run.c.run.gen
    assert run.feed(m.Tick(run.at())) == []  # nothing more happens


def test_the_final_holders_are_the_workers_whose_state_is_at_the_last_step() -> None:
    """A worker dropped by a switch keeps the placement it left; once a later plan
    committed, it is not a final holder."""
    run = Run(replace(SETTINGS, steps=7)).start()
    run.commit(3)
    run.feed(m.RejoinDecision(run.at(), None, "unused"))
    run.c = replace(run.c, run=st.rejoin_planned(run.c.run, two_stage((0, 2), (1, 2)),
                                                 None, ()))
    run.commit()  # the switch: worker 3 leaves the world
    assert 3 not in run.c.run.world
    out = run.commit(3)
    (stop,) = of(out, m.Stop)
    assert not stop.failed and stop.step == 7
    assert all(3 not in holders for holders in stop.final.values())
    assert stop.final[0] == (0, 1) and stop.final[3] == (2,)


# ---------------------------------------------------------------------- recovery paths
def test_a_kill_is_recovered_by_the_policys_plan() -> None:
    run = Run().start()
    run.commit(2)
    out = run.kill(3)
    assert of(out, m.Fence)[0].workers == (3,)
    assert of(out, m.Abort) == [m.Abort(0, 2)]
    (decide,) = of(out, m.Decide)
    assert decide.ask.failed == {3} and decide.ask.base == PLAN
    assert mode(run.c) is Mode.DECIDING
    out = run.answer(Chosen("dynamic", two_stage((0, 2), (1, 2))))
    assert published(out) == [1] and mode(run.c) is Mode.RECOVERING
    run.commit()
    assert mode(run.c) is Mode.TRAINING and run.c.run.next_step == 3


def test_no_replica_left_restarts_from_the_checkpoint() -> None:
    run = Run().start()
    run.commit(5)
    run.feed(m.CheckpointDone(run.at(), 4, 0))
    run.kill(1, 3)  # both replicas of stage 1
    out = run.answer(Chosen("restart", two_stage((0, 2))))
    assert run.c.run.next_step == 4 and run.c.run.epoch == run.c.run.gen
    assert of(out, m.DropTimelines)[0].epoch == run.c.run.gen
    assert of(out, m.Resolved)[0].lost_steps == 1


@dataclass(frozen=True)
class RollingBack(Chosen):
    """A decision that reloads the checkpoint without being a restart (a swap onto a
    stage that lost every replica)."""

    rollback: str | None = "storage"


def test_a_swap_onto_a_wiped_stage_reloads_in_place_on_its_plan() -> None:
    spares = replace(SETTINGS, num_workers=6, num_local=6)
    run = Run(spares, workers=6).start()
    assert run.c.run.idle == {4, 5}  # the spare node's workers start idle
    run.commit(5)
    run.feed(m.CheckpointDone(run.at(), 4, 0))
    run.kill(1, 3)  # both replicas of stage 1
    swapped = two_stage((0, 4), (2, 5))
    out = run.answer(RollingBack("swap", swapped))
    state = run.c.run
    assert state.plan == swapped and state.load == st.Load("restore", 4)
    assert state.next_step == 4 and state.from_checkpoint and state.idle == frozenset()
    assert of(out, m.Resolved)[0].lost_steps == 1


def test_a_hang_is_a_death_after_the_deadline() -> None:
    run = Run().start()
    run.commit()
    beat = 0

    def beats() -> m.Beats:  # every worker beats but worker 1
        nonlocal beat
        beat += 1
        return m.Beats(run.at(), {w: (run.c.members.incarnation(w), 1 if w == 1 else beat)
                                  for w in range(4)})

    run.feed(beats())
    run.now += SETTINGS.hang_s - SETTINGS.heartbeat_s - 0.05
    assert not of(run.feed(beats()), m.Failure)
    run.now += 0.1
    (failure,) = of(run.feed(beats()), m.Failure)
    assert failure.workers == (1,) and "hang (no heartbeat for" in failure.cause


def test_a_peer_named_by_a_failed_transfer_dies_fast_once_its_heartbeat_stalls() -> None:
    run = Run().start()
    run.commit()
    counts = {w: (run.c.members.incarnation(w), 1) for w in range(4)}
    run.feed(m.Beats(run.at(), counts))
    run.feed(m.Errors(run.at(), 0, (ErrorReport(0, False, 2, "recv from 2 failed"),)))
    run.now += 0.3  # far below the hang deadline
    beats = {w: (inc, n + (w != 2)) for w, (inc, n) in counts.items()}
    (failure,) = of(run.feed(m.Beats(run.at(), beats)), m.Failure)
    assert failure.workers == (2,) and "reported by peers" in failure.cause


def test_a_fatal_error_then_a_kill_are_two_failures() -> None:
    run = Run().start()
    run.commit()
    out = run.feed(m.Errors(run.at(), 0, (ErrorReport(1, True, None, "InjectedError: x"),)))
    assert of(out, m.Failure)[0].workers == (1,)
    run.answer(Chosen("reroute", two_stage((0, 2), (3, 2))))
    run.commit()
    out = run.kill(3)
    assert of(out, m.Failure)[0].workers == (3,) and of(out, m.Decide)


def test_a_failure_during_a_recovery_is_a_failure_of_the_new_generation() -> None:
    run = Run().start()
    run.commit()
    run.kill(3)
    run.answer(Chosen("dynamic", two_stage((0, 2), (1, 2)), _mig(2, 0, 2)))
    out = run.kill(1)
    assert of(out, m.Abort) == [m.Abort(1, 1)]
    (decide,) = of(out, m.Decide)
    # nothing committed since: the decision starts from the older placement
    assert decide.ask.base == PLAN and decide.ask.failed == {1, 3}


def test_a_repaired_worker_rejoins_at_a_step_boundary() -> None:
    run = Run(replace(SETTINGS, rejoin=True)).start()
    run.commit()
    run.kill(3)
    run.answer(Chosen("reroute", two_stage((0, 2), (1, 2))))
    run.commit()
    (launch,) = of(run.feed(m.Tick(run.at())), m.Launch)
    assert launch.workers == (3,) and launch.replacement
    run.launch([3], replacement=True)
    out = run.feed(m.Registered(run.at(), (3,)))
    assert m.StartFrom(3, run.c.members.incarnation(3), run.c.run.gen + 1) in out
    out = run.commit()
    (ask,) = of(out, m.DecideRejoin)
    assert ask.idle == {3}
    run.feed(m.RejoinDecision(run.at(), Chosen("dynamic", PLAN, _mig(2, 2, 3))))
    out = run.commit()
    assert of(out, m.Commit)[0].end and published(out) == [run.c.run.gen]
    assert run.c.run.plan == PLAN and not run.c.run.idle


def test_a_retry_runs_the_recovery_plan_then_escalates_then_stops() -> None:
    run = Run().start()
    run.commit(3)
    run.kill(3)
    recovery = two_stage((0, 2), (1, 2))
    run.answer(Chosen("reroute", recovery))
    for attempt in range(SETTINGS.max_retries + 2):
        run.feed(m.Errors(run.at(), run.c.run.gen,
                          (ErrorReport(0, False, None, "glitch"),)))
        run.now += 5.0
        (probe,) = of(run.feed(m.Tick(run.at())), m.ProbeAbsent)
        in_flight = run.c.run.next_step
        out = run.feed(m.Absent(run.at(), probe.gen, {}))
        assert m.Abort(probe.gen, in_flight) in out
        if attempt < SETTINGS.max_retries:
            assert run.c.run.plan == recovery and run.c.run.retries == attempt + 1
            assert "retry" in logs(out)
        elif attempt == SETTINGS.max_retries:
            assert run.c.run.load == st.INIT and "restarting from the checkpoint" in logs(out)
        else:
            (stop,) = of(out, m.Stop)
            assert stop.failed and "errors persist" in stop.reason and "glitch" in stop.reason


def test_a_member_inside_an_older_set_up_is_waited_for_then_declared_failed() -> None:
    run = Run().start()
    run.commit()
    run.kill(3)
    run.answer(Chosen("dynamic", two_stage((0, 2), (1, 2)), _mig(2, 0, 2)))
    run.feed(m.Errors(run.at(), 1, (ErrorReport(0, False, 1, "timeout"),)))
    run.now += 5.0
    out = run.feed(m.Absent(run.at(), 1, {1: 0}))  # still in generation 0's set-up
    assert "still inside an older generation's group set-up" in logs(out)
    assert not of(out, m.Abort)
    run.now += 60.0
    out = run.feed(m.Absent(run.at(), 1, {1: 0}))
    assert of(out, m.Failure)[0].workers == (1,)


def test_a_restart_between_the_two_phases_drops_the_switch() -> None:
    run = Run().start()
    run.commit()
    run.kill(3)
    interim = two_stage((0, 2), (1, 2))

    @dataclass(frozen=True)
    class TwoPhase(Chosen):
        chosen: Any = None

    @dataclass(frozen=True)
    class Chosen2:
        interim_plan: ExecutionPlan
        interim_step_s: float = 1.0
        interim_s: float = 3.0

    run.answer(TwoPhase("reroute-then-dynamic", two_stage((0, 2), (1, 2)),
                        chosen=Chosen2(interim)))
    assert run.c.run.pending is not None
    run.kill(0, 2)
    run.answer(Chosen("restart", two_stage((1, 1))))
    assert run.c.run.pending is None


def test_a_malformed_report_is_logged_and_the_next_one_read() -> None:
    run = Run().start()
    run.commit()
    out = run.feed(m.Errors(run.at(), 0, (MALFORMED, ErrorReport(1, True, None, "x"))))
    assert "malformed" in logs(out) and of(out, m.Failure)[0].workers == (1,)
    assert run.c.watch.errors_read == 2


def test_a_flood_of_join_slots_is_skipped_and_counted() -> None:
    run = Run().start()
    out = run.feed(m.JoinSlots(run.at(), 10**9))
    (refused,) = of(out, m.Refused)
    (read,) = of(out, m.ReadJoins)
    assert refused.kind == "join-flood" and len(read.slots) == slots.MAX_BACKLOG
    out = run.feed(m.JoinRequests(run.at(), tuple((i, MISSING) for i in read.slots)))
    assert len(run.c.joins.pending) == slots.MAX_PENDING  # the oldest are given up
    assert len(of(out, m.Refused)) == slots.MAX_BACKLOG - slots.MAX_PENDING


def test_every_worker_failing_relaunches_them_and_reloads() -> None:
    run = Run(replace(SETTINGS, rejoin=True)).start()
    run.commit(4)
    out = run.kill(0, 1, 2, 3)
    (launch,) = of(out, m.Launch)
    assert launch.workers == (0, 1, 2, 3) and mode(run.c) is Mode.RELAUNCHING
    run.launch(range(4), replacement=True)
    out = run.feed(m.Registered(run.at(), (0, 1, 2, 3)))
    (resolved,) = of(out, m.Resolved)
    assert resolved.strategy == "restart" and resolved.lost_steps == 4
    assert run.c.run.plan == PLAN and run.c.run.next_step == 0
    assert mode(run.c) is Mode.RECOVERING


def test_every_worker_failing_without_rejoin_stops_with_the_reason() -> None:
    run = Run().start()
    run.commit()
    (stop,) = of(run.kill(0, 1, 2, 3), m.Stop)
    assert stop.failed and "every worker failed" in stop.reason


def test_an_idle_workers_death_aborts_nothing() -> None:
    run = Run(replace(SETTINGS, num_workers=5, num_local=5), workers=5).start()
    run.commit()
    out = run.kill(4)
    assert not of(out, m.Abort) and of(out, m.Failure)[0].idle
    assert run.c.run.gen == 0 and mode(run.c) is Mode.TRAINING


def test_a_signal_drains_the_step_in_flight_then_stops() -> None:
    run = Run().start()
    run.commit(3)
    run.feed(m.StopAsked(run.at(), "SIGTERM"))
    assert mode(run.c) is Mode.DRAINING
    (stop,) = of(run.commit(), m.Stop)
    assert stop.interrupted and stop.step == 4 and stop.reason == "SIGTERM"


def test_a_drain_that_outlasts_its_grace_aborts_the_step() -> None:
    run = Run().start()
    run.commit(3)
    run.feed(m.StopAsked(run.at(), "SIGINT"))
    run.now += SETTINGS.drain_grace_s + 0.1
    out = run.feed(m.Tick(run.at()))
    assert m.Abort(0, 3) in out and of(out, m.Stop)[0].step == 3


def test_a_replayed_software_fault_and_end() -> None:
    run = Run().start()
    run.commit(6)
    run.feed(m.CheckpointDone(run.at(), 5, 0))
    out = run.feed(m.SoftwareFault(run.at()))
    assert of(out, m.Failure)[0].lost_steps == 1 and run.c.run.next_step == 5
    run.commit()
    run.feed(m.TraceEnd(run.at()))
    (stop,) = of(run.commit(), m.Stop)
    assert not stop.interrupted and stop.step == 7


def test_joining_failed_starts_then_deadline() -> None:
    run = Run()
    run.launch(range(4))
    for attempt in range(1, MAX_FAILED_STARTS + 1):
        out = run.feed(m.Exits(run.at(), {2: 1}))
        if attempt < MAX_FAILED_STARTS:
            assert of(out, m.Launch)[0].workers == (2,)
            run.launch([2])
        else:
            (stop,) = of(out, m.Stop)
            assert stop.bad_input and "3 times" in stop.reason
    late = Run()
    late.launch(range(4))
    late.now += SETTINGS.join_timeout_s + 1
    (stop,) = of(late.feed(m.Tick(late.at())), m.Stop)
    assert stop.bad_input and "only 0 of the 4 workers" in stop.reason
    stopped = Run()
    stopped.launch(range(4))
    assert of(stopped.feed(m.StopAsked(stopped.at(), "SIGINT")), m.Stop)[0].failed


def test_the_relaunched_workers_deadline_and_death() -> None:
    for how in ("tick", "exits", "stop"):
        run = Run(replace(SETTINGS, rejoin=True)).start()
        run.commit()
        run.kill(0, 1, 2, 3)
        run.launch(range(4), replacement=True)
        if how == "tick":
            run.now += SETTINGS.join_timeout_s + 1
            out = run.feed(m.Tick(run.at()))
        elif how == "exits":
            out = run.feed(m.Exits(run.at(), {1: 1}))
        else:
            out = run.feed(m.StopAsked(run.at(), "SIGTERM"))
        assert of(out, m.Stop)[0].failed and mode(run.c) is Mode.FAILED


def test_a_death_outside_the_states_placement_keeps_it() -> None:
    """The switch's new worker dies before the new plan committed: the placement the state
    has is intact, so it is trained on again (no policy)."""
    run = _with_rejoined_worker()
    out = run.kill(4)
    (resolved,) = of(out, m.Resolved)
    assert resolved.strategy == "keep" and run.c.run.plan == PLAN
    assert mode(run.c) is Mode.RECOVERING
    absent = _with_rejoined_worker()
    absent.feed(m.Errors(absent.at(), absent.c.run.gen, (ErrorReport(0, False, 4, "x"),)))
    absent.now += 5.0
    out = absent.feed(m.Absent(absent.at(), absent.c.run.gen, {4: None}))
    assert of(out, m.Resolved)[0].strategy == "keep" and mode(absent.c) is Mode.RECOVERING


def _unexplained(run: Run, absent: dict[int, int | None]) -> list[m.Effect]:
    run.feed(m.Errors(run.at(), run.c.run.gen, (ErrorReport(0, False, None, "x"),)))
    run.now += 5.0
    return run.feed(m.Absent(run.at(), run.c.run.gen, absent))


def test_unexplained_errors_in_a_healthy_generation() -> None:
    run = Run().start()
    run.commit()
    assert of(_unexplained(run, {1: None}), m.Decide) and mode(run.c) is Mode.DECIDING
    spent = Run().start()
    spent.commit()
    spent.c = replace(spent.c, run=replace(spent.c.run, retries=SETTINGS.max_retries + 1))
    assert of(_unexplained(spent, {}), m.Stop)[0].failed


def test_a_drain_ends_at_a_death_or_an_unexplained_generation() -> None:
    run = Run().start()
    run.commit()
    run.feed(m.StopAsked(run.at(), "SIGTERM"))
    assert not of(run.kill(3), m.Stop)[0].failed
    absent = Run().start()
    absent.commit()
    absent.feed(m.StopAsked(absent.at(), "SIGTERM"))
    assert not of(_unexplained(absent, {1: None}), m.Stop)[0].failed
    spent = Run().start()
    spent.commit()
    spent.c = replace(spent.c, run=replace(spent.c.run, retries=SETTINGS.max_retries + 1))
    spent.feed(m.StopAsked(spent.at(), "SIGTERM"))
    assert of(_unexplained(spent, {}), m.Stop)[0].failed


def _recovering(settings: Settings = SETTINGS) -> Run:
    run = Run(settings).start()
    run.commit()
    run.kill(3)
    run.answer(Chosen("reroute", two_stage((0, 2), (1, 2))))
    assert mode(run.c) is Mode.RECOVERING
    return run


def test_what_ends_or_interrupts_a_recovery() -> None:
    run = _recovering()
    assert of(run.kill(0, 1, 2), m.Stop)[0].failed  # no rejoin: every worker failed
    relaunch = _recovering(replace(SETTINGS, rejoin=True))
    relaunch.kill(0, 1, 2)
    assert mode(relaunch.c) is Mode.RELAUNCHING
    last = _recovering(replace(SETTINGS, steps=2))
    assert of(last.commit(), m.Stop)
    for stop in (m.StopAsked(0.0, "SIGINT"), m.TraceEnd(0.0)):
        drained = _recovering()
        drained.feed(stop)
        assert mode(drained.c) is Mode.DRAINING


def test_a_relaunched_worker_that_hangs_fails_the_run() -> None:
    run = Run(replace(SETTINGS, rejoin=True)).start()
    run.commit()
    run.kill(0, 1, 2, 3)
    run.launch(range(4), replacement=True)
    run.feed(m.Registered(run.at(), (0, 1)))
    counts = {w: (run.c.members.incarnation(w), 1) for w in (0, 1)}
    run.feed(m.Beats(run.at(), counts))
    run.now += 5.0
    assert of(run.feed(m.Beats(run.at(), counts)), m.Stop)[0].failed


def test_a_shell_that_cannot_go_on_stops_training_in_every_mode() -> None:
    """An exception in the coordinator (a full disk, a policy that raised, a bug) ends
    through the failure path whatever the run was doing: the workers are told to stop."""
    runs = {Mode.JOINING: Run(), Mode.TRAINING: Run().start()}
    runs[Mode.JOINING].launch(range(4))
    deciding = Run().start()
    deciding.kill(3)
    runs[Mode.DECIDING] = deciding
    runs[Mode.RECOVERING] = _recovering()
    relaunching = Run(replace(SETTINGS, rejoin=True)).start()
    relaunching.kill(0, 1, 2, 3)
    runs[Mode.RELAUNCHING] = relaunching
    draining = Run().start()
    draining.feed(m.StopAsked(draining.at(), "SIGTERM"))
    runs[Mode.DRAINING] = draining
    for k, run in runs.items():
        assert mode(run.c) is k
        (stop,) = of(run.feed(m.ShellFailed(run.at(), "OSError: No space left")), m.Stop)
        assert stop.failed and stop.reason == "OSError: No space left" and run.c.closed
    bad = Run()
    bad.launch(range(4))
    (stop,) = of(bad.feed(m.ShellFailed(bad.at(), "port: taken", bad_input=True)), m.Stop)
    assert stop.bad_input


# ---------------------------------------------------------------------- the diagram
SCENARIOS: list[Callable[[], None]] = [
    test_a_replacement_that_keeps_dying_after_it_joined_is_given_up,
    test_a_failure_right_after_a_reload_reloads_again_never_keeps,
    test_two_remote_joiners_never_get_the_same_dead_id,
    test_a_run_that_cannot_go_on_tells_its_workers_to_stop,
    test_the_final_holders_are_the_workers_whose_state_is_at_the_last_step,
    test_a_kill_is_recovered_by_the_policys_plan, test_no_replica_left_restarts_from_the_checkpoint,
    test_a_failure_during_a_recovery_is_a_failure_of_the_new_generation,
    test_a_repaired_worker_rejoins_at_a_step_boundary,
    test_a_retry_runs_the_recovery_plan_then_escalates_then_stops,
    test_a_member_inside_an_older_set_up_is_waited_for_then_declared_failed,
    test_every_worker_failing_relaunches_them_and_reloads,
    test_every_worker_failing_without_rejoin_stops_with_the_reason,
    test_a_signal_drains_the_step_in_flight_then_stops,
    test_a_drain_that_outlasts_its_grace_aborts_the_step, test_a_replayed_software_fault_and_end,
    test_joining_failed_starts_then_deadline, test_the_relaunched_workers_deadline_and_death,
    test_a_death_outside_the_states_placement_keeps_it,
    test_unexplained_errors_in_a_healthy_generation,
    test_a_drain_ends_at_a_death_or_an_unexplained_generation,
    test_what_ends_or_interrupts_a_recovery, test_a_relaunched_worker_that_hangs_fails_the_run,
    test_a_shell_that_cannot_go_on_stops_training_in_every_mode,
]


def test_every_declared_transition_happens_in_some_scenario() -> None:
    for scenario in SCENARIOS:
        scenario()
    missing = sorted(machine.TRANSITIONS - SEEN)
    assert not missing, f"declared but never made: {missing}"


@pytest.mark.parametrize("edge", sorted(machine.TRANSITIONS))
def test_each_transition_names_modes_and_a_known_cause(edge: tuple[Mode, str, Mode]) -> None:
    before, cause, after = edge
    assert before is not after
    assert cause in {"tick", "exits", "death", "registered", "reduced", "stop", "software",
                     "trace-end", "decision", "unexplained", "crash"}


# ---------------------------------------------------------------------- state on disk
def test_a_checkpoint_is_complete_only_once_its_manifest_is_written() -> None:
    run = Run(replace(SETTINGS, keep_checkpoints=2, checkpoint_every=10)).start()
    run.commit(10)
    assert not of(run.feed(m.CheckpointLayers(run.at(), 10, 0, frozenset({0, 1}))),
                  m.SaveCheckpoint)  # two layers of four
    (save,) = of(run.feed(m.CheckpointLayers(run.at(), 10, 0, frozenset({2, 3}))),
                 m.SaveCheckpoint)
    assert save.accepted and run.c.run.checkpoints == (0,)  # not complete yet
    run.feed(m.CheckpointDone(run.at(), 10, 0))
    assert run.c.run.checkpoints == (0, 10)
    for step in (20, 30):
        run.commit(10)
        run.feed(m.CheckpointDone(run.at(), step, 0))
    assert run.c.run.checkpoints == (20, 30)  # the older ones are deleted: forgotten
    # one being written by an abandoned timeline (before a restart) is dropped quietly, and
    # what arrives of it later is ignored
    run.commit(10)
    run.feed(m.CheckpointLayers(run.at(), 40, 0, frozenset({0, 2})))  # the dying ones' layers
    run.kill(0, 2)
    out = run.answer(Chosen("restart", two_stage((1, 3))))
    assert m.DropCheckpoint(40, 0, "abandoned timeline", quiet=True) in out
    assert run.feed(m.CheckpointLayers(run.at(), 40, 0, frozenset(range(4)))) == []


def test_a_disk_that_refuses_drops_that_checkpoint_and_training_goes_on() -> None:
    """A full disk while writing a checkpoint raised out of the coordinator's loop after
    the state had marked the checkpoint complete."""
    run = Run().start()
    run.commit(10)
    run.feed(m.CheckpointDone(run.at(), 10, 0))
    run.commit(10)
    out = run.feed(m.CheckpointFailed(run.at(), 20, 0, "worker 3: No space left on device"))
    (drop,) = of(out, m.DropCheckpoint)
    assert (drop.step, drop.gen) == (20, 0) and "No space" in drop.reason
    assert "warning: checkpoint after 20 steps dropped" in logs(out)
    assert "holds 10 steps" in logs(out)
    assert run.c.run.checkpoints == (0, 10) and mode(run.c) is Mode.TRAINING
    run.kill(1, 3)  # a restart reloads the last complete one
    run.answer(Chosen("restart", two_stage((0, 2))))
    assert run.c.run.load == st.Load("restore", 10)


def test_a_corrupt_checkpoint_falls_back_to_the_one_before_and_is_set_aside() -> None:
    run = Run().start()
    run.commit(20)
    for step in (10, 20):
        run.feed(m.CheckpointDone(run.at(), step, 0))
    run.commit(3)
    run.kill(1, 3)
    run.answer(Chosen("restart", two_stage((0, 2))))
    assert run.c.run.load == st.Load("restore", 20)
    gen = run.c.run.gen
    bad = ErrorReport(0, False, None, "checkpoints/step00000020/layer1.bin does not match "
                      "its sha256 in the manifest", corrupt_step=20)
    out = run.feed(m.Errors(run.at(), gen, (bad,)))
    assert of(out, m.MarkCorrupt) == [m.MarkCorrupt(20, bad.message)]
    assert m.Abort(gen, 20) in out and published(out) == [gen + 1]
    assert "corrupt" in logs(out) and "the one after 10 steps" in logs(out)
    assert run.c.run.load == st.Load("restore", 10) and run.c.run.next_step == 10
    assert 20 not in run.c.run.checkpoints and not of(out, m.Failure)
    # a report about a checkpoint the generation does not load changes nothing
    assert run.feed(m.Errors(run.at(), gen + 1, (bad,))) == []


# ---------------------------------------------------------------------- found by properties
def test_the_votes_of_a_broken_generation_commit_nothing() -> None:
    """A step every worker had reduced before a death broke its generation was committed
    while the policy was being asked (its abort was written already)."""
    run = Run().start()
    run.commit(2)
    run.kill(3)
    assert mode(run.c) is Mode.DECIDING
    assert run.feed(m.Reduced(run.at(), 0, 2, 4)) == [] and run.c.run.next_step == 2


def test_what_only_a_running_generation_acts_on_is_ignored_while_joining() -> None:
    """A software fault restarted, and unexplained errors were judged, before any
    generation was published."""
    run = Run()
    run.launch(range(4))
    for obs in (m.SoftwareFault(run.at()), m.Absent(run.at(), 0, {1: None}),
                m.Errors(run.at(), 0, (ErrorReport(1, True, None, "x"),)),
                m.Relaunch(run.at(), (1,)), m.Ready(run.at(), 0, 4)):
        assert run.feed(obs) == [] and mode(run.c) is Mode.JOINING


def test_a_dead_members_late_registration_does_not_bring_it_back() -> None:
    run = Run(replace(SETTINGS, rejoin=True)).start()
    run.commit()
    run.kill(3)
    run.answer(Chosen("reroute", two_stage((0, 2), (1, 2))))
    run.commit()
    run.feed(m.Tick(run.at()))  # the repair is launched
    run.launch([3], replacement=True)
    run.kill(3)  # and dies before it registered
    assert run.feed(m.Registered(run.at(), (3,))) == []
    assert 3 not in run.c.run.alive and run.c.members.by_worker[3].gone


# ---------------------------------------------------------------------- the checkpoint protocol
CKPT = replace(SETTINGS, steps=6, checkpoint_every=4, checkpoint_deadline_s=5.0)
ALL = frozenset(range(4))


def test_a_due_checkpoint_is_expected_before_its_verdict_is_written() -> None:
    """The verdict was written before the coordinator expected the checkpoint it made due:
    a worker's upload could arrive first and be refused."""
    run = Run(CKPT).start()
    out = run.commit(4)
    kinds = [type(e) for e in out if isinstance(e, m.ExpectCheckpoint | m.Commit)]
    assert kinds == [m.Commit] * 3 + [m.ExpectCheckpoint, m.Commit]  # before step 3's
    (expect,) = of(out, m.ExpectCheckpoint)
    assert (expect.step, expect.gen) == (4, 0) and expect.deadline_s == run.now + 5.0
    assert expect.writers == {0: 0, 1: 1, 2: 2, 3: 3}  # replicas take turns by layer


def test_a_checkpoint_fails_at_its_deadline_or_when_a_writer_dies() -> None:
    run = Run(CKPT).start()
    run.commit(4)
    run.now += 6.0
    out = run.feed(m.Tick(run.at()))
    (drop,) = of(out, m.DropCheckpoint)
    assert drop.step == 4 and "not written within its deadline; 0 of 4" in drop.reason
    dying = Run(replace(CKPT, steps=20)).start()
    dying.commit(4)
    dying.feed(m.CheckpointLayers(dying.at(), 4, 0, frozenset({0, 1})))
    out = dying.feed(m.Exits(dying.at(), {1: -9}))  # layer 1 is written: nothing lost
    assert not of(out, m.DropCheckpoint)
    dying.answer(Chosen("reroute", two_stage((0, 2), (3, 2))))
    dying.commit(4)  # the next one, written by the new plan
    out = dying.kill(3)  # it writes layer 3 of the first and layer 1 of the second
    drops = of(out, m.DropCheckpoint)
    assert [d.step for d in drops] == [4, 8]
    assert all("worker(s) [3] exited before writing" in d.reason for d in drops)


def _finished(settings: Settings = CKPT) -> tuple[Run, list[m.Effect]]:
    """A run that just committed its last step (6, no checkpoint of it)."""
    run = Run(settings).start()
    out = run.commit(settings.steps)
    assert mode(run.c) is Mode.FINISHED
    return run, out


def test_the_final_checkpoint_is_written_by_the_final_holders() -> None:
    run, out = _finished()
    (stop,) = of(out, m.Stop)
    assert stop.write and stop.step == 6 and stop.final_timeout_s > 3 * 5.0
    expect = [e for e in out if isinstance(e, m.ExpectCheckpoint) and e.step == 6]
    assert expect and out.index(expect[0]) < out.index(stop)  # expected before asked
    (save,) = of(run.feed(m.CheckpointLayers(run.at(), 6, stop.gen, ALL)), m.SaveCheckpoint)
    assert save.accepted and not save.fallback
    (done,) = of(run.feed(m.CheckpointDone(run.at(), 6, stop.gen)), m.FinalDone)
    assert done.folder == "checkpoints" and run.c.closed and 6 in run.c.run.checkpoints
    assert run.feed(m.Tick(run.at() + 100)) == []


def test_a_final_checkpoint_the_folder_refuses_is_uploaded_into_the_run_folder() -> None:
    """A full checkpoint folder lost the trained model: the final checkpoint could not be
    written and the run ended without params.pt."""
    run, out = _finished()
    gen = of(out, m.Stop)[0].gen
    out = run.feed(m.CheckpointFailed(run.at(), 6, gen, "worker 0: No space left on device"))
    assert of(out, m.DropCheckpoint)[0].step == 6  # listed in the report
    (expect,) = of(out, m.ExpectCheckpoint)
    assert expect.fallback and (expect.step, expect.gen) == (6, gen)
    asks = of(out, m.AskFinal)
    assert sorted(a.worker for a in asks) == [0, 1, 2, 3] and all(a.upload for a in asks)
    assert "upload it into the run folder" in logs(out)
    (save,) = of(run.feed(m.CheckpointLayers(run.at(), 6, gen, ALL)), m.SaveCheckpoint)
    assert save.fallback and save.accepted
    (done,) = of(run.feed(m.CheckpointDone(run.at(), 6, gen)), m.FinalDone)
    assert done.folder == "fallback" and 6 not in run.c.run.checkpoints  # never reloaded
    lost, out = _finished()
    lost.feed(m.CheckpointFailed(lost.at(), 6, gen, "No space left on device"))
    lost.now += 6.0  # the upload does not finish in time either
    (done,) = of(lost.feed(m.Tick(lost.at())), m.FinalDone)
    assert done.folder is None and "could not be written" in done.reason


def test_a_final_writer_that_leaves_hands_its_layer_to_the_next_holder() -> None:
    run, out = _finished()
    gen = of(out, m.Stop)[0].gen
    run.feed(m.CheckpointLayers(run.at(), 6, gen, frozenset({1, 2, 3})))
    (ask,) = of(run.feed(m.Exits(run.at(), {0: 0})), m.AskFinal)  # it missed a commit
    assert (ask.worker, ask.layers, ask.upload) == (1, (0,), False)
    (done,) = of(run.feed(m.Exits(run.at(), {1: 0})), m.FinalDone)  # the last holder too
    assert done.folder is None and "every holder of its final state is gone" in done.reason


def test_a_final_step_with_a_checkpoint_complete_or_in_flight_is_not_written_again() -> None:
    every = replace(CKPT, checkpoint_every=3)  # 6 is due: its checkpoint is in flight
    run, out = _finished(every)
    (stop,) = of(out, m.Stop)
    assert not stop.write and not of(out, m.FinalDone)
    gen = stop.gen
    out = run.feed(m.CheckpointFailed(run.at(), 6, 0, "worker 3: disk error"))
    assert [e.gen for e in of(out, m.ExpectCheckpoint)] == [gen]  # the holders write it
    assert not any(a.upload for a in of(out, m.AskFinal))
    done = Run(every).start()
    out = done.commit(5)
    done.feed(m.CheckpointDone(done.at(), 3, 0))
    out = done.commit()
    done.feed(m.CheckpointLayers(done.at(), 6, 0, ALL))
    (final,) = of(done.feed(m.CheckpointDone(done.at(), 6, 0)), m.FinalDone)
    assert final.folder == "checkpoints"
