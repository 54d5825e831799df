"""Real processes: the coordinator killed, frozen or stuck under live workers.

The coordinators run in processes of their own (``takeover_harness``), their workers in
the tests' forkserver: a SIGKILLed coordinator leaves its workers running, as a
scheduler's restart would. The oracle is the failure-free run's parameters (float64,
< 1e-9) and the workers' pids: nobody relaunched.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import max_abs_diff
from events import failures
from takeover_harness import Coordinating, StuckPolicy, gone_within, kill_all, until

from chameleon_ft.runtime.chaos import alive
from chameleon_ft.spec.train import parse_fault

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STEPS = 30
HANG_S = 2.0
TRAIN = {"steps": STEPS, "dtype": "float64", "hang_timeout_s": HANG_S,
         "collective_timeout_s": 3.0, "checkpoint_every": 4, "coordinator_grace_s": 20.0}
"""The tiny job (about 20 ms a step), with a grace that leaves time for a new coordinator."""


def _params(out: Path) -> dict[str, torch.Tensor]:
    return dict(torch.load(out / "params.pt", weights_only=True))


def test_a_coordinator_killed_mid_run_is_replaced_under_live_workers(
        tmp_path: Path, reference: Any) -> None:
    first = Coordinating(tmp_path, TRAIN, port=0)
    pids = first.pids()
    try:
        until(lambda: first.committed() >= 9, 60)
        killed_at = first.kill()
        assert all(alive(p) for p in pids), "the workers died with their coordinator"
        second = Coordinating(tmp_path, TRAIN, resume=True)
        assert second.wait(120) == 0, [x for _, x in second.mine()][-20:]
        lines = [x for _, x in second.mine()]
        assert not [x for x in lines if x.startswith("launched workers")], lines
        assert any(x.startswith("took the run over at step ") for x in lines), lines
        report = json.loads((tmp_path / "report.json").read_text())
        assert [(r["worker"], r["pid"]) for r in report["reattached"]] == \
            list(enumerate(pids))  # the same processes: nobody was relaunched
        assert all(r["local"] for r in report["reattached"])  # held by pid descriptor
        assert report["coordinator_term"] == 1 and not failures(report)
        assert [s["step"] for s in report["steps"]] == list(range(STEPS))
        _, params = reference("float64", STEPS)
        assert max_abs_diff(_params(tmp_path), params) < 1e-9
        gone = gone_within(pids, 10)
        assert len(gone) == len(pids), "workers left behind"
        assert killed_at < min(gone.values())
    finally:
        kill_all(*pids)


def test_a_verdict_read_by_some_workers_only_is_applied_by_the_others(
        tmp_path: Path, reference: Any) -> None:
    """The coordinator wrote step 12's commit while worker 3 was stopped, and died: the
    others applied it, worker 3 holds its gradients. The new coordinator has worker 3
    apply them (another worker holds the step after it): nobody redoes the step."""
    first = Coordinating(tmp_path, TRAIN, port=0, split_commit=(12, 3))
    pids = first.pids()
    try:
        assert first.wait(60) == -signal.SIGKILL
        time.sleep(0.3)
        os.kill(pids[3], signal.SIGCONT)
        second = Coordinating(tmp_path, TRAIN, resume=True)
        assert second.wait(120) == 0, [x for _, x in second.mine()][-20:]
        _, took = second.until(r"took the run over at step (\d+).*apply step (\d+) first")
        assert took.group(1, 2) == ("13", "12"), took.group(0)
        report = json.loads((tmp_path / "report.json").read_text())
        assert [r["pid"] for r in report["reattached"]] == pids and not failures(report)
        _, params = reference("float64", STEPS)
        assert max_abs_diff(_params(tmp_path), params) < 1e-9
    finally:
        kill_all(*pids)


def test_a_worker_that_does_not_report_is_dead_and_recovered_from(
        tmp_path: Path, reference: Any) -> None:
    """Worker 3 is stopped when its coordinator dies: it never reports to the new one,
    which treats it as dead once its bound passed and recovers through the policy."""
    first = Coordinating(tmp_path, TRAIN, port=0)
    pids = first.pids()
    try:
        until(lambda: first.committed() >= 9, 60)
        os.kill(pids[3], signal.SIGSTOP)
        first.kill()
        second = Coordinating(tmp_path, TRAIN, resume=True)
        assert second.wait(120) == 0, [x for _, x in second.mine()][-20:]
        report = json.loads((tmp_path / "report.json").read_text())
        assert [r["worker"] for r in report["reattached"]] == [0, 1, 2]
        (event,) = report["events"]
        assert event["workers"] == [3] and "did not report" in event["cause"]
        assert event["strategy"] not in ("", "none", "restart"), event
        _, params = reference("float64", STEPS)
        assert max_abs_diff(_params(tmp_path), params) < 1e-9
    finally:
        kill_all(*pids)


def test_without_a_new_coordinator_the_workers_exit_after_the_grace(tmp_path: Path) -> None:
    grace_s = 2.0
    first = Coordinating(tmp_path, {**TRAIN, "coordinator_grace_s": grace_s}, port=0)
    pids = first.pids()
    try:
        until(lambda: first.committed() >= 5, 60)
        killed_at = first.kill()
        gone = gone_within(pids, grace_s + 10)
        assert len(gone) == len(pids), "workers outlived the grace"
        after = sorted(t - killed_at for t in gone.values())
        # they waited the grace for a new coordinator (a refused connection is seen at
        # once), then left within a bound
        assert grace_s - 0.5 < after[0] and after[-1] < grace_s + 1.5, after
    finally:
        kill_all(*pids)


def test_a_policy_call_that_never_returns_ends_every_worker_within_three_hang_deadlines(
        tmp_path: Path) -> None:
    """The coordinator's loop is stuck in the recovery policy after a kill: the store's
    own thread still answers, but its progress value stops; the workers see that, and
    its own watchdog writes report.json saying where it is stuck and ends it."""
    marker = tmp_path / "stuck-at"
    first = Coordinating(tmp_path / "run", {**TRAIN, "coordinator_grace_s": HANG_S},
                         port=0, decide=StuckPolicy(marker),
                         faults=[parse_fault("rank=3,step=6,kind=kill")])
    pids = first.pids()
    try:
        until(marker.exists, 60)
        stuck_at = float(marker.read_text())
        survivors = pids[:3]
        gone = gone_within(survivors, 3 * HANG_S + 5)
        assert len(gone) == len(survivors), "workers outlived a stuck coordinator"
        assert max(gone.values()) - stuck_at < 3 * HANG_S, \
            sorted(t - stuck_at for t in gone.values())
        assert first.wait(20) == 1  # its watchdog: twice the hang deadline, at least 10 s
        report = json.loads((tmp_path / "run" / "report.json").read_text())
        assert "stuck in a call of the recovery policy (Decide)" in report["failed"]
        assert any("__call__" in frame for frame in report["stuck"]["at"]), report["stuck"]
        assert report["stuck"]["for_s"] >= HANG_S
    finally:
        kill_all(*pids)


def test_workers_leave_a_stuck_loop_whose_process_and_store_live_on(tmp_path: Path) -> None:
    """Without the coordinator's own watchdog, its process and its store's thread go on
    answering: only the progress value its loop no longer advances tells the workers."""
    marker = tmp_path / "stuck-at"
    first = Coordinating(tmp_path / "run", {**TRAIN, "coordinator_grace_s": HANG_S},
                         port=0, decide=StuckPolicy(marker), no_watchdog=True,
                         faults=[parse_fault("rank=3,step=6,kind=kill")])
    pids = first.pids()
    try:
        until(marker.exists, 60)
        stuck_at = float(marker.read_text())
        gone = gone_within(pids[:3], 3 * HANG_S + 5)
        assert len(gone) == 3, "workers stayed with a stuck coordinator"
        assert max(gone.values()) - stuck_at < 3 * HANG_S, \
            sorted(t - stuck_at for t in gone.values())
        assert first.proc.is_alive()  # its store answered all along
    finally:
        first.kill()
        kill_all(*pids)


TP_LAYOUT: dict[str, Any] = {"cluster": {"num_nodes": 1, "devices_per_node": 4},
                             "job": {"pp": 2, "dp": 1, "tp": 2}}
"""Two workers of two processes each (pp 2 x tp 2): the fewest a unit's takeover needs."""
TP_TRAIN = {"steps": 8, "dtype": "float64", "timeout_s": 6.0, "checkpoint_every": 4,
            "coordinator_grace_s": 30.0}
"""Deadlines a loaded 2-core host keeps with DTensor's first operations (design 4.11)."""


def test_a_tensor_parallel_run_is_taken_over_by_every_process_of_its_workers(
        tmp_path: Path) -> None:
    """At tp 2 the coordinator is killed mid-run: each worker's rank 0 reports what it
    holds, its sibling re-attaches its channel without a report, and the next coordinator
    trains on with the same four processes, equal to plain training (design 4.11)."""
    from dist_harness import tiny_config
    from takeover_harness import siblings_of

    from chameleon_ft.runtime.workload.reference import train_reference

    first = Coordinating(tmp_path, TP_TRAIN, port=0, layout=TP_LAYOUT)
    pids = first.pids()
    procs = list(pids)
    try:
        procs = sorted({*pids, *siblings_of(pids[0], first.proc.pid)})
        assert len(procs) == 4, procs  # each worker's rank 0 and its sibling
        until(lambda: first.committed() >= 3, 120)
        first.kill()
        assert all(alive(p) for p in procs), "processes died with their coordinator"
        second = Coordinating(tmp_path, TP_TRAIN, resume=True, layout=TP_LAYOUT)
        assert second.wait(150) == 0, [x for _, x in second.mine()][-20:]
        lines = [x for _, x in second.mine()]
        assert not [x for x in lines if x.startswith("launched workers")], lines
        assert any(x.startswith("took the run over at step ") for x in lines), lines
        report = json.loads((tmp_path / "report.json").read_text())
        assert [(r["worker"], r["pid"]) for r in report["reattached"]] == \
            list(enumerate(pids))  # rank 0 of each: nobody was relaunched
        assert report["coordinator_term"] == 1 and not report["events"]
        assert [s["step"] for s in report["steps"]] == list(range(TP_TRAIN["steps"]))
        reference = train_reference(tiny_config(**TP_LAYOUT, **TP_TRAIN))
        assert max_abs_diff(_params(tmp_path), reference.params) < 1e-9
        gone = gone_within(procs, 15)
        assert len(gone) == len(procs), "processes left behind"
    finally:
        kill_all(*procs)


def test_at_tp_2_the_siblings_leave_with_rank_0_once_the_grace_is_over(
        tmp_path: Path) -> None:
    """No coordinator follows: rank 0 waits out the grace; its sibling, with no grace of
    its own, waits as long as rank 0 does and leaves with it (rank 0's exit marks its
    slot failed: not the hang deadline's silence later)."""
    from takeover_harness import siblings_of

    grace_s = 3.0
    first = Coordinating(tmp_path, {**TP_TRAIN, "coordinator_grace_s": grace_s}, port=0,
                         layout=TP_LAYOUT)
    pids = first.pids()
    procs = list(pids)
    try:
        procs = sorted({*pids, *siblings_of(pids[0], first.proc.pid)})
        assert len(procs) == 4, procs
        until(lambda: first.committed() >= 2, 120)
        killed_at = first.kill()
        gone = gone_within(procs, grace_s + 15)
        assert len(gone) == len(procs), "processes outlived the grace"
        leaders = [gone[p] - killed_at for p in pids]
        siblings = [gone[p] - killed_at for p in procs if p not in pids]
        assert grace_s - 0.5 < min(leaders) and max(leaders) < grace_s + 2.0, leaders
        # none left before its leader gave up, and all within a second after (the hang
        # deadline is 6 s)
        assert min(siblings) > min(leaders) - 0.2, (leaders, siblings)
        assert max(siblings) < max(leaders) + 1.0, (leaders, siblings)
    finally:
        kill_all(*procs)
