"""The coordinator before it launches anything: deadlines derived from the plan, the
checks on a job file, and the bulk channel's refusals."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.coordinator.shell import COLLECTIVE_FLOOR_S, Coordinator
from chameleon_ft.runtime.storage.blobs import BlobError
from chameleon_ft.spec.config import config_from_mapping

DOC: dict[str, Any] = {
    "model": {"name": "tiny", "num_blocks": 2, "hidden_size": 32, "num_heads": 2,
              "vocab_size": 256, "seq_len": 32},
    "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
    "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
    "train": {"steps": 6, "dtype": "float64"},
}


def _coord(tmp_path: Path, log: list[str] | None = None, **train: Any) -> Coordinator:
    doc = copy.deepcopy(DOC)
    doc["train"].update(train)
    return Coordinator(config_from_mapping(doc), out_dir=tmp_path,
                       log=(log.append if log is not None else None))


def test_collective_deadline_is_derived_from_the_plan(tmp_path: Path) -> None:
    coord = _coord(tmp_path)
    est = coord._estimate_s(coord.plan0)
    assert coord.collective_timeout_s(coord.plan0, None) == max(COLLECTIVE_FLOOR_S, 10 * est)


def test_a_set_deadline_is_a_floor_that_slow_plans_raise(tmp_path: Path) -> None:
    log: list[str] = []
    coord = _coord(tmp_path, log, collective_timeout_s=5.0)
    assert coord.collective_timeout_s(coord.plan0, None) == 5.0

    class SlowMigration:
        time_s = 2.0

    assert coord.collective_timeout_s(coord.plan0, SlowMigration()) > 20.0
    assert any("collective timeout raised" in line for line in log)


def test_a_deadline_shorter_than_a_healthy_step_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"train\.collective_timeout_s: .* less than twice"):
        _coord(tmp_path, collective_timeout_s=1e-6)


def test_hang_deadline_and_shorthand() -> None:
    doc = copy.deepcopy(DOC)
    doc["train"].update(timeout_s=4.0)
    train = config_from_mapping(doc).train
    assert train.hang_s == 4.0 and train.collective_floor_s == 4.0
    doc["train"].update(hang_timeout_s=1.5, heartbeat_s=0.1)
    assert config_from_mapping(doc).train.hang_s == 1.5
    doc["train"].update(hang_timeout_s=0.1)
    with pytest.raises(ValueError, match="heartbeat_s"):
        config_from_mapping(doc)


def test_a_short_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--token"):
        Coordinator(config_from_mapping(DOC), out_dir=tmp_path, token="short")


def test_bulk_requests_are_checked(tmp_path: Path) -> None:
    coord = _coord(tmp_path)
    for bad in ({}, {"op": "put", "kind": "checkpoint", "layer": "x"},
                {"op": "put", "kind": "checkpoint", "layer": 99},
                {"op": "get", "kind": "nothing", "layer": 0},
                {"op": "get", "kind": "restore", "layer": 0, "step": 5}):
        with pytest.raises(BlobError):
            coord._on_blob(bad, b"")
    # an upload of a generation before the last restart is refused
    coord.state = st.RunState(**{**vars(coord.state), "epoch": 3})
    with pytest.raises(BlobError, match="before the last restart"):
        coord._on_blob({"op": "put", "kind": "checkpoint", "layer": 0, "step": 2, "gen": 1},
                       b"x")
    coord._on_blob({"op": "put", "kind": "checkpoint", "layer": 0, "step": 2, "gen": 3}, b"x")
    assert (2, 3) in coord.assemblies
    with pytest.raises(BlobError, match="another generation"):
        coord._on_blob({"op": "put", "kind": "final", "layer": 0, "gen": 7}, b"x")
