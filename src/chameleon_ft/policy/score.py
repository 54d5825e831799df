"""Scoring candidates: the paper's Eq. 8 and its expectation over a random horizon.

Eq. 8: over a window of ``D`` seconds a candidate with step time ``t`` and transition
``t_tr`` trains ``B / t`` samples/s after the transition, so its average throughput is
``score = (B / t) (D - t_tr) / D``, zero when ``D <= t_tr``.

When ``D`` is unknown it is taken as exponential with mean ``Dbar`` (time to the next
failure, see ``horizon.py``); the expected work ``X E[(D - t_tr)+]`` has the closed form
``X Dbar exp(-t_tr / Dbar)``, and dividing by ``Dbar`` gives a score in the same unit as
Eq. 8 (samples/s averaged over the expected window).

Two-phase candidates (``reroute-then-dynamic``): after the transition ``a`` they train at
``X_r`` (the rerouted speed) for ``T`` seconds of background migration, pause ``r`` for the
switch, then train at ``X_d``. Work over a fixed window:
``X_r clip(D - a, 0, T) + X_d (D - a - T - r)+``; its expectation for exponential ``D``:
``X_r Dbar (e^{-a/Dbar} - e^{-(a+T)/Dbar}) + X_d Dbar e^{-(a+T+r)/Dbar}``.
"""

from __future__ import annotations

import math

from chameleon_ft.recovery.types import Candidate


def score(global_batch: float, step_s: float, transition_s: float, horizon_s: float) -> float:
    """Eq. 8: average samples/s over a window of ``horizon_s`` seconds.

    Args:
        global_batch: samples per step ``B``.
        step_s: the candidate's step time ``t``.
        transition_s: time before training resumes ``t_tr``.
        horizon_s: the window ``D``.

    Returns:
        ``(B / t) (D - t_tr) / D``, or 0 when ``D <= t_tr`` or the step is infinite.

    Raises:
        ValueError: for a negative horizon or a non-positive step time.
    """
    if horizon_s < 0 or math.isnan(horizon_s):
        raise ValueError(f"horizon_s: must be >= 0, got {horizon_s}")
    if not step_s > 0:
        raise ValueError(f"step_s: must be > 0, got {step_s}")
    if horizon_s <= transition_s or not math.isfinite(step_s):
        return 0.0
    return (global_batch / step_s) * (horizon_s - transition_s) / horizon_s


def work_in_window(candidate: Candidate, global_batch: float, horizon_s: float) -> float:
    """Samples a candidate trains in a window of exactly ``horizon_s`` seconds."""
    if not candidate.feasible or not math.isfinite(candidate.step_s):
        return 0.0
    rate = global_batch / candidate.step_s
    after = horizon_s - candidate.transition_s
    if after <= 0:
        return 0.0
    if candidate.interim_step_s is None:
        return rate * after
    interim_rate = global_batch / candidate.interim_step_s
    first = min(after, candidate.interim_s)
    rest = max(0.0, after - candidate.interim_s - candidate.switch_s)
    return interim_rate * first + rate * rest


def expected_work(candidate: Candidate, global_batch: float, mean_horizon_s: float) -> float:
    """Expected samples trained before the next change, the window exponential with mean
    ``mean_horizon_s`` (closed forms in the module docstring)."""
    if not candidate.feasible or not math.isfinite(candidate.step_s):
        return 0.0
    if math.isinf(mean_horizon_s):
        # Infinite horizon: only the steady state matters; report the rate times a unit.
        return global_batch / candidate.step_s
    d = mean_horizon_s
    a = candidate.transition_s
    rate = global_batch / candidate.step_s
    if candidate.interim_step_s is None:
        return rate * d * math.exp(-a / d)
    interim_rate = global_batch / candidate.interim_step_s
    t_bg, switch = candidate.interim_s, candidate.switch_s
    first = interim_rate * d * (math.exp(-a / d) - math.exp(-(a + t_bg) / d))
    second = rate * d * math.exp(-(a + t_bg + switch) / d)
    return first + second


def candidate_score(candidate: Candidate, global_batch: float, *, horizon_s: float,
                    expected: bool) -> float:
    """The average samples/s a candidate achieves: over a fixed window (Eq. 8, generalised
    to two phases) or, when ``expected``, over an exponential window of mean ``horizon_s``.
    """
    if not candidate.feasible:
        return 0.0
    if expected:
        if math.isinf(horizon_s):
            return global_batch / candidate.step_s
        return expected_work(candidate, global_batch, horizon_s) / horizon_s
    if horizon_s <= 0:
        return 0.0
    return work_in_window(candidate, global_batch, horizon_s) / horizon_s


def score_ceiling(global_batch: float, step_s: float, transition_s: float, *,
                  horizon_s: float, expected: bool) -> float:
    """The score (:func:`candidate_score`) of a one-phase candidate with ``step_s`` and
    ``transition_s``: no candidate whose step is at least ``step_s`` and whose transition is
    at least ``transition_s`` scores more (a second phase of that step, a longer
    transition or the policy's fragility term only lower it)."""
    rate = global_batch / step_s
    if expected:
        return rate if math.isinf(horizon_s) else rate * math.exp(-transition_s / horizon_s)
    if horizon_s <= 0:
        return 0.0
    return rate * max(0.0, horizon_s - transition_s) / horizon_s


def break_even_horizon_s(slow_step_s: float, fast_step_s: float,
                         fast_transition_s: float, slow_transition_s: float = 0.0) -> float:
    """The window beyond which the faster-but-costlier candidate wins under Eq. 8.

    Solving ``(D - a_s) / t_s = (D - a_f) / t_f`` gives
    ``D* = (a_f t_s - a_s t_f) / (t_s - t_f)``; with a zero-transition slow candidate this
    is ``T_tr t_r / (t_r - t_d)``.

    Raises:
        ValueError: when the "fast" step is not faster.
    """
    if not fast_step_s < slow_step_s:
        raise ValueError(f"fast_step_s: {fast_step_s} must be below slow_step_s {slow_step_s}")
    return ((fast_transition_s * slow_step_s - slow_transition_s * fast_step_s)
            / (slow_step_s - fast_step_s))
