"""A worker's checkpoint writer process: the bytes go to disk from a process of their own.

A checkpoint's layers are copied into host memory that the worker shares with this process
(one anonymous memory file per layer, ``os.memfd_create``, its descriptor handed over the
socket once); the process writes each layer's file (``checkpoint.write_layer``: temporary
name, sha256 on the way, fsync, rename) at the lowest CPU priority and answers with the
file's size and digest. Writing from a thread of the worker at a low priority would stall
the worker: a nice-19 thread the kernel keeps off the CPU while it holds the interpreter's
lock holds up every other thread of the process, the heartbeat among them (a 0.2 s silence
was seen on a loaded 2-core machine). A process of its own holds no lock the worker needs.

The process imports no torch (it starts in a few tens of milliseconds), serves one request
at a time, and exits when the worker closes its end (or dies). A writer that stops
answering is killed (:meth:`DiskWriter.kill`) and the next checkpoint starts a new one.

Requests, over a Unix stream socket: ``u32 length | JSON`` (descriptors of new layer memory
attached), then the packed header's bytes; the answer is ``u32 length | JSON``.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chameleon_ft.runtime.storage.checkpoint import write_layer

LOWEST_PRIORITY = 19
"""The writer process's niceness: training keeps its cores, writing takes what is left."""

_LEN = struct.Struct(">I")
_MAX_FDS = 200  # below the kernel's 253 descriptors per message


class WriterGone(OSError):
    """The writer process died or closed its end."""


def supported() -> bool:
    """Whether this platform has anonymous memory files and descriptor passing (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise WriterGone("the checkpoint writer process closed its end")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = (),
          tail: bytes = b"") -> None:
    body = json.dumps(message).encode()
    first = _LEN.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [first], list(fds))
    else:
        sock.sendall(first)
    if tail:
        sock.sendall(tail)


class DiskWriter:
    """The worker's side: starts the writer process when first needed and asks it to
    write layers. Used by one thread at a time (the checkpoint's writer thread)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._known: set[int] = set()
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The writer process's id, while it runs."""
        return None if self._proc is None else self._proc.pid

    def write(self, folder: Path, name: str, head: bytes,
              spans: list[tuple[int, int, int]], fds: dict[int, int]) -> tuple[int, str]:
        """Write ``head`` then the ``spans`` (memory id, offset, length) into the file
        ``folder/name``; returns its size and sha256.

        Args:
            fds: the descriptors of memory ids the writer may not know yet (only those it
                does not know are sent; the caller keeps ownership).

        Raises:
            OSError: the disk refused (the writer's message), or the writer died
                (:class:`WriterGone`).
        """
        with self._lock:
            sock = self._started()
            new = [(i, fd) for i, fd in fds.items() if i not in self._known][:_MAX_FDS]
            try:
                _send(sock, {"op": "write", "folder": str(folder), "name": name,
                             "head": len(head), "spans": spans,
                             "new": [i for i, _ in new]}, [fd for _, fd in new], head)
                self._known.update(i for i, _ in new)
                answer = json.loads(_recv_exact(sock, _LEN.unpack(_recv_exact(sock, 4))[0]))
            except OSError as exc:
                self._close()
                if isinstance(exc, WriterGone):
                    raise
                raise WriterGone(f"the checkpoint writer process is gone ({exc})") from None
        if not answer.get("ok"):
            raise OSError(answer.get("error", "the checkpoint writer failed"))
        return int(answer["size"]), str(answer["sha256"])

    def start(self) -> None:
        """Start the writer process now (it takes a moment to start: a worker that will
        checkpoint starts it while it sets up, not at its first checkpoint)."""
        with self._lock:
            self._started()

    def forget(self, ids: set[int]) -> None:
        """Tell the writer to release the memory of ``ids`` (layers no longer written)."""
        with self._lock:
            gone = ids & self._known
            if not gone or self._sock is None:
                return
            with contextlib.suppress(OSError):
                _send(self._sock, {"op": "forget", "ids": sorted(gone)})
            self._known -= gone

    def kill(self) -> None:
        """Stop the writer now (it stopped answering); the next write starts a new one.
        Does not wait for the lock: the thread blocked on the writer gets an error."""
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()

    def close(self) -> None:
        """Close the writer's end; the process exits."""
        with self._lock:
            self._close()

    def _started(self) -> socket.socket:
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            return self._sock
        self._close()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_root = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                close_fds=True)
        finally:
            theirs.close()
        self._sock = mine
        return mine

    def _close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None
        self._known = set()
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------------ the writer process
def describe(exc: BaseException) -> str:
    """An error as a checkpoint failure's reason: the system's message and the file."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return str(exc) or type(exc).__name__


def _serve(sock: socket.socket) -> None:
    maps: dict[int, mmap.mmap] = {}
    while True:
        try:
            prefix, fds, _, _ = socket.recv_fds(sock, 4, _MAX_FDS)
        except OSError:
            return
        if len(prefix) < 4:
            return  # the worker closed its end, or died
        prefix += _recv_exact(sock, 4 - len(prefix))
        try:
            request = json.loads(_recv_exact(sock, _LEN.unpack(prefix)[0]))
        except OSError:
            return
        for i, fd in zip(request.get("new", []), fds, strict=False):
            maps[i] = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            os.close(fd)
        if request["op"] == "forget":
            for i in request["ids"]:
                with contextlib.suppress(KeyError, BufferError):
                    maps.pop(i).close()
            continue
        try:
            head = _recv_exact(sock, request["head"])
        except OSError:
            return
        try:
            answer = _write(request, head, maps)
        except Exception as exc:  # every failure is the checkpoint's, told to the worker
            answer = {"ok": False, "error": describe(exc)}
        body = json.dumps(answer).encode()
        try:
            sock.sendall(_LEN.pack(len(body)) + body)
        except OSError:
            return  # the worker is gone


def _write(request: dict[str, Any], head: bytes, maps: dict[int, mmap.mmap]) -> dict[str, Any]:
    def write_into(write: Any) -> None:
        write(head)
        for i, offset, length in request["spans"]:
            if length:
                write(memoryview(maps[i])[offset:offset + length])

    file = write_layer(Path(request["folder"]), request["name"], write_into)
    return {"ok": True, "size": file.size, "sha256": file.sha256}


def main() -> None:
    """The writer process: serve the worker until it closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the worker's to handle
    with contextlib.suppress(OSError):
        os.nice(LOWEST_PRIORITY)
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        _serve(sock)
    finally:
        sock.close()


if __name__ == "__main__":
    main()
