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
    term: int = 0
    """The coordinator's term: 0 for the run's first coordinator, one more for each that
    took the run over (every control value is sealed for it; a worker re-attaches only to
    a later term)."""
    coordinator_grace_s: float = 30.0
    """How long a worker whose coordinator went away waits for the next one."""

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


@dataclass(frozen=True)
class HeldState:
    """Layers a worker holds as committed after ``step`` steps, placed by the plan of
    generation ``gen`` (the generation whose commit or load made them)."""

    step: int
    gen: int
    layers: tuple[int, ...]
    plan: dict[str, Any]
    """The plan of generation ``gen`` (``ExecutionPlan.to_dict``)."""

    def to_doc(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"step": self.step, "gen": self.gen, "layers": list(self.layers),
                "plan": self.plan}

    @classmethod
    def from_doc(cls, doc: Any) -> HeldState | None:
        """Parse :meth:`to_doc` output (None stays None).

        Raises:
            ValueError: for a malformed state.
        """
        if doc is None:
            return None
        try:
            return cls(step=int(doc["step"]), gen=int(doc["gen"]),
                       layers=tuple(int(i) for i in doc["layers"]), plan=dict(doc["plan"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError("malformed held state") from None


@dataclass(frozen=True)
class ReattachReport:
    """What a worker whose coordinator went away tells the next one (its
    ``reattach/{worker}`` key, sealed for the new coordinator's term): its process, the
    newest generation it followed, and the state it holds."""

    worker: int
    incarnation: str
    host: str
    pid: int
    started: int
    """When the process started (clock ticks since boot, ``/proc``): with the pid, it
    names the process (a pid can be reused, the pair cannot)."""
    seen_gen: int
    """The newest generation it knows was published (-1: none)."""
    gen: int
    """The newest generation whose directive it read (-1: none)."""
    members: dict[str, str]
    """That directive's incarnations (worker -> incarnation): who was alive then."""
    held: HeldState | None
    """The state it holds (None: none yet)."""
    pending: HeldState | None = None
    """The state it holds if the step it reduced and whose verdict it never read
    committed (its gradients are kept): its stage's layers one step later."""

    def to_json(self) -> str:
        """Serialise."""
        doc = dict(vars(self))
        doc["held"] = None if self.held is None else self.held.to_doc()
        doc["pending"] = None if self.pending is None else self.pending.to_doc()
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str | bytes) -> ReattachReport:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: for a malformed report.
        """
        try:
            d = json.loads(text)
            return cls(worker=int(d["worker"]), incarnation=str(d["incarnation"]),
                       host=str(d["host"]), pid=int(d["pid"]), started=int(d["started"]),
                       seen_gen=int(d["seen_gen"]), gen=int(d["gen"]),
                       members={str(k): str(v) for k, v in dict(d["members"]).items()},
                       held=HeldState.from_doc(d["held"]),
                       pending=HeldState.from_doc(d.get("pending")))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise ValueError("malformed re-attach report") from None
