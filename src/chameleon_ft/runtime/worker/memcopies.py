"""Checkpoints in memory: each layer a worker writes to a checkpoint is also kept in the
host memory of a worker on another node, so a reload reads it from there, not from
storage, unless that worker died too (``[recovery] memory_checkpoint``; Gemini's idea).

Each worker serves the copies it holds on an authenticated bulk channel of its own
(``storage.blobs``; its address sealed in the store under ``memory_copies_key``, so a
stranger cannot send a writer's layers elsewhere). After writing
a layer's file, the writer sends the same bytes to its *peer*: the first worker of the
running plan on the next node, the one with its index there (``peer_of``). The layer's
report, and
so the manifest, names the peer (``memory``); a reload of that layer asks the peer first
and checks the bytes against the manifest's size and sha256, and reads the file when the
peer is gone, has no copy, or answers anything else. A copy that cannot be sent leaves
the checkpoint as it is (on storage only). A holder keeps the copies of the two newest
checkpoints of each layer (the newest may never complete; the one before is what a
reload then reads); a copy lives as long as its holder's process.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from chameleon_ft.runtime.deadlines import Deadline
from chameleon_ft.runtime.storage.blobs import BlobClient, BlobError, BlobServer, Payload

if TYPE_CHECKING:
    from chameleon_ft.runtime.worker.channel import Channel

KEEP_STEPS = 2
"""Checkpoints of each layer a holder keeps: the newest and the one before."""


def peer_of(worker: int, workers: Sequence[int], workers_per_node: int) -> int | None:
    """The worker that holds ``worker``'s copies: on the next node (cyclically, in id
    order) with a worker of ``workers``, the one with ``worker``'s index on its node, else
    that node's first; None when every one shares its node. A node's copies so spread
    over the next node's workers, one worker's each."""
    node, index = divmod(worker, workers_per_node)
    by_node: dict[int, list[int]] = {}
    for w in sorted(set(workers)):
        by_node.setdefault(w // workers_per_node, []).append(w)
    others = sorted(n for n in by_node if n != node)
    if not others:
        return None
    target = by_node[next((n for n in others if n > node), others[0])]
    return next((w for w in target if w % workers_per_node == index), target[0])


class MemoryCopies:
    """One worker's side: the copies it holds for others, and sending and fetching.

    Args:
        worker: this worker's id.
        address: the address other workers reach this one at (the server binds to it).
        secret: the job secret (every message is authenticated).
        store: makes a channel over a store connection, for the writer and restore threads.
        deadline: transfer deadlines by size.
        timeout_s: deadline of connecting and of a reply's header.
    """

    def __init__(self, worker: int, address: str, secret: bytes,
                 store: Callable[[], Channel], deadline: Deadline, timeout_s: float) -> None:
        self.worker, self.address, self.secret = worker, address, secret
        self._store_of = store
        self._store: Channel | None = None
        self.deadline, self.timeout_s = deadline, timeout_s
        self.copies: dict[int, dict[int, bytes]] = {}
        """Layer -> checkpoint step -> the packed bytes held for another worker."""
        self.lock = threading.Lock()
        self._store_lock = threading.Lock()
        """The store connection is shared by the writer thread and the training thread."""
        self.server: BlobServer | None = None
        self.fetched = 0
        """Layers this worker reloaded from a peer's memory."""

    def start(self) -> None:
        """Serve the copies and publish the address (once, before the first checkpoint)."""
        if self.server is not None:
            return
        self.server = BlobServer(self.address, self.secret, self._handle,
                                 timeout_s=self.timeout_s, deadline=self.deadline)
        with self._store_lock:
            self._client().serve_copies(self.address, self.server.port)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def _client(self) -> Channel:
        if self._store is None:
            self._store = self._store_of()
        return self._store

    def _handle(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        layer, step = int(header["layer"]), int(header["step"])
        with self.lock:
            if header.get("op") == "put":
                kept = self.copies.setdefault(layer, {})
                kept[step] = payload
                for old in sorted(kept)[:-KEEP_STEPS]:
                    del kept[old]
                return {}, b""
            data = self.copies.get(layer, {}).get(step)
        if data is None:
            raise BlobError(f"worker {self.worker} holds no copy of layer {layer} after "
                            f"{step} steps")
        return {}, data

    def _channel(self, holder: int) -> BlobClient:
        with self._store_lock:
            where = self._client().copies_of(holder)
        if where is None:  # never published (or refused): do not wait for it
            raise BlobError(f"worker {holder} serves no copies")
        host, port = where
        return BlobClient(str(host), int(port), self.secret, timeout_s=self.timeout_s,
                          attempts=1, deadline=self.deadline)

    def send(self, holder: int, step: int, layer: int, data: Payload) -> bool:
        """Give ``holder`` a copy of layer ``layer`` after ``step`` steps (its packed bytes,
        whole or in pieces); whether it took it (a failure only leaves the layer on
        storage)."""
        try:
            self._channel(holder).request({"op": "put", "layer": layer, "step": step}, data)
        except Exception:  # the copy is an extra: the checkpoint stands without it
            return False
        return True

    def fetch(self, holder: int, step: int, layer: int, size: int,
              sha256: str) -> bytes | None:
        """Layer ``layer`` after ``step`` steps from ``holder``'s memory, verified against
        the manifest's ``size`` and ``sha256``; None when it cannot be had."""
        try:
            _, data = self._channel(holder).request(
                {"op": "get", "layer": layer, "step": step}, max_reply_bytes=size)
        except Exception:  # gone, never had it, unreachable: storage has the layer
            return None
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            return None
        self.fetched += 1
        return data
