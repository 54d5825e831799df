"""The simulator's event loop against a tiny hand-made policy with round numbers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from chameleon_ft.failures import EventKind, Trace, TraceEvent
from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.sim.engine import simulate
from chameleon_ft.sim.policies import KEEP, Choice, EventContext
from chameleon_ft.spec.recovery import RecoverySpec

# 2 nodes x 2 workers; 2 pipelines x 2 stages, stage-major: worker s*2+p.
NUM_WORKERS, PER_NODE = 4, 2
FF_STEP_S, BATCH = 2.0, 8  # 4 samples/s failure-free
FF = BATCH / FF_STEP_S
RECOVERY = RecoverySpec(detect_s=1.0, rebuild_s=2.0, restart_s=50.0, checkpoint_load_s=10.0,
                        checkpoint_interval_s=1000.0)


def one_pipeline(workers: list[int]) -> ExecutionPlan:
    return ExecutionPlan(num_layers=4, pipelines=(
        Pipeline((Stage(workers[0], 0, 2), Stage(workers[1], 2, 4)), 8),))


class FakePolicy:
    """Any failure: drop to one pipeline on two live workers at half speed after a 3 s stall
    (or restart when ``restart``); a rejoin returns to the full plan after 3 s."""

    def __init__(self, *, restart: bool = False, rejoin: bool = True) -> None:
        self.name = "fake"
        self.restart = restart
        self.rejoin = rejoin
        self.calls: list[tuple[str, float, frozenset[int], float]] = []
        self.full = ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=8)

    def start(self) -> Choice:
        return Choice(strategy="initial", plan=self.full, step_s=FF_STEP_S,
                      throughput_samples_s=FF)

    def on_failure(self, base: Choice, failed: frozenset[int], ctx: EventContext) -> Choice:
        self.calls.append(("fail", ctx.now_s, failed, ctx.since_checkpoint_s))
        alive = sorted(ctx.alive)
        if len(alive) < 2:
            return Choice(strategy="down", plan=None)
        if self.restart:
            return Choice(strategy="restart", plan=one_pipeline(alive), step_s=4.0,
                          throughput_samples_s=2.0, stall_s=60.0,
                          terms=(("load_s", 10.0), ("restart_s", 50.0)), rollback=True)
        return Choice(strategy="shrink", plan=one_pipeline(alive), step_s=4.0,
                      throughput_samples_s=2.0, stall_s=3.0,
                      terms=(("detect_s", 1.0), ("rebuild_s", 2.0)))

    def on_rejoin(self, base: Choice, returned: frozenset[int], ctx: EventContext) -> Choice:
        self.calls.append(("rejoin", ctx.now_s, returned, ctx.next_event_in_s))
        if not self.rejoin or len(ctx.alive) < NUM_WORKERS:
            return Choice(strategy=KEEP, plan=None)
        return Choice(strategy="dynamic", plan=self.full, step_s=FF_STEP_S,
                      throughput_samples_s=FF, stall_s=3.0, terms=(("rebuild_s", 3.0),))


def run(events: list[TraceEvent], duration_s: float, policy: FakePolicy | None = None, *,
        recovery: RecoverySpec = RECOVERY, checkpoint_every_steps: int = 0):
    policy = policy or FakePolicy()
    result = simulate(Trace(tuple(events), duration_s), policy, failure_free_samples_s=FF,
                      recovery=recovery, num_workers=NUM_WORKERS, workers_per_node=PER_NODE,
                      checkpoint_every_steps=checkpoint_every_steps)
    return result, policy


def lost_total(result) -> float:
    return sum(v for _, v in result.time_lost_s)


def test_no_failure_is_failure_free():
    result, _ = run([], 1000.0)
    assert result.samples == pytest.approx(FF * 1000.0)
    assert result.relative_to_failure_free == pytest.approx(1.0)
    assert result.num_decisions == 0
    assert lost_total(result) == pytest.approx(0.0, abs=1e-9)


def test_single_failure_hand_computed():
    # Fail worker 1 at t=101: 50 whole steps (100 s) are done, 1 s of the 51st is lost.
    result, policy = run([TraceEvent(101.0, EventKind.WORKER_FAIL, (1,))], 501.0)
    # After a 3 s stall the shrunk plan runs 397 s at 2 samples/s.
    assert result.samples == pytest.approx(50 * BATCH + 397 * 2.0)
    lost = dict(result.time_lost_s)
    assert lost["partial_step_s"] == pytest.approx(1.0)
    assert lost["detect_s"] == pytest.approx(1.0)
    assert lost["rebuild_s"] == pytest.approx(2.0)
    assert lost["degraded_s"] == pytest.approx(397 * 0.5)
    assert lost_total(result) == pytest.approx(501.0 - result.samples / FF)
    assert dict(result.decisions) == {"shrink": 1}
    assert policy.calls[0][2] == frozenset({1})
    assert result.timeline == ((0.0, FF), (101.0, 0.0), (104.0, 2.0))
    # Kept training: 100 s before the failure (its last second was lost), 397 s after.
    assert result.training_s == pytest.approx(497.0)
    assert result.training_time_share == pytest.approx(497.0 / 501.0)
    assert result.effective_training_time == pytest.approx(result.samples / FF / 501.0)
    assert result.effective_training_time == pytest.approx(result.relative_to_failure_free)


def test_failure_during_transition_redecides_from_committed_plan():
    # Restart of 60 s from t=10; a second failure at t=30 aborts it and decides again with
    # both failures from the original plan.
    events = [TraceEvent(10.0, EventKind.WORKER_FAIL, (1,)),
              TraceEvent(30.0, EventKind.WORKER_FAIL, (3,))]
    result, policy = run(events, 200.0, FakePolicy(restart=True))
    assert [c[2] for c in policy.calls] == [frozenset({1}), frozenset({1, 3})]
    # Everything since the checkpoint at t=0 is rolled back; the plan runs from t=90.
    assert result.samples == pytest.approx((200.0 - 90.0) * 2.0)
    lost = dict(result.time_lost_s)
    assert lost["lost_work_s"] == pytest.approx(10.0)
    assert lost["restart_s"] + lost["load_s"] == pytest.approx(20.0 + 60.0)
    assert lost_total(result) == pytest.approx(200.0 - result.samples / FF)


def test_restart_loses_work_since_last_checkpoint():
    # Checkpoint at t=1000 holds 500 steps; failure at 1301 loses 150 steps plus 1 s.
    result, policy = run([TraceEvent(1301.0, EventKind.WORKER_FAIL, (0,))], 2000.0,
                         FakePolicy(restart=True))
    assert policy.calls[0][3] == pytest.approx(300.0)  # since the checkpoint
    assert result.samples == pytest.approx(500 * BATCH + (2000.0 - 1361.0) * 2.0)
    lost = dict(result.time_lost_s)
    assert lost["lost_work_s"] == pytest.approx(300.0)
    assert lost["partial_step_s"] == pytest.approx(1.0)


def test_repair_rejoins_and_oracle_horizon_is_true():
    events = [TraceEvent(100.0, EventKind.NODE_FAIL, (1,)),
              TraceEvent(400.0, EventKind.REPAIR, (1,))]
    result, policy = run(events, 1000.0)
    assert policy.calls[1][:3] == ("rejoin", 400.0, frozenset({2, 3}))
    assert policy.calls[1][3] == pytest.approx(600.0)
    # 50 steps, stall 3, 296 s at 2/s, rejoin loses the partial step in flight.
    shrunk_steps = math.floor(296.0 / 4.0)
    expected = 50 * BATCH + shrunk_steps * BATCH + (1000.0 - 403.0) * FF
    assert result.samples == pytest.approx(expected)
    assert dict(result.decisions) == {"dynamic": 1, "shrink": 1}


def test_repair_during_transition_waits_for_it():
    events = [TraceEvent(100.0, EventKind.NODE_FAIL, (1,)),
              TraceEvent(101.0, EventKind.REPAIR, (1,))]
    result, policy = run(events, 1000.0)
    assert [c[:2] for c in policy.calls] == [("fail", 100.0), ("rejoin", 103.0)]
    assert result.samples == pytest.approx(100.0 * FF + (1000.0 - 106.0) * FF)


def test_software_fault_restarts_same_plan_from_checkpoint():
    result, policy = run([TraceEvent(1500.0, EventKind.SOFTWARE)], 3000.0)
    assert policy.calls == []
    assert result.num_software_restarts == 1
    assert result.num_decisions == 0
    stall = RECOVERY.detect_s + RECOVERY.restart_s + RECOVERY.checkpoint_load_s
    # Rolled back to t=1000; progress resumes at 1500 + stall.
    assert result.samples == pytest.approx(1000.0 * FF + (3000.0 - 1500.0 - stall) * FF)
    assert lost_total(result) == pytest.approx(3000.0 - result.samples / FF)


def test_failure_of_idle_worker_changes_nothing():
    events = [TraceEvent(100.0, EventKind.WORKER_FAIL, (1,)),
              TraceEvent(200.0, EventKind.WORKER_FAIL, (3,))]  # idle after the shrink
    result, policy = run(events, 300.0, FakePolicy())
    assert len(policy.calls) == 1
    assert result.samples == pytest.approx(50 * BATCH + (300.0 - 103.0) * 2.0)


def test_down_until_repair():
    events = [TraceEvent(100.0, EventKind.NODE_FAIL, (0,)),
              TraceEvent(200.0, EventKind.WORKER_FAIL, (2,)),
              TraceEvent(500.0, EventKind.REPAIR, (0,))]
    result, _ = run(events, 1000.0, FakePolicy(rejoin=False))
    lost = dict(result.time_lost_s)
    assert lost["down_s"] > 0
    assert lost_total(result) == pytest.approx(1000.0 - result.samples / FF)


class TwoPhasePolicy(FakePolicy):
    """A failure: reroute-then-dynamic: 3 s stall, the interim plan at 1 sample/s for ~10 s,
    a 2 s switch, then the final plan at 2 samples/s."""

    def on_failure(self, base: Choice, failed: frozenset[int], ctx: EventContext) -> Choice:
        alive = sorted(ctx.alive)
        final = Choice(strategy="reroute-then-dynamic", plan=one_pipeline(alive[-2:]), step_s=4.0,
                       throughput_samples_s=2.0, stall_s=2.0, terms=(("rebuild_s", 2.0),))
        return Choice(strategy="reroute-then-dynamic", plan=one_pipeline(alive[:2]), step_s=8.0,
                      throughput_samples_s=1.0, stall_s=3.0, terms=(("detect_s", 3.0),),
                      then=final, then_after_s=10.0)


def test_two_phase_switches_at_a_step_boundary_after_the_migration():
    result, _ = run([TraceEvent(100.0, EventKind.WORKER_FAIL, (1,))], 1000.0, TwoPhasePolicy())
    # Interim from 103: 10 s of migration round up to 2 interim steps (16 s), then 2 s pause.
    assert result.samples == pytest.approx(50 * BATCH + 16 * 1.0 + (1000.0 - 121.0) * 2.0)
    assert dict(result.decisions) == {"reroute-then-dynamic": 1}
    assert result.timeline == ((0.0, FF), (100.0, 0.0), (103.0, 1.0), (119.0, 0.0),
                               (121.0, 2.0))


def test_failure_during_interim_phase_cancels_the_switch():
    events = [TraceEvent(100.0, EventKind.WORKER_FAIL, (1,)),
              TraceEvent(110.0, EventKind.WORKER_FAIL, (2,))]
    result, _ = run(events, 1000.0, TwoPhasePolicy())
    # The second failure at 110 loses the interim step in flight (7 s of 8) and decides
    # again from the interim plan: no switch at 119; interim 113-129, final from 131.
    assert (119.0, 0.0) not in result.timeline
    assert result.samples == pytest.approx(50 * BATCH + 16 * 1.0 + (1000.0 - 131.0) * 2.0)
    assert dict(result.time_lost_s)["partial_step_s"] == pytest.approx(7.0 / FF)


SLOW_AFTER_FAILURE = [TraceEvent(101.0, EventKind.WORKER_FAIL, (1,)),
                      TraceEvent(500.0, EventKind.SOFTWARE), TraceEvent(970.0, EventKind.SOFTWARE)]
"""A failure at 101 leaves a plan at half speed (4 s steps from 104); software faults at
500 and 970 restart it from its checkpoint."""


def test_checkpoints_every_n_steps_are_sparser_in_wall_time_on_a_slower_plan():
    stall = RECOVERY.detect_s + RECOVERY.restart_s + RECOVERY.checkpoint_load_s  # 61 s
    result, _ = run(SLOW_AFTER_FAILURE, 1100.0, checkpoint_every_steps=100)
    # Step 100 commits at 304 (50 steps by 101, 50 more of 4 s from 104): the fault at 500
    # rolls back to 800 samples, losing the 49 steps since (1192 - 800 samples).
    # Restarted at 561, step 200 commits at 961 (a redone step counts once): the fault at
    # 970 loses 2 samples in flight and the 2 steps since; from 1031, 69 s at 2 samples/s.
    assert result.samples == pytest.approx(1600.0 + 69.0 * 2.0)
    lost = dict(result.time_lost_s)
    assert lost["lost_work_s"] == pytest.approx((392.0 + 16.0) / FF)
    assert lost["partial_step_s"] == pytest.approx((4.0 + 2.0) / FF)
    assert lost["restart_s"] + lost["load_s"] + lost["detect_s"] == pytest.approx(
        2 * stall + 1.0)  # and the failure's own detection
    assert lost_total(result) == pytest.approx(1100.0 - result.samples / FF)
    # Kept training: 0-100, 104-304, 561-961 and 1031-1100.
    assert result.training_s == pytest.approx(100.0 + 200.0 + 400.0 + 69.0)


def test_checkpoints_by_wall_time_at_the_same_failure_free_cadence_lose_less():
    # Every 200 s is 100 failure-free steps, but on the slow plan only 50: at 400 the
    # checkpoint holds 124 steps (992 samples), so the fault at 500 loses 200 samples.
    by_time = RecoverySpec(detect_s=1.0, rebuild_s=2.0, restart_s=50.0,
                           checkpoint_load_s=10.0, checkpoint_interval_s=200.0)
    result, _ = run(SLOW_AFTER_FAILURE[:2], 1100.0, recovery=by_time)
    assert dict(result.time_lost_s)["lost_work_s"] == pytest.approx(200.0 / FF)
    steps, _ = run(SLOW_AFTER_FAILURE[:2], 1100.0, recovery=by_time, checkpoint_every_steps=100)
    assert dict(steps.time_lost_s)["lost_work_s"] == pytest.approx(392.0 / FF)
    assert steps.samples < result.samples


def test_checkpoints_by_steps_equal_checkpoints_by_time_on_the_failure_free_plan():
    # 500 failure-free steps are exactly the 1000 s interval: the same restart.
    events = [TraceEvent(1301.0, EventKind.WORKER_FAIL, (0,))]
    by_time, _ = run(events, 2000.0, FakePolicy(restart=True))
    by_steps, policy = run(events, 2000.0, FakePolicy(restart=True), checkpoint_every_steps=500)
    assert policy.calls[0][3] == pytest.approx(300.0)
    assert by_steps.samples == pytest.approx(by_time.samples)
    assert dict(by_steps.time_lost_s) == pytest.approx(dict(by_time.time_lost_s))
    assert by_steps.training_s == pytest.approx(by_time.training_s)


def test_no_checkpoints_restart_from_the_start_whatever_the_cadence():
    without = RecoverySpec(detect_s=1.0, rebuild_s=2.0, restart_s=50.0, checkpoint_load_s=10.0,
                           checkpoint=False)
    result, _ = run([TraceEvent(1500.0, EventKind.SOFTWARE)], 2000.0, recovery=without,
                    checkpoint_every_steps=10)
    assert dict(result.time_lost_s)["lost_work_s"] == pytest.approx(1500.0)
    assert result.training_s == pytest.approx(2000.0 - 1500.0 - 61.0)


def test_negative_checkpoint_cadence_is_refused():
    with pytest.raises(ValueError, match="checkpoint_every"):
        run([], 10.0, checkpoint_every_steps=-1)


# ------------------------------------------------------------------ checkpoints in memory
MEMORY = replace(RECOVERY, memory_checkpoint=True, memory_checkpoint_every=7)


class ReloadPolicy(FakePolicy):
    """Any failure: reload on one pipeline (4 s steps, 2 samples/s) after a 60 s stall,
    from memory or from storage as ``sources`` says, one per failure in turn."""

    def __init__(self, *sources: bool) -> None:
        super().__init__(restart=True)
        self.sources = list(sources)
        self.since_memory: list[float] = []

    def on_failure(self, base: Choice, failed: frozenset[int], ctx: EventContext) -> Choice:
        self.since_memory.append(ctx.since_memory_checkpoint_s)
        choice = super().on_failure(base, failed, ctx)
        return replace(choice, from_memory=self.sources.pop(0))


def test_a_reload_from_memory_loses_only_the_work_since_the_last_copy():
    # Copies every 7 steps: at t=1301, 650 steps are done and the last copy holds 644
    # (t=1288); the checkpoint on storage holds 500 (t=1000).
    policy = ReloadPolicy(True)
    result, _ = run([TraceEvent(1301.0, EventKind.WORKER_FAIL, (0,))], 2000.0, policy,
                    recovery=MEMORY)
    assert policy.since_memory == [pytest.approx(12.0)]
    assert policy.calls[0][3] == pytest.approx(300.0)  # since the checkpoint on storage
    assert result.samples == pytest.approx(644 * BATCH + (2000.0 - 1361.0) * 2.0)
    lost = dict(result.time_lost_s)
    assert lost["lost_work_s"] == pytest.approx(12.0)
    assert lost["partial_step_s"] == pytest.approx(1.0)
    # the same reload from storage loses everything since t=1000
    storage, _ = run([TraceEvent(1301.0, EventKind.WORKER_FAIL, (0,))], 2000.0,
                     ReloadPolicy(False), recovery=MEMORY)
    assert dict(storage.time_lost_s)["lost_work_s"] == pytest.approx(300.0)


def test_a_reload_from_storage_starts_the_copies_in_memory_over():
    # The first reload reads storage (back to step 500); the one-pipeline plan then runs
    # 4 s steps from t=1361 and copies at step 504 (t=1377); at t=1391 (507 steps) a
    # reload from memory goes back to 504, not to a copy from before the first failure.
    events = [TraceEvent(1301.0, EventKind.WORKER_FAIL, (0,)),
              TraceEvent(1391.0, EventKind.WORKER_FAIL, (1,))]
    policy = ReloadPolicy(False, True)
    result, _ = run(events, 2000.0, policy, recovery=MEMORY)
    assert policy.since_memory[1] == pytest.approx(12.0)
    assert result.samples == pytest.approx(500 * BATCH + 4 * 2 * 4.0 + (2000.0 - 1451.0) * 2.0)
    assert lost_total(result) == pytest.approx(2000.0 - result.samples / FF)


def test_a_software_fault_reloads_from_memory():
    policy = FakePolicy()
    result = simulate(Trace((TraceEvent(1501.0, EventKind.SOFTWARE),), 3000.0), policy,
                      failure_free_samples_s=FF, recovery=replace(MEMORY, memory_checkpoint_every=1),
                      num_workers=NUM_WORKERS, workers_per_node=PER_NODE,
                      memory_load_s=lambda plan: 0.5)
    stall = RECOVERY.detect_s + RECOVERY.restart_s + 0.5
    # a copy at every step: only the step in flight (1 s) is lost
    assert result.samples == pytest.approx(750 * BATCH + (3000.0 - 1501.0 - stall) * FF)
    lost = dict(result.time_lost_s)
    assert lost["load_s"] == pytest.approx(0.5) and "lost_work_s" not in lost
    assert lost_total(result) == pytest.approx(3000.0 - result.samples / FF)


def test_an_idle_spare_failing_changes_nothing():
    # a third node of spares (workers 4, 5) idle from the start
    policy = FakePolicy()
    result = simulate(Trace((TraceEvent(100.0, EventKind.NODE_FAIL, (2,)),), 300.0), policy,
                      failure_free_samples_s=FF, recovery=RECOVERY, num_workers=6,
                      workers_per_node=PER_NODE)
    assert policy.calls == [] and result.samples == pytest.approx(300.0 * FF)
