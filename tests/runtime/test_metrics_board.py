"""Per-step metrics: the global gradient norm and the learning rate from the workers'
reports, into metrics.jsonl, the progress line and (with the tensorboard package)
TensorBoard event files; without the package --tensorboard is one line."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from chameleon_ft.runtime.report.board import MISSING
from chameleon_ft.runtime.report.records import StepRecord, step_metrics
from chameleon_ft.runtime.report.run import RunReport


def _report(tmp_path: Path, lines: list[str], tensorboard: bool = False) -> RunReport:
    return RunReport(tmp_path, steps=3, start_step=0, tokens_per_step=64, log=lines.append,
                     log_every=None, resumed=False, tensorboard=tensorboard)


def test_the_norm_is_the_workers_shares_added_up() -> None:
    timings = [{"worker": 0, "grad_norm_sq": 9.0, "lr": 0.1, "f_s": [0.1]},
               {"worker": 1, "grad_norm_sq": 16.0, "lr": 0.1},
               {"worker": 2, "grad_norm_sq": 0.0, "lr": None}]
    norm, lr = step_metrics(timings)
    assert norm == pytest.approx(5.0) and lr == 0.1
    assert all("grad_norm_sq" not in t and "lr" not in t for t in timings)
    assert step_metrics([{"worker": 0}]) == (None, None)  # nothing reported


def test_metrics_lines_and_progress_carry_norm_and_rate(tmp_path: Path) -> None:
    lines: list[str] = []
    report = _report(tmp_path, lines)
    report.open()
    report.committed(StepRecord(0, 2.5, 0.5, 0, 1.0, 4, grad_norm=math.sqrt(2), lr=3e-4), [])
    metrics = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert metrics["grad_norm"] == pytest.approx(math.sqrt(2)) and metrics["lr"] == 3e-4
    assert "grad norm 1.414" in lines[-1]


def test_tensorboard_without_the_package_is_one_line(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ValueError) as info:
        _report(tmp_path, [], tensorboard=True)
    assert str(info.value) == MISSING and "\n" not in MISSING
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = _report(tmp_path, [], tensorboard=True)
    report.open()
    for step in range(3):
        report.committed(StepRecord(step, 3.0 - step, 0.5, 0, float(step), 4,
                                    grad_norm=1.0 + step, lr=1e-3), [])
    report.write({})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s",
            "train/step_s"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("train/loss")] == [3.0, 2.0, 1.0]
    assert [e.step for e in events.Scalars("train/grad_norm")] == [0, 1, 2]
