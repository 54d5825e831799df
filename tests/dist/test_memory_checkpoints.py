"""Checkpoints in memory on real processes: each layer a worker writes to a checkpoint is
also held in the memory of a worker on the other node, and a reload after a stage lost
every replica reads it from there (verified against the manifest), from storage where
the holder died too. The oracle: float64 parameters equal to the failure-free run's.

The tiny job: workers 0 and 1 on node 0, 2 and 3 on node 1; pipelines (0, 2) and (1, 3),
layers 0-1 on the first stage, 2-3 on the second. Replicas take turns writing (layer i by
holder i mod 2): layer 0 by worker 0, copied to worker 2 (the same index on the other
node), layer 1 by 1 to 3, layer 2 by 2 to 0, layer 3 by 3 to 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dist_harness import alive, max_abs_diff, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

MEMORY = {"memory_checkpoint": True}
STEPS = 8
SETUP_SLACK_S = 8.0
"""Deadline of collectives and group set-up in these runs (the shared job's is 2 s)."""


def _reloads_after_killing(tmp_path: Path, reference: Any,
                           workers: tuple[int, ...]) -> list[dict[str, Any]]:
    """Kill ``workers`` at step 5, check the run against the failure-free one (every step
    once, float64 parameters, no process left) and return its reloads' events.

    The reloads counted are those of the kill alone: the groups' set-up deadline has more
    slack than the shared job's 2 s (a survivor that joined a generation's groups later
    than that on a loaded 2-core machine was declared failed, and its restart changed
    which layers came from memory); killed workers are seen by their exits, so the wait
    costs nothing here."""
    report, params, pids = run_job(
        tmp_path, policy="dynamic", steps=STEPS, recovery=MEMORY,
        faults=tuple(f"rank={w},step=5,kind=kill,phase=forward" for w in workers),
        collective_timeout_s=SETUP_SLACK_S)
    assert not [pid for pid in pids if alive(pid)]
    assert [s["step"] for s in report["steps"]] == list(range(STEPS)), report["events"]
    assert max_abs_diff(params, reference("float64", steps=STEPS)[1]) < 1e-9
    reloads = [e for e in report["events"] if e["lost_steps"] or e["strategy"] == "restart"]
    assert reloads, report["events"]
    return reloads


def test_a_wiped_stage_reloads_from_a_peers_memory(tmp_path: Path, reference: Any) -> None:
    # workers 2 and 3 hold the second stage of both pipelines; its copies live on 0 and 1
    reloads = _reloads_after_killing(tmp_path, reference, (2, 3))
    # layers 2 and 3 from the survivors' memory, at least once each; 0 and 1 from storage
    assert sum(e["from_memory_layers"] for e in reloads) >= 2, reloads


def test_a_reload_reads_each_layer_where_it_survives(tmp_path: Path,
                                                    reference: Any) -> None:
    # worker 1 alone survives: of the four layers it loads only layer 3's copy (its own)
    # is in a live memory; the others' holders (2, 3, 0) died with their stages
    reloads = _reloads_after_killing(tmp_path, reference, (0, 2, 3))
    assert sum(e["from_memory_layers"] for e in reloads) == 1, reloads
