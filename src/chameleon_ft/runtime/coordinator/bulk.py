"""Checkpoints as the coordinator follows them: the layer files the workers report, the
manifest it writes, and the bulk channel for workers on hosts without the shared folder.

Workers write their layers themselves (``worker.checkpoints``) and report each file's size
and sha256 through the store; this handle gathers the reports of each checkpoint it
expects, notices failures and deadlines, and writes the manifest when the control plane
accepts the checkpoint. It never reads a layer file, except to serve a worker that does not
see the folder (``get restore``: one layer at a time, verified) or to write one such a
worker sends (``put checkpoint``). It decides nothing about the run: the control plane says
which checkpoints are accepted (``SaveCheckpoint``), dropped (``DropCheckpoint``) and which
timelines are abandoned (``DropTimelines``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.runtime.deadlines import Deadline
from chameleon_ft.runtime.protocol import ControlStore
from chameleon_ft.runtime.storage.blobs import BlobError, BlobServer
from chameleon_ft.runtime.storage.checkpoint import (
    Assembly,
    CheckpointError,
    CheckpointStore,
    LayerFile,
    Manifest,
)


@dataclass
class Pending:
    """A checkpoint the coordinator expects: its assembly and its deadline."""

    assembly: Assembly
    deadline_s: float
    expected_s: float = 0.0
    """When the step it holds committed (run clock)."""
    written_s: float | None = None
    """When every layer file was reported (the control plane was told then)."""
    writers: dict[int, list[float]] = field(default_factory=dict)
    """Per worker: bytes written and seconds spent writing them."""
    assigned: dict[int, int] = field(default_factory=dict)
    """Layer -> the worker expected to write it (empty: not followed)."""

    @property
    def written(self) -> bool:
        """Every layer file was reported."""
        return self.written_s is not None

    def record(self) -> dict[str, Any]:
        """What the report says of this checkpoint's writing."""
        total = float(sum(size for _, size, _ in self.assembly.layers.values()))
        took = (self.written_s or self.expected_s) - self.expected_s
        return {"step": self.assembly.step, "gen": self.assembly.gen, "bytes": total,
                "committed_at_s": self.expected_s, "written_after_s": took,
                "workers": {str(w): {"bytes": b, "write_s": s}
                            for w, (b, s) in sorted(self.writers.items())}}


class BulkState:
    """The checkpoints being written, and the bulk channel."""

    def __init__(self, host: str, secret: bytes, ckpt: CheckpointStore, num_layers: int, *,
                 timeout_s: float, deadline: Deadline | None = None) -> None:
        self.ckpt = ckpt
        self.num_layers = num_layers
        self.lock = threading.Lock()
        self.pending: dict[tuple[int, int], Pending] = {}
        self.epoch = 0
        """Uploads of generations before this one belong to an abandoned timeline."""
        self.server = BlobServer(host, secret, self.on_blob, timeout_s=timeout_s,
                                 deadline=deadline)

    @property
    def port(self) -> int:
        """The blob server's port."""
        return self.server.port

    @property
    def assemblies(self) -> dict[tuple[int, int], Assembly]:
        """The checkpoints being written, by ``(step, gen)``."""
        with self.lock:
            return {k: v.assembly for k, v in self.pending.items()}

    def expect(self, step: int, gen: int, deadline_s: float, now_s: float = 0.0,
               assigned: dict[int, int] | None = None) -> None:
        """Generation ``gen`` writes the checkpoint after ``step`` steps, by ``deadline_s``
        (run clock); ``assigned`` says which worker writes each layer (a layer whose writer
        is gone fails the checkpoint at once instead of at its deadline)."""
        with self.lock:
            if (step, gen) not in self.pending:
                self.pending[(step, gen)] = Pending(
                    self.ckpt.begin(step, gen, self.num_layers), deadline_s, now_s,
                    assigned=dict(assigned or {}))

    def get(self, step: int, gen: int) -> Assembly | None:
        """The assembly of a checkpoint being written, if it is expected."""
        with self.lock:
            entry = self.pending.get((step, gen))
        return None if entry is None else entry.assembly

    def is_pending(self, step: int) -> bool:
        """Whether a checkpoint after ``step`` steps is being written."""
        with self.lock:
            return any(k[0] == step and not v.written for k, v in self.pending.items())

    def poll(self, store: ControlStore, now_s: float,
             gone: Callable[[int], bool] = lambda _w: False,
             ) -> tuple[list[tuple[int, int]], list[tuple[int, int, str]]]:
        """The checkpoints whose every layer is now written, and those that failed (a
        worker's disk refused, a layer's writer is gone, or the deadline passed):
        ``(step, gen[, reason])``."""
        written, failed = [], []
        with self.lock:
            pending = [(k, v) for k, v in self.pending.items() if not v.written]
        for (step, gen), entry in pending:
            why = store.checkpoint_failure(gen, step)
            if why is None and not entry.assembly.complete and \
                    store.checkpoint_progress(gen, step) > 0:
                for layer, doc in store.checkpoint_files(gen, step, self.num_layers).items():
                    if layer in entry.assembly.layers:
                        continue
                    held = doc.get("memory")
                    entry.assembly.report(layer, LayerFile(str(doc["file"]), int(doc["size"]),
                                                           str(doc["sha256"])),
                                          None if held is None else int(held))
                    share = entry.writers.setdefault(int(doc.get("worker", -1)), [0.0, 0.0])
                    share[0] += int(doc["size"])
                    share[1] += float(doc.get("write_s", 0.0))
            lost = sorted({w for layer, w in entry.assigned.items()
                           if layer not in entry.assembly.layers and gone(w)})
            if why is None and lost:
                why = f"worker(s) {lost} exited before writing their layers"
            if why is not None:
                failed.append((step, gen, why))
            elif entry.assembly.complete:
                entry.written_s = now_s
                written.append((step, gen))
            elif now_s > entry.deadline_s:
                failed.append((step, gen, f"not written within its deadline; "
                               f"{len(entry.assembly.layers)} of {self.num_layers} layers "
                               "were"))
        return written, failed

    def save(self, step: int, gen: int, *, accepted: bool, plan: dict[str, Any],
             meta: dict[str, Any],
             store: ControlStore) -> tuple[Manifest, dict[str, Any]] | None:
        """Write the manifest of a written checkpoint (or discard it); returns it with the
        record of its writing.

        Raises:
            OSError: when the disk refuses the manifest (the checkpoint is discarded).
        """
        with self.lock:
            entry = self.pending.pop((step, gen), None)
        store.forget_checkpoint(gen, step, self.num_layers)
        if entry is None:
            return None
        if not accepted:
            self.ckpt.discard(entry.assembly)
            return None
        try:
            return self.ckpt.commit(entry.assembly, plan=plan, meta=meta), entry.record()
        except (OSError, CheckpointError):
            self.ckpt.discard(entry.assembly)
            raise

    def drop(self, step: int, gen: int, store: ControlStore) -> None:
        """Discard a checkpoint that failed."""
        with self.lock:
            entry = self.pending.pop((step, gen), None)
        store.forget_checkpoint(gen, step, self.num_layers)
        if entry is not None:
            self.ckpt.discard(entry.assembly)

    def drop_before(self, epoch: int) -> None:
        """Discard checkpoints of abandoned timelines; refuse their later uploads."""
        with self.lock:
            self.epoch = max(self.epoch, epoch)
            stale = [k for k in self.pending if k[1] < self.epoch]
            entries = [self.pending.pop(k) for k in stale]
        for entry in entries:
            self.ckpt.discard(entry.assembly)

    # ------------------------------------------------------------------ the bulk channel
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
            entry = self.pending.get((step, gen))
        if entry is None:
            raise BlobError(f"no checkpoint after {step} steps is expected from generation "
                            f"{gen}")
        try:
            entry.assembly.add(layer, payload)
        except OSError as exc:
            raise BlobError(f"the coordinator could not write layer {layer}: "
                            f"{exc.strerror or exc}") from None

    def close(self) -> None:
        """Stop serving; discard checkpoints that will never complete."""
        try:
            self.server.close()
        finally:
            with self.lock:
                entries = list(self.pending.values())
                self.pending.clear()
            for entry in entries:
                self.ckpt.discard(entry.assembly)
