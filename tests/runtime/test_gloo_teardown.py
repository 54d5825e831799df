"""The gloo behaviour recovery relies on, pinned with ranks as threads in one process.

A worker that gives up on a generation calls ``break_connections``: its peers' pending
operations on that generation's group must fail at once (not after the group timeout), and
a group of the next generation under a new store prefix must work.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.coordinator.store import ControlStore
from chameleon_ft.runtime.signing import Signer
from chameleon_ft.runtime.worker.channel import Channel, Shared
from chameleon_ft.runtime.worker.groups import break_connections, make_group

TIMEOUT_S = 5.0


def _groups(store: dist.TCPStore, prefix: str, size: int,
            signer: Signer | None = None) -> list[dist.ProcessGroup]:
    """``size`` ranks' groups under ``prefix`` (through the sealing rendezvous store with
    ``signer``)."""
    out: list[dist.ProcessGroup | None] = [None] * size
    kept = []

    def build(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                               timeout=timedelta(seconds=TIMEOUT_S))
        meet: dist.Store = client
        if signer is not None:
            meet = Channel(client, Shared(signer, rank, f"i{rank}")).rendezvous(TIMEOUT_S)
            kept.append(meet)
        out[rank] = make_group(meet, prefix, rank, size, backend="gloo",
                               timeout_s=TIMEOUT_S, address="127.0.0.1")

    threads = [threading.Thread(target=build, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    assert all(g is not None for g in out)
    return out  # type: ignore[return-value]


@pytest.mark.timeout(30)
def test_breaking_a_generation_releases_blocked_peers_at_once() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    g0 = _groups(store, "gen0/world/", 3)
    errors: dict[int, float] = {}

    def blocked(rank: int, src: int) -> None:
        start = time.monotonic()
        try:
            g0[rank].recv([torch.zeros(4)], src, 7).wait()
        except RuntimeError:
            errors[rank] = time.monotonic() - start

    # rank 1 waits on rank 2, rank 0 waits on rank 1: a chain like a pipeline's
    threads = [threading.Thread(target=blocked, args=(1, 2)),
               threading.Thread(target=blocked, args=(0, 1))]
    for t in threads:
        t.start()
    time.sleep(0.2)
    break_connections(g0[2], 2, 3)  # rank 2 gives up: rank 1 fails now
    threads[0].join(TIMEOUT_S)
    break_connections(g0[1], 1, 3)  # rank 1 reacts the same way: rank 0 fails now
    threads[1].join(TIMEOUT_S)
    assert sorted(errors) == [0, 1]
    assert max(errors.values()) < TIMEOUT_S / 2  # well before the group timeout

    g1 = _groups(store, "gen1/world/", 2)  # the survivors' next generation
    out = [torch.ones(3), torch.full((3,), 2.0)]
    works = [g1[r].allreduce([out[r]]) for r in range(2)]
    for w in works:
        w.wait()
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in out)


@pytest.mark.timeout(30)
def test_retiring_knows_the_keys_gloos_rendezvous_writes() -> None:
    """Retiring a generation deletes gloo's rendezvous keys by name: a torch whose layout
    differs must fail here, not leak keys in every generation of every run."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    control = ControlStore(store)
    before = store.num_keys()
    control.publish(7, {"action": "train", "world": [0, 1, 2]}, [(proto.world_prefix(7), 3)])
    directive = control.signed.peek(proto.directive_key(7))
    assert directive is not None
    salt = json.loads(directive.payload)["rendezvous"]
    prefix = proto.hidden_prefix(proto.world_prefix(7),
                                 proto.rendezvous_tag(control.signer, 7, salt))
    assert prefix.startswith(proto.world_prefix(7)) and prefix != proto.world_prefix(7)
    _groups(store, prefix, 3, control.signer)
    keys = proto.rendezvous_keys([(prefix, 3)])
    assert keys and store.check(keys)
    control.retire(7, 0, -1, [0, 1, 2])
    assert not any(store.check([k]) for k in keys)
    # what stays is the abort key of generation 6 and the current generation's number
    assert store.num_keys() - before == 2
