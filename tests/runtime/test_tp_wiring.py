"""Tensor parallelism's wiring on the runtime (design 4.11), piece by piece and without a
run: a layer stored as shards and its manifest, the names of the planes' and the workers'
groups, each rank's device, the unit of a worker's processes (one failure ends them all,
a clean finish does not), the slots its processes watch each other by, what a rank that
is not the control-plane member writes, and which errors are communication failures."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.coordinator.effects import _groups
from chameleon_ft.runtime.coordinator.launcher import forkserver_context, start_unit
from chameleon_ft.runtime.placement import Place, device_index, rank_place
from chameleon_ft.runtime.signing import Signer, control_key
from chameleon_ft.runtime.storage.checkpoint import (
    CheckpointError,
    CheckpointStore,
    LayerFile,
    layer_file_name,
)
from chameleon_ft.runtime.worker import exits
from chameleon_ft.runtime.worker.channel import Channel, Shared
from chameleon_ft.runtime.worker.comm import CommError, comm_failure
from chameleon_ft.runtime.worker.unit import UnitBeats, UnitWatch

# ---------------------------------------------------------------- shards on disk


def _sharded(store: CheckpointStore, step: int, degree: int) -> Any:
    """A checkpoint of two layers: layer 0 whole, layer 1 as ``degree`` shards."""
    assembly = store.begin(step, 0, 2)
    assert not assembly.add(0, b"whole")
    for rank in range(degree):
        done = assembly.add(1, f"shard {rank}".encode(), (rank, degree))
        assert done == (rank == degree - 1)  # complete with its last shard only
    return store.commit(assembly, plan={}, meta={})


def test_a_layer_stored_as_shards_is_read_by_its_degree(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    manifest = _sharded(store, 2, degree=2)
    doc = json.loads((manifest.folder / "manifest.json").read_text())
    assert doc["layers"]["0"]["file"] == "layer0.bin"  # a whole layer as before
    assert doc["layers"]["1"]["degree"] == 2
    assert [s["file"] for s in doc["layers"]["1"]["shards"]] == [
        layer_file_name(1, (0, 2)), layer_file_name(1, (1, 2))] == [
        "layer1.tp0of2.bin", "layer1.tp1of2.bin"]
    again = store.latest()
    assert again is not None and again.degree(1) == 2 and again.degree(0) == 1
    assert again.read_parts(1, (1, 2)) == [b"shard 1"]  # its own shard at its degree
    assert again.read_parts(1, (0, 4)) == [b"shard 0", b"shard 1"]  # every file to join
    assert again.read_parts(1) == [b"shard 0", b"shard 1"]  # a tp-1 reader
    assert again.read_parts(0, (1, 2)) == [b"whole"]  # a whole layer, split by the reader
    with pytest.raises(CheckpointError, match="2 shards"):
        again.read_layer(1)


def test_shards_of_two_degrees_or_a_missing_shard_never_complete(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    assembly = store.begin(4, 1, 1)
    assembly.report(0, LayerFile("a", 1, "x"), shard=(0, 2))
    with pytest.raises(CheckpointError, match="a shard of 4"):
        assembly.report(0, LayerFile("b", 1, "y"), shard=(1, 4))
    with pytest.raises(CheckpointError, match="shard 2 of 2"):
        assembly.report(0, LayerFile("b", 1, "y"), shard=(2, 2))
    assert not assembly.complete and assembly.layers == {}
    with pytest.raises(CheckpointError, match="missing"):
        store.commit(assembly, plan={}, meta={})


def test_a_damaged_shard_fails_its_layer(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    manifest = _sharded(store, 2, degree=2)
    (manifest.folder / "layer1.tp1of2.bin").write_bytes(b"SHARD 1")
    assert store.manifest(2).read_parts(1, (0, 2)) == [b"shard 0"]
    with pytest.raises(CheckpointError, match="sha256"):
        store.manifest(2).read_parts(1, (1, 2))


def test_shards_travel_the_bulk_channel(tmp_path: Path) -> None:
    """A worker without the shared folder uploads its shard (``put`` with ``shard``) and
    fetches the files it needs by ``index``; the coordinator writes and serves them."""
    from chameleon_ft.runtime.coordinator.bulk import BulkState
    from chameleon_ft.runtime.storage.blobs import BlobError

    store = CheckpointStore(tmp_path, keep=2)
    bulk = BulkState("127.0.0.1", b"s" * 32, store, 1, timeout_s=5.0, tp=2)
    try:
        bulk.expect(2, 0)
        put = {"op": "put", "kind": "checkpoint", "layer": 0, "step": 2, "gen": 0}
        for rank in (1, 0):
            bulk.on_blob({**put, "shard": [rank, 2]}, f"shard {rank}".encode())
        assembly = bulk.get(2, 0)
        assert assembly is not None and assembly.complete
        assert [f for f, _, _ in assembly.layers[0]] == ["layer0.tp0of2.bin",
                                                         "layer0.tp1of2.bin"]
        store.commit(assembly, plan={}, meta={})
        get = {"op": "get", "kind": "restore", "layer": 0, "step": 2}
        assert bulk.on_blob({**get, "index": 1}, b"") == ({"files": 2}, b"shard 1")
        with pytest.raises(BlobError, match="no file 2"):
            bulk.on_blob({**get, "index": 2}, b"")
        with pytest.raises(BlobError, match="malformed shard"):
            bulk.expect(4, 0)
            bulk.on_blob({**put, "step": 4, "shard": [3, 2]}, b"x")
    finally:
        bulk.close()


class _Files:
    """The bulk channel as a worker sees it, over a layer stored as ``files``."""

    def __init__(self, files: list[bytes]) -> None:
        self.files, self.asked = files, []

    def request(self, header: dict[str, Any], payload: bytes = b"") -> tuple[Any, bytes]:
        self.asked.append(header["index"])
        return {"files": len(self.files)}, self.files[header["index"]]


@pytest.mark.parametrize(("stored", "shard", "asked", "got"), [
    (2, (1, 2), [0, 1], ["1"]),        # written at its degree: its own shard
    (2, (0, 2), [0], ["0"]),
    (1, (1, 2), [0], ["0"]),           # a whole layer: split by the reader
    (4, (1, 2), [0, 1, 2, 3], ["0", "1", "2", "3"]),  # another degree: every file
])
def test_a_worker_without_the_folder_fetches_what_its_degree_needs(
        stored: int, shard: tuple[int, int], asked: list[int], got: list[str]) -> None:
    from chameleon_ft.runtime.worker.checkpoints import CheckpointIO

    blobs = _Files([str(k).encode() for k in range(stored)])
    io = CheckpointIO(0, None, blobs, lambda: None, shard=shard)  # type: ignore[arg-type]
    assert io.read_parts(2, 0, 1) == [g.encode() for g in got]
    assert blobs.asked == asked


# ---------------------------------------------------------------- names and places


def test_planes_and_worker_groups_have_prefixes_of_their_own() -> None:
    assert proto.in_plane(proto.world_prefix(3), None) == "gen3/world/"
    assert proto.in_plane(proto.world_prefix(3), 1) == "gen3/plane1/world/"
    assert proto.in_plane(proto.bucket_prefix(3, (0, 2)), 0) == "gen3/plane0/bucket/0_2/"
    assert proto.tp_prefix(3, 5) == "gen3/tp5/"
    for prefix in ("gen3/plane1/world/x", "gen3/tp5/x"):
        assert proto.message_kind(prefix) == "rendezvous"
    assert proto.checkpoint_layer_key(3, 4, 1) == "gen3/ckpt/4/layer/1"
    assert proto.checkpoint_layer_key(3, 4, 1, 1) == "gen3/ckpt/4/layer/1/tp1"


def test_a_generation_retires_every_planes_groups_and_every_workers_group() -> None:
    rounds = [[[[0, 2], [0, 1]], [[1, 3], [2, 3]]]]
    directive: dict[str, Any] = {"ties": [], "norm": {"members": [0, 1, 2, 3], "clip": 1.0}}
    one = _groups(7, [0, 1, 2, 3], rounds, directive, tp=1)
    assert [p for p, _ in one] == ["gen7/world/", "gen7/world-down/", "gen7/bucket/0_1_2_3/",
                                   "gen7/bucket/0_2/", "gen7/bucket/1_3/"]
    two = _groups(7, [0, 1, 2, 3], rounds, directive, tp=2)
    assert len(two) == 2 * len(one) + 4
    assert {(proto.in_plane(p, r), n) for p, n in one for r in (0, 1)} <= set(two)
    assert {(f"gen7/tp{w}/", 2) for w in range(4)} <= set(two)


def test_each_rank_of_a_worker_has_a_device_of_its_own() -> None:
    # 2 workers of tp 4 on a host of 8 GPUs; then a task that sees only its own 4
    devices = [device_index(rank_place(Place(w, task_index=w, task_workers=2), 4, r), 8,
                            "nccl") for w in range(2) for r in range(4)]
    assert devices == list(range(8))
    own = [device_index(rank_place(Place(5, task_index=0, task_workers=1), 4, r), 4, "nccl")
           for r in range(4)]
    assert own == [0, 1, 2, 3]
    assert rank_place(Place(3), 1, 0) == Place(3)


# ---------------------------------------------------------------- the unit


def _rank(*args: Any) -> None:
    """A rank of a test unit: ``args[9]`` is its rank; rank ``args[0]`` exits with status
    ``args[1]`` at once, the others sleep (the siblings exit 0 when ``args[2]``)."""
    rank = args[9]
    if rank == args[0]:
        os._exit(args[1])
    if args[2] and rank > 0:
        os._exit(0)
    time.sleep(60)


def _unit(failing: int, status: int, finish: bool = False) -> Any:
    ctx = forkserver_context()
    place = Place(0)
    return start_unit(ctx, _rank, (failing, status, finish, None, None, None, None), place,
                      (0,), tp=3, name="test-unit")


def _ended(unit: Any, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (code := unit.exitcode) is None:
        assert time.monotonic() < deadline, "the unit did not end"
        time.sleep(0.02)
    return int(code)


@pytest.mark.parametrize("failing", [0, 2])
def test_one_failed_process_ends_the_whole_unit(failing: int) -> None:
    unit = _unit(failing, 9)
    try:
        assert len(unit.pids) == 3 and unit.pid == unit.pids[0]
        assert _ended(unit) == 9  # the failed rank's status, once
        unit.join(10.0)
        assert not unit.is_alive()  # the others were killed by pid
    finally:
        unit.kill()
        unit.join(5.0)


def test_siblings_that_finish_cleanly_leave_rank_0_running() -> None:
    unit = _unit(-1, 0, finish=True)
    try:
        unit.procs[1].join(20.0)
        unit.procs[2].join(20.0)
        assert unit.exitcode is None and unit.procs[0].exitcode is None
        os.kill(unit.pid, signal.SIGKILL)
        assert _ended(unit) == -signal.SIGKILL
    finally:
        unit.kill()
        unit.join(5.0)


def _leaves_early(*args: Any) -> None:
    """A rank of a test unit: rank 0 leaves by ``exit_now`` with its slot's hook registered
    as ``worker_main`` registers it (a rank 0 that gave its coordinator up); the others
    sleep."""
    rank, beats = args[9], args[10]
    if rank == 0:
        exits.before_exit(UnitWatch(beats, rank, torch.device("cpu")).fail)
        exits.exit_now(exits.EXIT_COORDINATOR_GONE, "test: the coordinator is gone")
    time.sleep(60)


def test_a_rank_that_leaves_early_marks_its_slot_failed() -> None:
    unit = start_unit(forkserver_context(), _leaves_early, (None,) * 7, Place(0), (0,),
                      tp=2, name="test-unit")
    try:
        assert _ended(unit) == exits.EXIT_COORDINATOR_GONE
        # its siblings see it at once, not after the hang deadline's silence
        assert "failed" in (unit.beats.silent(0, 60.0, since=time.monotonic()) or "")
    finally:
        unit.kill()
        unit.join(5.0)


def test_the_slots_tell_a_silent_or_failed_rank() -> None:
    beats = UnitBeats.create(forkserver_context(), 2)
    now = time.monotonic()
    assert beats.silent(1, 0.5, since=now) is None  # never beat: counted from ``since``
    assert "silent" in (beats.silent(1, 0.5, since=now - 1.0) or "")
    beats.beat(1)
    assert beats.silent(1, 0.5, since=now - 10.0) is None
    beats.fail(1)
    beats.beat(1)  # a failed rank stays failed
    assert "failed" in (beats.silent(1, 0.5, since=now) or "")


def test_rank_0_learns_of_a_silent_sibling_within_the_deadline() -> None:
    beats = UnitBeats.create(forkserver_context(), 2)
    sibling = UnitWatch(beats, 1, torch.device("cpu"))
    sibling.start()
    stalled = threading.Event()
    sibling.arm(1.0, 1.0, lambda: not stalled.is_set(), lambda why: None)
    leader = UnitWatch(beats, 0, torch.device("cpu"))
    gone: list[tuple[str, float]] = []
    leader.start()
    leader.arm(1.0, 1.0, lambda: True, lambda why: gone.append((why, time.monotonic())))
    time.sleep(1.5)
    assert not gone  # the sibling beats
    stalled.set()  # its device stops completing work: it stops beating
    since = time.monotonic()
    deadline = since + 6.0
    while not gone and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(gone) == 1 and "rank 1" in gone[0][0]
    assert 0.9 < gone[0][1] - since < 3.0  # the 1 s deadline, and a loaded host's lag


def test_a_rank_that_is_not_the_member_writes_no_control_key() -> None:
    store = dist.HashStore()
    signer = Signer(control_key(b"k" * 32), "job")
    sibling = Channel(store, Shared(signer, 3, "inc", member=False, shard=1))
    sibling.register({"host": "h"})
    sibling.began(2)
    sibling.ready(2)
    sibling.reduced(2, 0)
    sibling.step_report(2, 0, [[0, 1.0]], {"f_s": []})
    sibling.beat(1)
    sibling.reattach("{}")  # the worker's re-attach report is rank 0's (design 4.1)
    sibling.probe(1, 1.5)  # and so is an idle slow worker's probe
    assert not sibling.report(2, proto.ErrorReport(3, True, None, "x"))
    assert store.num_keys() == 0
    sibling.layer_written(2, 4, 0, {"file": "f"})  # its own shard's report
    assert store.check([proto.checkpoint_layer_key(2, 4, 0, 1)])


def test_errors_of_a_tensor_parallel_collective_are_communication_failures() -> None:
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert isinstance(comm_failure(closed, broken=False), CommError)
    assert isinstance(comm_failure(RuntimeError("anything"), broken=True), CommError)
    assert comm_failure(RuntimeError("shape mismatch"), broken=False) is None
    assert comm_failure(ValueError("Connection closed"), broken=True) is None
