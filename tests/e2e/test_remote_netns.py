"""A job as a cluster deploys it: the coordinator alone on its host, every worker on
another host (a network namespace joined to this one by a veth pair), started the way
``srun`` or a Kubernetes Job starts them: with only ``MASTER_ADDR``, ``MASTER_PORT``,
``LOCAL_RANK`` and the token in their environment. A worker is killed mid-step; the run
recovers and ends where the plain single-process trainer does."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cli_helpers import LAYOUT, ROOT, TINY_MODEL, cmd, env
from procs import kill_groups

from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec import load_config

TOKEN = "a-test-token-of-enough-length"
STEPS = 5
JOB = TINY_MODEL + LAYOUT + f"""
[train]
steps = {STEPS}
dtype = "float64"
timeout_s = 2.0
heartbeat_s = 0.1
"""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10,
                          check=False)


@contextlib.contextmanager
def other_host() -> Iterator[tuple[str, str, str]]:
    """A network namespace reached over a veth pair: (namespace, this host's address on
    the link, the namespace's). Skips the test where namespaces cannot be made. Addresses
    come from 198.18.0.0/15 (reserved for network tests), one /30 per process id."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to make a network namespace")
    pid = os.getpid()
    ns, here, there = f"chm{pid}", f"chmh{pid}", f"chmw{pid}"
    base = (pid % 16384) * 4
    prefix = f"198.18.{base >> 8}."
    host_ip, ns_ip = f"{prefix}{(base & 255) + 1}", f"{prefix}{(base & 255) + 2}"
    made = _ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here: {made.stderr.strip()}")
    try:
        steps = [("link", "add", here, "type", "veth", "peer", "name", there),
                 ("link", "set", there, "netns", ns),
                 ("addr", "add", f"{host_ip}/30", "dev", here),
                 ("link", "set", here, "up"),
                 ("netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", there),
                 ("netns", "exec", ns, "ip", "link", "set", there, "up"),
                 ("netns", "exec", ns, "ip", "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"`ip {' '.join(step)}` is not permitted here: "
                            f"{done.stderr.strip()}")
        yield ns, host_ip, ns_ip
    finally:
        _ip("link", "del", here)  # takes its peer in the namespace with it
        _ip("netns", "del", ns)


def _launcher_env(master: str, port: int, local_rank: int) -> dict[str, str]:
    """What a cluster's launcher gives a task, and only that (plus what runs Python)."""
    return {"MASTER_ADDR": master, "MASTER_PORT": str(port), "LOCAL_RANK": str(local_rank),
            "CHAMELEON_TOKEN": TOKEN, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def _address(proc: subprocess.Popen[str], timeout_s: float) -> tuple[str, int]:
    """The ``HOST:PORT`` the coordinator announced on stderr."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        found = re.search(r"listening on (\S+):(\d+);", line)
        if found:
            return found.group(1), int(found.group(2))
    raise AssertionError("the coordinator never announced its address")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_worker_remote_joins_from_launcher_variables_and_recovers(tmp_path: Path
                                                                        ) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    procs: list[subprocess.Popen[str]] = []
    with other_host() as (ns, host_ip, _ns_ip):
        try:
            train = subprocess.Popen(
                cmd("train", "--config", str(job), "--remote-workers", "4", "--host", host_ip,
                    "--port", "0", "--out", str(tmp_path / "run"), "--json",
                    "--fault", "rank=3,step=2,kind=kill,phase=backward"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                env=env(CHAMELEON_TOKEN=TOKEN), start_new_session=True)
            procs.append(train)
            master, port = _address(train, 90)
            assert master == host_ip  # it listens on the link, not on loopback
            # two tasks of two workers each, started as srun starts tasks: launcher
            # variables only, no flag naming the coordinator or the token
            for local_rank in range(2):
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, *cmd("worker", "--num-workers", "2")],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                    env=_launcher_env(master, port, local_rank), start_new_session=True))
            out, err = train.communicate(timeout=180)
            assert train.returncode == 0, err[-4000:]
            outputs = [p.communicate(timeout=60)[0] for p in procs[1:]]
        finally:
            kill_groups(*procs)
    report = json.loads(out)
    assert len(report["loss"]) == STEPS
    (event,) = report["events"]
    assert event["workers"] == [3] and event["strategy"] and event["transition_s"] is not None
    # the coordinator sees no remote process: the kill is found by silence, in time
    assert event["detected_after_s"] <= 2.0  # [train] timeout_s
    started = sorted(int(w) for text in outputs
                     for w in re.findall(r"worker (\d+) started .* reachable at 198\.18\.", text))
    assert started == [0, 1, 2, 3], outputs
    # the task whose worker was killed says so in its status; the other ends cleanly
    assert sorted(p.returncode for p in procs[1:]) == [0, 1], outputs
    reference = train_reference(load_config(job), steps=STEPS, dtype=torch.float64)
    got = torch.load(tmp_path / "run" / "params.pt")
    assert sorted(got) == sorted(reference.params)
    assert max(float((got[k] - reference.params[k]).abs().max()) for k in got) < 1e-9
