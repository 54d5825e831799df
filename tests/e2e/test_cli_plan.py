"""``chameleon plan`` end to end, in a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import chameleon, paper32_with_spares


def test_plan_json() -> None:
    result = chameleon("plan", "--config", "examples/paper32.toml", "--fail", "5",
                       "--horizon-s", "36000", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["decision"]["strategy"] in {"recycle", "dynamic", "restart", "shrink",
                                           "reroute-then-dynamic"}
    assert doc["spare_workers"] == []
    assert doc["decision"]["reason"]
    strategies = [c["strategy"] for c in doc["candidates"]]
    # paper32 can defer weight gradients: Chameleon reroutes the ReCycle way
    assert strategies == ["recycle", "dynamic", "restart", "shrink", "swap",
                          "reroute-then-dynamic"]
    for c in doc["candidates"]:
        for key in ("feasible", "step_s", "throughput_samples_s", "transition_s", "score",
                    "peak_memory_bytes", "terms"):
            assert key in c
        if c["feasible"]:
            assert abs(sum(c["terms"].values()) - c["transition_s"]) <= 1e-6 * c["transition_s"]
    by = {c["strategy"]: c for c in doc["candidates"]}
    rebuild = {"detect_s", "comm_s", "build_s", "warmup_s", "lost_step_s"}
    assert rebuild <= set(by["recycle"]["terms"])
    assert rebuild | {"migrate_s", "search_s"} <= set(by["dynamic"]["terms"])
    assert {"restart_s", "load_s", "lost_s"} <= set(by["restart"]["terms"])
    assert {"comm_s", "warmup_s"} <= set(by["reroute-then-dynamic"]["switch_terms"])
    assert not by["swap"]["feasible"] and "0 worker(s) idle" in by["swap"]["reason"]
    chosen = next(c for c in doc["candidates"] if c["strategy"] == doc["decision"]["strategy"])
    assert chosen["score"] == max(c["score"] for c in doc["candidates"])
    free = doc["failure_free"]
    assert free["step_s"] > 0 and free["throughput_samples_s"] > 0
    assert chosen["throughput_samples_s"] >= 0.94 * free["throughput_samples_s"]
    assert doc["search_s"] >= 0


def test_plan_table_and_fixed_policy() -> None:
    result = chameleon("plan", "--config", "examples/paper32.toml", "--fail", "5,6",
                       "--policy", "reroute", "--node-mtbf-hours", "100")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "* reroute" in out
    assert "decision: reroute" in out
    for name in ("recycle", "dynamic", "restart", "shrink", "reroute-then-dynamic"):
        assert name in out
    # every feasible candidate's transition terms, and the chosen one's
    assert "transition terms (s):" in out
    assert "  dynamic: detect_s 30 s, comm_s" in out
    assert "transition: detect_s 30 s, comm_s" in out


def test_plan_bad_input_is_one_line_exit_2() -> None:
    for args, field in ((["--fail", "99"], "--fail"), (["--fail", "5", "--horizon-s", "-1"],
                                                       "--horizon-s")):
        result = chameleon("plan", "--config", "examples/paper32.toml", *args)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and field in lines[0], result.stderr
        assert "Traceback" not in result.stderr


def test_plan_with_spare_nodes_swaps(tmp_path: Path) -> None:
    job = paper32_with_spares(tmp_path)
    # a whole node: stage 0 loses every replica; the spare node takes its place and every
    # worker reloads the checkpoint, without restarting the job's processes
    result = chameleon("plan", "--config", str(job), "--fail", "0,1,2,3,4,5,6,7", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["spare_workers"] == list(range(32, 40))
    by = {c["strategy"]: c for c in doc["candidates"]}
    assert by["swap"]["feasible"] and by["swap"]["rollback"] == "storage"
    assert {"detect_s", "comm_s", "build_s", "warmup_s", "load_s", "lost_s"} == set(
        by["swap"]["terms"])
    assert by["swap"]["transition_s"] < by["restart"]["transition_s"]
    assert doc["decision"]["strategy"] == "swap"
    workers = {w for p in doc["decision"]["plan"]["pipelines"] for w, _, _ in p["stages"]}
    assert workers == set(range(8, 40))
    # the table lists the swap with its terms
    table = chameleon("plan", "--config", str(job), "--fail", "5")
    assert table.returncode == 0, table.stderr
    assert "1 spare node(s) (8 idle workers)" in table.stdout
    assert "  swap: detect_s 30 s, comm_s" in table.stdout and "migrate_s" in table.stdout
