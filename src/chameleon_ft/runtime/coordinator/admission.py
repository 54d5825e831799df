"""Join requests from other hosts: read without blocking from a bounded window of slots,
their proofs checked, each proof used once, answered.

Join requests come from strangers by design (the store authenticates nobody), so all
here is bounded: at most ``MAX_BACKLOG`` reserved slots are looked at (a flood of
reservations moves the window on, the skipped slots counted as refused); a slot reserved
but not written is waited for at most the hang deadline, ``MAX_PENDING`` at a time,
without holding up the slots after it; a proof binds the request's fields to the
coordinator's current join nonce (``auth.join_proof``), and the nonces of proofs seen are
remembered until that join nonce changes (after ``MAX_PROOFS`` of them), so a recorded
request replayed is refused, and never answered (its reply key is the original's).

Which worker id a joiner gets is the control plane's decision
(:func:`chameleon_ft.runtime.control.members.admit`).
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_ft.runtime import auth
from chameleon_ft.runtime.protocol import JOIN_SLOTS_KEY, ControlStore, join_request_key

MAX_BACKLOG = 64
"""Reserved slots looked at, at most: beyond, the oldest are skipped (a flood)."""
MAX_PENDING = 8
"""Slots reserved but not yet written waited for at once."""
MAX_PROOFS = 1024
"""Proofs remembered per join nonce; then the nonce changes (the older one stays valid
until the next change, so a joiner that read it just before is not refused)."""
RECHECK_S = 0.05
"""How often slots reserved but not yet written are looked at again."""


@dataclass(frozen=True)
class Request:
    """One join request read: the request (None: malformed) and why its proof fails."""

    request: auth.JoinRequest | None
    refusal: str | None


class JoinDesk:
    """A bounded window over the join slots, and the proofs seen."""

    def __init__(self, store: ControlStore, *, token: str, job_name: str, job_id: str,
                 nonce: str, hang_s: float) -> None:
        self.store = store
        self.token, self.job_name, self.job_id = token, job_name, job_id
        self.hang_s = hang_s
        self.seen = 0
        """The first slot not looked at yet."""
        self.pending: dict[int, float] = {}
        """Slots reserved but not written: since when (run clock)."""
        self.looked_s = float("-inf")
        self.nonces = [nonce]
        """The current join nonce, then the previous one."""
        self.used: list[set[str]] = [set()]
        """Per join nonce: the request nonces of the proofs seen with it."""
        self.changes = 0
        store.join_nonce(nonce, self.changes)

    def requests(self, now_s: float) -> list[Request]:
        """The requests written since the last call (a replayed one is left out)."""
        slots = self.store.join_slots()
        if slots - self.seen > MAX_BACKLOG:
            self.store.refusals.refuse(JOIN_SLOTS_KEY, b"%d" % slots,
                                       f"{slots - MAX_BACKLOG - self.seen} reserved slots "
                                       "skipped", kind="join-flood")
            self.seen = slots - MAX_BACKLOG
        indices = list(range(self.seen, max(self.seen, slots)))
        self.seen = max(self.seen, slots)
        if self.pending and now_s - self.looked_s >= RECHECK_S:
            self.looked_s = now_s
            indices = sorted(self.pending) + indices
        out: list[Request] = []
        for index in indices:
            raw = self.store.take_join_request(index)
            if raw is None:
                self._wait_for(index, now_s)
                continue
            self.pending.pop(index, None)
            item = self._read(index, raw)
            if item is not None:
                out.append(item)
        return out

    def _wait_for(self, index: int, now_s: float) -> None:
        """A slot reserved but not written: wait for it (bounded in time and number)."""
        since = self.pending.setdefault(index, now_s)
        if now_s - since >= self.hang_s:
            del self.pending[index]
        elif len(self.pending) > MAX_PENDING:
            del self.pending[min(self.pending)]
        else:
            return
        self.store.refusals.refuse(join_request_key(index), None, "reserved, never written",
                                   kind="join-slot")

    def _read(self, index: int, raw: bytes) -> Request | None:
        try:
            request = auth.JoinRequest.from_json(raw)
        except ValueError:
            return Request(None, "malformed join request")
        refusal = None
        for nonce, used in zip(self.nonces, self.used, strict=True):
            refusal = auth.check_join(request, token=self.token, job_name=self.job_name,
                                      job_id=self.job_id, nonce=nonce)
            if refusal is None:
                if request.wnonce in used:
                    self.store.refusals.refuse(join_request_key(index), raw,
                                               "a join proof used before", kind="join-replay")
                    return None
                used.add(request.wnonce)
                if len(used) >= MAX_PROOFS and used is self.used[0]:
                    self._change_nonce()
                return Request(request, None)
        return Request(request, refusal)

    def _change_nonce(self) -> None:
        """A new join nonce: the previous one stays valid until the next change."""
        self.changes += 1
        self.nonces = [auth.new_nonce(), self.nonces[0]]
        self.used = [set(), self.used[0]]
        self.store.join_nonce(self.nonces[0], self.changes)

    def reply(self, request: auth.JoinRequest, reply: auth.JoinReply) -> None:
        """Answer a request (a refusal's key is bounded: ``ControlStore.reply``)."""
        self.store.reply(request.wnonce, reply.to_json(), refusal=not reply.ok)
