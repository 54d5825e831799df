"""``chameleon simulate`` end to end, in a subprocess, on a tiny uniform job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

JOB = """\
[cluster]
num_nodes = 2
devices_per_node = 4

[job]
pp = 2
dp = 4
global_batch = 16

[profile]
kind = "uniform"
num_layers = 8
fwd_s = 0.01
bwd_input_s = 0.01
bwd_weight_s = 0.01
param_bytes = 1e8
optimizer_bytes = 6e8
activation_bytes = 1e7
output_bytes = 1e6

[recovery]
detect_s = 10.0
rebuild_s = 5.0
restart_s = 100.0
checkpoint_load_s = 50.0
checkpoint_interval_s = 600.0
search_exhaustive_workers = 1
search_extra_stages = 0
"""


def chameleon(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chameleon_ft", "simulate", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)


def test_job_with_flags_writes_reports_and_trace_that_replays(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    out = tmp_path / "out"
    trace = tmp_path / "trace.csv"
    args = ("--job", str(job), "--days", "0.2", "--node-mtbf-hours", "3", "--repair-hours",
            "0.5", "--policies", "chameleon,reroute,bamboo,oracle", "--seed", "3")
    first = chameleon(*args, "--out", str(out), "--save-trace", str(trace), "--json")
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    names = [p["name"] for p in doc["policies"]]
    assert names == ["chameleon", "reroute", "bamboo", "oracle"]
    for policy in doc["policies"]:
        for key in ("avg_throughput_samples_s", "relative_to_failure_free", "time_lost_s",
                    "num_decisions", "decisions"):
            assert key in policy
        assert 0 < policy["relative_to_failure_free"] <= 1.0
    assert sorted(p.name for p in out.iterdir()) == ["relative.png", "report.json",
                                                     "report.md", "timeline.png"]
    assert (out / "report.json").read_text() == first.stdout
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "| chameleon |" in (out / "report.md").read_text()
    replay = chameleon(*args, "--trace", str(trace), "--json")
    assert replay.returncode == 0, replay.stderr
    assert replay.stdout == first.stdout


def test_spare_nodes_and_memory_checkpoints_from_the_flags(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    result = chameleon("--job", str(job), "--days", "0.25", "--node-mtbf-hours", "3",
                       "--repair-hours", "1", "--seed", "3", "--spare-nodes", "1",
                       "--memory-checkpoint", "--policies", "chameleon,swap,restart", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["job"]["spare_nodes"] == 1 and doc["job"]["memory_checkpoint"] is True
    by = {p["name"]: p for p in doc["policies"]}
    assert set(by) == {"chameleon", "swap", "restart"}
    assert by["swap"]["decisions"].get("swap", 0) > 0
    assert by["chameleon"]["relative_to_failure_free"] >= by["swap"][
        "relative_to_failure_free"] - 0.005


def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    bad_trace = tmp_path / "bad.csv"
    bad_trace.write_text("time_s,event,target\n10,node-fail,7\n100,end,\n")
    out = tmp_path / "out"
    cases = [
        (("--scenario", "nope"), "unknown scenario 'nope'"),
        (("--job", str(job), "--days", "1", "--policies", "chameleon,magic"),
         "unknown policy 'magic'"),
        (("--job", str(job), "--trace", str(bad_trace)), "node 7 is outside the cluster"),
        (("--job", str(job)), "--days"),
        (("--job", str(job), "--days", "1", "--spare-nodes", "-1"), "--spare-nodes"),
    ]
    for args, message in cases:
        result = chameleon(*args, "--out", str(out))
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not out.exists()
