"""The chaos harness's verdict on one run (runtime/chaos.py ``check_run``), on a report
built by hand: which strategies it counts, and that re-joins count as one of them."""

from __future__ import annotations

import torch

from chameleon_ft.runtime.chaos import ChaosHooks, check_run


def _event(strategy: str, cause: str = "kill") -> dict[str, object]:
    return {"strategy": strategy, "cause": cause, "workers": [1], "lost_steps": 0,
            "fault_at_s": 1.0, "detected_at_s": 1.5, "transition_s": 2.0}


def _report(rejoins: list[dict[str, object]]) -> dict[str, object]:
    return {"faults": [], "steps": [{"step": i} for i in range(3)],
            "events": [_event("reroute"), _event("dynamic"), _event("slow", cause="slow")],
            "rejoins": rejoins}


def test_a_rejoin_that_folds_workers_back_counts_as_the_rejoin_strategy() -> None:
    params = {"w": torch.zeros(2, dtype=torch.float64)}
    hooks = ChaosHooks(seed=0, budget=0, last_step=0)
    rejoins = [{"workers": [1], "step": 2, "strategy": "dynamic", "reason": "r"},
               {"workers": [1], "step": 3, "strategy": "keep", "reason": "k"}]
    result = check_run(_report(rejoins), params, params, hooks, [], 3)
    # the slow event is no failure; the kept idle worker is no re-join
    assert result["strategies"] == {"reroute": 1, "dynamic": 1, "rejoin": 1}
    assert result["exact"] and result["steps_ok"] and result["events"] == 2


def test_a_run_without_rejoins_names_no_rejoin() -> None:
    params = {"w": torch.zeros(2, dtype=torch.float64)}
    hooks = ChaosHooks(seed=0, budget=0, last_step=0)
    keep_only = [{"workers": [2], "step": 1, "strategy": "keep", "reason": "k"}]
    for rejoins in ([], keep_only):
        result = check_run(_report(rejoins), params, params, hooks, [], 3)
        assert "rejoin" not in result["strategies"]
