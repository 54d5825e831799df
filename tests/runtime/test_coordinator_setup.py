"""The coordinator before it launches anything: deadlines derived from the plan, the
checks on a job file, and the bulk channel's refusals."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from chameleon_ft.runtime.coordinator.bulk import BulkState
from chameleon_ft.runtime.coordinator.setup import COLLECTIVE_FLOOR_S
from chameleon_ft.runtime.coordinator.shell import Coordinator
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
    job = _coord(tmp_path).job
    est = job.estimate_s(job.plan0)
    assert job.collective_deadline(job.plan0, None) == (max(COLLECTIVE_FLOOR_S, 10 * est), None)


def test_a_set_deadline_is_a_floor_that_slow_plans_raise(tmp_path: Path) -> None:
    job = _coord(tmp_path, collective_timeout_s=5.0).job
    assert job.collective_deadline(job.plan0, None) == (5.0, None)

    class SlowMigration:
        time_s = 2.0

    deadline, note = job.collective_deadline(job.plan0, SlowMigration())
    assert deadline > 20.0
    assert note is not None and "collective timeout raised" in note


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
    job = _coord(tmp_path).job
    bulk = BulkState("127.0.0.1", job.secret, job.ckpt, job.num_layers, timeout_s=5.0)
    try:
        _check_bulk(bulk)
    finally:
        bulk.close()


def _check_bulk(bulk: BulkState) -> None:
    for bad in ({}, {"op": "put", "kind": "checkpoint", "layer": "x"},
                {"op": "put", "kind": "checkpoint", "layer": 99},
                {"op": "get", "kind": "nothing", "layer": 0},
                {"op": "get", "kind": "restore", "layer": 0, "step": 5}):
        with pytest.raises(BlobError):
            bulk.on_blob(bad, b"")
    # an upload of a generation before the last restart is refused
    bulk.drop_before(3)
    with pytest.raises(BlobError, match="before the last restart"):
        bulk.on_blob({"op": "put", "kind": "checkpoint", "layer": 0, "step": 2, "gen": 1}, b"x")
    bulk.on_blob({"op": "put", "kind": "checkpoint", "layer": 0, "step": 2, "gen": 3}, b"x")
    assert (2, 3) in bulk.assemblies
    with pytest.raises(BlobError, match="another generation"):
        bulk.on_blob({"op": "put", "kind": "final", "layer": 0, "gen": 7}, b"x")
    # a final upload whose state is older than the run's end would mix two steps
    bulk.expect_finals(gen=7, step=12)
    with pytest.raises(BlobError, match="holds step 11, the run ends at 12"):
        bulk.on_blob({"op": "put", "kind": "final", "layer": 0, "gen": 7, "held_step": 11},
                     b"x")
    bulk.on_blob({"op": "put", "kind": "final", "layer": 0, "gen": 7, "held_step": 12}, b"y")
    assert bulk.finals == {0: b"y"}
