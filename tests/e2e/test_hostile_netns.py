"""A stranger on the job's network cannot steer it. The coordinator listens on a veth
link; from a network namespace on the other end, a client without the token forges every
message type of the protocol ahead of its real writer, replays a recorded join request
and recorded sealed values, and floods the counters and the join slots
(``hostile_client.py``). The run, with a worker killed and a glitch on the way, ends
equal to the plain single-process trainer, and the report counts each kind refused."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cli_helpers import LAYOUT, ROOT, TINY_MODEL, cmd, env
from procs import kill_groups
from test_remote_netns import _address, other_host

from chameleon_ft.runtime import auth
from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.signing import payload_of
from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec import load_config

TOKEN = "a-test-token-of-enough-length"
STEPS = 40
JOB = TINY_MODEL + LAYOUT + f"""
[train]
steps = {STEPS}
dtype = "float64"
timeout_s = 2.0
heartbeat_s = 0.1
checkpoint_every = 5
"""
MUST_REFUSE = ("directive", "verdict", "abort", "ready", "reduced", "error", "errors-count",
               "loss", "ckpt", "final", "faults-list", "faults-claim", "join-flood",
               "join-slot", "join-replay", "heartbeat")
"""Kinds whose forgeries some reader meets for sure (each is planted ahead of a read)."""


def _recorded_request(host: str, port: int) -> bytes:
    """A real join request, as a stranger on the wire would record it: the job is full,
    so the coordinator refuses it (and remembers its proof)."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    job = proto.JobInfo.from_json(payload_of(store.get(proto.JOB_KEY)))
    nonce = payload_of(store.get(proto.JOIN_NONCE_KEY)).decode()
    request = auth.JoinRequest(wnonce=auth.new_nonce(), proof="", job="", host="recorded",
                               address="198.18.0.77").proved(TOKEN, job.job_id, nonce)
    text = request.to_json().encode()
    index = store.add(proto.JOIN_SLOTS_KEY, 1) - 1
    store.set(proto.join_request_key(index), text)
    store.wait([proto.join_reply_key(request.wnonce)], timedelta(seconds=30))
    reply = auth.JoinReply.from_json(payload_of(store.get(proto.join_reply_key(request.wnonce))))
    assert not reply.ok and "workers" in reply.reason, reply
    return text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stranger_without_the_token_cannot_steer_the_run(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    procs: list[subprocess.Popen[str]] = []
    with other_host() as (ns, host_ip, _ns_ip):
        try:
            with socket.socket() as probe:  # a free port on the link, named to both
                probe.bind((host_ip, 0))
                port = probe.getsockname()[1]
            replay, done = tmp_path / "recorded.json", tmp_path / "stranger.json"
            stranger = subprocess.Popen(  # no token in its environment
                ["ip", "netns", "exec", ns, sys.executable,
                 str(ROOT / "tests" / "e2e" / "hostile_client.py"), host_ip, str(port),
                 "--replay", str(replay), "--out", str(done)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                env=env(), start_new_session=True)
            procs.append(stranger)
            train = subprocess.Popen(
                cmd("train", "--config", str(job), "--host", host_ip, "--port", str(port),
                    "--out", str(tmp_path / "run"), "--json", "--token", TOKEN,
                    "--fault", "rank=3,step=15,kind=kill,phase=backward",
                    "--fault", "rank=1,step=30,kind=glitch,phase=forward"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                env=env(), start_new_session=True)
            procs.append(train)
            assert _address(train, 90) == (host_ip, port)
            replay.write_bytes(_recorded_request(host_ip, port))
            out, err = train.communicate(timeout=240)
            stranger_out = stranger.communicate(timeout=60)[0]
        finally:
            kill_groups(*procs)
    assert train.returncode == 0, err[-6000:]
    did = json.loads(done.read_text()) if done.exists() else {}
    report = json.loads(out)
    refused = report["forgeries"]["total"]
    print("forgeries refused, by kind:", json.dumps(refused, sort_keys=True))
    missing = [kind for kind in MUST_REFUSE if not refused.get(kind)]
    assert not missing, (missing, report["forgeries"], did, stranger_out[-2000:])
    assert did.get("directive") and did.get("verdict") and did.get("join-replay"), did
    # the real failures were seen and recovered from; no forged one took anyone out
    assert [e["workers"] for e in report["events"] if not e["idle"]][:1] == [[3]]
    assert len(report["loss"]) == STEPS
    # refusals are bounded: the report lists at most a hundred join refusals, the log
    # has a line per source at most
    assert report["refused_total"] >= 40 and len(report["refused"]) <= 100
    refusal_lines = [line for line in err.splitlines() if "refused" in line]
    assert len(refusal_lines) <= 80, refusal_lines[-20:]
    reference = train_reference(load_config(job), steps=STEPS, dtype=torch.float64)
    got = torch.load(tmp_path / "run" / "params.pt")
    assert sorted(got) == sorted(reference.params)
    assert max(float((got[k] - reference.params[k]).abs().max()) for k in got) < 1e-9
