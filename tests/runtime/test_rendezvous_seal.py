"""Process groups meet through the sealing store (torch 2.13's gloo): what the rendezvous
writes is sealed, what it reads is opened, and a member waits past a stranger's values
(written before the real member came, or copied from another member's key) for the real
one."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.signing import Signer
from chameleon_ft.runtime.worker.channel import Channel, Shared
from chameleon_ft.runtime.worker.groups import make_group

TIMEOUT_S = 10.0


@pytest.mark.timeout(60)
def test_groups_meet_through_the_seal_and_wait_past_forged_values() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    signer = Signer.private()
    prefix = proto.hidden_prefix(proto.world_prefix(0), proto.rendezvous_tag(signer, 0, "s"))
    stranger = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    stranger.set(f"{prefix}/0/2", b"\x00an address of the stranger's")  # before rank 2
    groups: list[Any] = [None] * 3
    shared = [Shared(signer, r, f"i{r}") for r in range(3)]
    kept: list[Any] = []
    errors: list[BaseException] = []

    def build(rank: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                   timeout=timedelta(seconds=TIMEOUT_S))
            meet = Channel(client, shared[rank]).rendezvous(TIMEOUT_S)
            kept.append(meet)  # torch calls the store through this object
            groups[rank] = make_group(meet, prefix, rank, 3, backend="gloo",
                                      timeout_s=TIMEOUT_S, address="127.0.0.1")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    stranger.wait([f"{prefix}/0/0"], timedelta(seconds=TIMEOUT_S))
    # a member's own sealed value copied to another member's key
    stranger.set(f"{prefix}/0/2", stranger.get(f"{prefix}/0/0"))
    time.sleep(0.5)  # ranks 0 and 1 read rank 2's key meanwhile, and refuse it
    assert groups == [None] * 3, "a group formed without its third member"
    threads.append(threading.Thread(target=build, args=(2,)))
    threads[-1].start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    assert not errors, errors
    tensors = [torch.full((4,), float(r + 1)) for r in range(3)]
    works = [groups[r].allreduce([tensors[r]]) for r in range(3)]
    for work in works:
        work.wait()
    assert all(torch.equal(t, torch.full((4,), 6.0)) for t in tensors)
    refused = [s.refusals.counts().get("rendezvous", 0) for s in shared]
    assert refused[0] >= 1 and refused[1] >= 1 and refused[2] == 0, refused
