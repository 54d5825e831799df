"""Join requests from other hosts: the slots the control plane asks for read without
blocking, their proofs checked, each proof used once, answered.

Which slots are read, waited for or given up (a bounded window over a counter anyone can
raise) is the control plane's (:mod:`chameleon_ft.runtime.control.slots`), and so is
which worker id a joiner gets (:func:`chameleon_ft.runtime.control.joining.on_joins`).
This handle does what needs the store and the job's key: it takes (reads and deletes)
the slots asked for, checks each proof, draws the incarnation an admitted joiner's
process gets, and writes the replies. A proof binds the request's fields to the
coordinator's current join nonce (``auth.join_proof``), and the nonces of proofs seen
are remembered until that join nonce changes (after ``MAX_PROOFS`` of them), so a
recorded request replayed is refused, and never answered (its reply key is the
original's). A refusal's reply is deleted once ``MAX_REFUSAL_REPLIES`` later ones were
written (``ControlStore.reply``); a joiner deletes its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from chameleon_ft.runtime import auth
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.coordinator.store import ControlStore
from chameleon_ft.runtime.protocol import MALFORMED, MISSING, REPLAYED, join_request_key

MAX_PROOFS = 1024
"""Proofs remembered per join nonce; then the nonce changes (the older one stays valid
until the next change, so a joiner that read it just before is not refused)."""


class JoinDesk:
    """The join slots as the control plane reads them, and the proofs seen."""

    def __init__(self, store: ControlStore, *, token: str, job_name: str, job_id: str,
                 nonce: str) -> None:
        self.store = store
        self.token, self.job_name, self.job_id = token, job_name, job_id
        self.nonces = [nonce]
        """The current join nonce, then the previous one."""
        self.used: list[set[str]] = [set()]
        """Per join nonce: the request nonces of the proofs seen with it."""
        self.changes = 0
        store.join_nonce(nonce, self.changes)

    def take(self, slots: Iterable[int]) -> tuple[tuple[int, m.Joiner | str], ...]:
        """Read and delete these slots: each a :class:`~messages.Joiner` with its proof
        checked, ``MISSING`` (not written yet), ``MALFORMED`` or ``REPLAYED`` (counted)."""
        out: list[tuple[int, m.Joiner | str]] = []
        for index in slots:
            raw = self.store.take_join_request(index)
            out.append((index, MISSING if raw is None else self._read(index, raw)))
        return tuple(out)

    def _read(self, index: int, raw: bytes) -> m.Joiner | str:
        try:
            request = auth.JoinRequest.from_json(raw)
        except ValueError:
            return MALFORMED
        refusal = None
        for nonce, used in zip(self.nonces, self.used, strict=True):
            refusal = auth.check_join(request, token=self.token, job_name=self.job_name,
                                      job_id=self.job_id, nonce=nonce)
            if refusal is None:
                if request.wnonce in used:
                    self.store.refusals.refuse(join_request_key(index), raw,
                                               "a join proof used before", kind="join-replay")
                    return REPLAYED
                used.add(request.wnonce)
                if len(used) >= MAX_PROOFS and used is self.used[0]:
                    self._change_nonce()
                break
        return m.Joiner(request, auth.new_nonce(), refusal)

    def _change_nonce(self) -> None:
        """A new join nonce: the previous one stays valid until the next change."""
        self.changes += 1
        self.nonces = [auth.new_nonce(), self.nonces[0]]
        self.used = [set(), self.used[0]]
        self.store.join_nonce(self.nonces[0], self.changes)

    def reply(self, request: auth.JoinRequest, reply: auth.JoinReply) -> None:
        """Answer a request (a refusal's key is bounded: ``ControlStore.reply``)."""
        self.store.reply(request.wnonce, reply.to_json(), refusal=not reply.ok)
