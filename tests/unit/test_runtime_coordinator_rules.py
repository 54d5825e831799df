"""The coordinator's rules that need no process: measured transitions, and which absent
members are still waited for."""

from __future__ import annotations

import pytest

from chameleon_ft.runtime.control.detector import SETUP_WAIT_DEADLINES, members_in_older_setup
from chameleon_ft.runtime.report.records import Event, StepRecord, measure_transitions


def event(at: float) -> Event:
    return Event(workers=[], cause="software", gen=0, step=40, fault_at_s=at,
                 detected_at_s=at, detected_after_s=0.0)


def test_a_step_redone_by_a_later_restart_still_ends_the_first_recovery() -> None:
    # fault at 10.0, restart, step 40 commits at 10.6 and 41 at 11.1 (gen 1); a second fault
    # at 11.3 restarts from step 40 again: gen 2 redoes 40 and 41
    commits = [StepRecord(39, 0.1, 0.5, 0, 9.9, 8),
               StepRecord(40, 0.1, 0.6, 1, 10.6, 8), StepRecord(41, 0.1, 0.5, 1, 11.1, 8),
               StepRecord(40, 0.1, 0.6, 2, 11.9, 8), StepRecord(41, 0.1, 0.5, 2, 12.4, 8),
               StepRecord(42, 0.1, 0.5, 2, 12.9, 8)]
    first, second = event(10.0), event(11.3)
    measure_transitions([first, second], commits)
    assert first.resumed_at_s == 10.6
    assert first.transition_s == pytest.approx(10.6 - 10.0 - 0.5)
    assert second.resumed_at_s == 11.9
    assert second.transition_s == pytest.approx(11.9 - 11.3 - 0.5)


def test_idle_events_and_events_after_the_last_commit_stay_unmeasured() -> None:
    idle, late = event(1.0), event(5.0)
    idle.idle = True
    measure_transitions([idle, late], [StepRecord(3, 0.1, 0.5, 0, 2.0, 8)])
    assert idle.transition_s is None and late.transition_s is None


def test_a_member_inside_an_older_generations_set_up_is_waited_for_until_its_deadline() -> None:
    # generation 1 (deadline 4 s) published at 10 s; generation 2 (deadline 1 s) at 10.5 s
    gens = {1: (10.0, 4.0), 2: (10.5, 1.0)}
    until = 10.0 + SETUP_WAIT_DEADLINES * 4.0 + 2.0
    setup = {0: 1, 1: 2, 2: None}
    # worker 0 is still in generation 1's set-up: waited for; worker 1 is in generation 2's
    # own set-up and worker 2 never began one: neither is waited for
    assert members_in_older_setup(setup, 2, gens, 12.0, slack_s=2.0) == {0: until}
    assert members_in_older_setup(setup, 2, gens, until - 0.01, slack_s=2.0) == {0: until}
    # past the longest set-up gloo takes with a dead peer, it is stuck for good
    assert members_in_older_setup(setup, 2, gens, until, slack_s=2.0) == {}


def test_an_unknown_generation_is_not_waited_for() -> None:
    # generation 0 was retired (a later generation got ready), or left out because one of
    # its members went silent (gloo then retries for five deadlines): nothing to wait for
    assert members_in_older_setup({3: 0}, 2, {2: (10.5, 1.0)}, 11.0, slack_s=2.0) == {}
