"""``chameleon train`` and ``chameleon worker`` end to end, in subprocesses."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import LAYOUT, TINY_MODEL, cmd, env

TINY_TOML = TINY_MODEL + LAYOUT + """
[recovery]
detect_s = 0.05
rebuild_s = 0.05

[train]
steps = 5
dtype = "float64"
timeout_s = 2.0
heartbeat_s = 0.1
"""



TOKEN = "a-test-token-of-enough-length"



@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_TOML)
    return path


def _train(tiny: Path, out: Path, *extra: str) -> dict:
    proc = subprocess.run(cmd("train", "--config", str(tiny), "--out", str(out), "--json",
                               *extra), capture_output=True, text=True, timeout=120, env=env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_train_kill_report_and_params(tiny: Path, tmp_path: Path) -> None:
    ref = _train(tiny, tmp_path / "ref")
    got = _train(tiny, tmp_path / "kill", "--fault", "rank=2,step=2,kind=kill,phase=backward",
                 "--policy", "reroute")
    assert len(got["loss"]) == len(got["step_s"]) == 5
    assert not ref["events"]
    (event,) = got["events"]
    assert event["strategy"] == "reroute"
    assert 0 <= event["detected_after_s"] < 1.0
    assert event["transition_s"] is not None
    assert (tmp_path / "kill" / "report.json").exists()
    a = torch.load(tmp_path / "ref" / "params.pt")
    b = torch.load(tmp_path / "kill" / "params.pt")
    assert sorted(a) == sorted(b) and all(k.startswith("layers.") for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-9


@pytest.mark.parametrize(("args", "message"), [
    (("--fault", "rank=7,step=1,kind=kill"), "rank 7 does not exist"),
    (("--workers", "2"), "needs 4 workers"),
    (("--policy", "nonsense"), "unknown policy"),
    (("--policy", "recycle"), "simulator baseline"),
])
def test_train_bad_input_one_line(tiny: Path, args: tuple[str, ...], message: str) -> None:
    proc = subprocess.run(cmd("train", "--config", str(tiny), *args), capture_output=True,
                          text=True, timeout=60, env=env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.parametrize(("trace", "message"), [
    ("time_s,event,target\n1.0,worker-fail\n2.0,end,\n", "trace row 1 (worker-fail at 1.0 s): "
     "needs a target"),
    ("time_s,event,target\n1.0,worker-fail,4\n2.0,end,\n", "worker 4 is outside the cluster"),
    ("when,what\n", "the first line must be the header"),
])
def test_train_bad_trace_one_line(tiny: Path, tmp_path: Path, trace: str, message: str) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(trace)
    proc = subprocess.run(cmd("train", "--config", str(tiny), "--trace", str(path)),
                          capture_output=True, text=True, timeout=60, env=env(),
                          cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--trace" in lines[0] and message in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()  # refused before a run directory is made


def test_worker_silent_coordinator_one_line() -> None:
    proc = subprocess.run(cmd("worker", "--coordinator", "127.0.0.1:1", "--connect-timeout", "1",
                               "--token", TOKEN),
                          capture_output=True, text=True, timeout=30, env=env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not answer" in lines[0]


TP2_TOML = TINY_MODEL + LAYOUT.replace("devices_per_node = 2", "devices_per_node = 4"
                                       ).replace("pp = 2", "pp = 2\ntp = 2") + """
[recovery]
detect_s = 0.05
rebuild_s = 0.05

[train]
steps = 5
dtype = "float64"
timeout_s = 6.0
heartbeat_s = 0.1
"""
"""The same 4 workers at tp 2 (design 4.11): 8 processes, deadlines a loaded host keeps."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_hosts_on_loopback_with_a_remote_kill_at_tp2(tiny: Path, tmp_path: Path) -> None:
    # "host" A: the coordinator and workers 0, 1; "host" B: `chameleon worker` with 2, 3.
    # Worker 3 (remote: the coordinator cannot see its process) is killed mid-step. Each
    # worker is 2 processes: `chameleon worker` starts them as one unit and ends the unit
    # when its rank 0 is killed; the coordinator finds the worker by its silence. (At tp 1
    # the same is tests/e2e/test_remote_netns.py's: every worker remote, one killed.)
    tiny.write_text(TP2_TOML)
    train = subprocess.Popen(cmd("train", "--config", str(tiny), "--workers", "2",
                                  "--remote-workers", "2", "--out", str(tmp_path / "run"),
                                  "--json", "--fault", "rank=3,step=2,kind=kill,phase=forward"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env(CHAMELEON_TOKEN=TOKEN))
    worker = None
    try:
        assert train.stderr is not None
        deadline = time.monotonic() + 60
        address = None
        while address is None and time.monotonic() < deadline:
            line = train.stderr.readline()
            if "listening on" in line:
                address = line.split("listening on ")[1].split(";")[0]
        assert address, "the coordinator never printed its address"
        worker = subprocess.Popen(cmd("worker", "--coordinator", address, "--num-workers", "2"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=env(CHAMELEON_TOKEN=TOKEN))
        out, err = train.communicate(timeout=120)
        assert train.returncode == 0, err[-3000:]
        report = json.loads(out)
        assert len(report["loss"]) == 5
        (event,) = report["events"]
        assert event["workers"] == [3]
        assert event["detected_after_s"] <= 6.0  # [train] timeout_s
        worker_out, _ = worker.communicate(timeout=30)
        assert "worker 2 started" in worker_out and "worker 3 started" in worker_out
        # the remote units trained exactly what one process does
        from chameleon_ft.runtime.workload.reference import train_reference
        from chameleon_ft.spec import load_config

        params = torch.load(tmp_path / "run" / "params.pt")
        reference = train_reference(load_config(tiny)).params
        assert max(float((params[k] - reference[k]).abs().max()) for k in reference) < 1e-9
    finally:
        for proc in (train, worker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_final_checkpoint_the_disk_refuses_exits_3_with_the_model(tiny: Path,
                                                                    tmp_path: Path) -> None:
    """The checkpoint folder refuses the final checkpoint: params.pt is written from the
    copy uploaded into the run folder, and the exit status says so (3)."""
    out = tmp_path / "run"
    proc = subprocess.run(cmd("train", "--config", str(tiny), "--out", str(out), "--json",
                              "--fault", "rank=1,step=4,kind=disk-full,phase=checkpoint"),
                          capture_output=True, text=True, timeout=120, env=env())
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("chameleon train: trained 5 steps and wrote params.pt, but the "
                           "checkpoint folder refused the final checkpoint"), last
    report = json.loads(proc.stdout)
    assert report["final_state"] == "final-state" and report["failed"] is None
    assert [d["step"] for d in report["dropped_checkpoints"]] == [5]
    assert (out / "params.pt").is_file() and (out / "final-state" / "step00000005").is_dir()
