"""State on disk with real worker processes: workers write their own checkpoint files, a
disk that refuses drops that checkpoint and training goes on, a corrupt checkpoint is never
loaded (the one before it is), a drain lets the step in flight commit, and a run resumes
on another plan, each ending equal to the uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from dist_harness import TINY, alive, max_abs_diff, run_job
from events import failures

from chameleon_ft.runtime.coordinator.shell import Coordinator, Hooks
from chameleon_ft.runtime.storage.checkpoint import step_dir_name
from chameleon_ft.spec.config import config_from_mapping

pytestmark = pytest.mark.slow


def _clean(pids: list[int]) -> None:
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "worker processes left behind"


def _flip_a_bit(run_dir: Path, step: int, layer: int = 1) -> Path:
    path = run_dir / "checkpoints" / step_dir_name(step) / f"layer{layer}.bin"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def test_workers_write_their_own_checkpoints_in_parallel(tmp_path: Path,
                                                         reference: Any) -> None:
    report, params, pids = run_job(tmp_path, steps=6, checkpoint_every=2)
    _clean(pids)
    assert report["checkpoints"] == [2, 4, 6]
    manifest = json.loads((tmp_path / "checkpoints" / step_dir_name(4) /
                           "manifest.json").read_text())
    assert sorted(manifest["layers"]) == ["0", "1", "2", "3"]
    assert not report["dropped_checkpoints"] and not list((tmp_path / "checkpoints").glob(
        ".partial-*"))
    assert max_abs_diff(params, reference("float64", 6)[1]) < 1e-9


def test_disk_faults_drop_checkpoints_and_a_resume_uses_the_last_complete(
        tmp_path: Path, reference: Any) -> None:
    faults = ("rank=1,step=3,kind=disk-full,phase=checkpoint",
              "rank=2,step=5,kind=read-only,phase=checkpoint")
    lines: list[str] = []
    report, params, pids = run_job(tmp_path, steps=8, checkpoint_every=2, faults=faults,
                                   on_log=lambda _c, line: lines.append(line))
    _clean(pids)
    dropped = [d["step"] for d in report["dropped_checkpoints"]]
    assert dropped == [4, 6], report["dropped_checkpoints"]
    assert "No space left on device" in report["dropped_checkpoints"][0]["reason"]
    assert "Read-only file system" in report["dropped_checkpoints"][1]["reason"]
    assert sum("warning: checkpoint after" in line for line in lines) == 2
    assert report["checkpoints"] == [2, 8] and not failures(report)
    assert max_abs_diff(params, reference("float64", 8)[1]) < 1e-9
    # the final checkpoint lost (a coordinator that died before it): the last complete
    # one is the one after 2 steps, and the resumed run ends where the first would have
    shutil.rmtree(tmp_path / "checkpoints" / step_dir_name(8))
    resumed, params, pids = run_job(tmp_path, steps=8, checkpoint_every=2,
                                    coordinator={"resume": True})
    _clean(pids)
    assert resumed["resumed_from_step"] == 2
    assert max_abs_diff(params, reference("float64", 8)[1]) < 1e-9


def _read_only(folder: Path, on: bool) -> None:
    """Make ``folder`` refuse new entries, or accept them again. Root writes through file
    modes, so as root the folder is made immutable instead (``chattr +i``)."""
    if os.geteuid() != 0:
        folder.chmod(0o555 if on else 0o755)
        return
    if shutil.which("chattr") is None:
        pytest.skip("root writes into read-only folders and chattr is missing")
    done = subprocess.run(["chattr", "+i" if on else "-i", str(folder)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr cannot make the folder immutable here: {done.stderr.strip()}")


def test_a_checkpoint_folder_made_read_only_mid_run(tmp_path: Path, reference: Any) -> None:
    state: list[str] = []

    class ReadOnlyUntilADrop(Hooks):
        # read-only once the checkpoint after 2 steps is complete, writable again once a
        # checkpoint written meanwhile was dropped (writes run in the background, so the
        # steps at which this happens vary)
        def on_commit(self, coord: Coordinator, step: int) -> None:
            if not state and 2 in coord.job.ckpt.steps():
                _read_only(coord.job.ckpt.root, True)
                state.append("read-only")
            elif state == ["read-only"] and coord.report.dropped:
                _read_only(coord.job.ckpt.root, False)
                state.append("writable")

    try:
        report, params, pids = run_job(tmp_path, steps=12, checkpoint_every=2,
                                       coordinator={"hooks": ReadOnlyUntilADrop()})
    finally:
        if state == ["read-only"]:
            _read_only(tmp_path / "checkpoints", False)
    _clean(pids)
    assert state == ["read-only", "writable"]
    dropped = [d["step"] for d in report["dropped_checkpoints"]]
    assert dropped and all(2 < s < 12 for s in dropped), report["dropped_checkpoints"]
    assert 12 in report["checkpoints"] and not failures(report)
    assert max_abs_diff(params, reference("float64", 12)[1]) < 1e-9


def test_a_bit_flip_in_the_newest_checkpoint_resumes_from_the_one_before(
        tmp_path: Path, reference: Any) -> None:
    report, _, pids = run_job(tmp_path, steps=6, checkpoint_every=2)
    _clean(pids)
    assert report["checkpoints"] == [2, 4, 6]
    bad = _flip_a_bit(tmp_path, 6)
    bad_bytes = bad.read_bytes()
    lines: list[str] = []
    resumed, params, pids = run_job(tmp_path, steps=10, checkpoint_every=2,
                                    coordinator={"resume": True},
                                    on_log=lambda _c, line: lines.append(line))
    _clean(pids)
    assert resumed["resumed_from_step"] == 6  # the newest manifest checked out...
    (corrupt,) = resumed["corrupt_checkpoints"]  # ...but its file did not
    assert corrupt["step"] == 6 and bad.name in corrupt["reason"]
    assert sum("is corrupt" in line for line in lines) == 1
    # step 6 was redone from the checkpoint after 4 steps and written again, whole
    manifest = json.loads((bad.parent / "manifest.json").read_text())
    assert manifest["gen"] > 0 and (bad.parent / "layer1.bin").read_bytes() != bad_bytes
    assert [s["step"] for s in resumed["steps"]] == list(range(4, 10))
    assert max_abs_diff(params, reference("float64", 10)[1]) < 1e-9


def test_a_restart_whose_newest_checkpoint_is_corrupt_loads_the_one_before(
        tmp_path: Path, reference: Any) -> None:
    flipped: list[int] = []

    class CorruptAtFailure(Hooks):
        def on_failure(self, coord: Coordinator, event: Any) -> None:
            # checkpoints are written in the background: the newest complete one when the
            # failure strikes (after 4 or after 8 steps) is the one a restart would load
            if not flipped:
                newest = max(coord.job.ckpt.steps())
                flipped.append(newest)
                _flip_a_bit(coord.job.out_dir, newest, layer=2)

    # workers 2 and 3 hold layers 2-3: no replica left, only a restart recovers
    report, params, pids = run_job(tmp_path, policy="restart", steps=14, checkpoint_every=4,
                                   faults=("rank=2,step=10,kind=kill,phase=forward",
                                           "rank=3,step=10,kind=kill,phase=forward"),
                                   coordinator={"hooks": CorruptAtFailure()})
    _clean(pids)
    assert flipped and flipped[0] in (4, 8)
    assert [c["step"] for c in report["corrupt_checkpoints"]] == flipped
    restart = next(e for e in report["events"] if not e["idle"])
    assert restart["strategy"] == "restart"
    assert max_abs_diff(params, reference("float64", 14)[1]) < 1e-9


def test_a_drain_lets_the_step_in_flight_commit_and_checkpoints_it(tmp_path: Path) -> None:
    from byo_models import SlowData

    train = {**TINY["train"], "steps": 40, "timeout_s": 0.0, "hang_timeout_s": 0.5,
             "collective_timeout_s": 60.0}
    config = config_from_mapping({**TINY, "train": train})
    # from step 4 on each micro-batch takes 1 s: step 4 lasts about 4 s, twice the old
    # drain grace (max(hang deadline, 2 s))
    data = SlowData(TINY["model"]["seq_len"], delay_s=1.0, from_step=4,
                    global_batch=TINY["job"]["global_batch"])
    sent: list[int] = []

    class TermAfterCommit(Hooks):
        def on_commit(self, coord: Coordinator, step: int) -> None:
            if step == 3 and not sent:
                sent.append(step)
                os.kill(os.getpid(), signal.SIGTERM)  # the coordinator's own handler drains

    coord = Coordinator(config, out_dir=tmp_path, hooks=TermAfterCommit(), data=data)
    report = coord.run()
    _clean(list(coord.launched_pids))
    # the step in flight when the signal came (step 4, ~2 s: longer than the hang deadline)
    # committed, and the final checkpoint holds it
    assert report["interrupted"] == "SIGTERM"
    assert report["committed_steps"] == 5 and report["checkpoints"][-1] == 5


def test_resume_on_a_plan_with_fewer_workers(tmp_path: Path, reference: Any) -> None:
    _, _, pids = run_job(tmp_path, steps=6, checkpoint_every=2)
    _clean(pids)
    doc = json.loads(json.dumps(TINY))
    doc["cluster"]["num_nodes"] = 1
    doc["job"]["dp"] = 1
    doc["train"].update(steps=10, checkpoint_every=2)
    coord = Coordinator(config_from_mapping(doc), out_dir=tmp_path, resume=True)
    resumed = coord.run()
    _clean(list(coord.launched_pids))
    assert resumed["resumed_from_step"] == 6 and resumed["num_workers"] == 2
    assert max_abs_diff(coord.params, reference("float64", 10)[1]) < 1e-9
