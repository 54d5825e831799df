"""The coordinator's state machine, one test per transition, without processes.

Several tests reproduce defects of the coordinator before its state became one value:
a retry that republished a plan naming a dead worker, a pending switch that survived a
restart, an idle worker's death aborting the step, stale checkpoint uploads accepted.
"""

from __future__ import annotations

import pytest

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.plan import Pipeline, Stage
from chameleon_ft.recovery.types import Migration, Transfer
from chameleon_ft.runtime.control import state as st

# 2 pipelines x 2 stages over 4 layers; stage-major: stage s of pipeline p on s * 2 + p
PLAN = ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=4)


def _plan(*pipelines: tuple[int, int]) -> ExecutionPlan:
    """Pipelines of two stages (layers 0-1 and 2-3) on the given worker pairs."""
    pipes = tuple(Pipeline((Stage(a, 0, 2), Stage(b, 2, 4)), 4 // len(pipelines))
                  for a, b in pipelines)
    return ExecutionPlan(num_layers=4, pipelines=pipes)


def _without(plan: ExecutionPlan, dead: int) -> ExecutionPlan:
    """A one-pipeline plan on two of the other workers (a stand-in for a recovery's plan)."""
    survivors = [w for w in sorted(plan.workers) if w != dead]
    return _plan((survivors[0], survivors[1]))


def _migration(src: int, dst: int) -> Migration:
    return Migration(slots=(), moved_bytes=1.0,
                     transfers=(Transfer(layer=2, src=src, dst=dst, part=0, num_parts=1,
                                         num_bytes=1.0),), rounds=((0,),), time_s=0.1)


def _training(step: int = 5) -> st.RunState:
    s = st.start(PLAN, range(4))
    for k in range(step):
        s = st.committed(s, k)
    return s


def test_start() -> None:
    s = st.start(PLAN, range(5))
    assert s.gen == 0 and s.next_step == 0 and s.load == st.INIT
    assert s.alive == frozenset(range(5)) and s.idle == {4}
    assert s.world == frozenset(range(4)) and s.from_checkpoint
    resumed = st.start(PLAN, range(4), step=20, load=st.Load("restore", 20))
    assert resumed.next_step == 20 and resumed.checkpoints == (20,)
    assert resumed.latest_checkpoint() == 20


def test_committed_advances_and_settles_the_placement() -> None:
    s = st.start(PLAN, range(4))
    s = st.committed(s, 0)
    assert s.next_step == 1 and not s.from_checkpoint and s.load is None
    assert s.state_plan == PLAN and s.retries == 0
    with pytest.raises(ValueError, match="step 3 committed"):
        st.committed(s, 3)


def test_death_in_the_world_breaks_the_generation() -> None:
    s = _training()
    new, broken = st.workers_died(s, [3])
    assert broken and new.alive == {0, 1, 2} and new.gen == s.gen


def test_death_of_an_idle_worker_breaks_nothing() -> None:
    s = st.rejoin_ready(_training(), [4])
    assert s.idle == {4}
    new, broken = st.workers_died(s, [4])
    assert not broken and new.alive == {0, 1, 2, 3} and new.idle == frozenset()
    assert new.gen == s.gen and new.next_step == s.next_step


def test_dying_twice_or_unknown_is_ignored() -> None:
    s = _training()
    new, broken = st.workers_died(s, [9])
    assert new is s and not broken


def test_recovered_starts_a_generation_on_the_new_plan() -> None:
    s, _ = st.workers_died(_training(), [3])
    plan = _without(PLAN, 3)
    new = st.recovered(s, st.Recovery("dynamic", plan, migration=_migration(1, 0)))
    assert new.gen == s.gen + 1 and new.plan == plan and new.next_step == s.next_step
    assert new.state_plan == PLAN  # nothing committed on the new plan yet
    assert new.world == {0, 1} and new.idle == {2}
    with pytest.raises(ValueError, match="not alive"):
        st.recovered(s, st.Recovery("dynamic", PLAN))


def test_restart_rewinds_to_the_checkpoint_and_opens_an_epoch() -> None:
    s = _training(7)
    s, _ = st.checkpoint_complete(s, 4, s.gen)
    s, _ = st.workers_died(s, [2, 3])
    plan = _without(PLAN, 3)
    new = st.recovered(s, st.Recovery("restart", plan, restored_step=s.latest_checkpoint()))
    assert new.next_step == 4 and new.load == st.Load("restore", 4)
    assert new.from_checkpoint and new.epoch == new.gen
    with pytest.raises(ValueError, match="checkpoint step"):
        st.recovered(s, st.Recovery("restart", plan))


def test_restart_clears_the_pending_second_phase() -> None:
    # reroute-then-dynamic: phase one trains rerouted, the switch waits; a second failure
    # that forces a restart must drop the switch (its migration's sources are gone)
    s, _ = st.workers_died(_training(), [3])
    dynamic = _without(PLAN, 3)
    s = st.recovered(s, st.Recovery("reroute-then-dynamic", dynamic,
                                    migration=_migration(2, 1), interim=_plan((0, 2)),
                                    switch_after=3))
    assert s.pending is not None and s.pending.at_step == s.next_step + 2
    # a failure of the interim plan whose decision is a restart (here: decided on the
    # state as it is, the pending switch still there)
    restarted = st.recovered(s, st.Recovery("restart", _plan((0, 2)), restored_step=0))
    assert restarted.pending is None
    for k in range(restarted.next_step, s.pending.at_step + 2):
        restarted = st.committed(restarted, k)
        assert not restarted.switch_due


def test_a_death_the_pending_switch_needs_drops_it() -> None:
    s = _training()
    s = st.rejoin_ready(s, [4])
    plan = _plan((0, 2), (1, 4))
    s = st.rejoin_planned(s, plan, _migration(3, 4), [4])
    assert s.pending is not None and s.switch_due
    new, broken = st.workers_died(s, [4])
    assert not broken and new.pending is None


def test_reroute_then_dynamic_switches_after_its_steps() -> None:
    s, _ = st.workers_died(_training(2), [3])
    dynamic = _without(PLAN, 3)
    interim = _plan((0, 2))
    s = st.recovered(s, st.Recovery("reroute-then-dynamic", dynamic,
                                    migration=_migration(2, 1), interim=interim,
                                    switch_after=2))
    assert s.plan == interim and not s.switch_due
    s = st.committed(s, 2)
    assert s.switch_due  # the verdict of step 3 says commit-end
    s = st.committed(s, 3)
    switched = st.switched(s)
    assert switched.gen == s.gen + 1 and switched.plan == dynamic
    assert switched.migration is not None and switched.pending is None
    with pytest.raises(ValueError, match="no switch"):
        st.switched(switched)


def test_retry_republishes_the_running_generation_not_the_old_placement() -> None:
    # worker 3 died; the reroute generation failed with errors before its first commit;
    # the retry must run the reroute plan again (the old placement names worker 3)
    s, _ = st.workers_died(_training(), [3])
    plan = _without(PLAN, 3)
    s = st.recovered(s, st.Recovery("reroute", plan))
    again = st.retried(s)
    assert again.gen == s.gen + 1 and again.plan == plan and again.retries == 1
    assert 3 not in again.world
    assert set(again.world) <= set(again.alive)


def test_retry_of_a_generation_with_a_dead_member_is_refused() -> None:
    broken, _ = st.workers_died(_training(), [2])
    with pytest.raises(ValueError, match="dead"):
        st.retried(broken)


def test_retries_are_bounded_then_restart_then_stop() -> None:
    s = _training()
    actions = []
    for _ in range(4):
        action = st.retry_action(s, max_retries=2)
        actions.append(action)
        if action is st.RetryAction.RETRY:
            s = st.retried(s)
        elif action is st.RetryAction.RESTART:
            s = st.escalated(s, s.state_plan, s.latest_checkpoint())
        else:
            s = st.stopped(s, "errors persist")
    assert actions == [st.RetryAction.RETRY, st.RetryAction.RETRY, st.RetryAction.RESTART,
                       st.RetryAction.STOP]
    assert s.mode is st.Mode.FAILED and s.reason == "errors persist"


def test_a_commit_resets_the_retry_count() -> None:
    s = st.retried(_training())
    assert s.retries == 1
    assert st.committed(s, s.next_step).retries == 0


def test_rejoin_ready_then_planned_then_switched() -> None:
    s = st.rejoin_ready(_training(), [4])
    assert 4 in s.alive and s.idle == {4}
    plan = _plan((0, 2), (1, 4))
    s2 = st.rejoin_planned(s, plan, _migration(3, 4), [4])
    assert s2.pending is not None and s2.pending.rejoin == (4,)
    with pytest.raises(ValueError, match="already pending"):
        st.rejoin_planned(s2, plan, None, [4])
    s3 = st.switched(st.committed(s2, s2.next_step))
    assert s3.plan == plan and 4 not in s3.idle and 3 in s3.world  # 3 sends its state


def test_an_idle_worker_that_dies_before_the_switch_stays_dead() -> None:
    """A re-join folded in every idle worker; one the new plan does not use died before the
    switch, and the switch brought it back to life (found by the generated sequences of
    ``test_runtime_control_properties.py``): later decisions could hand it a stage."""
    s = st.rejoin_ready(_training(), [4, 5])
    s = st.rejoin_planned(s, _plan((0, 2), (1, 4)), _migration(3, 4), [4, 5])
    assert s.pending is not None and s.pending.rejoin == (4, 5)
    s, broken = st.workers_died(s, [5])
    assert not broken and s.pending is not None and s.pending.rejoin == (4,)
    s = st.switched(st.committed(s, s.next_step))
    assert 5 not in s.alive and 5 not in s.idle and 3 in s.world  # 3 sends its state


def test_idle_workers_stay_available_to_later_decisions() -> None:
    s = st.rejoin_ready(_training(), [4])
    s, _ = st.workers_died(s, [3])
    assert 4 in s.alive  # the policy sees it and may use it
    plan = _plan((0, 2), (1, 4))
    new = st.recovered(s, st.Recovery("dynamic", plan, migration=_migration(2, 4)))
    assert new.idle == frozenset() and 4 in new.world


def test_checkpoints_of_an_abandoned_timeline_are_refused() -> None:
    s = _training(6)
    s, ok = st.checkpoint_complete(s, 4, s.gen)
    assert ok and s.checkpoints == (0, 4)
    s, _ = st.workers_died(s, [2, 3])
    s = st.recovered(s, st.Recovery("restart", _without(PLAN, 3), restored_step=4))
    # an upload of generation 0 (before the restart) arriving late
    s2, ok = st.checkpoint_complete(s, 6, 0)
    assert not ok and s2 is s
    s3, ok = st.checkpoint_complete(st.committed(st.committed(s, 4), 5), 6, s.gen)
    assert ok and s3.checkpoints[-1] == 6
    # a checkpoint of a step not committed yet is refused too
    _, ok = st.checkpoint_complete(s, 9, s.gen)
    assert not ok


def test_drain_finish_and_stop() -> None:
    s = _training()
    d = st.draining(s, "SIGTERM")
    assert d.mode is st.Mode.DRAINING and d.reason == "SIGTERM"
    assert st.draining(d, "SIGINT") is d
    f = st.finished(d)
    assert f.mode is st.Mode.FINISHED and f.gen == s.gen + 1
    failed = st.stopped(s, "no replica")
    assert failed.mode is st.Mode.FAILED and failed.gen == s.gen + 1


def test_a_replacement_under_a_placed_id_holds_nothing() -> None:
    # worker 3 dies; the recovery generation fails before its first commit; meanwhile a
    # replacement took id 3. The next decision must not think the placement is intact.
    s, _ = st.workers_died(_training(), [3])
    s = st.recovered(s, st.Recovery("reroute", _plan((0, 2), (1, 2))))
    s = st.rejoin_ready(s, [3])
    s, broken = st.workers_died(s, [1])
    assert broken and s.state_plan == PLAN and 3 in s.alive
    base, failed, usable = st.decision_inputs(s)
    assert base == PLAN and failed == {1, 3}
    assert usable == {0, 2}  # 3 waits for a re-join; it holds none of PLAN's state
    # once a plan with the replacement commits, it holds that plan's state
    s = st.recovered(s, st.Recovery("dynamic", _plan((0, 3)), migration=_migration(2, 3)))
    s = st.committed(s, s.next_step)
    assert s.holding == {0, 2, 3} and st.decision_inputs(s)[1] == frozenset()


def test_software_restart_reloads_the_checkpoint_on_the_running_plan() -> None:
    s = _training(7)
    s, _ = st.checkpoint_complete(s, 4, s.gen)
    s = st.rejoin_ready(s, [4])
    new = st.software_restart(s)
    assert new.gen == s.gen + 1 and new.plan == PLAN and new.next_step == 4
    assert new.load == st.Load("restore", 4) and new.from_checkpoint
    assert new.epoch == new.gen and new.alive == s.alive and new.idle == {4}
    # without a checkpoint after step 0 it goes back to the initial parameters
    fresh = st.software_restart(_training(3))
    assert fresh.next_step == 0 and fresh.load == st.INIT


def test_software_restart_during_a_recovery_uses_the_plan_it_moves_to() -> None:
    # reroute-then-dynamic in its first phase: the restart trains the interim plan from the
    # checkpoint and drops the switch (its migration starts from state rolled back)
    s, _ = st.workers_died(_training(), [3])
    interim = _plan((0, 2))
    s = st.recovered(s, st.Recovery("reroute-then-dynamic", _without(PLAN, 3),
                                    migration=_migration(2, 1), interim=interim,
                                    switch_after=3))
    new = st.software_restart(s)
    assert new.plan == interim and new.pending is None and new.migration is None
    assert new.next_step == 0 and new.idle == {1}


def test_software_restart_refused_when_not_training_or_a_member_is_dead() -> None:
    s = _training()
    with pytest.raises(ValueError, match="draining"):
        st.software_restart(st.draining(s, "SIGTERM"))
    dead, _ = st.workers_died(s, [3])
    with pytest.raises(ValueError, match="not alive"):
        st.software_restart(dead)


def test_a_replacement_under_a_rerouted_id_is_not_offered_to_the_policy() -> None:
    """The chaos benchmark found it: worker 0 died, its stage was rerouted, a replacement
    took id 0 and came up idle; at the next failure the policy was offered worker 0, took
    it for the stage's own worker back, and handed it its stage with no state copied (the
    replacement crashed: no state for its layers)."""
    from chameleon_ft.plan.reroute import reroute_plan

    s = _training()
    s, _ = st.workers_died(s, {0})
    rerouted = reroute_plan(PLAN, [0])
    s = st.committed(st.recovered(s, st.Recovery("reroute", rerouted)), s.next_step)
    s = st.rejoin_ready(s, [0])  # the replacement, idle
    assert 0 in rerouted.dead_workers and 0 in s.stateless
    s, broken = st.workers_died(s, {3})
    base, failed, usable = st.decision_inputs(s)
    assert broken and base == rerouted and failed == {3}
    assert 0 not in usable and usable == {1, 2}
