"""Measured transitions: the first commit after a failure ends its recovery."""

from __future__ import annotations

import pytest

from chameleon_ft.runtime.coordinator import Event, StepRecord, measure_transitions


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
