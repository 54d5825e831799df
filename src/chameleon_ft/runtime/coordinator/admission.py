"""Join requests from other hosts: read in slot order, proofs checked, answered.

Which worker id a joiner gets is the control plane's decision
(:func:`chameleon_ft.runtime.control.members.admit`); this handle reads the requests
without ever blocking and writes the replies.
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_ft.runtime import auth
from chameleon_ft.runtime.protocol import ControlStore


@dataclass(frozen=True)
class Request:
    """One join request read: the request (None: malformed) and why its proof fails."""

    request: auth.JoinRequest | None
    refusal: str | None


class JoinDesk:
    """A cursor over the join slots: a slot reserved but not written is skipped after the
    hang deadline (its writer died between reserving and writing)."""

    def __init__(self, store: ControlStore, *, token: str, job_name: str, job_id: str,
                 nonce: str, hang_s: float) -> None:
        self.store = store
        self.token, self.job_name, self.job_id, self.nonce = token, job_name, job_id, nonce
        self.hang_s = hang_s
        self.seen = 0
        self.wait_since_s: float | None = None

    def requests(self, now_s: float) -> list[Request]:
        """The requests written since the last call, in slot order."""
        out: list[Request] = []
        slots = self.store.join_slots()
        while self.seen < slots:
            raw = self.store.take_join_request(self.seen)
            if raw is None:
                if self.wait_since_s is None:
                    self.wait_since_s = now_s
                if now_s - self.wait_since_s < self.hang_s:
                    break
                self.seen += 1
                self.wait_since_s = None
                continue
            self.wait_since_s = None
            self.seen += 1
            try:
                request = auth.JoinRequest.from_json(raw)
            except ValueError:
                out.append(Request(None, "malformed join request"))
                continue
            out.append(Request(request, auth.check_join(
                request, token=self.token, job_name=self.job_name, job_id=self.job_id,
                nonce=self.nonce)))
        return out

    def reply(self, request: auth.JoinRequest, reply: auth.JoinReply) -> None:
        """Answer a request."""
        self.store.reply(request.wnonce, reply.to_json())
