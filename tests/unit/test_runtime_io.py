"""The runtime's pure I/O pieces: checkpoints on disk, the bulk channel, the join
handshake. Real files and loopback sockets, no worker processes."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from chameleon_ft.runtime import auth
from chameleon_ft.runtime.storage.blobs import BlobClient, BlobError, BlobServer, send_message
from chameleon_ft.runtime.storage.checkpoint import CheckpointError, CheckpointStore, Manifest

# ---------------------------------------------------------------- checkpoints


def _write(store: CheckpointStore, step: int, gen: int = 0, layers: int = 3) -> Manifest:
    assembly = store.begin(step, gen, layers)
    for i in range(layers):
        done = assembly.add(i, f"layer {i} after {step}".encode())
        assert done == (i == layers - 1)
    return store.commit(assembly, plan={"p": 1}, meta={"config": "abc"})


def test_checkpoint_round_trip_and_manifest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    manifest = _write(store, 20)
    assert manifest.folder.name == "step00000020"
    again = store.latest()
    assert again is not None and again.step == 20 and again.meta == {"config": "abc"}
    assert again.read_layer(1) == b"layer 1 after 20"
    doc = json.loads((manifest.folder / "manifest.json").read_text())
    assert doc["layers"]["2"]["sha256"] and doc["step"] == 20
    assert not list(tmp_path.glob("checkpoints/.partial-*"))


def test_an_incomplete_assembly_is_never_read_or_committed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    assembly = store.begin(10, 0, 3)
    assembly.add(0, b"x")
    assert store.latest() is None and store.steps() == []
    with pytest.raises(CheckpointError, match="missing"):
        store.commit(assembly, plan={}, meta={})
    # a crash leaves the partial folder; opening the store again removes it
    CheckpointStore(tmp_path, keep=3)
    assert not list(tmp_path.glob("checkpoints/.partial-*"))


def test_a_fresh_run_sets_an_earlier_runs_checkpoints_aside(tmp_path: Path) -> None:
    """A run from step 0 in a folder holding an earlier run's later checkpoints keeps its
    own: retention no longer deletes them for the older run's, nothing is deleted."""
    earlier = CheckpointStore(tmp_path, keep=2)
    for step in (200, 220, 240):
        _write(earlier, step)
    store = CheckpointStore(tmp_path, keep=2)
    moved = store.set_aside_earlier()
    assert moved == tmp_path / "checkpoints.earlier-1"
    assert sorted(p.name for p in moved.glob("step*")) == ["step00000220", "step00000240"]
    assert store.steps() == []
    assert _write(store, 20).step == 20 and _write(store, 40).step == 40
    assert store.steps() == [20, 40]
    assert store.set_aside_earlier() == tmp_path / "checkpoints.earlier-2"  # a third run
    assert store.set_aside_earlier() is None  # nothing left to move: the folder stays
    assert store.steps() == [] and store.root.is_dir()


def test_two_timelines_assemble_apart(tmp_path: Path) -> None:
    # after a restart, uploads of the old generation (0) and of the new one (2) for the
    # same step must not complete each other's checkpoint
    store = CheckpointStore(tmp_path, keep=3)
    old, new = store.begin(8, 0, 2), store.begin(8, 2, 2)
    old.add(0, b"old-0")
    new.add(1, b"new-1")
    assert not old.complete and not new.complete
    new.add(0, b"new-0")
    manifest = store.commit(new, plan={}, meta={})
    assert manifest.read_layer(0) == b"new-0" and manifest.gen == 2


def test_corruption_is_detected_and_an_older_checkpoint_used(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    _write(store, 10)
    newer = _write(store, 20)
    (newer.folder / "layer1.bin").write_bytes(b"layer 1 after 2X")  # same size, flipped
    with pytest.raises(CheckpointError, match="sha256"):
        store.manifest(20).read_layer(1)
    (newer.folder / "layer2.bin").write_bytes(b"short")  # a size change: manifest check
    latest = store.latest()
    assert latest is not None and latest.step == 10


def test_only_the_last_k_are_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (5, 10, 15, 20):
        _write(store, step)
    assert store.steps() == [15, 20]


def test_redone_step_replaces_its_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    _write(store, 4, gen=0)
    assembly = store.begin(4, 5, 3)
    for i in range(3):
        assembly.add(i, b"redo")
    manifest = store.commit(assembly, plan={}, meta={})
    assert manifest.gen == 5 and store.manifest(4).read_layer(0) == b"redo"


def test_malformed_manifest_is_a_checkpoint_error(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    manifest = _write(store, 3)
    (manifest.folder / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        store.manifest(3)
    assert store.latest() is None


# ---------------------------------------------------------------- bulk channel

SECRET = auth.secret_of("a-test-token-of-enough-length")


def _echo(header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    if header.get("op") == "fail":
        raise BlobError("refused on purpose")
    if header.get("op") == "bug":
        raise KeyError("oops")
    return {"got": len(payload)}, payload[::-1]


@pytest.fixture
def server() -> Any:
    srv = BlobServer("127.0.0.1", SECRET, _echo, timeout_s=2.0, max_payload_bytes=1 << 20)
    yield srv
    srv.close()


def test_blob_round_trip(server: BlobServer) -> None:
    client = BlobClient("127.0.0.1", server.port, SECRET, timeout_s=2.0)
    data = bytes(range(256)) * 1000
    reply, back = client.request({"op": "put"}, data)
    assert reply["got"] == len(data) and back == data[::-1]


def test_blob_wrong_secret_is_refused(server: BlobServer) -> None:
    client = BlobClient("127.0.0.1", server.port, auth.secret_of("another-token-entirely"),
                        timeout_s=2.0, attempts=1)
    with pytest.raises(BlobError):
        client.request({"op": "put"}, b"x")
    assert server.refused >= 1


def test_blob_refusals_and_handler_bugs_are_replies(server: BlobServer) -> None:
    client = BlobClient("127.0.0.1", server.port, SECRET, timeout_s=2.0)
    with pytest.raises(BlobError, match="on purpose"):
        client.request({"op": "fail"})
    with pytest.raises(BlobError, match="KeyError"):
        client.request({"op": "bug"})
    assert client.request({"op": "put"}, b"ok")[1] == b"ko"  # the server still serves


def test_blob_oversized_and_corrupt_payloads_are_refused(server: BlobServer) -> None:
    client = BlobClient("127.0.0.1", server.port, SECRET, timeout_s=2.0, attempts=1)
    with pytest.raises(BlobError, match="refused"):
        client.request({"op": "put"}, b"x" * ((1 << 20) + 1))
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as sock:
        # a valid header whose payload then differs from its digest
        send_message(sock, SECRET, {"op": "put"}, b"abcd")
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as sock:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")  # a stranger speaking another protocol
        sock.settimeout(2)
        assert sock.recv(4) in (b"CHB1", b"")
    assert server.refused >= 2


def test_blob_silent_peer_is_bounded(server: BlobServer) -> None:
    # a client that connects and sends nothing occupies one thread until the deadline
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.settimeout(5)
        data = sock.recv(1 << 16)
    assert time.monotonic() - start < 4.0
    assert data == b"" or data.startswith(b"CHB1")


def test_blob_client_gives_up_after_its_attempts() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = BlobClient("127.0.0.1", port, SECRET, timeout_s=0.5, attempts=2)
    with pytest.raises(BlobError, match="2 times"):
        client.request({"op": "put"}, b"x")


def test_blob_concurrent_requests(server: BlobServer) -> None:
    client = BlobClient("127.0.0.1", server.port, SECRET, timeout_s=5.0)
    results: list[bytes] = []

    def one(i: int) -> None:
        results.append(client.request({"op": "put"}, bytes([i]) * 1000)[1])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(r[0] for r in results) == list(range(8))


def test_blob_connections_wait_in_the_listen_queue_while_the_server_is_busy(
        server: BlobServer) -> None:
    # After a restart every worker asks for its layers at once while the coordinator's
    # interpreter is busy; a connection that finds the listen queue full has its SYN
    # dropped and retries after TCP's 1 s initial timeout (a whole step lost per restart).
    server.server.shutdown()  # nobody accepts: connections can only wait in the queue
    socks = []
    try:
        for _ in range(64):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", server.port))
            socks.append(sock)
        deadline = time.monotonic() + 0.5
        pending = list(socks)
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], pending, [], 0.05)
            pending = [s for s in pending if s not in writable]
        assert not pending, f"{len(pending)} of 64 connections not queued"
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 for s in socks)
    finally:
        for sock in socks:
            sock.close()


# ---------------------------------------------------------------- joins


def test_join_proof_binds_token_job_nonces_and_fields() -> None:
    token = "a-test-token-of-enough-length"
    request = auth.JoinRequest(wnonce="w1", proof="", job="", host="h",
                               address="10.0.0.2").proved(token, "job1", "n1")
    assert auth.check_join(request, token=token, job_name="tiny", job_id="job1",
                           nonce="n1") is None
    for kwargs in ({"token": "another-token-of-length"}, {"job_id": "job2"}, {"nonce": "n2"}):
        args = {"token": token, "job_name": "tiny", "job_id": "job1", "nonce": "n1", **kwargs}
        assert "wrong token" in str(auth.check_join(request, **args))
    # a copied proof cannot carry other fields: another address or GPU index is refused
    for change in ({"address": "10.0.0.66"}, {"host": "elsewhere"}, {"local_index": 3},
                   {"wnonce": "w2"}):
        forged = replace(request, **change)
        assert "wrong token" in str(auth.check_join(forged, token=token, job_name="tiny",
                                                    job_id="job1", nonce="n1"))


def test_join_for_another_job_names_both() -> None:
    request = auth.JoinRequest(wnonce="w", proof="x", job="other", host="h", address="a")
    why = auth.check_join(request, token="t" * 20, job_name="tiny", job_id="j", nonce="n")
    assert why is not None and "'tiny'" in why and "'other'" in why


@pytest.mark.parametrize("text", ["", "{}", "[]", "null", '{"wnonce": 1}', "\xff",
                                  json.dumps({"wnonce": "", "proof": "", "job": "",
                                              "host": "", "address": ""}),
                                  json.dumps({"wnonce": "x" * 600, "proof": "", "job": "",
                                              "host": "", "address": ""})])
def test_malformed_join_requests_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="malformed"):
        auth.JoinRequest.from_json(text)


def test_reply_round_trip_and_malformed() -> None:
    reply = auth.JoinReply(ok=True, worker=3, incarnation="abc", replacement=True)
    assert auth.JoinReply.from_json(reply.to_json()) == reply
    with pytest.raises(ValueError):
        auth.JoinReply.from_json("{")


def test_tokens() -> None:
    assert len(auth.new_token()) >= auth.MIN_TOKEN_CHARS
    assert auth.resolve_token(None, {auth.TOKEN_ENV: "x" * 20}) == "x" * 20
    assert auth.resolve_token("y" * 20, {auth.TOKEN_ENV: "x" * 20}) == "y" * 20
    assert auth.resolve_token(None, {}) is None
    with pytest.raises(ValueError, match="--token"):
        auth.resolve_token("short", {})


@pytest.mark.parametrize(("host", "loop"), [("127.0.0.1", True), ("127.0.1.1", True),
                                            ("::1", True), ("localhost", True),
                                            ("10.1.2.3", False), ("0.0.0.0", False),
                                            ("example", False)])
def test_is_loopback(host: str, loop: bool) -> None:
    assert auth.is_loopback(host) is loop


def test_advertise_address_is_never_a_loopback_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    assert auth.advertise_address("127.0.0.1", 5) == "127.0.0.1"
    assert auth.advertise_address("10.0.0.1", 5, "10.0.0.9") == "10.0.0.9"

    class FakeSocket:
        def __init__(self, *_: Any) -> None:
            pass

        def __enter__(self) -> FakeSocket:
            return self

        def __exit__(self, *_: Any) -> None:
            pass

        def connect(self, _: Any) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.1.1", 0)  # what Debian maps the host name to

    monkeypatch.setattr(auth.socket, "socket", FakeSocket)
    with pytest.raises(ValueError, match="--advertise-address"):
        auth.advertise_address("10.0.0.1", 5)
