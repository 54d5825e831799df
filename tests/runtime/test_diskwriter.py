"""The checkpoint writer process: a worker's snapshot goes to disk from a process of its own,
at the lowest CPU priority, with the same bytes as packing it in the worker."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chameleon_ft.runtime.signing import Signer
from chameleon_ft.runtime.storage import diskwriter
from chameleon_ft.runtime.storage.packing import pack, pack_parts
from chameleon_ft.runtime.worker.channel import Channel, Shared

pytestmark = pytest.mark.skipif(not diskwriter.supported(), reason="Linux only")


def _snapshot(layer: int = 3):
    from chameleon_ft.runtime.worker.checkpoints import HostBuffers
    from chameleon_ft.runtime.workload.optim import LayerTrainState

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2).to(torch.bfloat16))
    state = LayerTrainState.create(module, lambda p: torch.optim.AdamW(p, lr=0.1), None)
    module[0](torch.randn(3, 5)).sum().backward()
    state.optimizer.step()
    host = HostBuffers()
    return host, host.snapshot(layer, state)


def _write(writer: diskwriter.DiskWriter, host, tree, folder: Path, layer: int = 3):
    arena = host.arenas[layer]
    head, flats = pack_parts(tree)
    spans = [arena.span(f) for f in flats]
    assert all(s is not None for s in spans)  # every tensor lies in the shared memory
    return writer.write(folder, "layer.bin", head, spans, {arena.id: arena.fd})


def test_the_writer_process_writes_the_packed_bytes_at_the_lowest_priority(tmp_path) -> None:
    host, tree = _snapshot()
    writer = diskwriter.DiskWriter()
    try:
        size, digest = _write(writer, host, tree, tmp_path / "step")
        data = (tmp_path / "step" / "layer.bin").read_bytes()
        assert data == pack(tree)
        assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())
        assert os.getpriority(os.PRIO_PROCESS, writer.pid) == diskwriter.LOWEST_PRIORITY
        first = writer.pid
        size2, _ = _write(writer, host, tree, tmp_path / "again")  # the same process
        assert writer.pid == first and size2 == size
    finally:
        writer.close()
    assert writer.pid is None


def test_a_refused_write_is_an_error_and_the_writer_goes_on(tmp_path) -> None:
    host, tree = _snapshot()
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    writer = diskwriter.DiskWriter()
    try:
        with pytest.raises(OSError, match="file"):
            _write(writer, host, tree, blocked / "step")
        pid = writer.pid
        _write(writer, host, tree, tmp_path / "step")
        assert writer.pid == pid
        assert not list((tmp_path / "step").glob(".*tmp*"))  # no temporary file left
    finally:
        writer.close()


def test_a_writer_dying_mid_write_fails_that_write_and_the_next_starts_another(
        tmp_path) -> None:
    host, tree = _snapshot()
    writer = diskwriter.DiskWriter()
    try:
        _write(writer, host, tree, tmp_path / "a")
        dead = writer.pid
        os.kill(dead, signal.SIGSTOP)  # it takes the request and never answers
        failed: list[BaseException] = []

        def write() -> None:
            try:
                _write(writer, host, tree, tmp_path / "b")
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=write)
        thread.start()
        thread.join(0.3)
        assert thread.is_alive()  # waiting for the answer
        writer.kill()  # what a checkpoint past its deadline does
        thread.join(10)
        assert not thread.is_alive() and isinstance(failed[0], diskwriter.WriterGone)
        _write(writer, host, tree, tmp_path / "c")  # memory handed over again
        assert writer.pid not in (None, dead)
        assert (tmp_path / "c" / "layer.bin").read_bytes() == pack(tree)
        os.kill(writer.pid, signal.SIGKILL)  # found dead before a request: a new one, no error
        writer._proc.wait()
        _write(writer, host, tree, tmp_path / "d")
        assert (tmp_path / "d" / "layer.bin").read_bytes() == pack(tree)
    finally:
        writer.close()


def test_released_memory_is_forgotten_and_handed_over_again(tmp_path) -> None:
    host, tree = _snapshot()
    writer = diskwriter.DiskWriter()
    try:
        _write(writer, host, tree, tmp_path / "a")
        writer.forget({host.arenas[3].id})
        _write(writer, host, tree, tmp_path / "b")  # fails unless the memory is sent again
        assert (tmp_path / "b" / "layer.bin").read_bytes() == pack(tree)
    finally:
        writer.close()


def test_the_writer_exits_when_the_worker_closes_its_end(tmp_path) -> None:
    host, tree = _snapshot()
    writer = diskwriter.DiskWriter()
    _write(writer, host, tree, tmp_path)
    proc = writer._proc
    assert proc is not None
    writer.close()
    assert proc.returncode == 0


def test_without_shared_memory_the_worker_writes_the_same_file(tmp_path, monkeypatch) -> None:
    """Where the system refuses anonymous memory files, the snapshot is ordinary memory
    and the worker writes the file itself: the same bytes, reported the same way."""
    from chameleon_ft.runtime.worker.checkpoints import CheckpointIO

    def refuse(*_args: object) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "memfd_create", refuse)
    host, tree = _snapshot()
    assert host.arenas[3].fd is None
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    chan = Channel(store, Shared(Signer.private(), 0, "i0"))
    io = CheckpointIO(0, tmp_path, None, lambda: chan)  # type: ignore[arg-type]
    io.host = host
    assert io.write(4, 1, {3: tree})
    assert io.disk is None or io.disk.pid is None  # no writer process was needed
    written = next(tmp_path.glob(".partial-*/layer3.bin")).read_bytes()
    assert written == pack(tree)
    opened = chan.signed.peek("gen1/ckpt/4/layer/3")
    assert opened is not None
    doc = json.loads(opened.payload)
    assert doc["sha256"] == hashlib.sha256(written).hexdigest()
