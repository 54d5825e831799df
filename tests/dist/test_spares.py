"""Warm spares on real processes: a spare node's workers start idle, take a killed
worker's place (``swap``) by copying its layers from a same-stage replica, or, when a
stage lost every replica, sit in the slot while every worker reloads the checkpoint in
place. The oracle is the one of test_recovery.py: float64 parameters equal to the
failure-free run's, every step reported once, no survivor restarted, no process left."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dist_harness import alive, max_abs_diff, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

SPARES = {"spare_nodes": 1}
"""One spare node of the tiny job's cluster: workers 4 and 5, after the layout's 0-3."""


def _plan_workers(report: dict[str, Any]) -> set[int]:
    return {w for p in report["final_plan"]["pipelines"] for w, _, _ in p["stages"]}


def _check(report: dict[str, Any], params: Any, pids: list[int], reference: Any) -> None:
    assert len(pids) == 6, pids  # four workers and two spares, none launched again
    assert (report["num_workers"], report["spare_workers"]) == (4, 2)
    assert not [pid for pid in pids if alive(pid)]
    assert [s["step"] for s in report["steps"]] == list(range(6)), report["events"]
    _, ref_params = reference("float64")
    assert max_abs_diff(params, ref_params) < 1e-9


def test_a_spare_takes_a_killed_workers_place(tmp_path: Path, reference: Any) -> None:
    report, params, pids = run_job(tmp_path, policy="swap", cluster=SPARES,
                                   faults=("rank=1,step=2,kind=kill,phase=backward",))
    _check(report, params, pids, reference)
    assert [(e["strategy"], e["workers"]) for e in report["events"]] == [("swap", [1])]
    assert report["events"][0]["lost_steps"] == 0  # copied from a replica: nothing redone
    used = _plan_workers(report)
    assert len(used) == 4 and 1 not in used and used & {4, 5}


def test_a_wiped_stage_reloads_in_place_with_spares_in_its_slots(tmp_path: Path,
                                                               reference: Any) -> None:
    # workers 2 and 3 hold the second stage of both pipelines: no replica survives, so the
    # spares take both slots and every worker reloads the last complete checkpoint
    report, params, pids = run_job(tmp_path, policy="swap", cluster=SPARES,
                                   faults=("rank=2,step=3,kind=kill,phase=forward",
                                           "rank=3,step=3,kind=kill,phase=forward"))
    _check(report, params, pids, reference)
    # the two deaths (detected one after the other, or together); on a loaded host a
    # survivor slow to join the new groups may be fenced after them (a later event)
    killed = [e for e in report["events"] if set(e["workers"]) & {2, 3}]
    assert {e["strategy"] for e in killed} == {"swap"}, report["events"]
    assert sorted(w for e in killed for w in e["workers"]) == [2, 3], report["events"]
    # checkpoint every 2 steps: the one after 2 steps, or the start when it was dropped
    assert max(e["lost_steps"] for e in killed) in (1, 3), report["events"]
    # the spares hold the slots, unless one was fenced later (on a loaded host a worker
    # stuck in an older generation's gloo set-up past its deadline is declared failed)
    fenced = {w for e in report["events"] if e not in killed for w in e["workers"]}
    used = _plan_workers(report)
    assert {4, 5} - fenced <= used and used & {4, 5} and not used & {2, 3}, \
        (used, report["events"])


def test_chameleon_with_a_spare_recovers_exactly(tmp_path: Path, reference: Any) -> None:
    report, params, pids = run_job(tmp_path, cluster=SPARES,
                                   faults=("rank=3,step=2,kind=kill,phase=optimizer",))
    _check(report, params, pids, reference)
    assert report["events"][0]["workers"] == [3], report["events"]
    assert report["events"][0]["strategy"] in {"swap", "reroute", "dynamic", "shrink",
                                               "reroute-then-dynamic"}
