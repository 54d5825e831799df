"""A job with warm spares, as the coordinator prepares it (no process started)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

from chameleon_ft.runtime.coordinator.setup import prepare
from chameleon_ft.spec.config import config_from_mapping
from chameleon_ft.spec.train import parse_fault

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from dist_harness import TINY


def _config(**recovery: object) -> object:
    doc = copy.deepcopy(TINY)
    doc["cluster"]["spare_nodes"] = 1
    doc["recovery"].update(recovery)
    return config_from_mapping(doc)


def test_the_fleet_is_the_layout_and_its_spares(tmp_path: Path) -> None:
    job = prepare(_config(), out_dir=tmp_path, check_resources=False)
    assert (job.num_workers, job.num_local) == (6, 6)
    assert set(job.plan0.workers) == {0, 1, 2, 3}  # the spares start idle
    with pytest.raises(ValueError, match=r"7 local workers for a fleet of 6 \(4 in the "
                                         r"layout, 2 spares\)"):
        prepare(_config(), out_dir=tmp_path, num_local_workers=7, check_resources=False)
    # a fault may name a spare (the trace's hardware failures hit them too)
    job = prepare(_config(), out_dir=tmp_path, check_resources=False,
                  faults=[parse_fault("rank=5,step=1,kind=kill")])
    assert [f.rank for f in job.faults] == [5]


def test_memory_checkpoints_are_planned_at_the_runtime_cadence(tmp_path: Path) -> None:
    """The runtime copies each checkpoint into a peer's memory as it writes it: its planner
    prices reloads from memory at the checkpoints' cadence, and none at all where there
    is nothing to copy (no periodic checkpoints) or nowhere to hold it (one node)."""
    job = prepare(_config(memory_checkpoint=True), out_dir=tmp_path, check_resources=False)
    assert job.config.recovery.memory_checkpoint is True
    assert job.config.recovery.memory_checkpoint_every == 2  # TINY's checkpoint_every
    assert any("every 2 steps" in note for note in job.notes)
    doc = copy.deepcopy(TINY)
    doc["recovery"]["memory_checkpoint"] = True
    doc["train"]["checkpoint_every"] = 0
    job = prepare(config_from_mapping(doc), out_dir=tmp_path, check_resources=False)
    assert job.config.recovery.memory_checkpoint is False
    assert any("checkpoint_every = 0" in note for note in job.notes)
    doc = copy.deepcopy(TINY)
    doc["recovery"]["memory_checkpoint"] = True
    doc["cluster"].update(num_nodes=1, devices_per_node=4)
    job = prepare(config_from_mapping(doc), out_dir=tmp_path, check_resources=False)
    assert job.config.recovery.memory_checkpoint is False
    assert any("single node" in note for note in job.notes)
