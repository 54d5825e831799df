"""Who may join a job: tokens, the join handshake, advertised addresses.

Threat model (docs/design.md 4.5): the ``TCPStore`` and gloo have no encryption and no
authentication of their own. The token keeps out workers that do not belong to the job (a
stale worker of another job on the same port, a typo in an address, a stranger probing
the port): a worker proves it knows the token without sending it, by an HMAC over a nonce
the coordinator chose, one it chose itself and its request's fields. Keys derived from
the token seal every control value (``runtime.signing``) and authenticate every bulk
transfer (``runtime.blobs``). Someone who reaches the store can still deny service
(flood it, delete or overwrite keys); nobody without the token can steer the job.

Handshake through the store::

    worker: nonce = join/nonce (the coordinator's current one);
            i = add(join/slots, 1) - 1;
            join/req/{i} = {wnonce, proof, job, host, address, local_index}
    coordinator: join/reply/{wnonce} = sealed {ok, worker, incarnation} or
                 {ok: false, reason}

``proof = HMAC-SHA256(token, "join|{job_id}|{nonce}|{wnonce}|{fields}")``, ``fields``
the request's job, host, address and local index (:meth:`JoinRequest.fields`). The
coordinator accepts each proof once (``coordinator.admission``).

Pure Python (no torch).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
from dataclasses import asdict, dataclass, replace
from typing import Any

from chameleon_ft.runtime.placement import MAX_LOCAL_INDEX

TOKEN_ENV = "CHAMELEON_TOKEN"
"""Environment variable holding the job token (both sides)."""
COORDINATOR_ENV = "CHAMELEON_COORDINATOR"
"""Environment variable holding ``HOST:PORT`` of the coordinator (``chameleon worker``)."""
JOB_ENV = "CHAMELEON_JOB"
"""Environment variable naming the job a worker means to join (optional)."""
MIN_TOKEN_CHARS = 16


def new_token() -> str:
    """A fresh random token (192 bits, URL-safe)."""
    return secrets.token_urlsafe(24)


def new_nonce() -> str:
    """A fresh random nonce (hex)."""
    return secrets.token_hex(16)


def resolve_token(flag: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The token from ``--token`` or, failing that, ``CHAMELEON_TOKEN``.

    Raises:
        ValueError: for a token shorter than 16 characters.
    """
    env = os.environ if environ is None else environ
    token = flag if flag else env.get(TOKEN_ENV) or None
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"--token: at least {MIN_TOKEN_CHARS} characters (got {len(token)}); "
                         "leave it out to have the coordinator generate one")
    return token


def secret_of(token: str) -> bytes:
    """The key that authenticates bulk transfers, derived from the token."""
    return hashlib.sha256(b"chameleon-blobs|" + token.encode()).digest()


def join_proof(token: str, job_id: str, nonce: str, wnonce: str, fields: str = "") -> str:
    """What a worker sends to prove it knows ``token`` (``fields``: the request's own,
    :meth:`JoinRequest.fields`, so that a copied proof cannot carry other ones)."""
    msg = f"join|{job_id}|{nonce}|{wnonce}|{fields}".encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``127.x``, ``::1``, ``localhost``)."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class JoinRequest:
    """A remote worker asking to join."""

    wnonce: str
    proof: str
    job: str
    """The job name the worker means to join ("" for whichever runs there)."""
    host: str
    address: str
    """Where other workers reach it."""
    local_index: int | None = None
    """Its node-local index from its launcher (``LOCAL_RANK``, ``SLURM_LOCALID``), or
    None: the coordinator picks one (``runtime.placement``)."""

    def to_json(self) -> str:
        """Serialise."""
        return json.dumps(asdict(self))

    def fields(self) -> str:
        """What the proof binds besides the nonces: the job, host, address and index."""
        return json.dumps([self.job, self.host, self.address, self.local_index])

    def proved(self, token: str, job_id: str, nonce: str) -> JoinRequest:
        """This request with its proof made with ``token``."""
        return replace(self, proof=join_proof(token, job_id, nonce, self.wnonce, self.fields()))

    @classmethod
    def from_json(cls, text: bytes | str) -> JoinRequest:
        """Parse, rejecting anything malformed.

        Raises:
            ValueError: for a message that is not a join request.
        """
        try:
            doc = json.loads(text)
            fields = {k: doc[k] for k in ("wnonce", "proof", "job", "host", "address")}
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError("malformed join request") from None
        if not all(isinstance(v, str) and len(v) <= 512 for v in fields.values()):
            raise ValueError("malformed join request")
        if not fields["wnonce"]:
            raise ValueError("malformed join request")
        index = doc.get("local_index")
        if index is not None and (type(index) is not int
                                  or not 0 <= index < MAX_LOCAL_INDEX):
            raise ValueError("malformed join request")
        return cls(**fields, local_index=index)


@dataclass(frozen=True)
class JoinReply:
    """The coordinator's answer."""

    ok: bool
    reason: str = ""
    worker: int = -1
    incarnation: str = ""
    replacement: bool = False
    """Admitted in place of a dead worker (it waits idle until a plan uses it)."""
    local_index: int = 0
    """The worker's node-local index among this job's workers on its host (its GPU)."""

    def to_json(self) -> str:
        """Serialise."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> JoinReply:
        """Parse.

        Raises:
            ValueError: for a malformed reply.
        """
        try:
            doc: dict[str, Any] = json.loads(text)
            return cls(ok=bool(doc["ok"]), reason=str(doc.get("reason", "")),
                       worker=int(doc.get("worker", -1)),
                       incarnation=str(doc.get("incarnation", "")),
                       replacement=bool(doc.get("replacement", False)),
                       local_index=int(doc.get("local_index", 0)))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError("malformed join reply") from None


def check_join(request: JoinRequest, *, token: str, job_name: str, job_id: str,
               nonce: str) -> str | None:
    """Why ``request`` must be refused, or None when it proves it belongs to the job."""
    if request.job and request.job != job_name:
        return (f"this coordinator runs job {job_name!r}, not {request.job!r} (another job "
                "on the same port?)")
    expected = join_proof(token, job_id, nonce, request.wnonce, request.fields())
    if not hmac.compare_digest(expected, request.proof):
        return "wrong token (check --token or CHAMELEON_TOKEN on both sides)"
    return None


def advertise_address(coordinator_host: str, coordinator_port: int,
                      override: str | None = None) -> str:
    """The address other workers should dial to reach this host.

    ``override`` (``--advertise-address``) wins. With a loopback coordinator every worker
    is local: ``127.0.0.1``. Otherwise the address of the interface that reaches the
    coordinator (a connected UDP socket sends nothing and tells it); when the coordinator
    listens on every interface (``0.0.0.0``), the interface of the default route. Never a
    loopback alias such as ``127.0.1.1``, which some systems map the host name to.

    Raises:
        ValueError: when no address other hosts could use is found.
    """
    if override:
        return override
    if is_loopback(coordinator_host):
        return "127.0.0.1"
    target = coordinator_host
    if target in ("0.0.0.0", "::", ""):
        target = "192.0.2.1"  # TEST-NET-1: never routed, only used to pick the interface
    try:
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((target.strip("[]"), coordinator_port or 9))
            address = str(s.getsockname()[0])
    except OSError as exc:
        raise ValueError(f"--advertise-address: cannot tell which interface reaches "
                         f"{coordinator_host} ({exc}); give the address other hosts reach "
                         "this one at") from None
    if is_loopback(address) or address in ("0.0.0.0", "::"):
        raise ValueError(f"--advertise-address: the interface that reaches {coordinator_host} "
                         f"is {address}, which other hosts cannot dial; give this host's "
                         "address")
    return address
