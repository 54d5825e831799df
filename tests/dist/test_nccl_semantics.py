"""The NCCL completion path, run on CPU: every group of the workers completes operations
as NCCL's do (``worker.nccl_like``: ``wait()`` returns before the transfer is done, a
received tensor is written only once the operation is seen complete, a dead peer's
transfers hang until an abort). Recovery must still be invisible: the final parameters
equal the failure-free run's (float64), with no worker left behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dist_harness import alive, max_abs_diff, run_job
from events import failures

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

NCCL_LIKE = {"nccl_semantics": True}


def _clean(pids: list[int]) -> None:
    assert pids and not [pid for pid in pids if alive(pid)]


def test_failure_free_run_equals_the_reference(tmp_path: Path, reference: Any) -> None:
    """No fault: every receive's data arrives only through the polled completion."""
    report, params, pids = run_job(tmp_path, coordinator=NCCL_LIKE)
    _, ref_params = reference("float64")
    _clean(pids)
    assert not failures(report)
    assert max_abs_diff(params, ref_params) < 1e-9


@pytest.mark.parametrize(("policy", "phase"), [("reroute", "backward"),
                                               ("dynamic", "reduce"),
                                               ("restart", "optimizer")])
def test_a_kill_is_recovered_exactly(tmp_path: Path, reference: Any, policy: str,
                                     phase: str) -> None:
    """The survivors' transfers with the dead worker never fail by themselves: they end
    when the coordinator aborts the generation (or at the collective deadline)."""
    report, params, pids = run_job(tmp_path, policy=policy, coordinator=NCCL_LIKE,
                                   faults=(f"rank=1,step=2,kind=kill,phase={phase}",))
    _, ref_params = reference("float64")
    _clean(pids)
    (event,) = report["events"]
    assert event["workers"] == [1]
    assert event["strategy"] == policy
    assert [s["step"] for s in report["steps"]] == list(range(6))
    assert max_abs_diff(params, ref_params) < 1e-9


def test_a_glitch_in_the_all_reduce_is_retried_exactly(tmp_path: Path, reference: Any) -> None:
    """A transient failure of one worker's all-reduce: its peers' operations hang (no
    error reaches them) until the coordinator aborts the generation on the report; the
    generation is redone as it was published."""
    report, params, pids = run_job(tmp_path, coordinator=NCCL_LIKE,
                                   faults=("rank=2,step=3,kind=glitch,phase=reduce",))
    _, ref_params = reference("float64")
    _clean(pids)
    assert not failures(report)  # nobody died
    assert any("retry 1 of" in line for line in report["log"])
    assert [s["step"] for s in report["steps"]] == list(range(6))
    assert max_abs_diff(params, ref_params) < 1e-9
