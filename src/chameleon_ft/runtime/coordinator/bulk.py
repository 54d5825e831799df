"""Bulk state the coordinator serves and receives over ``storage.blobs``: checkpoint shards
assembled into checkpoints, the state a restart reloads, the final state.

The blob server answers on its own threads; this handle holds what they share with the
coordinator's loop behind a lock. It decides nothing about the run: the control plane says
which checkpoints are accepted (``SaveCheckpoint``) and which timelines are abandoned
(``DropTimelines``); uploads of generations before the last (re)load are refused here by
the epoch the shell last told it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from chameleon_ft.runtime.storage.blobs import BlobError, BlobServer
from chameleon_ft.runtime.storage.checkpoint import (
    Assembly,
    CheckpointError,
    CheckpointStore,
    Manifest,
)


class FinalStateMissing(RuntimeError):
    """No holder of some layer uploaded its final state."""


class BulkState:
    """Checkpoint assemblies, reloads and the final state, over the blob channel."""

    def __init__(self, host: str, secret: bytes, ckpt: CheckpointStore, num_layers: int, *,
                 timeout_s: float) -> None:
        self.ckpt = ckpt
        self.num_layers = num_layers
        self.lock = threading.Lock()
        self.assemblies: dict[tuple[int, int], Assembly] = {}
        self.completed: queue.Queue[tuple[int, int]] = queue.Queue()
        self.finals: dict[int, bytes] = {}
        self.final_gen = -1
        self.final_step = -1
        self.epoch = 0
        """Uploads of generations before this one belong to an abandoned timeline."""
        self.server = BlobServer(host, secret, self.on_blob, timeout_s=timeout_s)

    @property
    def port(self) -> int:
        """The blob server's port."""
        return self.server.port

    def on_blob(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        """Answer a bulk request (on a server thread)."""
        try:
            op, kind = str(header["op"]), str(header["kind"])
            layer = int(header["layer"])
        except (KeyError, TypeError, ValueError):
            raise BlobError("malformed request") from None
        if not 0 <= layer < self.num_layers:
            raise BlobError(f"layer {layer} does not exist")
        if op == "put" and kind == "checkpoint":
            self._put_checkpoint(header, layer, payload)
            return {}, b""
        if op == "put" and kind == "final":
            self._put_final(header, layer, payload)
            return {}, b""
        if op == "get" and kind == "restore":
            try:
                return {}, self.ckpt.manifest(int(header["step"])).read_layer(layer)
            except CheckpointError as exc:
                raise BlobError(str(exc)) from None
        raise BlobError(f"unknown request {op} {kind}")

    def _put_checkpoint(self, header: dict[str, Any], layer: int, payload: bytes) -> None:
        step, gen = int(header["step"]), int(header["gen"])
        with self.lock:
            if gen < self.epoch:
                raise BlobError(f"checkpoint upload from generation {gen}, before the last "
                                f"restart (generation {self.epoch}): refused")
            key = (step, gen)
            if key not in self.assemblies:
                self.assemblies[key] = self.ckpt.begin(step, gen, self.num_layers)
            assembly = self.assemblies[key]
        if assembly.add(layer, payload):
            self.completed.put(key)

    def _put_final(self, header: dict[str, Any], layer: int, payload: bytes) -> None:
        with self.lock:
            if int(header["gen"]) != self.final_gen:
                raise BlobError("final upload for another generation")
            if int(header.get("held_step", -1)) != self.final_step:
                # a worker whose state is older than the run's (it missed a commit): its
                # copy would mix two steps into the final state
                raise BlobError(f"final upload of layer {layer} holds step "
                                f"{header.get('held_step')}, the run ends at {self.final_step}")
            self.finals.setdefault(layer, payload)

    def done(self) -> list[tuple[int, int]]:
        """Checkpoints whose every layer arrived since the last call: ``(step, gen)``."""
        out = []
        while True:
            try:
                out.append(self.completed.get_nowait())
            except queue.Empty:
                return out

    def save(self, step: int, gen: int, *, accepted: bool, plan: dict[str, Any],
             meta: dict[str, Any]) -> Manifest | None:
        """Commit (or discard) a complete assembly."""
        with self.lock:
            assembly = self.assemblies.pop((step, gen), None)
        if assembly is None:
            return None
        if not accepted:
            self.ckpt.discard(assembly)
            return None
        return self.ckpt.commit(assembly, plan=plan, meta=meta)

    def drop_before(self, epoch: int) -> None:
        """Discard assemblies of abandoned timelines; refuse their later uploads."""
        with self.lock:
            self.epoch = max(self.epoch, epoch)
            stale = [k for k in self.assemblies if k[1] < self.epoch]
            for key in stale:
                self.ckpt.discard(self.assemblies.pop(key))

    def expect_finals(self, gen: int, step: int) -> None:
        """The final generation is ``gen``; its uploads must hold ``step`` steps."""
        with self.lock:
            self.final_gen, self.final_step = gen, step

    def gather_finals(self, holders: Mapping[int, tuple[int, ...]],
                      gone: Callable[[int], bool], timeout_s: float) -> dict[int, bytes]:
        """Wait (bounded) for one holder of every layer to upload its final state.

        Raises:
            FinalStateMissing: when every holder of a layer is gone, or the time is up.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                have = dict(self.finals)
            missing = [i for i in range(self.num_layers) if i not in have]
            if not missing:
                return have
            lost = [i for i in missing if all(gone(w) for w in holders.get(i, ()))]
            if lost or time.monotonic() > deadline:
                raise FinalStateMissing(
                    f"layers {missing}: no holder uploaded its final state (holders "
                    f"{[list(holders.get(i, ())) for i in missing]})")
            time.sleep(0.002)

    def close(self) -> None:
        """Stop serving; discard checkpoints that will never complete."""
        try:
            self.server.close()
        finally:
            with self.lock:
                for assembly in self.assemblies.values():
                    self.ckpt.discard(assembly)
                self.assemblies.clear()
