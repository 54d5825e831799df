"""Real processes: every failure of the coordinator ends through the failure path, and a
checkpoint folder that refuses the final checkpoint never loses the trained model.

Each test reproduces a way the earlier coordinator ended without its failure path (an
exception out of its loop: no stop directive, no ``report.json``, workers left to their
watchdog) or lost the trained model (a full checkpoint folder: no ``params.pt``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from dist_harness import CheckedTraffic, alive, max_abs_diff, run_job, tiny_config

from chameleon_ft.runtime import auth
from chameleon_ft.runtime.coordinator.shell import Coordinator, Hooks, WorkerFailure
from chameleon_ft.spec.train import parse_fault

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _gone(pids: list[int], within_s: float) -> float:
    """Seconds until every pid exited (asserts it happens within ``within_s``)."""
    start = time.monotonic()
    while any(alive(p) for p in pids) and time.monotonic() - start < within_s:
        time.sleep(0.02)
    assert not [p for p in pids if alive(p)], "worker processes left behind"
    return time.monotonic() - start


def _failing_run(out: Path, **kwargs: Any) -> tuple[BaseException, Coordinator, list[str]]:
    """Run the tiny job expecting it to fail; the failure, the coordinator, its log."""
    lines: list[str] = []
    faults = [parse_fault(f) for f in kwargs.pop("faults", ())]
    config = tiny_config(**kwargs.pop("train", {}))
    coord = Coordinator(config, out_dir=out, log=lines.append, faults=faults,
                        hooks=CheckedTraffic(kwargs.pop("hooks", None)), **kwargs)
    with pytest.raises((WorkerFailure, ValueError)) as failure:
        coord.run()
    return failure.value, coord, lines


def test_an_exception_in_the_shell_stops_every_worker_and_writes_the_report(
        tmp_path: Path) -> None:
    """A bug in the shell (here a harness hook that raises at a commit) ended the
    coordinator with a traceback: no stop directive, no report, workers left running
    until their watchdog noticed."""
    class Broken(Hooks):
        def on_commit(self, coord: Coordinator, step: int) -> None:
            if step == 2:
                raise RuntimeError("a defect in the shell")

    started = time.monotonic()
    failure, coord, lines = _failing_run(tmp_path, hooks=Broken())
    assert isinstance(failure, WorkerFailure)
    assert str(failure) == "RuntimeError: a defect in the shell"  # one line
    # the workers read the stop directive and left (within the hang deadline)
    _gone(coord.launched_pids, coord.job.hang_s)
    assert time.monotonic() - started < 30
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed"] == "RuntimeError: a defect in the shell"
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    assert any("training stopped: RuntimeError" in line for line in lines)


def test_a_policy_that_raises_ends_through_the_failure_path(tmp_path: Path) -> None:
    def policy(*_args: Any) -> Any:
        raise ZeroDivisionError("the policy divided by zero")

    failure, coord, _ = _failing_run(tmp_path, decide=policy,
                                     faults=("rank=3,step=2,kind=kill,phase=forward",))
    assert "the recovery policy raised ZeroDivisionError: the policy divided by zero" \
        in str(failure)
    _gone(coord.launched_pids, coord.job.hang_s)
    report = json.loads((tmp_path / "report.json").read_text())
    assert "the recovery policy raised" in report["failed"]
    assert report["events"][0]["workers"] == [3]


def test_a_metrics_file_the_disk_refuses_loses_lines_not_the_run(
        tmp_path: Path, reference: Any) -> None:
    """An unguarded metrics.jsonl append on a full disk ended the run."""
    class Refusing(Hooks):
        def on_commit(self, coord: Coordinator, step: int) -> None:
            if step == 1:  # appending to a folder fails as a full disk does: OSError
                coord.report.metrics_path.unlink()
                coord.report.metrics_path.mkdir()

    lines: list[str] = []
    report, params, pids = run_job(tmp_path, coordinator={"hooks": Refusing()},
                                   on_log=lambda _c, line: lines.append(line))
    _gone(pids, 5)
    assert sum("metrics.jsonl not appended" in line for line in lines) == 1
    assert [s["step"] for s in report["steps"]] == list(range(6))
    assert max_abs_diff(params, reference("float64")[1]) < 1e-9


def test_a_repair_whose_address_cannot_be_advertised_is_given_up(
        tmp_path: Path, reference: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``advertise_address`` failing during a relaunch raised out of the loop."""
    expected = reference("float64", 10)[1]
    real = auth.advertise_address
    calls: list[int] = []

    def flaky(host: str, port: int) -> str:
        calls.append(port)
        if len(calls) > 1:  # the first launch works, every repair fails
            raise OSError("no route to the coordinator's address")
        return real(host, port)

    monkeypatch.setattr(auth, "advertise_address", flaky)
    lines: list[str] = []
    report, params, pids = run_job(tmp_path, policy="reroute", rejoin=True, steps=10,
                                   faults=("rank=3,step=2,kind=kill,phase=forward",),
                                   on_log=lambda _c, line: lines.append(line))
    _gone(pids, 5)
    text = "\n".join(lines)
    assert "could not start worker(s) [3]: OSError: no route" in text
    assert "could not be started 3 times; no more repairs" in text
    assert [s["step"] for s in report["steps"]] == list(range(10))
    assert max_abs_diff(params, expected) < 1e-9


def test_a_final_checkpoint_the_disk_refuses_is_uploaded_into_the_run_folder(
        tmp_path: Path, reference: Any) -> None:
    """The final checkpoint failing skipped the report and lost the trained model."""
    report, params, pids = run_job(tmp_path, checkpoint_every=4,
                                   faults=("rank=1,step=5,kind=disk-full,phase=checkpoint",))
    _gone(pids, 5)
    assert report["final_state"] == "final-state"
    assert [d["step"] for d in report["dropped_checkpoints"]] == [6]
    assert "No space left on device" in report["dropped_checkpoints"][0]["reason"]
    assert report["checkpoints"] == [4]  # a resume starts from the last complete one
    assert (tmp_path / "final-state" / "step00000006" / "manifest.json").is_file()
    assert max_abs_diff(params, reference("float64")[1]) < 1e-9


@contextlib.contextmanager
def _small_file_system(folder: Path, size: str) -> Any:
    """A tmpfs of ``size`` mounted on ``folder`` (skips where mounting is not permitted)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small file system needs root and mount(8)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


def test_a_checkpoint_folder_that_fills_up_drops_checkpoints_and_keeps_the_model(
        tmp_path: Path, reference: Any) -> None:
    """Tried as an operator would: the checkpoint folder on a 1 MiB file system. Training
    went on past the dropped checkpoints, then the final one could not be written and the
    run ended "training failed": no params.pt, no report.json, though the run folder had
    space. Each checkpoint of the tiny job is about 0.4 MiB: the folder fills up after
    two. Which ones complete depends on the host: a checkpoint still being written when
    the next one starts (a loaded host, whose disk writer runs at the lowest priority)
    shares the folder with it, and both may be refused."""
    with _small_file_system(tmp_path / "checkpoints", "1m"):
        report, params, pids = run_job(tmp_path, steps=12, checkpoint_every=2)
        _gone(pids, 5)
        dropped = [d["step"] for d in report["dropped_checkpoints"]]
        leftovers = list((tmp_path / "checkpoints").glob(".partial-*"))
    assert dropped and dropped[-1] == 12, report["dropped_checkpoints"]  # the final one too
    assert max(report["checkpoints"], default=0) < 12
    assert not leftovers  # a dropped checkpoint's files are gone: its space came back
    assert report["final_state"] == "final-state" and report["failed"] is None
    assert (tmp_path / "params.pt").is_file() and (tmp_path / "report.json").is_file()
    assert max_abs_diff(params, reference("float64", 12)[1]) < 1e-9
