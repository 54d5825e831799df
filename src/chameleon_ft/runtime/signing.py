"""Authenticated control values: what the coordinator and the workers write to the store,
sealed with the job's key, and acted on only when the seal holds (docs/design.md 4.5).

The store (``TCPStore``) authenticates nobody: whoever reaches its port can read, write,
count, delete and list every key. So every value the control plane acts on carries a MAC
(HMAC-SHA256, 128 bits kept) under the job key, over the job's id, the key's name (which
names the generation: every per-generation key lives under ``gen{g}/``), a sequence
number and the payload::

    value = b"{seq}.{tag}." + payload
    tag = HMAC-SHA256(key, job_id NUL name NUL seq NUL payload)[:16], hex

A value copied from another key, another generation or another job fails its tag. A key
written more than once (a heartbeat, the current generation, the fault list) numbers its
values, and its readers keep the highest number they accepted and refuse a lower one (a
replay); a key written once is never read with an older value of its own. A refused value
is ignored and counted (:class:`Refusals`), never acted on; a reader waiting for a value
waits past forged ones (the legitimate writer overwrites them). A key's name is no secret
and a counter carries no proof: the control plane acts on no counter (``protocol``).

Pure Python (no torch): the coordinator's store (``coordinator.store``) and the workers'
channels (``worker.channel``) both read and write through :class:`SignedStore`.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

TAG_CHARS = 32
"""Hex characters of a tag (128 bits)."""
MAX_SEQ_CHARS = 19
"""Digits of the largest sequence number (below 2**63)."""
PEEK = b"\x00chameleon-peek\x00"
"""The marker a non-blocking read compares against (``compare_set`` with it as both the
expected and the new value returns the value, or the marker for a missing key)."""


def control_key(secret: bytes) -> bytes:
    """The control plane's MAC key, derived from the job secret (``auth.secret_of``, itself
    derived from the token), distinct from the bulk channel's key."""
    return hmac.digest(secret, b"chameleon-control", "sha256")


class Forged(ValueError):
    """A value whose seal does not hold: forged, copied from another key, generation or
    job, or not a sealed value at all."""


@dataclass(frozen=True)
class Opened:
    """A value whose seal held: its sequence number and payload."""

    seq: int
    payload: bytes

    def text(self) -> str:
        """The payload as text."""
        return self.payload.decode(errors="replace")


def split(raw: bytes) -> tuple[int, bytes, bytes]:
    """``(seq, tag, payload)`` of a sealed value, unverified.

    Raises:
        Forged: when ``raw`` does not have a sealed value's form.
    """
    parts = bytes(raw).split(b".", 2)
    if len(parts) != 3 or not parts[0].isdigit() or len(parts[0]) > MAX_SEQ_CHARS \
            or len(parts[1]) != TAG_CHARS:
        raise Forged("not a sealed value")
    return int(parts[0]), parts[1], parts[2]


def payload_of(raw: bytes) -> bytes:
    """The payload of a sealed value, unverified (what a joiner reads before it can check
    anything: the job's public description).

    Raises:
        Forged: when ``raw`` does not have a sealed value's form.
    """
    return split(raw)[2]


class Signer:
    """Seals and opens values under one job's key.

    Args:
        key: the MAC key (:func:`control_key`).
        job_id: the job's id (random per run): values of another run never pass.
    """

    def __init__(self, key: bytes, job_id: str) -> None:
        self.key = key
        self.job_id = job_id
        self._job = job_id.encode()

    @classmethod
    def private(cls) -> Signer:
        """A signer with a fresh random key: for a store only this process writes."""
        return cls(secrets.token_bytes(32), secrets.token_hex(8))

    def _tag(self, name: str, seq: int, payload: bytes) -> bytes:
        head = b"%s\x00%s\x00%d\x00" % (self._job, name.encode(), seq)
        return hmac.digest(self.key, head + payload, "sha256").hex()[:TAG_CHARS].encode()

    def seal(self, name: str, payload: bytes | str, seq: int = 0) -> bytes:
        """``payload`` sealed for key ``name`` with sequence number ``seq``."""
        data = payload.encode() if isinstance(payload, str) else bytes(payload)
        if not 0 <= seq < 10 ** MAX_SEQ_CHARS:
            raise ValueError(f"seq: must be in [0, 10**{MAX_SEQ_CHARS}), got {seq}")
        return b"%d.%s." % (seq, self._tag(name, seq, data)) + data

    def open(self, name: str, raw: bytes) -> Opened:
        """The value of key ``name``, its seal checked.

        Raises:
            Forged: when the seal does not hold for this key, job and payload.
        """
        seq, tag, payload = split(raw)
        if not hmac.compare_digest(tag, self._tag(name, seq, payload)):
            raise Forged("bad tag (forged, or copied from another key, generation or job)")
        return Opened(seq, payload)

    def derive(self, label: str) -> str:
        """A name part only holders of the key can compute (16 hex characters)."""
        return hmac.digest(self.key, b"name\x00%s\x00%s" % (self._job, label.encode()),
                           "sha256").hex()[:16]


def first_part(name: str) -> str:
    """The default message kind of a key: its first path component."""
    return name.split("/", 1)[0]


class Refusals:
    """Values refused, counted per message kind (thread-safe).

    The same bytes refused again at the same key (read again at the next poll) count once;
    one warning line per source, for at most ``max_sources`` sources, then one line saying
    further ones are only counted.

    Args:
        warn: receives each warning line.
        kind_of: the message kind of a key's name.
        max_sources: sources that get a warning line.
        max_remembered: refused values remembered to count each once.
    """

    def __init__(self, warn: Callable[[str], None] | None = None, *,
                 kind_of: Callable[[str], str] = first_part, max_sources: int = 16,
                 max_remembered: int = 4096) -> None:
        self.warn = warn or (lambda _line: None)
        self.kind_of = kind_of
        self.max_sources, self.max_remembered = max_sources, max_remembered
        self._counts: dict[str, int] = {}
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._sources: set[str] = set()
        self._quiet = False
        self._lock = threading.Lock()
        self.version = 0
        """Bumped at every new refusal (a worker reports its counts when it moved)."""

    def refuse(self, name: str, raw: bytes | None, why: str, *,
               source: str | None = None, kind: str | None = None) -> None:
        """Count a refused value of key ``name`` (``raw``: its bytes; None: count it
        whatever was refused before) and warn once per source (default: its kind)."""
        kind = kind or self.kind_of(name)
        source = source or kind
        line = None
        with self._lock:
            if raw is not None:
                mark = (name, hash(bytes(raw)))
                if mark in self._seen:
                    return
                self._seen[mark] = None
                if len(self._seen) > self.max_remembered:
                    self._seen.popitem(last=False)
            self._counts[kind] = self._counts.get(kind, 0) + 1
            self.version += 1
            if source not in self._sources and len(self._sources) < self.max_sources:
                self._sources.add(source)
                line = f"refused the value at {name!r} ({kind}: {why}); counted, further " \
                       f"ones from {source} are not logged"
            elif source not in self._sources and not self._quiet:
                self._quiet = True
                line = "refused values from more sources: counted in the report, not logged"
        if line is not None:
            self.warn(line)

    def counts(self) -> dict[str, int]:
        """Refusals so far, per message kind."""
        with self._lock:
            return dict(sorted(self._counts.items()))


def merge_counts(*parts: Mapping[str, int]) -> dict[str, int]:
    """Per-kind counts added up."""
    out: dict[str, int] = {}
    for part in parts:
        for kind, n in part.items():
            out[str(kind)] = out.get(str(kind), 0) + int(n)
    return dict(sorted(out.items()))


class SignedStore:
    """A raw store client (``TCPStore`` or anything with its methods) seen through a
    :class:`Signer`: writes seal, reads open, refused values are counted and ignored.

    No read here blocks: :meth:`peek` is one ``compare_set`` that changes nothing.

    Args:
        raw: the store client.
        signer: the job's signer.
        refusals: where refused values are counted.
        max_latest: keys whose highest accepted sequence number is remembered.
    """

    def __init__(self, raw: Any, signer: Signer, refusals: Refusals | None = None,
                 max_latest: int = 4096) -> None:
        self.raw, self.signer = raw, signer
        self.refusals = refusals or Refusals()
        self.max_latest = max_latest
        self._latest: OrderedDict[str, Opened] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, name: str, payload: bytes | str, seq: int = 0) -> None:
        """Write ``payload`` sealed at ``name``."""
        self.raw.set(name, self.signer.seal(name, payload, seq))

    def raw_peek(self, name: str) -> bytes | None:
        """The bytes at ``name`` (None: no such key), without blocking."""
        value = bytes(self.raw.compare_set(name, PEEK, PEEK))
        return None if value == PEEK else value

    def open(self, name: str, raw: bytes, *, source: str | None = None) -> Opened | None:
        """``raw`` read at ``name`` if its seal holds, else None (counted)."""
        try:
            return self.signer.open(name, raw)
        except Forged as exc:
            self.refusals.refuse(name, raw, str(exc), source=source)
            return None

    def peek(self, name: str, *, source: str | None = None) -> Opened | None:
        """The value at ``name`` if there is one and its seal holds (a refused one is
        counted), without blocking."""
        raw = self.raw_peek(name)
        return None if raw is None else self.open(name, raw, source=source)

    def latest(self, name: str, *, source: str | None = None) -> Opened | None:
        """The value at ``name`` with the highest sequence number accepted so far: a value
        numbered lower than one accepted before is a replay (refused, counted)."""
        raw = self.raw_peek(name)
        value = None if raw is None else self.open(name, raw, source=source)
        with self._lock:
            known = self._latest.get(name)
            replayed = value is not None and known is not None and value.seq < known.seq
            if value is not None and not replayed:
                self._latest[name] = known = value
                self._latest.move_to_end(name)
                if len(self._latest) > self.max_latest:
                    self._latest.popitem(last=False)
        if replayed:
            self.refusals.refuse(name, raw, "replayed: an older value of this key",
                                 source=source)
        return known

    def forget(self, name: str) -> None:
        """Stop remembering ``name``'s highest sequence number (its key is deleted)."""
        with self._lock:
            self._latest.pop(name, None)

    def all_present(self, names: list[str]) -> bool:
        """Whether every key in ``names`` exists (one request; nothing is opened)."""
        return not names or bool(self.raw.check(names))

    def claim(self, name: str, payload: str) -> bool:
        """Claim ``name`` once for the whole job: True for the first legitimate claim
        (``payload`` says whose; each claim is made unique, so a second claim by the same
        process is refused too). A forged value found there is replaced atomically
        (``compare_set``), so a stranger cannot claim it first.
        """
        mine = self.signer.seal(name, f"{payload}/{secrets.token_hex(8)}")
        found = bytes(self.raw.compare_set(name, b"", mine))
        for _ in range(4):
            if found == mine:
                return True
            if self.open(name, found) is not None:
                return False  # a legitimate claim came first
            found = bytes(self.raw.compare_set(name, found, mine))
        return found == mine


class Reported:
    """What the other processes say they refused: each writes its counts, numbered, to a
    key of its own (``key_of(worker, incarnation)``); this reads them, and keeps the sum of
    those no longer followed.

    Args:
        signed: the reader's store.
        key_of: the key of one process's counts.
    """

    def __init__(self, signed: SignedStore, key_of: Callable[[int, str], str]) -> None:
        self.signed, self.key_of = signed, key_of
        self.followed: dict[tuple[int, str], dict[str, int]] = {}
        self.gone: dict[str, int] = {}

    def read(self, worker: int, incarnation: str) -> None:
        """Read one process's counts now."""
        opened = self.signed.latest(self.key_of(worker, incarnation), source=f"worker {worker}")
        if opened is None:
            return
        try:
            counts = {str(k): int(v) for k, v in dict(json.loads(opened.payload)).items()}
        except (ValueError, TypeError):
            return
        self.followed[(worker, incarnation)] = counts

    def drop(self, worker: int, incarnation: str) -> None:
        """A process no longer followed: its last counts are kept in the sum."""
        self.read(worker, incarnation)
        self.gone = merge_counts(self.gone, self.followed.pop((worker, incarnation), {}))
        self.signed.forget(self.key_of(worker, incarnation))

    def total(self, live: Mapping[int, str]) -> dict[str, int]:
        """Every process's counts added up (``live``'s read now)."""
        for worker, incarnation in live.items():
            self.read(worker, incarnation)
        return merge_counts(self.gone, *self.followed.values())
