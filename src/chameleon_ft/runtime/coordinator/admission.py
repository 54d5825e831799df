"""Join requests from other hosts: read, proofs checked, answered.

Which slots are read, skipped or waited for, and which worker id a joiner gets, is the
control plane's (:func:`chameleon_ft.runtime.control.joining.on_joins`); this handle reads
the slots the control plane asks for without ever blocking, checks each proof, draws the
incarnation an admitted joiner's process gets, writes the replies and deletes the slots
read. A reply is deleted by its joiner once read; one nobody reads (a stranger's) is
deleted after the join deadline, and at most ``MAX_REPLIES`` wait, so refusals leave no
keys behind however many come.
"""

from __future__ import annotations

from collections import deque

from chameleon_ft.runtime import auth
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import slots as sl
from chameleon_ft.runtime.protocol import MALFORMED, ControlStore

MAX_REPLIES = 1024
"""Replies kept for their joiners at most (the oldest go first)."""


class JoinDesk:
    """The job's join requests, as the control plane reads them."""

    def __init__(self, store: ControlStore, *, token: str, job_name: str, job_id: str,
                 nonce: str, keep_s: float = 60.0) -> None:
        self.store = store
        self.token, self.job_name, self.job_id, self.nonce = token, job_name, job_id, nonce
        self.keep_s = keep_s
        """How long a reply waits for its joiner (the join deadline)."""
        self.replies: deque[tuple[float, str]] = deque()
        """``(written at, joiner's nonce)`` of the replies not known to be read."""

    def slots(self, first: int) -> tuple[m.Joiner | str, ...]:
        """The join slots from ``first`` on (at most ``MAX_SLOTS_PER_READ``): each a
        :class:`~messages.Joiner` with its proof checked, ``MISSING`` or ``MALFORMED``."""
        out: list[m.Joiner | str] = []
        for raw in self.store.join_requests(first, sl.MAX_SLOTS_PER_READ):
            if raw == sl.MISSING:
                out.append(sl.MISSING)
                continue
            try:
                request = auth.JoinRequest.from_json(raw)
            except ValueError:
                out.append(MALFORMED)
                continue
            refusal = auth.check_join(request, token=self.token, job_name=self.job_name,
                                      job_id=self.job_id, nonce=self.nonce)
            out.append(m.Joiner(request, auth.new_nonce(), refusal))
        return tuple(out)

    def reply(self, request: auth.JoinRequest, reply: auth.JoinReply, now_s: float) -> None:
        """Answer a request; replies older than the join deadline (or beyond the
        ``MAX_REPLIES`` newest) are deleted."""
        self.store.reply(request.wnonce, reply.to_json())
        self.replies.append((now_s, request.wnonce))
        old = []
        while self.replies and (len(self.replies) > MAX_REPLIES
                                or now_s - self.replies[0][0] > self.keep_s):
            old.append(self.replies.popleft()[1])
        if old:
            self.store.forget_replies(old)

    def drop(self, first: int, end: int) -> None:
        """Delete the slots read."""
        self.store.forget_join_requests(first, end)
