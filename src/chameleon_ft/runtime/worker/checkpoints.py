"""A worker's side of checkpoints: it writes its own layers, in the background, and reads
only the layers it restores, verifying each against the manifest.

At a checkpoint the worker takes a snapshot of the layers it writes (a copy in host
memory, taken at the commit, so training goes on at once), and a writer thread streams
each into the checkpoint's folder (``storage.checkpoint.write_layer``: a temporary name,
fsync, rename, the sha256 computed on the way) and reports the file, its size and digest
through the store; the coordinator writes the manifest when every layer is reported. The
next checkpoint waits for the previous one. A disk that refuses (full, read-only, failing)
is reported as that checkpoint's failure: the coordinator drops it and training goes on.

Each layer is written by one of its holders (spread over the replicas, so they share the
writing). A worker on a host that does not see the coordinator's checkpoint folder sends
the bytes over the authenticated bulk channel instead, and the coordinator writes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.deadlines import Deadline
from chameleon_ft.runtime.storage.blobs import BlobClient, BlobError
from chameleon_ft.runtime.storage.checkpoint import (
    JOB_MARKER,
    CheckpointError,
    LayerFile,
    Manifest,
    partial_dir,
    step_dir_name,
    write_layer,
)
from chameleon_ft.runtime.storage.packing import pack, pack_to
from chameleon_ft.runtime.workload.optim import LayerTrainState

LOWEST_PRIORITY = 19
"""The niceness of a checkpoint's writing (after its copy): training keeps its cores."""


class CorruptCheckpoint(RuntimeError):
    """A layer file of the checkpoint being loaded does not match its manifest."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


def shared_folder(root: str, job_id: str) -> Path | None:
    """The coordinator's checkpoint folder if this host sees it (its job marker holds this
    job's id), else None."""
    path = Path(root)
    with contextlib.suppress(OSError):
        if (path / JOB_MARKER).read_text().strip() == job_id:
            return path
    return None


def tree_bytes(tree: Any) -> int:
    """Bytes of the tensors in a state tree."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tree_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(tree_bytes(v) for v in tree)
    return 0


class _Copied:
    """A layer state already copied (its snapshot is itself)."""

    def __init__(self, tree: dict[str, Any]) -> None:
        self.tree = tree

    def state_tree(self) -> dict[str, Any]:
        return self.tree


class HostBuffers:
    """Host memory for the snapshots, kept from one checkpoint to the next.

    A fresh copy of a layer's state touches every page of new memory (page faults and
    zeroing on the step path's cores); the next checkpoint of the same layers copies into
    the same buffers instead. A buffer is reused only when the tensor it copies has its
    shape and dtype; layers the worker no longer writes are released. On a GPU the buffers
    are pinned, so the device-to-host copy runs at the link's speed. Only one checkpoint
    uses them at a time (the next one waits for the previous one's writing).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, tuple[Any, ...]], torch.Tensor] = {}

    def snapshot(self, layer: int, state: LayerTrainState | _Copied) -> dict[str, Any]:
        """A copy of ``state`` (layer ``layer``) in host memory, in reused buffers."""
        tree: dict[str, Any] = self._copy(layer, (), state.state_tree())
        return tree

    def keep_only(self, layers: set[int]) -> None:
        """Release the buffers of layers not in ``layers``."""
        self.buffers = {k: v for k, v in self.buffers.items() if k[0] in layers}

    def _copy(self, layer: int, path: tuple[Any, ...], value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = (layer, path)
            buf = self.buffers.get(key)
            if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                buf = torch.empty(value.shape, dtype=value.dtype, device="cpu",
                                  pin_memory=value.device.type == "cuda")
                self.buffers[key] = buf
            buf.copy_(value.detach())
            return buf
        if isinstance(value, dict):
            return {k: self._copy(layer, (*path, k), v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._copy(layer, (*path, i), v) for i, v in enumerate(value))
        return value


class CheckpointIO:
    """Writes and reads one worker's layers of the run's checkpoints.

    Args:
        worker: this worker's id.
        folder: the shared checkpoint folder, or None (send bytes over ``blobs``).
        blobs: the bulk channel to the coordinator.
        store: a store connection of its own for the writer thread.
    """

    def __init__(self, worker: int, folder: Path | None, blobs: BlobClient,
                 store: Callable[[], Any]) -> None:
        self.worker, self.folder, self.blobs = worker, folder, blobs
        self._store_of = store
        self._store: Any = None
        self.thread: threading.Thread | None = None
        self.copied = threading.Event()
        self.copied.set()
        self.pending_bytes = 0
        """Bytes of the checkpoint being written in the background."""
        self.manifests: dict[int, Manifest] = {}
        self.host = HostBuffers()

    # ------------------------------------------------------------------ writing
    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the checkpoint being written; returns whether it is done."""
        if self.thread is None:
            return True
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def finish(self, deadline: Deadline) -> bool:
        """Wait for the checkpoint being written, as long as its bytes allow."""
        return self.wait(deadline.for_bytes(self.pending_bytes))

    def snapshot_taken(self, timeout_s: float) -> bool:
        """Wait until the checkpoint being written has copied its layers (before the
        training thread changes them: the next optimizer step)."""
        return self.copied.wait(timeout_s)

    def write_async(self, step: int, gen: int, states: dict[int, LayerTrainState],
                    inject: OSError | None, deadline: Deadline) -> None:
        """Write ``states`` (the layers as committed after ``step`` steps) in the background,
        once the previous checkpoint is written (waiting as long as its bytes allow: a write
        still running then is reported as this one's failure).

        The writer thread first copies the layers into host memory (at normal priority,
        while the next step's forward and backward run: they do not change the state; the
        next optimizer step waits for the copy, :meth:`snapshot_taken`), then streams them
        to disk at the lowest CPU priority, so writing takes the cycles training leaves.
        """
        limit_s = deadline.for_bytes(self.pending_bytes)
        if not self.wait(limit_s):
            self._fail(gen, step, f"worker {self.worker}: the previous checkpoint was still "
                       f"being written after {limit_s:.0f} s")
            return
        self.copied = threading.Event()
        self.host.keep_only(set(states))
        if any(True for state in states.values() for _ in state.module.buffers()):
            # a forward may change buffers (batch norm's running statistics): copy now
            copies = {i: self.host.snapshot(i, state) for i, state in states.items()}
            states = {i: _Copied(tree) for i, tree in copies.items()}
        self.thread = threading.Thread(target=self._background,
                                       args=(step, gen, states, inject, self.copied),
                                       daemon=True, name=f"checkpoint-{step}")
        self.thread.start()

    def _background(self, step: int, gen: int, states: dict[int, Any],
                    inject: OSError | None, copied: threading.Event) -> None:
        try:
            layers = {i: state.tree if isinstance(state, _Copied)
                      else self.host.snapshot(i, state) for i, state in states.items()}
        finally:
            copied.set()
        self.pending_bytes = tree_bytes(layers)
        with contextlib.suppress(OSError, AttributeError):  # Linux: per-thread niceness
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        self.write(step, gen, layers, inject)

    def write(self, step: int, gen: int, layers: dict[int, dict[str, Any]],
              inject: OSError | None = None) -> bool:
        """Write ``layers`` now and report each; returns whether all were written."""
        try:
            for layer, tree in sorted(layers.items()):
                if inject is not None:
                    raise inject
                self._write_one(step, gen, layer, tree)
        except (OSError, BlobError) as exc:
            self._fail(gen, step, f"worker {self.worker}: {_describe(exc)}")
            return False
        return True

    def _write_one(self, step: int, gen: int, layer: int, tree: dict[str, Any]) -> None:
        if self.folder is None:  # no shared folder: the coordinator writes the bytes
            self.blobs.request({"op": "put", "kind": "checkpoint", "layer": layer,
                                "worker": self.worker, "step": step, "gen": gen}, pack(tree))
            return
        start = time.perf_counter()
        file = write_layer(partial_dir(self.folder, step, gen), f"layer{layer}.bin",
                           lambda write: pack_to(tree, write))
        self._report(gen, step, layer, file, time.perf_counter() - start)

    def _client(self) -> Any:
        if self._store is None:
            self._store = self._store_of()
        return self._store

    def _report(self, gen: int, step: int, layer: int, file: LayerFile,
                write_s: float) -> None:
        store = self._client()
        store.set(proto.checkpoint_layer_key(gen, step, layer), json.dumps(
            {"file": file.name, "size": file.size, "sha256": file.sha256,
             "worker": self.worker, "write_s": write_s}))
        store.add(proto.checkpoint_count_key(gen, step), 1)

    def _fail(self, gen: int, step: int, why: str) -> None:
        with contextlib.suppress(Exception):  # the coordinator's deadline covers a silence
            self._client().set(proto.checkpoint_failed_key(gen, step), why)

    # ------------------------------------------------------------------ reading
    def read(self, step: int, layer: int, gen: int) -> bytes:
        """Layer ``layer`` of the checkpoint after ``step`` steps, verified.

        Raises:
            CorruptCheckpoint: when the file does not match the manifest.
            BlobError: when the coordinator cannot send it (no shared folder).
        """
        if self.folder is None:
            try:
                _, data = self.blobs.request({"op": "get", "kind": "restore", "step": step,
                                              "layer": layer, "gen": gen})
            except BlobError as exc:
                if "corrupt" in str(exc) or "does not match" in str(exc):
                    raise CorruptCheckpoint(step, str(exc)) from None
                raise
            return data
        try:
            if step not in self.manifests:
                self.manifests[step] = Manifest.read(self.folder / step_dir_name(step))
            return self.manifests[step].read_layer(layer)
        except CheckpointError as exc:
            self.manifests.pop(step, None)
            raise CorruptCheckpoint(step, str(exc)) from None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return str(exc) or type(exc).__name__


def wait_final(store: Any, gen: int, worker: int, write: Callable[[list[int]], None],
               deadline_s: float, slice_s: float = 0.05) -> None:
    """After writing its share of the final checkpoint: write more layers when the
    coordinator asks (their first writer is gone), leave when it says the checkpoint is
    complete, or at the deadline."""
    more = proto.final_more_key(gen, worker)
    done = proto.final_done_key(gen)
    end = time.monotonic() + deadline_s
    written: set[int] = set()
    while time.monotonic() < end:
        if store.check([done]):
            return
        if store.check([more]):
            wanted = [i for i in json.loads(store.get(more)) if i not in written]
            if wanted:
                write(wanted)
                written.update(wanted)
        time.sleep(slice_s)
