"""A worker's side of checkpoints: it writes its own layers, in the background, and reads
only the layers it restores, verifying each against the manifest.

At a checkpoint the worker takes a snapshot of the layers it writes (a copy in host
memory the worker shares with its checkpoint writer process, taken at the commit, so
training goes on at once); the writer process streams each into the checkpoint's folder
at the lowest CPU priority (``storage.diskwriter``; ``storage.checkpoint.write_layer``: a
temporary name, fsync, rename, the sha256 computed on the way) and a thread of the worker
reports the file, its size and digest through the store; the coordinator writes the
manifest when every layer is reported. The next checkpoint waits for the previous one. A
disk that refuses (full, read-only, failing) is reported as that checkpoint's failure:
the coordinator drops it and training goes on.

Each layer is written by one of its holders (spread over the replicas, so they share the
writing). A worker on a host that does not see the coordinator's checkpoint folder sends
the bytes over the authenticated bulk channel instead, and the coordinator writes them.

At ``[job] tp > 1`` every rank of a writer writes its own shard of the layer
(``layer<i>.tp<r>of<k>.bin``) and reports it; a layer is complete when its ``k`` shards
are, and a reader takes its own shard, or, written at another degree, every file of the
layer to join and split again (design 4.11).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from chameleon_ft.runtime.deadlines import Deadline
from chameleon_ft.runtime.storage import diskwriter
from chameleon_ft.runtime.storage.blobs import BlobClient, BlobError
from chameleon_ft.runtime.storage.checkpoint import (
    JOB_MARKER,
    CheckpointError,
    LayerFile,
    Manifest,
    Shard,
    layer_file_name,
    partial_dir,
    step_dir_name,
    write_layer,
)
from chameleon_ft.runtime.storage.packing import pack_parts, pack_pieces, pack_to
from chameleon_ft.runtime.worker import device as dev
from chameleon_ft.runtime.worker.channel import Channel
from chameleon_ft.runtime.worker.memcopies import MemoryCopies
from chameleon_ft.runtime.workload.optim import LayerTrainState


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
    return _bytes_of(_tensor_paths(tree))


def _bytes_of(tensors: list[tuple[tuple[Any, ...], Any]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


class _Copied:
    """A layer state already copied (its snapshot is itself)."""

    def __init__(self, tree: dict[str, Any]) -> None:
        self.tree = tree

    def state_tree(self) -> dict[str, Any]:
        return self.tree


class _Arena:
    """One layer's snapshot memory: an anonymous memory file the writer process maps too
    (where the platform has one), else ordinary host memory written from the worker."""

    ALIGN = 64

    def __init__(self, ident: int, layout: tuple[tuple[Any, ...], ...], pinned: bool) -> None:
        self.id, self.layout = ident, layout
        spans, size = [], 0
        for _, shape, dtype in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            spans.append((size, nbytes))
            size += -(-nbytes // self.ALIGN) * self.ALIGN
        self.nbytes = size
        self.fd = _shared_memory(ident, size) if diskwriter.supported() else None
        if self.fd is not None:
            memory = mmap.mmap(self.fd, max(size, 1))
            self.base = torch.frombuffer(memory, dtype=torch.uint8)[:size]
            weakref.finalize(self, os.close, self.fd)
            if pinned:
                _pin(self, self.base)
        else:  # no shared memory here: the worker writes the files itself
            self.base = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        self.views = {path: self.base[o:o + n].view(dtype).view(shape)
                      for (path, shape, dtype), (o, n) in zip(layout, spans, strict=True)}
        self.touched = False
        """Whether every page is mapped in (a copy into untouched memory faults each in)."""

    def touch(self) -> None:
        """Map every page in now (torch releases the interpreter's lock meanwhile): the
        next copy into this memory then runs at memory speed."""
        if not self.touched:
            self.base.zero_()
            self.touched = True

    def span(self, flat: torch.Tensor) -> tuple[int, int, int] | None:
        """(id, offset, length) of ``flat``'s bytes in this memory, None if elsewhere."""
        length = flat.numel() * flat.element_size()
        if not length:
            return (self.id, 0, 0)
        offset = flat.data_ptr() - self.base.data_ptr()
        if offset < 0 or offset + length > self.nbytes:
            return None
        return (self.id, offset, length)


def _shared_memory(ident: int, size: int) -> int | None:
    """An anonymous memory file of ``size`` bytes, its pages allocated at once (one call
    instead of a fault per page during the copy); None when the system refuses it."""
    fd = None
    try:
        fd = os.memfd_create(f"chameleon-checkpoint-{ident}", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(size, 1))
        if size:
            os.posix_fallocate(fd, 0, size)
        return fd
    except OSError:
        if fd is not None:
            os.close(fd)
        return None


def _pin(owner: object, base: torch.Tensor) -> None:
    """Page-lock shared host memory for the GPU's copies (best effort: unpinned memory is
    only slower); unpinned when ``owner`` goes."""
    with contextlib.suppress(Exception):
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(base.data_ptr(), base.numel(), 1)) == 0:
            weakref.finalize(owner, cudart.cudaHostUnregister, base.data_ptr())


def _tensor_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _tensor_paths(v, (*path, k))]
    if isinstance(value, list | tuple):
        return [x for i, v in enumerate(value) for x in _tensor_paths(v, (*path, i))]
    return []


class HostBuffers:
    """Host memory for the snapshots, kept from one checkpoint to the next.

    A fresh copy of a layer's state touches every page of new memory (page faults and
    zeroing on the step path's cores); the next checkpoint of the same layers copies into
    the same memory instead. Each layer's snapshot lives in one block (:class:`_Arena`),
    shared with the checkpoint writer process, reused while the layer's tensors keep their
    paths, shapes and dtypes; layers the worker no longer writes are released. On a GPU the
    memory is page-locked, so the device-to-host copy runs at the link's speed. Only one
    checkpoint uses it at a time (the next one waits for the previous one's writing).
    """

    def __init__(self) -> None:
        self.arenas: dict[int, _Arena] = {}
        self.released: set[int] = set()
        """Ids of memory dropped since the writer last heard (it unmaps them)."""
        self._next_id = 0

    def snapshot(self, layer: int, state: LayerTrainState | _Copied,
                 non_blocking: bool = False) -> dict[str, Any]:
        """A copy of ``state`` (layer ``layer``) in host memory, in reused buffers
        (``non_blocking``: device-to-host copies only enqueued on the current stream; the
        caller waits for them)."""
        tree = state.state_tree()
        tensors = _tensor_paths(tree)
        arena = self.reserve(layer, layout_of(tensors))
        for path, t in tensors:
            arena.views[path].copy_(t.detach(), non_blocking=non_blocking)
        arena.touched = True
        copied: dict[str, Any] = _replace(tree, (), arena.views)
        return copied

    def reserve(self, layer: int, layout: Layout) -> _Arena:
        """The memory for a snapshot of layer ``layer`` laid out as ``layout`` (allocated
        now unless the layer already has it)."""
        tensors, pinned = layout
        arena = self.arenas.get(layer)
        if arena is None or arena.layout != tensors:
            if arena is not None:
                self.released.add(arena.id)
            arena = self.arenas[layer] = _Arena(self._next_id, tensors, pinned)
            self._next_id += 1
        return arena

    def keep_only(self, layers: set[int]) -> None:
        """Release the memory of layers not in ``layers``."""
        self.released.update(a.id for i, a in self.arenas.items() if i not in layers)
        self.arenas = {i: a for i, a in self.arenas.items() if i in layers}


Layout = tuple[tuple[tuple[Any, ...], ...], bool]
"""A snapshot's layout: each tensor's (path, shape, dtype), and whether any is on a GPU."""


def layout_of(tensors: list[tuple[tuple[Any, ...], Any]]) -> Layout:
    """The layout of a state tree's tensors (from :func:`_tensor_paths`)."""
    return (tuple((path, tuple(t.shape), t.dtype) for path, t in tensors),
            any(t.device.type == "cuda" for _, t in tensors))


def _replace(value: Any, path: tuple[Any, ...], views: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return views[path]
    if isinstance(value, dict):
        return {k: _replace(v, (*path, k), views) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_replace(v, (*path, i), views) for i, v in enumerate(value))
    return value


class CheckpointIO:
    """Writes and reads one worker's layers of the run's checkpoints.

    Args:
        worker: this worker's id.
        folder: the shared checkpoint folder, or None (send bytes over ``blobs``).
        blobs: the bulk channel to the coordinator.
        store: makes a channel over a store connection of its own, for the writer thread.
        memory: checkpoints in memory (``worker/memcopies.py``), or None.
        device: the worker's device (its threads work on it; snapshots of a GPU's layers
            are copied on a stream of their own).
        shard: ``(rank, degree)`` of this process in a worker of ``[job] tp > 1``: it
            writes and reads its shards.
    """

    def __init__(self, worker: int, folder: Path | None, blobs: BlobClient,
                 store: Callable[[], Channel], memory: MemoryCopies | None = None,
                 device: torch.device | None = None, shard: Shard | None = None) -> None:
        self.worker, self.folder, self.blobs = worker, folder, blobs
        self.shard = shard
        self.memory = memory
        self.device = device or torch.device("cpu")
        self._store_of = store
        self._store: Channel | None = None
        self.thread: threading.Thread | None = None
        self.copied = threading.Event()
        self.copied.set()
        self.pending_bytes = 0
        """Bytes of the checkpoint being written in the background."""
        self.manifests: dict[int, Manifest] = {}
        self.host = HostBuffers()
        self.disk = diskwriter.DiskWriter() if diskwriter.supported() else None
        """The checkpoint writer process (Linux); a worker that checkpoints starts it while
        it sets up."""

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

    def reserve_async(self, states: dict[int, LayerTrainState]) -> None:
        """Allocate the snapshot memory of ``states`` (the layers this worker will write)
        and map its pages in, in the background, before their first checkpoint, so that
        checkpoint's copy does not allocate and fault in a worker's whole share on the step
        path (1 GB: 0.42 s copying into fresh memory, 0.12 s into touched memory). Skipped
        while a checkpoint is being written (it allocates what it needs itself)."""
        if self.thread is not None and self.thread.is_alive():
            return
        self._release_others(set(states))
        tensors = {i: _tensor_paths(state.state_tree()) for i, state in states.items()}
        layouts = {i: layout_of(paths) for i, paths in tensors.items()}
        self.pending_bytes = sum(_bytes_of(paths) for paths in tensors.values())
        self.thread = dev.thread(self._reserve, self.device, "checkpoint-memory", (layouts,))
        self.thread.start()

    def _reserve(self, layouts: dict[int, Layout]) -> None:
        try:
            for layer, layout in layouts.items():
                self.host.reserve(layer, layout).touch()
        except (OSError, MemoryError, RuntimeError):
            pass  # the checkpoint allocates what is missing itself, or reports it

    def _release_others(self, layers: set[int]) -> None:
        """Release the snapshot memory of layers not in ``layers`` (here and in the writer
        process)."""
        self.host.keep_only(layers)
        if self.disk is not None and self.host.released:
            self.disk.forget(self.host.released)
        self.host.released = set()

    def write_async(self, step: int, gen: int, states: dict[int, LayerTrainState],
                    inject: OSError | None, deadline: Deadline,
                    peer: int | None = None) -> None:
        """Write ``states`` (the layers as committed after ``step`` steps) in the background,
        once the previous checkpoint is written (waiting as long as its bytes allow: a write
        still running then is reported as this one's failure); with checkpoints in memory,
        also give ``peer`` a copy of each.

        The writer thread first copies the layers into host memory (at normal priority,
        while the next step's forward and backward run: they do not change the state; the
        next optimizer step waits for the copy, :meth:`snapshot_taken`), then has the
        writer process stream them to disk at the lowest CPU priority, so writing takes the
        cycles training leaves (module ``storage.diskwriter``). A writer still busy with the
        previous checkpoint past its deadline is killed.
        """
        limit_s = deadline.for_bytes(self.pending_bytes)
        if not self.wait(limit_s):
            if self.disk is not None:
                self.disk.kill()
            self._fail(gen, step, f"worker {self.worker}: the previous checkpoint was still "
                       f"being written after {limit_s:.0f} s")
            return
        self.copied = threading.Event()
        self._release_others(set(states))
        if any(True for state in states.values() for _ in state.module.buffers()):
            # a forward may change buffers (batch norm's running statistics): copy now
            copies = {i: self.host.snapshot(i, state) for i, state in states.items()}
            states = {i: _Copied(tree) for i, tree in copies.items()}
        ready = dev.stream_point(self.device)
        self.thread = dev.thread(self._background, self.device, f"checkpoint-{step}",
                                 (step, gen, states, inject, self.copied, peer, ready))
        self.thread.start()

    def _background(self, step: int, gen: int, states: dict[int, Any],
                    inject: OSError | None, copied: threading.Event,
                    peer: int | None, ready: Any) -> None:
        try:
            with dev.side_stream(self.device, after=ready) as non_blocking:
                layers = {i: state.tree if isinstance(state, _Copied)
                          else self.host.snapshot(i, state, non_blocking)
                          for i, state in states.items()}
        finally:
            copied.set()
        self.pending_bytes = tree_bytes(layers)
        self.write(step, gen, layers, inject, peer)

    def write(self, step: int, gen: int, layers: dict[int, dict[str, Any]],
              inject: OSError | None = None, peer: int | None = None,
              upload: bool = False) -> bool:
        """Write ``layers`` now and report each (a copy in ``peer``'s memory first, with
        checkpoints in memory; ``upload``: over the bulk channel, the coordinator writes
        them); returns whether all were written."""
        try:
            for layer, tree in sorted(layers.items()):
                if inject is not None:
                    raise inject
                if upload:
                    self._upload(step, gen, layer, tree)
                    continue
                self._write_one(step, gen, layer, tree, peer)
        except (OSError, BlobError) as exc:
            self._fail(gen, step, f"worker {self.worker}: {diskwriter.describe(exc)}")
            return False
        return True

    def _upload(self, step: int, gen: int, layer: int, tree: dict[str, Any]) -> None:
        """Send a layer's bytes over the bulk channel: the coordinator writes them."""
        header: dict[str, Any] = {"op": "put", "kind": "checkpoint", "layer": layer,
                                  "worker": self.worker, "step": step, "gen": gen}
        if self.shard is not None:
            header["shard"] = list(self.shard)
        self.blobs.request(header, pack_pieces(tree))

    def _write_one(self, step: int, gen: int, layer: int, tree: dict[str, Any],
                   peer: int | None) -> None:
        if self.folder is None:  # no shared folder: the coordinator writes the bytes
            self._upload(step, gen, layer, tree)
            return
        start = time.perf_counter()
        folder, name = partial_dir(self.folder, step, gen), layer_file_name(layer, self.shard)
        file = self._write_elsewhere(folder, name, layer, tree)
        if file is None:  # not a snapshot in shared memory (the final checkpoint): from here
            file = write_layer(folder, name, lambda write: pack_to(tree, write))
        held = None
        if self.memory is not None and peer is not None and self.shard is None and \
                self.memory.send(peer, step, layer, pack_pieces(tree)):
            held = peer
        self._report(gen, step, layer, file, time.perf_counter() - start, held)

    def _write_elsewhere(self, folder: Path, name: str, layer: int,
                         tree: dict[str, Any]) -> LayerFile | None:
        """Have the writer process write ``tree``, a snapshot of layer ``layer`` in the
        memory it shares; None when there is no writer process or the tree lies elsewhere.

        Raises:
            OSError: the disk refused, or the writer process died.
        """
        arena = self.host.arenas.get(layer)
        if self.disk is None or arena is None or arena.fd is None:
            return None
        head, flats = pack_parts(tree)
        spans = [arena.span(flat) for flat in flats]
        if any(span is None for span in spans):
            return None
        size, sha256 = self.disk.write(folder, name, head, spans,  # type: ignore[arg-type]
                                       {arena.id: arena.fd})
        return LayerFile(name, size, sha256)

    def _client(self) -> Channel:
        if self._store is None:
            self._store = self._store_of()
        return self._store

    def reconnect(self) -> None:
        """Another coordinator is followed: the writer's next report opens a connection
        to it (a report of a checkpoint it does not expect is ignored there)."""
        self._store = None

    def _report(self, gen: int, step: int, layer: int, file: LayerFile,
                write_s: float, held: int | None = None) -> None:
        # a report that cannot be written (the coordinator went away) leaves the
        # checkpoint incomplete: its deadline drops it there, the next one is written
        with contextlib.suppress(Exception):
            self._write_report(gen, step, layer, file, write_s, held)

    def _write_report(self, gen: int, step: int, layer: int, file: LayerFile,
                      write_s: float, held: int | None) -> None:
        self._client().layer_written(gen, step, layer, {
            "file": file.name, "size": file.size, "sha256": file.sha256,
            "worker": self.worker, "write_s": write_s, "memory": held})

    def _fail(self, gen: int, step: int, why: str) -> None:
        with contextlib.suppress(Exception):  # the coordinator's deadline covers a silence
            self._client().checkpoint_failed(gen, step, why)

    # ------------------------------------------------------------------ reading
    def restore(self, step: int, wanted: list[int], gen: int,
                build: Callable[[int, list[bytes]], LayerTrainState]
                ) -> dict[int, LayerTrainState]:
        """Layers ``wanted`` of the checkpoint after ``step`` steps, each verified against
        the manifest before ``build(layer, parts)`` decodes it (a corrupt file is
        reported, never loaded).

        Raises:
            CorruptCheckpoint: when a file does not match the manifest.
            CommError: when the coordinator cannot send a layer (no shared folder).
        """
        from chameleon_ft.runtime.worker.comm import CommError

        layers = {}
        for i in wanted:
            try:
                parts = self.read_parts(step, i, gen)
            except BlobError as exc:
                raise CommError(f"worker {self.worker}: reading layer {i} of the checkpoint "
                                f"after {step} steps failed: {exc}", None) from None
            layers[i] = build(i, parts)
        return layers

    def read_parts(self, step: int, layer: int, gen: int) -> list[bytes]:
        """What this process loads of layer ``layer`` of the checkpoint after ``step``
        steps (:meth:`read`; at ``tp > 1`` ``Manifest.read_parts``: its own shard when
        the layer was written at its degree, else every file of the layer), verified.

        Raises:
            CorruptCheckpoint: when a file does not match the manifest.
            BlobError: when the coordinator cannot send it (no shared folder).
        """
        if self.shard is None:
            return [self.read(step, layer, gen)]
        if self.folder is None:
            return self._fetch_parts(step, layer, gen)
        try:
            if step not in self.manifests:
                self.manifests[step] = Manifest.read(self.folder / step_dir_name(step))
            return self.manifests[step].read_parts(layer, self.shard)
        except CheckpointError as exc:
            self.manifests.pop(step, None)
            raise CorruptCheckpoint(step, str(exc)) from None

    def _fetch_parts(self, step: int, layer: int, gen: int) -> list[bytes]:
        """:meth:`read_parts` over the bulk channel (the coordinator reads the files)."""
        def get(index: int) -> tuple[int, bytes]:
            try:
                answer, data = self.blobs.request({"op": "get", "kind": "restore",
                                                   "step": step, "layer": layer,
                                                   "gen": gen, "index": index})
            except BlobError as exc:
                if "corrupt" in str(exc) or "does not match" in str(exc):
                    raise CorruptCheckpoint(step, str(exc)) from None
                raise
            return int(answer.get("files", 1)), data

        assert self.shard is not None
        rank, degree = self.shard
        files, first = get(0)
        if files == degree:  # written at this degree: this rank's own shard
            return [first] if rank == 0 else [get(rank)[1]]
        return [first] + [get(k)[1] for k in range(1, files)]

    def read(self, step: int, layer: int, gen: int) -> bytes:
        """Layer ``layer`` of the checkpoint after ``step`` steps, verified: from the
        memory of the worker holding a copy when it still has it (checkpoints in memory),
        else from storage.

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
            manifest = self.manifests[step]
            holder = manifest.memory.get(layer)
            if self.memory is not None and holder is not None:
                _, size, sha256 = manifest.layers[layer][0]
                data = self.memory.fetch(holder, step, layer, size, sha256)
                if data is not None:
                    return data
            return manifest.read_layer(layer)
        except CheckpointError as exc:
            self.manifests.pop(step, None)
            raise CorruptCheckpoint(step, str(exc)) from None


def wait_final(chan: Channel, gen: int, write: Callable[[list[int], bool], None],
               deadline_s: float, slice_s: float = 0.05) -> None:
    """After writing its share of the final checkpoint: write the layers the coordinator
    asks for (their first writer is gone, or an attempt failed: the next uploads them),
    leave when it says the final checkpoint is over, or at the deadline.

    ``write(layers, upload)`` writes layers into the checkpoint folder, or with ``upload``
    over the bulk channel into the run folder.
    """
    end = time.monotonic() + deadline_s
    written: set[tuple[int, int]] = set()
    """(attempt, layer) written."""
    while time.monotonic() < end:
        done, ask = chan.final(gen)
        if done:
            chan.flush_refusals()  # the last word: the coordinator reports them
            return
        if ask is not None:
            attempt = int(ask["attempt"])
            wanted = [int(i) for i in ask["layers"] if (attempt, int(i)) not in written]
            if wanted:
                write(wanted, bool(ask["upload"]))
                written.update((attempt, i) for i in wanted)
        time.sleep(slice_s)
