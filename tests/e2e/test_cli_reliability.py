"""The runtime's edges through the CLI: the coordinator killed or stopped by a signal,
``--resume``, who may join, and a job that cannot fit the host."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import LAYOUT, TINY_MODEL, cmd, env
from events import failures

from chameleon_ft.runtime.chaos import alive

TOML = TINY_MODEL + LAYOUT + """
[recovery]
detect_s = 0.05
rebuild_s = 0.05

[train]
steps = 160
dtype = "float64"
hang_timeout_s = 1.5
heartbeat_s = 0.1
checkpoint_every = 5
coordinator_grace_s = 0.0
"""
TOKEN = "an-e2e-token-of-enough-length"
HANG_S = 1.5





def _wait_gone(pids: list[int], limit_s: float) -> float:
    start = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - start > limit_s + 5:
            break
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("job") / "tiny.toml"
    path.write_text(TOML)
    return path


@pytest.fixture(scope="module")
def reference(job: Path) -> dict[str, torch.Tensor]:
    """The job trained by plain single-process PyTorch: what every run must end equal to."""
    from chameleon_ft.runtime.workload.reference import train_reference
    from chameleon_ft.spec import load_config

    return dict(train_reference(load_config(job)).params)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


class Run:
    """``chameleon train`` in the background, its progress read line by line."""

    def __init__(self, *args: str, environ: dict[str, str] | None = None) -> None:
        # its own session: a signal to the process group (Ctrl-C) spares the test
        self.proc = subprocess.Popen(cmd("train", *args), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=environ or env(),
                                     start_new_session=True)
        self.lines: list[str] = []

    def until(self, pattern: str, limit_s: float = 90) -> re.Match[str]:
        deadline = time.monotonic() + limit_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip())
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"never saw {pattern!r}; last lines: {self.lines[-15:]}")

    def finish(self, limit_s: float = 120) -> int:
        out, _ = self.proc.communicate(timeout=limit_s)
        self.lines += out.splitlines()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _pids(run: Run) -> list[int]:
    match = run.until(r"launched workers 0-\d+ \(pids ([\d ]+)\)")
    return [int(p) for p in match.group(1).split()]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_frozen_coordinator_is_left_within_the_hang_deadline(job: Path,
                                                               tmp_path: Path) -> None:
    # A coordinator stopped rather than dead (a debugger, a host stuck in swap) keeps its
    # socket open, and a store request to it blocks with no deadline: the workers' watchdog
    # must still see the silence and leave within the hang deadline.
    run = Run("--config", str(job), "--out", str(tmp_path / "run"))
    pids: list[int] = []
    try:
        pids = _pids(run)
        run.until(r"step +(1[0-9]|[2-9]\d)\b")
        os.kill(run.proc.pid, signal.SIGSTOP)
        gone_after = _wait_gone(pids, HANG_S + 1)
        assert gone_after <= HANG_S + 1.0, f"workers outlived a frozen coordinator by " \
                                           f"{gone_after:.2f} s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(run.proc.pid, signal.SIGKILL)
        run.kill()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_coordinator_death_then_resume(job: Path, tmp_path: Path,
                                       reference: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "run"
    run = Run("--config", str(job), "--out", str(out))
    try:
        pids = _pids(run)
        run.until(r"step +(2[4-9]|[3-9]\d)\b")
        stopped = pids[1]
        os.kill(stopped, signal.SIGSTOP)  # a worker that is stopped when the coordinator dies
        os.kill(run.proc.pid, signal.SIGKILL)
        others = [p for p in pids if p != stopped]
        gone_after = _wait_gone(others, HANG_S + 1)
        assert gone_after <= HANG_S + 1.0, f"workers outlived the coordinator by {gone_after} s"
        time.sleep(HANG_S + 0.5)
        assert alive(stopped)
        os.kill(stopped, signal.SIGCONT)
        gone_after = _wait_gone([stopped], HANG_S + 1)
        assert gone_after <= HANG_S + 1.0, f"the continued worker lived {gone_after} s more"
    finally:
        run.kill()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
    manifests = sorted((out / "checkpoints").glob("step*/manifest.json"))
    assert manifests, "no checkpoint was written before the coordinator died"
    resumed = Run("--config", str(job), "--out", str(out), "--resume", "--json")
    assert resumed.finish() == 0, resumed.lines[-20:]
    text = "\n".join(resumed.lines)
    assert re.search(r"resuming from .*step0+\d+", text)
    assert _max_diff(dict(torch.load(out / "params.pt")), reference) < 1e-9
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == sorted({m["step"] for m in metrics})
    assert metrics[-1]["step"] == 159


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_drains_checkpoints_and_says_how_to_resume(
        job: Path, tmp_path: Path, reference: dict[str, torch.Tensor], sig: int,
        code: int) -> None:
    out = tmp_path / "run"
    run = Run("--config", str(job), "--out", str(out))
    try:
        pids = _pids(run)
        run.until(r"step +(1[6-9]|[2-9]\d)\b")
        if sig == signal.SIGINT:  # Ctrl-C: the terminal signals every process of the group
            os.killpg(run.proc.pid, sig)
        else:
            os.kill(run.proc.pid, sig)
        assert run.finish() == code
    finally:
        run.kill()
    assert _wait_gone(pids, 5) < 5
    text = "\n".join(run.lines)
    match = re.search(r"stopped by SIG\w+ after (\d+) steps; resume with: (.+)", text)
    assert match, run.lines[-10:]
    steps = int(match.group(1))
    assert f"--out {out} --resume" in match.group(2)
    assert (out / "checkpoints" / f"step{steps:08d}" / "manifest.json").exists()
    resumed = Run("--config", str(job), "--out", str(out), "--resume")
    assert resumed.finish() == 0, resumed.lines[-20:]
    assert _max_diff(dict(torch.load(out / "params.pt")), reference) < 1e-9


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_who_may_join(job: Path, tmp_path: Path) -> None:
    run = Run("--config", str(job), "--workers", "3", "--remote-workers", "1", "--out",
              str(tmp_path / "run"), "--token", TOKEN, "--steps", "120")
    worker: subprocess.Popen[str] | None = None
    try:
        address = run.until(r"listening on (\S+);").group(1)

        def join(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(cmd("worker", "--coordinator", address, *args),
                                  capture_output=True, text=True, timeout=60, env=env())

        def refused(proc: subprocess.CompletedProcess[str], reason: str) -> None:
            assert proc.returncode == 2, proc.stdout + proc.stderr
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and reason in lines[0], proc.stderr

        refused(join("--token", "not-the-token-of-this-job"), "wrong token")
        refused(join("--token", TOKEN, "--job", "another-job"), "not 'another-job'")
        worker = subprocess.Popen(cmd("worker", "--coordinator", address),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=env(CHAMELEON_TOKEN=TOKEN))
        run.until(r"step +\d+ ")
        refused(join("--token", TOKEN), "already has its 4 workers")
        assert run.finish() == 0, run.lines[-20:]
        report = json.loads((tmp_path / "run" / "report.json").read_text())
        assert [len(report["loss"])] == [120] and not failures(report)
        reasons = [r["reason"] for r in report["refused"]]
        assert len(reasons) == 2 and "wrong token" in reasons[0]
        assert "already has" in reasons[1]
        worker_out, _ = worker.communicate(timeout=30)
        assert worker.returncode == 0 and "worker 3 started" in worker_out
    finally:
        run.kill()
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(10)


def test_a_job_too_large_for_the_host_is_refused_before_launch() -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    start = time.monotonic()
    proc = subprocess.run(cmd("train", "--config", str(examples / "paper32.toml")),
                          capture_output=True, text=True, timeout=60, env=env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chameleon train: error: memory: 32 local"),\
        proc.stderr
    assert "cluster.device is 'a100-80g'" in lines[0]
    assert "launched" not in proc.stdout
    assert time.monotonic() - start < 30


def test_resume_without_a_checkpoint_is_one_line(job: Path, tmp_path: Path) -> None:
    proc = subprocess.run(cmd("train", "--config", str(job), "--out", str(tmp_path),
                               "--resume"), capture_output=True, text=True, timeout=60,
                          env=env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--resume: no complete checkpoint" in lines[0]

