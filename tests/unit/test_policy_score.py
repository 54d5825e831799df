"""Eq. 8, its expectation over an exponential horizon, and the failure-rate estimate."""

from __future__ import annotations

import math

import pytest
from scipy import integrate

from chameleon_ft.policy import (
    Candidate,
    Strategy,
    break_even_horizon_s,
    candidate_score,
    expected_work,
    mean_horizon_s,
    score,
    score_ceiling,
    work_in_window,
    worker_rate_per_s,
)
from chameleon_ft.policy.horizon import LiveExposure
from chameleon_ft.spec.recovery import LLAMA3_NODE_MTBF_HOURS, PolicySpec


def cand(step_s: float, transition_s: float, *, interim_step_s: float | None = None,
         interim_s: float = 0.0, switch_s: float = 0.0) -> Candidate:
    return Candidate(strategy=Strategy.DYNAMIC, feasible=True, plan=None, estimate=None,
                     step_s=step_s, throughput_samples_s=1.0 / step_s,
                     transition_s=transition_s, terms={"x_s": transition_s},
                     peak_memory_bytes=0.0, reason="test", interim_step_s=interim_step_s,
                     interim_s=interim_s, switch_s=switch_s)


def test_eq8_values() -> None:
    assert score(256, 2.0, 10.0, 100.0) == pytest.approx(128 * 0.9)
    assert score(256, 2.0, 0.0, 5.0) == pytest.approx(128)
    assert score(256, 2.0, 10.0, 10.0) == 0.0
    assert score(256, 2.0, 10.0, 3.0) == 0.0
    with pytest.raises(ValueError, match="horizon_s"):
        score(256, 2.0, 1.0, -1.0)


def test_break_even_matches_eq8_algebra() -> None:
    t_r, t_d, t_tr = 14.0, 13.0, 40.0
    d_star = break_even_horizon_s(t_r, t_d, t_tr)
    assert d_star == pytest.approx(t_tr * t_r / (t_r - t_d))
    assert score(256, t_r, 0.0, d_star) == pytest.approx(score(256, t_d, t_tr, d_star))
    below, above = 0.99 * d_star, 1.01 * d_star
    assert score(256, t_r, 0.0, below) > score(256, t_d, t_tr, below)
    assert score(256, t_r, 0.0, above) < score(256, t_d, t_tr, above)


def test_window_work_two_phase() -> None:
    c = cand(2.0, 10.0, interim_step_s=4.0, interim_s=20.0, switch_s=5.0)
    # 10 s stalled, 20 s at 64/s, 5 s stalled, then 128/s
    assert work_in_window(c, 256, 5.0) == 0.0
    assert work_in_window(c, 256, 20.0) == pytest.approx(10 * 64)
    assert work_in_window(c, 256, 32.0) == pytest.approx(20 * 64)
    assert work_in_window(c, 256, 45.0) == pytest.approx(20 * 64 + 10 * 128)
    assert candidate_score(c, 256, horizon_s=45.0, expected=False) == pytest.approx(
        (20 * 64 + 10 * 128) / 45)


@pytest.mark.parametrize("c", [cand(2.0, 30.0),
                               cand(2.0, 10.0, interim_step_s=3.0, interim_s=50.0, switch_s=5.0)])
def test_expected_work_closed_form_matches_integral(c: Candidate) -> None:
    mean = 200.0
    numeric, _ = integrate.quad(lambda d: work_in_window(c, 256, d) * math.exp(-d / mean) / mean,
                                0, 50 * mean, limit=400, points=[10, 30, 60, 65])
    assert expected_work(c, 256, mean) == pytest.approx(numeric, rel=1e-6)
    single = cand(2.0, 30.0)
    assert expected_work(single, 256, mean) == pytest.approx(128 * mean * math.exp(-30 / mean))


@pytest.mark.parametrize("expected", [True, False])
def test_the_score_ceiling_bounds_slower_later_and_two_phase_candidates(
        expected: bool) -> None:
    """``score_ceiling`` is a one-phase candidate's score, and no candidate at least as
    slow, with at least its transition, or switching to such a plan after a faster first
    phase's transition, scores more."""
    batch, step, floor = 64, 2.0, 30.0
    for horizon in (10.0, 600.0, 3600.0, math.inf if expected else 1e6):
        ceiling = score_ceiling(batch, step, floor, horizon_s=horizon, expected=expected)
        assert ceiling == pytest.approx(candidate_score(cand(step, floor), batch,
                                                        horizon_s=horizon, expected=expected),
                                        rel=1e-12)
        for slower, later in ((step, floor), (2.5, floor), (step, 90.0), (3.0, 400.0)):
            assert candidate_score(cand(slower, later), batch, horizon_s=horizon,
                                   expected=expected) <= ceiling * (1 + 1e-12)
        # a first phase at the first candidate's speed, then the slower plan: no more than
        # the first candidate alone
        first = cand(1.5, floor)
        two = cand(step, floor, interim_step_s=1.5, interim_s=300.0, switch_s=5.0)
        assert candidate_score(two, batch, horizon_s=horizon, expected=expected) <= (
            candidate_score(first, batch, horizon_s=horizon, expected=expected) * (1 + 1e-12))


def test_infeasible_scores_zero() -> None:
    bad = Candidate(strategy=Strategy.REROUTE, feasible=False, plan=None, estimate=None,
                    step_s=math.inf, throughput_samples_s=0.0, transition_s=math.inf, terms={},
                    peak_memory_bytes=0.0, reason="x")
    assert candidate_score(bad, 256, horizon_s=100.0, expected=False) == 0.0
    assert candidate_score(bad, 256, horizon_s=100.0, expected=True) == 0.0


def test_failure_rate_prior_and_update() -> None:
    spec = PolicySpec()
    assert spec.node_mtbf_hours == pytest.approx(6335, rel=1e-3)
    prior = worker_rate_per_s(spec, workers_per_node=8, num_failures=0, exposure_worker_s=0.0)
    assert prior == pytest.approx(1 / (LLAMA3_NODE_MTBF_HOURS * 3600 * 8))
    # one failure at t = 0 doubles the rate; a long quiet run lowers it
    assert worker_rate_per_s(spec, workers_per_node=8, num_failures=1,
                             exposure_worker_s=0.0) == pytest.approx(2 * prior)
    quiet = worker_rate_per_s(spec, workers_per_node=8, num_failures=0,
                              exposure_worker_s=32 * 1e8)
    assert quiet < prior
    # many failures in a short time push the rate towards the observed one
    busy = worker_rate_per_s(spec, workers_per_node=8, num_failures=50,
                             exposure_worker_s=32 * 3600 * 24 * 30)
    assert busy > 10 * prior
    with pytest.raises(ValueError, match="exposure_worker_s"):
        worker_rate_per_s(spec, workers_per_node=8, num_failures=0, exposure_worker_s=-1)


def test_exposure_counts_live_workers_only() -> None:
    exposure = LiveExposure(16)
    assert exposure.at(100.0) == 1600.0  # every worker alive from time 0
    exposure.observe(100.0, 8)
    exposure.observe(1100.0, 0)  # 8 live for 1,000 s, then none (the job is down)
    assert exposure.at(1100.0) == 1600.0 + 8000.0
    assert exposure.at(90_000.0) == 9600.0  # dead workers cannot fail: no exposure
    exposure.observe(90_000.0, 20)  # back, with spares: at most the job's 16 count
    assert exposure.at(90_010.0) == 9600.0 + 160.0
    exposure.observe(50.0, 4)  # a what-if decision in the past adds nothing
    assert exposure.at(90_010.0) == 9600.0 + 40.0




def test_mean_horizon_and_repair_cap() -> None:
    assert mean_horizon_s(1e-6, 100) == pytest.approx(1e4)
    assert mean_horizon_s(1e-6, 100, repair_hours=1.0) == pytest.approx(3600)
    assert math.isinf(mean_horizon_s(0.0, 100))
