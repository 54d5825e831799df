"""``chameleon worker`` under a scheduler's SIGTERM: with its coordinator drained by the
same signal (a Slurm requeue, a Kubernetes Job deleted) its workers stay to write the
final checkpoint and leave by the coordinator's stop; alone (its pod evicted) it stops
them within ``--drain-timeout``. Nothing is left behind either way."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import LAYOUT, ROOT, TINY_MODEL, cmd, env
from procs import kill_groups

TOKEN = "a-test-token-of-enough-length"
JOB = TINY_MODEL + LAYOUT + """
[train]
steps = 2000
dtype = "float64"
timeout_s = 2.0
heartbeat_s = 0.1
checkpoint_every = 50
drain_timeout_s = 20.0
"""


def _start(tmp_path: Path, *worker_args: str
           ) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """The coordinator (every worker remote) and one `chameleon worker` task running them
    all, each in a process group of its own; returns once a step committed."""
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    train = subprocess.Popen(cmd("train", "--config", str(job), "--remote-workers", "4",
                                 "--out", str(tmp_path / "run"), "--json"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT, env=env(CHAMELEON_TOKEN=TOKEN), start_new_session=True)
    assert train.stderr is not None
    address = None
    deadline = time.monotonic() + 90
    while address is None and time.monotonic() < deadline:
        found = re.search(r"listening on (\S+);", train.stderr.readline())
        address = found.group(1) if found else None
    assert address, "the coordinator never announced its address"
    worker = subprocess.Popen(cmd("worker", "--coordinator", address, "--num-workers", "4",
                                  *worker_args),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env=env(CHAMELEON_TOKEN=TOKEN), start_new_session=True)
    while time.monotonic() < deadline:  # training runs: a step line
        if train.stderr.readline().startswith("step"):
            return train, worker
    raise AssertionError("no step committed")


def _group_gone(pgid: int, timeout_s: float) -> bool:
    """Whether every process of group ``pgid`` has exited (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_to_every_task_drains_into_a_final_checkpoint(tmp_path: Path) -> None:
    train, worker = _start(tmp_path)
    try:
        # a scheduler stops the job: every task gets SIGTERM at once
        os.killpg(train.pid, signal.SIGTERM)
        os.killpg(worker.pid, signal.SIGTERM)
        out, err = train.communicate(timeout=60)
        worker_out, worker_err = worker.communicate(timeout=60)
        assert train.returncode == 128 + signal.SIGTERM, err[-3000:]
        report = json.loads(out)
        assert report["interrupted"] == "SIGTERM"
        done = report["committed_steps"]
        assert done in report["checkpoints"]  # the final checkpoint, written by the workers
        assert worker.returncode == 128 + signal.SIGTERM, worker_err[-3000:]
        assert "SIGTERM received: waiting up to 30 s" in worker_err
        # they left by the coordinator's stop, not killed
        assert sorted(re.findall(r"worker (\d) exited with status 0", worker_out)) == \
            ["0", "1", "2", "3"], worker_out
        assert _group_gone(worker.pid, 10) and _group_gone(train.pid, 10)
    finally:
        kill_groups(train, worker)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_to_a_worker_task_alone_stops_its_workers_within_the_grace(tmp_path: Path
                                                                           ) -> None:
    train, worker = _start(tmp_path, "--drain-timeout", "1")
    try:
        t0 = time.monotonic()
        os.killpg(worker.pid, signal.SIGTERM)  # its pod evicted; the coordinator goes on
        worker_out, worker_err = worker.communicate(timeout=30)
        assert time.monotonic() - t0 < 10
        assert worker.returncode == 128 + signal.SIGTERM, worker_err[-3000:]
        assert "did not leave within 1 s of SIGTERM; stopping them" in worker_err
        assert len(re.findall(r"worker \d exited with status -9", worker_out)) == 4, worker_out
        assert _group_gone(worker.pid, 10)
    finally:
        kill_groups(train, worker)
