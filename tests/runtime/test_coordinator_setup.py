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
                {"op": "get", "kind": "restore", "layer": 0, "step": 5},
                {"op": "put", "kind": "checkpoint", "layer": 0, "step": 2, "gen": 3}):
            with pytest.raises(BlobError):
                bulk.on_blob(bad, b"")
    # an upload of a generation before the last restart is refused
    bulk.refuse_before(3)
    with pytest.raises(BlobError, match="before the last restart"):
        bulk.on_blob({"op": "put", "kind": "checkpoint", "layer": 0, "step": 2, "gen": 1}, b"x")
    bulk.expect(2, 3)
    bulk.on_blob({"op": "put", "kind": "checkpoint", "layer": 0, "step": 2, "gen": 3}, b"x")
    assert set(bulk.assemblies[(2, 3)].layers) == {0}


class _Reports:
    """What the workers reported through the store, for one checkpoint."""

    def __init__(self) -> None:
        self.files: dict[int, dict[str, Any]] = {}
        self.failure: str | None = None
        self.forgotten = 0

    def checkpoint_failure(self, gen: int, step: int) -> str | None:
        return self.failure

    def checkpoint_progress(self, gen: int, step: int) -> int:
        return len(self.files)

    def checkpoint_files(self, gen: int, step: int, num_layers: int,
                         tp: int = 1) -> dict[tuple[int, int | None], Any]:
        return {(layer, None): doc for layer, doc in self.files.items()}

    def forget_checkpoint(self, gen: int, step: int, num_layers: int, tp: int = 1) -> None:
        self.forgotten += 1


def test_checkpoints_layers_arrive_from_reports_or_a_refusal(tmp_path: Path) -> None:
    """The bulk handle says which layer files arrived and which worker's disk refused; the
    control plane decides completion, deadlines and dead writers."""
    from chameleon_ft.runtime.storage.checkpoint import write_layer

    job = _coord(tmp_path).job
    bulk = BulkState("127.0.0.1", job.secret, job.ckpt, job.num_layers, timeout_s=5.0)
    try:
        reports = _Reports()
        bulk.expect(4, 1)
        folder = bulk.get(4, 1).folder  # type: ignore[union-attr]
        for layer in range(job.num_layers - 1):
            f = write_layer(folder, f"layer{layer}.bin", lambda w: w(b"state"))
            reports.files[layer] = {"file": f.name, "size": f.size, "sha256": f.sha256}
        some = frozenset(range(job.num_layers - 1))
        assert bulk.poll(reports, now_s=1.0) == ([(4, 1, some)], [])  # type: ignore[arg-type]
        assert bulk.poll(reports, now_s=1.5) == ([], [])  # type: ignore[arg-type]  # no news
        last = job.num_layers - 1
        f = write_layer(folder, f"layer{last}.bin", lambda w: w(b"state"))
        reports.files[last] = {"file": f.name, "size": f.size, "sha256": f.sha256}
        every = frozenset(range(job.num_layers))
        assert bulk.poll(reports, now_s=2.0) == ([(4, 1, every)], [])  # type: ignore[arg-type]
        saved = bulk.save(4, 1, accepted=True, plan={}, meta={}, store=reports)  # type: ignore[arg-type]
        assert saved is not None and job.ckpt.steps() == [4]
        manifest, record = saved
        assert manifest.read_layer(0) == b"state"
        assert record["bytes"] == 5 * job.num_layers and record["written_after_s"] == 2.0
        # a worker's disk refused: that checkpoint fails, nothing of it stays
        bulk.expect(8, 1)
        reports.files, reports.failure = {}, "worker 2: No space left on device"
        assert bulk.poll(reports, now_s=3.0) == (  # type: ignore[arg-type]
            [], [(8, 1, "worker 2: No space left on device")])
        bulk.drop(8, 1, reports)  # type: ignore[arg-type]
        assert not bulk.get(8, 1) and job.ckpt.steps() == [4]
        # the final state uploaded into the run folder: only uploads count, and it is
        # written there, never among the checkpoints
        bulk.expect(12, 2, fallback=True)
        for layer in range(job.num_layers):
            bulk.on_blob({"op": "put", "kind": "checkpoint", "layer": layer, "step": 12,
                          "gen": 2}, b"final")
        assert bulk.poll(reports, now_s=3.0) == ([(12, 2, every)], [])  # type: ignore[arg-type]
        manifest, _ = bulk.save(12, 2, accepted=True, plan={}, meta={},  # type: ignore[misc]
                                store=reports)  # type: ignore[arg-type]
        assert manifest.folder == tmp_path / "final-state" / "step00000012"
        assert manifest.read_layer(1) == b"final" and job.ckpt.steps() == [4]
    finally:
        bulk.close()


def test_a_dropped_checkpoints_folder_a_late_writer_re_created_is_swept(tmp_path: Path) -> None:
    """Found on a 1 MiB checkpoint folder: two checkpoints in flight filled it, both were
    dropped, and a writer still busy when its checkpoint was discarded re-created the
    folder and wrote on; the space never came back and every later checkpoint failed too.
    A drop or a save now removes every partial folder but those still expected."""
    from chameleon_ft.runtime.storage.checkpoint import write_layer

    job = _coord(tmp_path).job
    bulk = BulkState("127.0.0.1", job.secret, job.ckpt, job.num_layers, timeout_s=5.0)
    try:
        reports = _Reports()
        bulk.expect(2, 0)
        bulk.expect(4, 0)
        dropped, expected = bulk.get(2, 0).folder, bulk.get(4, 0).folder  # type: ignore[union-attr]
        bulk.drop(2, 0, reports)  # type: ignore[arg-type]
        write_layer(dropped, "layer0.bin", lambda w: w(b"late"))  # the late writer
        write_layer(expected, "layer0.bin", lambda w: w(b"state"))
        assert dropped.exists()
        bulk.expect(6, 0)
        bulk.drop(6, 0, reports)  # type: ignore[arg-type]
        assert not dropped.exists() and (expected / "layer0.bin").exists()
        write_layer(dropped, "layer1.bin", lambda w: w(b"later"))
        reports.files = {0: {"file": "layer0.bin", "size": 5, "sha256": ""}}
        bulk.save(4, 0, accepted=False, plan={}, meta={}, store=reports)  # type: ignore[arg-type]
        assert not list(job.ckpt.root.glob(".partial-*"))
    finally:
        bulk.close()


def test_a_stop_while_every_worker_is_remote_and_none_joined_fails_cleanly(
        tmp_path: Path) -> None:
    # The coordinator alone on its host (all 4 workers remote), stopped (SIGTERM, as a
    # scheduler's preemption sends it) before any worker joined: the plan's ids have no
    # member yet, and the shell must not look for their heartbeats.
    import threading
    import time

    from chameleon_ft.runtime.coordinator.shell import WorkerFailure

    log: list[str] = []
    coord = Coordinator(config_from_mapping(DOC), out_dir=tmp_path, num_local_workers=0,
                        token="a-test-token-of-enough-length", log=log.append)

    def stop_once_joining() -> None:
        deadline = time.monotonic() + 60
        while not any("listening on" in line for line in log) and time.monotonic() < deadline:
            time.sleep(0.01)
        coord.signals.append("SIGTERM")

    stopper = threading.Thread(target=stop_once_joining, daemon=True)
    stopper.start()
    with pytest.raises(WorkerFailure, match="interrupted \\(SIGTERM\\) while workers were joining"):
        coord.run()
    stopper.join(5)
    assert "0 local workers, 4 to join" in "\n".join(log)
