"""Checkpoints on disk: written atomically, described by a manifest, verified on load.

Layout of a run directory::

    checkpoints/
        .job                     the job id: a host that sees it shares the folder
        step00000020/            a complete checkpoint after 20 committed steps
            manifest.json        step, generation, plan, per-layer file, size and sha256
            layer0.bin ...       one file per layer: its parameters and optimizer state
            layer1.tp0of2.bin    or, written at [job] tp = 2, one file per shard (each
            layer1.tp1of2.bin    rank writes its own; the manifest says how they join)
        .partial-step00000040-g3/  a checkpoint being written (never read)
        step00000030/manifest.json.corrupt   a checkpoint found corrupt (never tried again)

Workers write the layer files themselves, in parallel, into the ``.partial-*`` folder named
by the step and the generation that writes it (two timelines, before and after a restart,
never mix): each file under a temporary name, flushed, fsynced and renamed, its sha256
computed as it is written (:func:`write_layer`). The coordinator never reads them: when
every layer's file was reported with its size and digest it writes the manifest the same
way and renames the folder to its final name, then fsyncs the parent. A reader therefore
sees either a whole checkpoint or none; a layer is read by name whatever the plan, and
verified against the manifest before it is decoded (:func:`read_layer_file`). The last
``keep`` complete checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
"""Version of the manifest layout."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not match its manifest."""


FileEntry = tuple[str, int, str]
"""A file of a checkpoint: (name, size in bytes, sha256 hex)."""
Shard = tuple[int, int]
"""``(rank, degree)``: a tensor-parallel rank's shard of a layer (design 4.11)."""


def layer_file_name(layer: int, shard: Shard | None = None) -> str:
    """The file a layer (or rank ``r`` of ``k``'s shard of it) is stored in."""
    if shard is None:
        return f"layer{layer}.bin"
    rank, degree = shard
    return f"layer{layer}.tp{rank}of{degree}.bin"


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one whole.

    The bytes go to a temporary sibling, are flushed and fsynced, then renamed over the
    target; the folder is fsynced so the rename survives a crash.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint after ``step`` committed steps."""
    return f"step{step:08d}"


def partial_dir(root: Path, step: int, gen: int) -> Path:
    """The folder where generation ``gen`` writes the checkpoint after ``step`` steps."""
    return root / f".partial-{step_dir_name(step)}-g{gen}"


JOB_MARKER = ".job"
"""A file in ``checkpoints/`` holding the job id: a worker that reads it there shares the
coordinator's folder and writes and reads layer files itself."""

CORRUPT = MANIFEST + ".corrupt"


@dataclass(frozen=True)
class LayerFile:
    """One layer's file in a checkpoint, as its writer reports it."""

    name: str
    size: int
    sha256: str


def write_layer(folder: Path, name: str,
                write_into: Callable[[Callable[[Any], Any]], Any]) -> LayerFile:
    """Write one layer's file atomically, hashing its bytes as they go out.

    Args:
        folder: the checkpoint's partial folder (created if needed).
        name: the file name.
        write_into: called with a ``write(bytes)`` function; writes the whole content.

    Raises:
        OSError: when the disk refuses (full, read-only, failing): nothing is left behind.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    tmp = path.with_name(f".{name}.tmp-{os.getpid()}-{threading.get_ident()}")
    digest = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as f:
            def write(data: Any) -> None:
                nonlocal size
                digest.update(data)
                f.write(data)
                size += len(data)

            write_into(write)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(folder)
    return LayerFile(name, size, digest.hexdigest())


def read_layer_file(path: Path, size: int, sha256: str) -> bytes:
    """A layer file's bytes, verified against its manifest entry.

    Raises:
        CheckpointError: when the file is missing, unreadable, or its bytes changed.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{path} does not match its sha256 in the manifest; the "
                              "checkpoint is corrupt")
    return data


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds."""

    step: int
    """Committed steps the state includes."""
    gen: int
    """The generation that uploaded it."""
    num_layers: int
    layers: dict[int, tuple[FileEntry, ...]]
    """Layer -> its files: one holding the whole layer, or its shards in rank order (the
    degree it was written at is their number; ``tp_layout.join_state_trees`` joins them,
    each shard's header says how)."""
    plan: dict[str, Any]
    """The plan that was running (for the record; any plan can load the state)."""
    meta: dict[str, Any]
    """Run facts (job name, config digest, dtype...) checked before resuming."""
    folder: Path
    memory: dict[int, int] = field(default_factory=dict)
    """Layer -> the worker that holds a copy of it in memory (checkpoints in memory)."""

    def to_json(self) -> str:
        """The manifest file's text (a whole layer as ``{file, bytes, sha256}``, a sharded
        one as ``{degree, shards: [{file, bytes, sha256}, ...]}``)."""
        def entry(i: int, files: tuple[FileEntry, ...]) -> dict[str, Any]:
            held = {"memory": self.memory[i]} if i in self.memory else {}
            docs = [{"file": f, "bytes": n, "sha256": h} for f, n, h in files]
            if len(docs) == 1:
                return {**docs[0], **held}
            return {"degree": len(docs), "shards": docs, **held}

        return json.dumps({
            "format": FORMAT, "step": self.step, "gen": self.gen,
            "num_layers": self.num_layers,
            "layers": {str(i): entry(i, files) for i, files in sorted(self.layers.items())},
            "plan": self.plan, "meta": self.meta}, indent=1, sort_keys=True)

    def degree(self, layer: int) -> int:
        """How many shards ``layer`` is stored as (1: whole)."""
        return len(self.layers[layer])

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """Parse and check the manifest of ``folder`` (not the layer contents).

        Raises:
            CheckpointError: for a missing, malformed or incomplete manifest.
        """
        try:
            doc = json.loads((folder / MANIFEST).read_text())
            if doc.get("format") != FORMAT:
                raise CheckpointError(f"{folder}: unknown checkpoint format {doc.get('format')}")
            layers = {int(i): _files(v) for i, v in doc["layers"].items()}
            memory = {int(i): int(v["memory"]) for i, v in doc["layers"].items()
                      if v.get("memory") is not None}
            manifest = cls(step=int(doc["step"]), gen=int(doc["gen"]),
                           num_layers=int(doc["num_layers"]), layers=layers,
                           plan=dict(doc["plan"]), meta=dict(doc["meta"]), folder=folder,
                           memory=memory)
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{folder}: unreadable manifest ({exc})") from None
        if sorted(layers) != list(range(manifest.num_layers)):
            raise CheckpointError(f"{folder}: the manifest lists layers {sorted(layers)}, "
                                  f"expected 0..{manifest.num_layers - 1}")
        for i, files in layers.items():
            for name, size, _ in files:
                path = folder / name
                if not path.is_file() or path.stat().st_size != size:
                    raise CheckpointError(f"{folder}: layer {i} file {name} is missing or "
                                          f"not {size} bytes")
        return manifest

    def read_layer(self, layer: int) -> bytes:
        """The bytes of ``layer`` stored whole, verified against the manifest's sha256.

        Raises:
            CheckpointError: when the file is missing or its contents changed, or the
                layer is stored as shards (:meth:`read_parts`).
        """
        files = self.layers[layer]
        if len(files) != 1:
            raise CheckpointError(f"{self.folder}: layer {layer} is stored as "
                                  f"{len(files)} shards")
        return self.read_file(layer, 0)

    def read_file(self, layer: int, index: int) -> bytes:
        """The bytes of ``layer``'s ``index``-th file (its shard ``index``), verified.

        Raises:
            CheckpointError: when the file is missing or its contents changed.
        """
        name, size, digest = self.layers[layer][index]
        return read_layer_file(self.folder / name, size, digest)

    def read_parts(self, layer: int, shard: Shard | None = None) -> list[bytes]:
        """What a reader needs of ``layer``: at ``shard`` = ``(rank, degree)`` with the
        layer stored at that degree, its own shard's file; otherwise every file of the
        layer (the reader joins them, and splits them again for its rank).

        Raises:
            CheckpointError: when a file is missing or its contents changed.
        """
        files = self.layers[layer]
        if shard is not None and len(files) == shard[1] > 1:
            return [self.read_file(layer, shard[0])]
        return [self.read_file(layer, k) for k in range(len(files))]


def _files(doc: Any) -> tuple[FileEntry, ...]:
    """A manifest's entry of one layer: its file, or its shards' in rank order."""
    if "shards" not in doc:
        return ((str(doc["file"]), int(doc["bytes"]), str(doc["sha256"])),)
    shards = tuple((str(v["file"]), int(v["bytes"]), str(v["sha256"])) for v in doc["shards"])
    if not shards or len(shards) != int(doc["degree"]):
        raise CheckpointError(f"a layer of {doc['degree']} shards lists {len(shards)}")
    return shards


class Assembly:
    """One checkpoint being written layer by layer, a layer whole or shard by shard
    (thread-safe)."""

    def __init__(self, root: Path, step: int, gen: int, num_layers: int) -> None:
        self.step, self.gen, self.num_layers = step, gen, num_layers
        self.folder = partial_dir(root, step, gen)
        self.files: dict[int, dict[int, FileEntry]] = {}
        """Layer -> shard rank (0 for a whole layer) -> its file, as reported so far."""
        self.degrees: dict[int, int] = {}
        """Layer -> how many files it is written as."""
        self.memory: dict[int, int] = {}
        """Layer -> the worker holding a copy in memory."""
        self.lock = threading.Lock()

    def _check(self, layer: int, shard: Shard | None) -> None:
        if not 0 <= layer < self.num_layers:
            raise CheckpointError(f"layer {layer} outside 0..{self.num_layers - 1}")
        if shard is not None and not 0 <= shard[0] < shard[1]:
            raise CheckpointError(f"layer {layer}: shard {shard[0]} of {shard[1]}")

    @property
    def layers(self) -> dict[int, tuple[FileEntry, ...]]:
        """The layers every file of which arrived: their files, in rank order."""
        with self.lock:
            return {i: tuple(files[r] for r in range(self.degrees[i]))
                    for i, files in self.files.items() if len(files) == self.degrees[i]}

    def report(self, layer: int, file: LayerFile, memory: int | None = None,
               shard: Shard | None = None) -> bool:
        """A layer's file (``shard``: one rank's shard of it) was written, a copy held in
        ``memory``'s memory if not None (a repeated report is ignored).

        Returns:
            Whether every layer is now present.

        Raises:
            CheckpointError: for a layer index outside the model, or a shard of another
                degree than its siblings.
        """
        self._check(layer, shard)
        rank, degree = shard or (0, 1)
        with self.lock:
            if self.degrees.setdefault(layer, degree) != degree:
                raise CheckpointError(f"layer {layer}: a shard of {degree} beside shards of "
                                      f"{self.degrees[layer]}")
            if layer not in self.files and memory is not None:
                self.memory[layer] = memory
            self.files.setdefault(layer, {}).setdefault(rank, (file.name, file.size,
                                                               file.sha256))
        return self.complete

    def add(self, layer: int, data: bytes, shard: Shard | None = None) -> bool:
        """Write one layer's bytes (or one shard's) here (a worker without the shared
        folder sends them) and report it."""
        self._check(layer, shard)
        with self.lock:
            known = (shard or (0, 1))[0] in self.files.get(layer, {})
        if known:
            return self.complete
        file = write_layer(self.folder, layer_file_name(layer, shard),
                           lambda write: write(data))
        return self.report(layer, file, shard=shard)

    @property
    def complete(self) -> bool:
        """Whether every layer arrived."""
        return len(self.layers) == self.num_layers


class CheckpointStore:
    """The ``checkpoints/`` folder of a run directory."""

    def __init__(self, run_dir: Path, keep: int, folder: str = "checkpoints") -> None:
        """Open (and create) the folder; leftovers of interrupted assemblies are removed.

        Args:
            run_dir: the run directory.
            keep: complete checkpoints to keep.
            folder: the folder's name in the run directory.
        """
        self.root = Path(run_dir) / folder
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.sweep(())

    def sweep(self, expected: Iterable[Path]) -> None:
        """Remove every partial folder but those of the checkpoints still ``expected``:
        an interrupted run's, and a dropped checkpoint's that a slow writer re-created
        after it was discarded (on a full disk the space must come back, or every later
        checkpoint fails too)."""
        kept = {Path(folder).name for folder in expected}
        for leftover in self.root.glob(".partial-*"):
            if leftover.name not in kept:
                shutil.rmtree(leftover, ignore_errors=True)

    def set_aside_earlier(self) -> Path | None:
        """Move an earlier run's checkpoints out of the way of a run that starts from step
        0 in the same folder: the folder is renamed to ``checkpoints.earlier-N`` (the
        first free N) and a new, empty one takes its place. Nothing is deleted.

        Without this the two runs would mix: retention keeps the newest step counts, so
        it would delete the new run's checkpoints in favour of the old run's later ones,
        and the new run's final checkpoint would not be written over a step the old run
        already holds.

        Returns:
            Where the earlier checkpoints went, or None when there were none.
        """
        if not any(path.name.startswith("step") for path in self.root.iterdir()):
            return None
        n = 1
        while (target := self.root.with_name(f"{self.root.name}.earlier-{n}")).exists():
            n += 1
        os.replace(self.root, target)
        self.root.mkdir()
        _fsync_dir(self.root.parent)
        return target

    def mark_job(self, job_id: str) -> None:
        """Say which job writes here (workers on hosts that see it write layer files)."""
        write_atomic(self.root / JOB_MARKER, job_id.encode())

    def begin(self, step: int, gen: int, num_layers: int) -> Assembly:
        """Start (or restart) assembling the checkpoint after ``step`` steps from ``gen``."""
        return Assembly(self.root, step, gen, num_layers)

    def commit(self, assembly: Assembly, *, plan: dict[str, Any],
               meta: dict[str, Any]) -> Manifest:
        """Write the manifest and publish the checkpoint under its final name.

        Raises:
            CheckpointError: when a layer is missing.
            OSError: when the disk refuses the manifest or the rename (the checkpoint is
                then not complete; discard it).
        """
        if not assembly.complete:
            missing = sorted(set(range(assembly.num_layers)) - set(assembly.layers))
            raise CheckpointError(f"checkpoint after {assembly.step} steps: layers {missing} "
                                  "missing")
        manifest = Manifest(step=assembly.step, gen=assembly.gen,
                            num_layers=assembly.num_layers, layers=dict(assembly.layers),
                            plan=plan, meta=meta, folder=assembly.folder,
                            memory=dict(assembly.memory))
        write_atomic(assembly.folder / MANIFEST, manifest.to_json().encode())
        final = self.root / step_dir_name(assembly.step)
        if final.exists():  # the same step again (a redo after a restart): replace it
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            os.replace(final, old)
            os.replace(assembly.folder, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(assembly.folder, final)
        _fsync_dir(self.root)
        self._prune()
        return Manifest.read(final)

    def discard(self, assembly: Assembly) -> None:
        """Drop an assembly that will never complete."""
        shutil.rmtree(assembly.folder, ignore_errors=True)

    def mark_corrupt(self, step: int, why: str) -> None:
        """Set a corrupt checkpoint aside: its manifest is renamed (never listed or tried
        again) and the reason written beside it."""
        folder = self.root / step_dir_name(step)
        with contextlib.suppress(OSError):
            os.replace(folder / MANIFEST, folder / CORRUPT)
            (folder / "CORRUPT.txt").write_text(why + "\n")
            _fsync_dir(folder)

    def _prune(self) -> None:
        complete = self.steps()
        for step in complete[:-self.keep]:
            shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)

    def steps(self) -> list[int]:
        """Committed-step counts of the complete checkpoints, ascending."""
        out = []
        for path in self.root.glob("step*"):
            if path.is_dir() and (path / MANIFEST).is_file():
                with contextlib.suppress(ValueError):
                    out.append(int(path.name[len("step"):]))
        return sorted(out)

    def manifest(self, step: int) -> Manifest:
        """The manifest of the checkpoint after ``step`` steps.

        Raises:
            CheckpointError: when it is missing or damaged.
        """
        return Manifest.read(self.root / step_dir_name(step))

    def latest(self) -> Manifest | None:
        """The newest checkpoint whose manifest and files check out, or None.

        A damaged newer checkpoint is skipped in favour of an older intact one.
        """
        for step in reversed(self.steps()):
            with contextlib.suppress(CheckpointError):
                return self.manifest(step)
        return None
