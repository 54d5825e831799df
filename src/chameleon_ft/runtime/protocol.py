"""The control plane's vocabulary: store keys and the messages the coordinator and the
workers exchange through the ``TCPStore``.

Everything of one generation lives under ``gen{g}/``: the directive (plan, schedule,
migration, what to load), the process groups' rendezvous, error reports, the per-step
"reduced" counters and the commit verdicts. A new generation never reads an old one's
keys, so a late message from before a failure cannot be mistaken for a current one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

JOB_KEY = "job"
"""JSON: what every worker needs to build its model and train (see ``JobInfo``)."""
NEXT_ID_KEY = "join/next"
"""Counter handing out worker ids to workers that join from another host."""
REGISTERED_KEY = "join/count"
"""Counter of workers that registered."""

COMMIT = "commit"
COMMIT_END = "commit-end"
"""Commit, then leave the generation: a planned plan change at a step boundary."""
ABORT = "abort"


def directive_key(gen: int) -> str:
    """JSON directive of generation ``gen``."""
    return f"gen{gen}/directive"


def abort_key(gen: int) -> str:
    """Set when generation ``gen`` ends (failure, retry or the end of training)."""
    return f"gen{gen}/abort"


def ready_key(gen: int) -> str:
    """Counter: workers that finished building groups and loading state."""
    return f"gen{gen}/ready"


def reduced_key(gen: int, step: int) -> str:
    """Counter: workers that finished ``step``'s gradient all-reduce."""
    return f"gen{gen}/reduced/{step}"


def verdict_key(gen: int, step: int) -> str:
    """``commit`` or ``abort`` for ``step``, written once by the coordinator."""
    return f"gen{gen}/verdict/{step}"


def loss_key(gen: int, step: int, worker: int) -> str:
    """JSON ``[[global micro-batch, loss], ...]`` of the micro-batches ``worker`` ended."""
    return f"gen{gen}/loss/{step}/{worker}"


def timing_key(gen: int, step: int, worker: int) -> str:
    """JSON: compute seconds of each forward and backward op of ``worker`` in ``step``."""
    return f"gen{gen}/timing/{step}/{worker}"


def num_errors_key(gen: int) -> str:
    """Counter of error reports in generation ``gen``."""
    return f"gen{gen}/num_errors"


def error_key(gen: int, index: int) -> str:
    """The ``index``-th error report (JSON ``ErrorReport``)."""
    return f"gen{gen}/error/{index}"


def heartbeat_key(worker: int) -> str:
    """Counter a worker increments every heartbeat interval."""
    return f"hb/{worker}"


def fault_time_key(worker: int) -> str:
    """Wall-clock time at which an injected fault fired on ``worker`` (for reports)."""
    return f"fault/{worker}"


def worker_info_key(worker: int) -> str:
    """JSON: host, pid and address of a registered worker."""
    return f"worker/{worker}"


def rejoin_ready_key(worker: int) -> str:
    """Set by a repaired worker once it is up and waiting to be folded back in."""
    return f"rejoin/{worker}/ready"


def rejoin_gen_key(worker: int) -> str:
    """The generation a repaired worker starts from (set when the coordinator uses it)."""
    return f"rejoin/{worker}/gen"


def checkpoint_layer_key(step: int, layer: int) -> str:
    """A layer's serialised state after ``step`` committed steps, uploaded by a worker."""
    return f"ckpt/{step}/layer{layer}"


def checkpoint_count_key(step: int) -> str:
    """Counter of layers uploaded for the checkpoint after ``step`` steps."""
    return f"ckpt/{step}/count"


def restore_layer_key(gen: int, layer: int) -> str:
    """A layer's checkpointed state, published by the coordinator for a restart."""
    return f"gen{gen}/restore/layer{layer}"


def final_layer_key(layer: int, worker: int) -> str:
    """A layer's final parameters as ``worker`` holds them, uploaded at the end."""
    return f"final/layer{layer}/w{worker}"


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
        """Parse :meth:`to_json` output."""
        d = json.loads(text)
        return cls(worker=int(d["worker"]), fatal=bool(d["fatal"]),
                   peer=None if d["peer"] is None else int(d["peer"]), message=str(d["message"]))


def dumps(doc: dict[str, Any]) -> str:
    """Compact JSON."""
    return json.dumps(doc, separators=(",", ":"))
