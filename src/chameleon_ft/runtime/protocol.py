"""The control plane's vocabulary: store keys and the messages the coordinator and the
workers exchange through the ``TCPStore``.

Everything of one generation lives under ``gen{g}/``: the directive (plan, schedule,
migration, what to load), the process groups' rendezvous, error reports, the per-step
"reduced" counters and the commit verdicts. A new generation never reads an old one's
keys, so a late message from before a failure cannot be mistaken for a current one; the
coordinator deletes a generation's keys once every live worker has moved past it.

Per-process keys carry the process's *incarnation* (a nonce the coordinator hands out
when a process takes a worker id), so a fenced process that comes back (a hung remote
worker that is continued) can never pass for the replacement that took its id.

Messages from many writers (error reports, join requests) go into numbered slots: a
writer reserves a slot with a counter, then writes it. The coordinator reads the slots in
order and checks a key exists before it reads it, so no read in its watch loop ever
blocks; a slot reserved by a writer that died before writing is skipped after the hang
deadline; a malformed message is ignored. Bulk state (checkpoints, the final state) does not travel here: see
``runtime.blobs``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

JOB_KEY = "job"
"""JSON: what every worker needs to build its model and train (see ``JobInfo``)."""
JOIN_SLOTS_KEY = "join/slots"
"""Counter a remote worker increments to reserve the index of its join request (it then
writes the request; the coordinator skips a slot left unwritten past the hang deadline)."""

COMMIT = "commit"
COMMIT_END = "commit-end"
"""Commit, then leave the generation: a planned plan change at a step boundary."""
ABORT = "abort"

CURRENT_GEN_KEY = "gen/current"
"""The newest published generation (workers that fell behind skip to it)."""

FAULTS_KEY = "faults/list"
"""JSON list of injected faults ``[rank, step, kind, phase]``; the index is the fault's id."""
FAULTS_VERSION_KEY = "faults/version"
"""Counter bumped whenever the fault list changes (workers re-read it at each step)."""


def join_request_key(index: int) -> str:
    """The ``index``-th join request (JSON ``JoinRequest``)."""
    return f"join/req/{index}"


def join_reply_key(wnonce: str) -> str:
    """The coordinator's answer to the join request with nonce ``wnonce``."""
    return f"join/reply/{wnonce}"


def directive_key(gen: int) -> str:
    """JSON directive of generation ``gen``."""
    return f"gen{gen}/directive"


def abort_key(gen: int) -> str:
    """Set when generation ``gen`` ends, whatever the reason (failure, retry, a planned
    switch, the end of training): workers blocked in its collectives are released."""
    return f"gen{gen}/abort"


def ready_key(gen: int) -> str:
    """Counter: workers that finished building groups and loading state."""
    return f"gen{gen}/ready"


def reduced_key(gen: int, step: int) -> str:
    """Counter: workers that finished ``step``'s gradient all-reduce."""
    return f"gen{gen}/reduced/{step}"


def verdict_key(gen: int, step: int) -> str:
    """``commit``, ``commit-end`` or ``abort`` for ``step``, written once by the coordinator."""
    return f"gen{gen}/verdict/{step}"


def loss_key(gen: int, step: int, worker: int) -> str:
    """JSON ``[[global micro-batch, loss], ...]`` of the micro-batches ``worker`` ended."""
    return f"gen{gen}/loss/{step}/{worker}"


def timing_key(gen: int, step: int, worker: int) -> str:
    """JSON: compute seconds of each forward and backward op of ``worker`` in ``step``."""
    return f"gen{gen}/timing/{step}/{worker}"


def error_slot_key(gen: int) -> str:
    """Counter a worker increments to reserve the index of its error report (it then
    writes the report; the coordinator skips a slot left unwritten past the deadline)."""
    return f"gen{gen}/error_slots"


def error_key(gen: int, index: int) -> str:
    """The ``index``-th error report (JSON ``ErrorReport``)."""
    return f"gen{gen}/error/{index}"


def rendezvous_keys(gen: int, groups: list[tuple[str, int]]) -> list[str]:
    """The keys gloo's rendezvous writes for the groups ``(prefix, size)`` of ``gen``."""
    return [f"{prefix}/0/{rank}" for prefix, size in groups for rank in range(size)]


def heartbeat_key(worker: int, incarnation: str) -> str:
    """Counter the process ``incarnation`` of ``worker`` increments every heartbeat."""
    return f"hb/{worker}/{incarnation}"


def setup_key(worker: int, incarnation: str) -> str:
    """The generation whose groups the process ``incarnation`` of ``worker`` last began to
    build (gloo's group set-up cannot be interrupted: a process can stay inside a superseded
    generation's set-up until that generation's deadline)."""
    return f"setup/{worker}/{incarnation}"


def worker_info_key(worker: int, incarnation: str) -> str:
    """JSON: host, pid and address of a registered process."""
    return f"worker/{worker}/{incarnation}"


def start_gen_key(worker: int, incarnation: str) -> str:
    """The first generation a process admitted later (a repaired worker) follows."""
    return f"start/{worker}/{incarnation}"


def fault_claim_key(index: int) -> str:
    """Counter: the first process to increment it fires fault ``index`` (it fires once)."""
    return f"faults/claim/{index}"


def fault_fired_key(index: int) -> str:
    """JSON: when, where and by whom fault ``index`` fired (written just before it does)."""
    return f"faults/fired/{index}"


@dataclass(frozen=True)
class ErrorReport:
    """What a worker tells the coordinator when something went wrong in its step."""

    worker: int
    fatal: bool
    """True when the worker is going away (an exception in its own code)."""
    peer: int | None
    """The worker on the other end of the failed operation, when known."""
    message: str

    def to_json(self) -> str:
        """Serialise."""
        return json.dumps({"worker": self.worker, "fatal": self.fatal, "peer": self.peer,
                           "message": self.message})

    @classmethod
    def from_json(cls, text: str | bytes) -> ErrorReport:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: for a malformed report.
        """
        try:
            d = json.loads(text)
            return cls(worker=int(d["worker"]), fatal=bool(d["fatal"]),
                       peer=None if d["peer"] is None else int(d["peer"]),
                       message=str(d["message"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError("malformed error report") from None


def dumps(doc: dict[str, Any]) -> str:
    """Compact JSON."""
    return json.dumps(doc, separators=(",", ":"))
