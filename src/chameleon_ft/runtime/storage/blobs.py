"""Bulk state between workers and the coordinator, off the store.

The ``TCPStore`` carries small control messages (directives, votes, heartbeats); a layer's
parameters and optimizer state do not belong there: a large value blocks the store's
connection and delays everybody's heartbeats. Checkpoint shards, the final state and the
state a restart reloads travel instead over this small request/response channel, served
by a thread pool in the coordinator.

Wire format (one request per connection)::

    b"CHB1" | u32 header length | header JSON | payload (header["size"] bytes)

The header carries the payload's sha256 and an HMAC-SHA256 of the header under the job's
secret, so a peer without the secret cannot upload or download, and a corrupted payload is
refused. The response has the same shape. Every socket operation has a deadline.

Pure Python (no torch).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from chameleon_ft.runtime.deadlines import Deadline

MAGIC = b"CHB1"
MAX_HEADER_BYTES = 1 << 16
CHUNK = 1 << 20
LISTEN_QUEUE = 1024
"""Connections waiting to be accepted (the kernel caps it at ``net.core.somaxconn``)."""

Handler = Callable[[dict[str, Any], bytes], tuple[dict[str, Any], bytes]]
"""``(request header, payload) -> (response header, payload)``; raise ``BlobError`` to
refuse with a message."""


class BlobError(RuntimeError):
    """A request was refused, or the channel failed."""


def _mac(secret: bytes, header: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True)
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()


def _recv_exact(sock: socket.socket, size: int, limit_s: float) -> bytes:
    deadline = time.monotonic() + limit_s
    buf = bytearray()
    while len(buf) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BlobError(f"timed out after {limit_s:g} s receiving {size} bytes")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(CHUNK, size - len(buf)))
        except TimeoutError:
            raise BlobError(f"timed out after {limit_s:g} s receiving {size} bytes") from None
        if not chunk:
            raise BlobError("connection closed mid-message")
        buf += chunk
    return bytes(buf)


Payload = bytes | Sequence[bytes | memoryview]
"""A message's payload: bytes, or pieces sent one after the other (never joined, so a
large payload is sent from its own memory)."""


def send_message(sock: socket.socket, secret: bytes, header: dict[str, Any],
                 payload: Payload = b"", deadline: Deadline | None = None) -> None:
    """Send one framed, authenticated message (within ``deadline`` for its bytes, when
    given; otherwise under the socket's own timeout)."""
    parts = [payload] if isinstance(payload, bytes) else list(payload)
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    size = sum(len(part) for part in parts)
    header = dict(header, size=size, sha256=digest.hexdigest())
    header["mac"] = _mac(secret, header)
    body = json.dumps(header).encode()
    if deadline is not None:
        sock.settimeout(deadline.for_bytes(len(body) + size))
    sock.sendall(MAGIC + struct.pack(">I", len(body)) + body)
    for part in parts:
        if len(part):
            sock.sendall(part)


def recv_message(sock: socket.socket, secret: bytes, limit_s: float,
                 max_payload_bytes: int,
                 deadline: Deadline | None = None) -> tuple[dict[str, Any], bytes]:
    """Receive one message and check its framing, MAC and payload digest.

    Args:
        sock: the connection.
        secret: the job secret.
        limit_s: the deadline of the header (and of the payload without ``deadline``).
        max_payload_bytes: larger payloads are refused.
        deadline: the payload's deadline by its announced size.

    Raises:
        BlobError: for a malformed, unauthenticated, oversized or corrupted message.
    """
    prefix = _recv_exact(sock, 8, limit_s)
    if prefix[:4] != MAGIC:
        raise BlobError("not a chameleon blob message")
    (length,) = struct.unpack(">I", prefix[4:])
    if length > MAX_HEADER_BYTES:
        raise BlobError(f"header of {length} bytes is too large")
    try:
        header = json.loads(_recv_exact(sock, length, limit_s))
    except (ValueError, UnicodeDecodeError):
        raise BlobError("malformed header") from None
    if not isinstance(header, dict):
        raise BlobError("malformed header")
    mac = header.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, header)):
        raise BlobError("authentication failed (wrong job secret or token)")
    size = header.get("size")
    if not isinstance(size, int) or not 0 <= size <= max_payload_bytes:
        raise BlobError(f"payload size {size!r} refused")
    payload_s = deadline.for_bytes(size) if deadline is not None else limit_s
    payload = _recv_exact(sock, size, payload_s) if size else b""
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise BlobError("payload does not match its sha256")
    return header, payload


class BlobServer:
    """The coordinator's side: answers requests on its own threads until closed."""

    def __init__(self, host: str, secret: bytes, handler: Handler, *, timeout_s: float,
                 max_payload_bytes: int = 1 << 40, port: int = 0,
                 deadline: Deadline | None = None) -> None:
        """Listen on ``host:port`` (0: any free port) and start serving.

        Args:
            host: the interface to listen on (the store's).
            secret: the job secret every message is authenticated with.
            handler: answers one request (called on a server thread).
            timeout_s: deadline of receiving a request's header.
            max_payload_bytes: larger uploads are refused.
            port: port to bind.
            deadline: a payload's deadline by its size (default: ``timeout_s`` whole).
        """
        self.secret, self.handler, self.timeout_s = secret, handler, timeout_s
        self.deadline = deadline
        self.max_payload_bytes = max_payload_bytes
        self.refused = 0
        """Requests refused (bad framing, authentication, handler errors)."""
        outer = self

        class _Request(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._handle(self.request)

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            # every worker asks at once after a restart, while the coordinator's interpreter
            # may be busy: a full listen queue drops a connection's SYN and TCP retries it
            # only after 1 s (socketserver's default queue holds 5)
            request_queue_size = LISTEN_QUEUE

        self.server = _Server((host, port), _Request)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={
            "poll_interval": 0.05}, daemon=True, name="chameleon-blobs")
        self.thread.start()

    def _handle(self, sock: socket.socket) -> None:
        try:
            header, payload = recv_message(sock, self.secret, self.timeout_s,
                                           self.max_payload_bytes, self.deadline)
        except (BlobError, OSError) as exc:
            self.refused += 1
            with contextlib.suppress(OSError, BlobError):
                send_message(sock, self.secret, {"ok": False, "error": str(exc)})
            return
        try:
            reply, data = self.handler(header, payload)
            reply = dict(reply, ok=True)
        except BlobError as exc:
            self.refused += 1
            reply, data = {"ok": False, "error": str(exc)}, b""
        except Exception as exc:  # a bug in a handler must not kill the server thread
            self.refused += 1
            reply, data = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, b""
        with contextlib.suppress(OSError, BlobError):
            send_message(sock, self.secret, reply, data, self.deadline)

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self.server.shutdown()
        self.server.server_close()


class BlobClient:
    """A worker's side: one request per call, each bounded by ``timeout_s``."""

    def __init__(self, host: str, port: int, secret: bytes, *, timeout_s: float,
                 attempts: int = 3, deadline: Deadline | None = None) -> None:
        """Args:
            host, port: the coordinator's blob server.
            secret: the job secret.
            timeout_s: deadline of connecting and of a reply's header.
            attempts: tries of a request that fails on the connection (not on a refusal).
            deadline: a payload's deadline by its size (default: ``timeout_s`` whole).
        """
        self.host, self.port, self.secret = host, port, secret
        self.timeout_s, self.attempts = timeout_s, attempts
        self.deadline = deadline

    def request(self, header: dict[str, Any], payload: Payload = b"",
                max_reply_bytes: int = 1 << 40) -> tuple[dict[str, Any], bytes]:
        """Send one request and return the reply.

        Raises:
            BlobError: when the server refuses, or after ``attempts`` connection failures.
        """
        last: Exception | None = None
        for attempt in range(self.attempts):
            try:
                with socket.create_connection((self.host, self.port),
                                              timeout=self.timeout_s) as sock:
                    # the server may refuse before the payload is through: its reply says why
                    with contextlib.suppress(OSError):
                        send_message(sock, self.secret, header, payload, self.deadline)
                    reply, data = recv_message(sock, self.secret, self.timeout_s,
                                               max_reply_bytes, self.deadline)
            except (OSError, BlobError) as exc:
                last = exc
                time.sleep(0.05 * (attempt + 1))
                continue
            if not reply.get("ok"):
                raise BlobError(str(reply.get("error", "refused")))
            return reply, data
        raise BlobError(f"blob request {header.get('op')} to {self.host}:{self.port} failed "
                        f"{self.attempts} times: {last}")
