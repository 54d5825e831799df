"""The documents the control plane carries through the store: the job's description every
worker reads (``JobInfo``) and a worker's error report (``ErrorReport``). Their keys and
seals are ``runtime.protocol``'s (which re-exports both).

Pure Python (no torch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobInfo:
    """What the coordinator tells every worker about the job (the ``job`` store key).

    Public: it holds nothing secret (the token never travels).
    """

    job_name: str
    job_id: str
    """Random per run: join proofs are bound to it."""
    nonce: str
    """The coordinator's first join nonce (the current one is under ``join/nonce``)."""
    num_workers: int
    num_layers: int
    dtype: str
    micro_batch: int
    global_batch: int
    heartbeat_s: float
    hang_timeout_s: float
    backend: str
    data_digest: str
    """The data source's digest (a worker on another host checks it has the same data)."""
    checkpoint_every: int
    control_timeout_s: float
    """Deadline of connecting and of one bulk transfer."""
    blob_port: int
    """The coordinator's bulk-state server (same host as the store)."""
    boundaries: list[list[Any]]
    """``[shape, dtype]`` of every layer's output for one micro-batch (a stage receives
    its first layer's input, the previous layer's output, into a buffer of that shape)."""
    targets_per_sample: int
    """Target elements of one sample: the loss is summed, then divided by this times the
    global batch."""
    workload: str
    """The model, data and optimizer to train (``runtime.workload``), sealed with the
    job's secret: a worker without the token cannot open it, and a forged one is refused."""
    checkpoint_dir: str = ""
    """The run's checkpoint folder on the coordinator's host (a worker that sees it there,
    with this job's marker, writes and reads its layer files itself)."""
    device: str = "cpu"
    """``cpu`` or ``cuda``: where workers compute."""
    storage_gb_per_s: float = 0.1
    """Checkpoint folder bandwidth: write and read deadlines are sized by it."""
    bulk_gb_per_s: float = 0.1
    """Bulk channel bandwidth: transfer deadlines are sized by it."""
    memory_copies: bool = False
    """Checkpoints in memory (``[recovery] memory_checkpoint``): each written layer is
    also copied into a worker's memory on another node."""
    workers_per_node: int = 1
    """Workers per node (``worker // workers_per_node`` is a worker's node)."""
    tp: int = 1
    """Processes per worker (``[job] tp``): each rank holds its shard of the stage's layers
    (design 4.11)."""
    nccl_semantics: bool = False
    """Run gloo groups behind NCCL's completion semantics (``worker.nccl_like``): how the
    tests exercise the NCCL path on CPU."""

    def to_json(self) -> str:
        """Serialise."""
        return json.dumps(dict(vars(self)))

    @classmethod
    def from_json(cls, text: str | bytes) -> JobInfo:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: for text that is not a job description of this version.
        """
        try:
            return cls(**json.loads(text))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError("the store does not hold a chameleon job of this version") from None


@dataclass(frozen=True)
class ErrorReport:
    """What a worker tells the coordinator when something went wrong in its step."""

    worker: int
    fatal: bool
    """True when the worker is going away (an exception in its own code)."""
    peer: int | None
    """The worker on the other end of the failed operation, when known."""
    message: str
    corrupt_step: int | None = None
    """Set when the report is a checkpoint (after this many steps) whose file does not
    match its manifest: the worker read it to load and refused it."""

    def to_json(self) -> str:
        """Serialise."""
        return json.dumps({"worker": self.worker, "fatal": self.fatal, "peer": self.peer,
                           "message": self.message, "corrupt_step": self.corrupt_step})

    @classmethod
    def from_json(cls, text: str | bytes) -> ErrorReport:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: for a malformed report.
        """
        try:
            d = json.loads(text)
            corrupt = d.get("corrupt_step")
            return cls(worker=int(d["worker"]), fatal=bool(d["fatal"]),
                       peer=None if d["peer"] is None else int(d["peer"]),
                       message=str(d["message"]),
                       corrupt_step=None if corrupt is None else int(corrupt))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError("malformed error report") from None
