"""Checkpoints as the coordinator follows them: the layer files the workers report, the
manifest it writes, and the bulk channel for workers on hosts without the shared folder.

Workers write their layers themselves (``worker.checkpoints``) and report each file's size
and sha256 through the store; this handle gathers the reports of each checkpoint the
control plane expects (``ExpectCheckpoint``), says which layers arrived and which worker's
disk refused, and writes the manifest when the control plane accepts the checkpoint. It
never reads a layer file, except to serve a worker that does not see the folder (``get
restore``: one layer at a time, verified) or to write one a worker sends (``put
checkpoint``: a worker without the folder, or the final state uploaded into the run folder
when the checkpoint folder refused it). It decides nothing about the run: the control
plane says which checkpoints are expected, complete (``SaveCheckpoint``), dropped
(``DropCheckpoint``; deadlines and writers that died are its to judge) and which timelines
are abandoned (``DropTimelines``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.runtime.coordinator.store import ControlStore
from chameleon_ft.runtime.deadlines import Deadline
from chameleon_ft.runtime.storage.blobs import BlobError, BlobServer
from chameleon_ft.runtime.storage.checkpoint import (
    Assembly,
    CheckpointError,
    CheckpointStore,
    LayerFile,
    Manifest,
)

FALLBACK_FOLDER = "final-state"
"""The run folder's subfolder that takes the final state when the checkpoint folder
refused it (written only then)."""


@dataclass
class Pending:
    """A checkpoint the coordinator expects: its assembly."""

    assembly: Assembly
    expected_s: float = 0.0
    """When the step it holds committed (run clock)."""
    written_s: float | None = None
    """When every layer file was reported (the control plane was told then)."""
    writers: dict[int, list[float]] = field(default_factory=dict)
    """Per worker: bytes written and seconds spent writing them."""
    reported: frozenset[int] = frozenset()
    """Layers the control plane was told of."""
    fallback: bool = False
    """The final state uploaded into the run folder (only uploads count)."""

    @property
    def written(self) -> bool:
        """Every layer file was reported."""
        return self.written_s is not None

    def record(self) -> dict[str, Any]:
        """What the report says of this checkpoint's writing."""
        total = float(sum(size for files in self.assembly.layers.values()
                          for _, size, _ in files))
        took = (self.written_s or self.expected_s) - self.expected_s
        return {"step": self.assembly.step, "gen": self.assembly.gen, "bytes": total,
                "committed_at_s": self.expected_s, "written_after_s": took,
                "workers": {str(w): {"bytes": b, "write_s": s}
                            for w, (b, s) in sorted(self.writers.items())}}


class BulkState:
    """The checkpoints being written, and the bulk channel."""

    def __init__(self, host: str, secret: bytes, ckpt: CheckpointStore, num_layers: int, *,
                 timeout_s: float, deadline: Deadline | None = None, tp: int = 1) -> None:
        self.ckpt = ckpt
        self.tp = tp
        """Processes per worker: at ``tp > 1`` each rank writes and reports its shard of
        a layer (design 4.11)."""
        self.fallback_ckpt: CheckpointStore | None = None
        """The run folder's store for the final state (made when first needed)."""
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

    def expect(self, step: int, gen: int, now_s: float = 0.0, *,
               fallback: bool = False) -> None:
        """Generation ``gen`` writes the checkpoint after ``step`` steps (``fallback``: the
        final state, uploaded into the run folder's ``final-state``)."""
        store = self.ckpt
        if fallback:
            if self.fallback_ckpt is None:
                self.fallback_ckpt = CheckpointStore(self.ckpt.root.parent, keep=1,
                                                     folder=FALLBACK_FOLDER)
            store = self.fallback_ckpt
        with self.lock:
            if (step, gen) not in self.pending:
                self.pending[(step, gen)] = Pending(
                    store.begin(step, gen, self.num_layers), now_s, fallback=fallback)

    def get(self, step: int, gen: int) -> Assembly | None:
        """The assembly of a checkpoint being written, if it is expected."""
        with self.lock:
            entry = self.pending.get((step, gen))
        return None if entry is None else entry.assembly

    def poll(self, store: ControlStore, now_s: float,
             ) -> tuple[list[tuple[int, int, frozenset[int]]], list[tuple[int, int, str]]]:
        """The expected checkpoints whose layers arrived since the last call, with every
        layer arrived so far, and those a worker could not write (its disk refused):
        ``(step, gen, layers | reason)``."""
        progress, failed = [], []
        with self.lock:
            pending = list(self.pending.items())
        for (step, gen), entry in pending:
            why = None if entry.fallback else store.checkpoint_failure(gen, step)
            if why is not None:
                failed.append((step, gen, why))
                continue
            if not entry.fallback and not entry.assembly.complete and \
                    store.checkpoint_progress(gen, step) > 0:
                self._gather(store, step, gen, entry)
            layers = frozenset(entry.assembly.layers)
            if layers != entry.reported:
                entry.reported = layers
                progress.append((step, gen, layers))
                if entry.assembly.complete and entry.written_s is None:
                    entry.written_s = now_s
        return progress, failed

    def _gather(self, store: ControlStore, step: int, gen: int, entry: Pending) -> None:
        """The layer files workers reported through the store."""
        done = entry.assembly.layers
        files = store.checkpoint_files(gen, step, self.num_layers, self.tp)
        for (layer, rank), doc in files.items():
            if layer in done:
                continue
            held = doc.get("memory")
            try:
                entry.assembly.report(layer, LayerFile(str(doc["file"]), int(doc["size"]),
                                                       str(doc["sha256"])),
                                      None if held is None else int(held),
                                      None if rank is None else (rank, self.tp))
            except CheckpointError:
                continue  # sealed by a worker, so never: the deadline drops it
            share = entry.writers.setdefault(int(doc.get("worker", -1)), [0.0, 0.0])
            share[0] += int(doc["size"])
            share[1] += float(doc.get("write_s", 0.0))

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
        store.forget_checkpoint(gen, step, self.num_layers, self.tp)
        if entry is None:
            return None
        target = self._store_of(entry)
        if not accepted:
            target.discard(entry.assembly)
            self.sweep()
            return None
        try:
            return target.commit(entry.assembly, plan=plan, meta=meta), entry.record()
        except (OSError, CheckpointError):
            target.discard(entry.assembly)
            raise
        finally:
            self.sweep()

    def drop(self, step: int, gen: int, store: ControlStore) -> None:
        """Discard a checkpoint that failed."""
        with self.lock:
            entry = self.pending.pop((step, gen), None)
        store.forget_checkpoint(gen, step, self.num_layers, self.tp)
        if entry is not None:
            self._store_of(entry).discard(entry.assembly)
            self.sweep()

    def sweep(self) -> None:
        """Remove the partial folders of checkpoints no longer expected, in both folders:
        a writer still busy when its checkpoint was discarded may have re-created the
        folder, and on a full disk that space must come back (called after every save or
        drop, and at the run's end once every worker left)."""
        for store in (self.ckpt, self.fallback_ckpt):
            if store is None:
                continue
            with self.lock:
                expected = [e.assembly.folder for e in self.pending.values()
                            if self._store_of(e) is store]
            store.sweep(expected)

    def _store_of(self, entry: Pending) -> CheckpointStore:
        return self.fallback_ckpt if entry.fallback and self.fallback_ckpt else self.ckpt

    def refuse_before(self, epoch: int) -> None:
        """Refuse uploads of generations before ``epoch`` (an abandoned timeline: the
        control plane drops its checkpoints)."""
        with self.lock:
            self.epoch = max(self.epoch, epoch)

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
            try:  # a whole layer's file, or (``index``) one of a sharded layer's files
                manifest = self.ckpt.manifest(int(header["step"]))
                index = int(header.get("index", 0))
                if not 0 <= index < manifest.degree(layer):
                    raise BlobError(f"layer {layer} has no file {index}")
                return {"files": manifest.degree(layer)}, manifest.read_file(layer, index)
            except (CheckpointError, TypeError, ValueError) as exc:
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
        shard = header.get("shard")
        try:
            entry.assembly.add(layer, payload, None if shard is None
                               else (int(shard[0]), int(shard[1])))
        except (TypeError, ValueError, IndexError, CheckpointError):
            raise BlobError(f"layer {layer}: malformed shard {shard!r}") from None
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
                self._store_of(entry).discard(entry.assembly)
