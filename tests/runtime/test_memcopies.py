"""Checkpoint copies in a peer's memory: who holds them, what a holder keeps, and that a
reload takes only bytes that match the manifest."""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from chameleon_ft.runtime.deadlines import Deadline
from chameleon_ft.runtime.signing import Signer, control_key
from chameleon_ft.runtime.worker.channel import Channel, Shared
from chameleon_ft.runtime.worker.memcopies import KEEP_STEPS, MemoryCopies, peer_of


def test_the_peer_is_the_next_worker_on_another_node() -> None:
    workers = [0, 1, 2, 3, 4, 5]  # two workers per node: nodes {0,1}, {2,3}, {4,5}
    assert [peer_of(w, workers, 2) for w in workers] == [2, 3, 4, 5, 0, 1]
    assert peer_of(1, [1, 4], 2) == 4  # only the running plan's workers hold copies
    assert peer_of(0, [0, 1, 5], 2) == 5  # the node's first when the same index is gone
    assert peer_of(5, [0, 1, 5], 2) == 1  # cyclically
    assert peer_of(0, [0, 1], 2) is None  # every one on its node: no copy


def test_a_holder_keeps_two_checkpoints_and_a_reload_checks_the_bytes() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    secret = b"s" * 32
    signer = Signer(control_key(secret), "job")

    def copies(worker: int) -> MemoryCopies:
        chan = Channel(store, Shared(signer, worker, f"i{worker}"))
        return MemoryCopies(worker, "127.0.0.1", secret, lambda: chan, Deadline(5.0, 0.1),
                            5.0)

    holder, writer = copies(2), copies(0)
    holder.start()
    try:
        for step in (2, 4):
            assert writer.send(2, step, 7, f"layer 7 after {step}".encode())
        pieces = [b"layer 7", memoryview(b" after 6")]  # sent piece by piece, held whole
        assert writer.send(2, 6, 7, pieces)
        assert sorted(holder.copies[7]) == [4, 6] and KEEP_STEPS == 2
        data = b"layer 7 after 6"
        digest = hashlib.sha256(data).hexdigest()
        assert writer.fetch(2, 6, 7, len(data), digest) == data
        assert writer.fetched == 1
        assert writer.fetch(2, 2, 7, len(data), digest) is None  # dropped: storage
        assert writer.fetch(2, 6, 7, len(data), "0" * 64) is None  # not the manifest's
        assert writer.fetch(2, 6, 8, len(data), digest) is None  # never held
        assert writer.fetched == 1
    finally:
        holder.close()
    assert writer.fetch(2, 6, 7, len(data), digest) is None  # the holder is gone
    assert not writer.send(2, 8, 7, b"x")
    assert writer.fetch(3, 6, 7, len(data), digest) is None  # a worker that never served
