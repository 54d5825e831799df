"""Choosing a recovery: Eq. 8, the expected-work rule, fixed baselines, rejoin, the cache."""

from __future__ import annotations

from chameleon_ft.policy.horizon import mean_horizon_s, worker_rate_per_s
from chameleon_ft.policy.planner import Decision, Planner
from chameleon_ft.policy.score import (
    break_even_horizon_s,
    candidate_score,
    expected_work,
    score,
    score_ceiling,
    work_in_window,
)
from chameleon_ft.recovery.types import Candidate, Migration, Strategy, Transfer

__all__ = ["Candidate", "Decision", "Migration", "Planner", "Strategy", "Transfer",
           "break_even_horizon_s", "candidate_score", "expected_work", "mean_horizon_s",
           "score", "score_ceiling", "work_in_window", "worker_rate_per_s"]
