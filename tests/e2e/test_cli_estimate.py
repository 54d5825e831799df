"""``chameleon estimate`` end to end, in a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import ROOT, chameleon, paper32_with_spares


def test_estimate_json_with_a_failure() -> None:
    result = chameleon("estimate", "--config", "examples/paper32.toml", "--fail", "5", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    for key in ("step_s", "throughput_samples_s", "bubble_fraction", "memory_fits",
                "peak_memory_bytes", "breakdown"):
        assert key in doc
        assert key in doc["rerouted"]
    assert doc["memory_fits"] is True
    assert 0 < doc["rerouted"]["gap"] < 0.2
    assert doc["rerouted"]["step_s"] > doc["step_s"]


def test_estimate_with_spare_nodes_prices_the_swapped_plan(tmp_path: Path) -> None:
    job = paper32_with_spares(tmp_path)
    result = chameleon("estimate", "--config", str(job), "--fail", "5", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    swapped = doc["swapped"]
    assert swapped["feasible"] and swapped["spares"] == [32]
    # the same layout: a swap is faster than rerouting, at most the failure-free speed
    assert doc["rerouted"]["gap"] > swapped["gap"] >= 0
    table = chameleon("estimate", "--config", str(job), "--fail", "5")
    assert "swapped (spares 32)" in table.stdout and "+ 1 spare node(s)" in table.stdout


def test_estimate_table() -> None:
    result = chameleon("estimate", "--config", "examples/llama3-405b-16k.toml")
    assert result.returncode == 0, result.stderr
    assert "failure-free" in result.stdout and "llama3-405b" in result.stdout


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text((ROOT / "examples/paper32.toml").read_text().replace("dp = 8", "dp = 7"))
    for args in (["--config", str(bad)],
                 ["--config", "examples/paper32.toml", "--fail", "99"],
                 ["--config", "examples/paper32.toml", "--fail", "x"],
                 ["--config", str(tmp_path / "none.toml")]):
        result = chameleon("estimate", *args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stdout == ""
