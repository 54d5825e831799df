"""A small chaos run in the suite (the benchmark, benchmarks/chaos.py, runs hundreds)."""

from __future__ import annotations

from pathlib import Path

import pytest
from events import failures

from chameleon_ft.runtime.chaos import ChaosHooks, check_run
from chameleon_ft.runtime.coordinator.shell import Coordinator
from chameleon_ft.spec.config import config_from_mapping

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _doc(steps: int) -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from chaos import chaos_doc

    return chaos_doc(4, steps)


def test_random_faults_in_one_run_are_survived_exactly(tmp_path: Path) -> None:
    steps, faults = 110, 6
    doc = _doc(steps)
    ref = Coordinator(config_from_mapping(doc), out_dir=tmp_path / "ref")
    assert not failures(ref.run())
    hooks = ChaosHooks(seed=3, budget=faults, last_step=steps - 25)
    coord = Coordinator(config_from_mapping(doc), out_dir=tmp_path / "chaos", hooks=hooks)
    report = coord.run()
    pids = list(coord.launched_pids)
    result = check_run(report, coord.params, ref.params, hooks, pids, steps)
    assert result["injected"] >= faults - 1, hooks.injected
    assert result["fired"] == result["injected"], report["faults"]
    assert result["exact"], result["max_diff"]
    assert result["steps_ok"] and result["lost_outside_restarts"] == 0
    assert result["events"] >= 3
