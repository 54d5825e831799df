"""Runtime training settings (section ``[train]``): used by ``chameleon train`` only.

Also the fault-injection plan: ``rank=R,step=S,kind=kill|hang|stall|error|glitch|disk-full|
disk-error|read-only[,phase=...]``, or ``rank=R,step=S,kind=slow,factor=F,steps=N`` (a
fail-slow),
parsed here (pure Python) so that the CLI, the config file and the tests share one format.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from chameleon_ft.spec._fields import check_choice, check_int, check_positive, fail

TRAIN_DTYPES = ("float32", "float64", "bfloat16")
"""The runtime's numerics (``[train] dtype``)."""


class ActivationCheckpointing(StrEnum):
    """What a worker keeps of a layer's forward for its backward."""

    NONE = "none"
    """Every activation the backward needs."""
    FULL = "full"
    """Only each layer's input; the backward runs the layer's forward again."""


class FaultKind(StrEnum):
    """How an injected fault takes a worker out."""

    KILL = "kill"
    """SIGKILL: the process disappears, its sockets close."""
    HANG = "hang"
    """SIGSTOP: the process stops answering but keeps its sockets open."""
    STALL = "stall"
    """The worker's device stops completing the work it was given (a hung kernel; on the
    CPU, compute that never returns): the process runs on and its threads answer, but the
    heartbeat thread sees the work pending and ends the worker at the hang deadline."""
    ERROR = "error"
    """An exception raised inside the worker's training code (the worker exits)."""
    GLITCH = "glitch"
    """A transient communication failure: the worker breaks its generation's connections
    and reports the error, but stays alive. Errors no death explains: the coordinator
    redoes the generation (bounded by ``max_retries``)."""
    DISK_FULL = "disk-full"
    """Writing the worker's share of a checkpoint fails with ``ENOSPC`` (phase
    ``checkpoint`` only): that checkpoint is dropped, training goes on."""
    DISK_ERROR = "disk-error"
    """The same with ``EIO`` (a failing disk)."""
    READ_ONLY = "read-only"
    """The same with ``EROFS`` (the folder became read-only)."""
    SLOW = "slow"
    """A fail-slow: from step ``step`` the worker computes ``factor`` times slower for
    ``steps`` of the job's steps (after each forward, backward and optimizer step it waits
    ``factor - 1`` times that operation's measured duration, the device's on a GPU), then
    runs at full speed again. It keeps training: the coordinator sees it only in its op
    timings (docs/design.md 4.3)."""


DISK_FAULTS = (FaultKind.DISK_FULL.value, FaultKind.DISK_ERROR.value, FaultKind.READ_ONLY.value)


class FaultPhase(StrEnum):
    """Where the fault fires."""

    FORWARD = "forward"
    """After the worker's first forward operation of the step."""
    BACKWARD = "backward"
    """After the worker's first backward operation of the step."""
    REDUCE = "reduce"
    """When the worker reaches the step's gradient reductions, after its last backward
    (its peers may already wait in the all-reduce)."""
    OPTIMIZER = "optimizer"
    """After the step was committed, before the worker applies it."""
    RECOVERY = "recovery"
    """While the worker joins a new generation (after building its groups, before it
    reports ready): a failure during a recovery."""
    MIGRATION = "migration"
    """After the worker posted its first state transfer of a migration (as sender or
    receiver): a failure while state moves."""
    CHECKPOINT = "checkpoint"
    """When the worker starts writing its layers of a checkpoint after a step numbered
    ``step`` or later (a disk fault fails that write; a kill or hang takes the worker out
    while it writes)."""


COMPUTE_PHASES = (FaultPhase.FORWARD.value, FaultPhase.BACKWARD.value,
                  FaultPhase.OPTIMIZER.value)
"""The phases in which a worker's device computes."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault: worker ``rank`` fails in ``phase`` of step ``step`` (0-based).

    A fault fires once: the first time the process holding ``rank`` reaches ``phase`` in a
    step numbered ``step`` or later (for ``recovery`` and ``migration``: a generation that
    starts at such a step). So a fault on a rank that died and was repaired fires in the
    replacement, and a fault on a rank that sits idle fires when it works again.
    """

    rank: int
    """Worker id that fails."""
    step: int
    """0-based step from which on the fault is armed."""
    kind: str = FaultKind.KILL.value
    """``kill``, ``hang``, ``stall``, ``error``, ``glitch``, or a disk fault (``disk-full``,
    ``disk-error``, ``read-only``)."""
    phase: str = FaultPhase.FORWARD.value
    """``forward``, ``backward``, ``reduce``, ``optimizer``, ``recovery``, ``migration``
    or ``checkpoint`` (a ``slow`` fault starts with the step's compute: ``forward``)."""
    factor: float | None = None
    """``slow`` only: how many times slower the worker computes (> 1)."""
    steps: int | None = None
    """``slow`` only: for how many of the job's steps (>= 1)."""

    def __post_init__(self) -> None:
        check_int("rank", self.rank, minimum=0)
        check_int("step", self.step, minimum=0)
        check_choice("kind", self.kind, [k.value for k in FaultKind])
        check_choice("phase", self.phase, [p.value for p in FaultPhase])
        self._check_slow()
        if self.kind == FaultKind.GLITCH and self.phase in (FaultPhase.OPTIMIZER,
                                                             FaultPhase.CHECKPOINT):
            fail("phase", f"a glitch is a communication failure; the {self.phase} phase "
                 "communicates nothing (use forward, backward, recovery or migration)")
        if self.kind == FaultKind.STALL and self.phase not in COMPUTE_PHASES:
            fail("phase", f"a stall hangs the device's compute; the {self.phase} phase "
                 "computes nothing (use forward, backward or optimizer)")
        if self.kind in DISK_FAULTS and self.phase != FaultPhase.CHECKPOINT:
            fail("phase", f"a {self.kind} fault happens while writing a checkpoint; use "
                 "phase=checkpoint")

    def _check_slow(self) -> None:
        if self.kind != FaultKind.SLOW:
            for name in ("factor", "steps"):
                if getattr(self, name) is not None:
                    fail(name, f"only a slow fault takes one (kind={self.kind}); leave "
                         f"{name}= out")
            return
        if self.factor is None or self.steps is None:
            fail("factor" if self.factor is None else "steps",
                 "a slow fault needs factor=F (times slower, > 1) and steps=N (how long)")
        check_positive("factor", self.factor)
        if self.factor <= 1.0:
            fail("factor", f"must be > 1 (F times slower), got {self.factor!r}")
        check_int("steps", self.steps)
        if self.phase != FaultPhase.FORWARD:
            fail("phase", "a slow fault slows the compute from the start of its step; leave "
                 "phase= out (or forward)")

    def to_text(self) -> str:
        """The ``rank=R,step=S,kind=K,phase=P`` form (``kind=slow,factor=F,steps=N``)."""
        if self.kind == FaultKind.SLOW:
            return (f"rank={self.rank},step={self.step},kind=slow,factor={self.factor:g},"
                    f"steps={self.steps}")
        return f"rank={self.rank},step={self.step},kind={self.kind},phase={self.phase}"


FAULT_KEYS = ("rank", "step", "kind", "phase", "factor", "steps")
"""The parts of a fault's text."""


def parse_fault(text: str) -> Fault:
    """Parse ``rank=R,step=S,kind=kill|hang|stall|error|glitch[,phase=...]`` (or
    ``rank=R,step=S,kind=slow,factor=F,steps=N``).

    Raises:
        ValueError: naming ``fault`` and the offending part.
    """
    values: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            fail("fault", f"{text!r}: expected key=value parts, got {part!r}")
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in FAULT_KEYS:
            fail("fault", f"{text!r}: unknown key {key!r}; use {', '.join(FAULT_KEYS)}")
        values[key] = value.strip()
    for required in ("rank", "step"):
        if required not in values:
            fail("fault", f"{text!r}: {required}= is required")
    try:
        rank, step = int(values["rank"]), int(values["step"])
        steps = int(values["steps"]) if "steps" in values else None
    except ValueError:
        fail("fault", f"{text!r}: rank, step and steps must be integers")
    try:
        factor = float(values["factor"]) if "factor" in values else None
    except ValueError:
        fail("fault", f"{text!r}: factor must be a number (F times slower), got "
             f"{values['factor']!r}")
    try:
        return Fault(rank=rank, step=step, kind=values.get("kind", FaultKind.KILL.value),
                     phase=values.get("phase", FaultPhase.FORWARD.value), factor=factor,
                     steps=steps)
    except ValueError as exc:
        raise ValueError(f"fault: {text!r}: {exc}") from None


def check_faults(faults: tuple[Fault, ...], num_workers: int, steps: int) -> None:
    """Reject faults naming a worker that does not exist or a step that never runs.

    Raises:
        ValueError: naming the fault and the valid range.
    """
    for f in faults:
        if f.rank >= num_workers:
            fail("fault", f"{f.to_text()}: rank {f.rank} does not exist; the job has "
                 f"{num_workers} workers (ranks 0..{num_workers - 1})")
        if f.step >= steps:
            fail("fault", f"{f.to_text()}: step {f.step} never runs; the run has {steps} "
                 f"steps (0..{steps - 1})")


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """How the runtime trains: steps, numerics, timeouts, checkpoints, injected faults."""

    steps: int = 20
    """Optimizer steps to run."""
    dtype: str = "float32"
    """``float32``; ``float64`` for bit-comparable recovery checks; ``bfloat16`` for mixed
    precision: bf16 compute (parameters, activations and their gradients between stages),
    fp32 master weights, gradients (accumulated, reduced and clipped in fp32), optimizer
    state and checkpoints."""
    seed: int = 0
    """Seed of the parameter initialisation (data order is fixed by the step number)."""
    lr: float = 1e-3
    """Learning rate: a shorthand for ``[optimizer] lr``, which wins when set (a different
    value in both places is an error)."""
    weight_decay: float = 0.0
    """Weight decay of every parameter: a shorthand for ``[optimizer] weight_decay``, as
    ``lr``."""
    backend: str = "auto"
    """How workers communicate: ``gloo`` (TCP; with CUDA compute its transfers are staged
    through host memory, so several workers may share one GPU), ``nccl`` (one GPU per
    worker), or ``auto`` (NCCL when the workers compute on CUDA, else gloo)."""
    device: str = "auto"
    """Where workers compute: ``cpu``, ``cuda`` (each worker on the GPU of its node-local
    index, ``LOCAL_RANK``/``SLURM_LOCALID`` or its order of admission on its host, within
    ``CUDA_VISIBLE_DEVICES``: ``runtime.placement``; never from its global id), or
    ``auto`` (CUDA when this host has a GPU)."""
    storage_gb_per_s: float = 0.1
    """Write (and read) bandwidth of the checkpoint folder per worker, GB/s: checkpoint and
    final-state deadlines are the hang deadline plus the bytes over this, at least 10 s.
    Measure it with ``python -m chameleon_ft.runtime.profiler``."""
    bulk_gb_per_s: float = 0.1
    """Bandwidth of the bulk channel to the coordinator (workers on hosts that do not see
    the checkpoint folder), GB/s: a transfer's deadline is sized by its bytes the same
    way."""
    drain_timeout_s: float = 30.0
    """The grace a scheduler gives between SIGTERM and SIGKILL (Slurm's ``KillWait`` is
    30 s by default): a drain lets the step in flight finish while that leaves time to
    write the final checkpoint, else aborts it at once."""
    heartbeat_s: float = 0.1
    """Interval of worker heartbeats into the store."""
    timeout_s: float = 0.0
    """Shorthand: when set (> 0), the default of both ``collective_timeout_s`` and
    ``hang_timeout_s``."""
    collective_timeout_s: float = 0.0
    """Deadline of every send, receive and all-reduce between workers. 0 (default): derived
    for each generation from its plan, ``max(3 s, 10 x (estimated step + migration))``; a
    value set here is a floor that a slower plan raises (with a log line). It must exceed
    the longest wait of a healthy worker: a worker carrying rerouted micro-batches makes
    its peers wait longer."""
    hang_timeout_s: float = 0.0
    """A worker whose heartbeat is silent this long is declared hung and fenced; workers
    whose coordinator is silent this long exit. 0 (default): ``max(2 s, 20 heartbeats)``."""
    coordinator_grace_s: float = 30.0
    """How long workers whose coordinator died, froze or stopped advancing its progress
    value wait for a new one on the job's address (``chameleon train --resume`` with the
    same ``--out``, ``--host`` and ``--port``, or the scheduler restarting it) before they
    exit; a new one within the grace re-attaches them, their state kept (0: they exit at
    once)."""
    max_retries: int = 2
    """Consecutive recoveries from errors that no death explains (the same step redone on
    rebuilt groups) before escalating to a checkpoint restart; if errors go on after
    that, training stops with the reason."""
    keep_checkpoints: int = 3
    """Complete checkpoints kept on disk (older ones are deleted once a newer one is
    complete)."""
    join_timeout_s: float = 60.0
    """How long the coordinator waits for every worker to join (process start or remote);
    also the deadline of each of a worker's waits on the coordinator, re-armed while the
    coordinator answers."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many committed steps (0: never; restart then goes back
    to the deterministic initial parameters, step 0)."""
    rejoin: bool = False
    """Relaunch a replacement ("repaired" worker) for each dead worker the coordinator
    launched itself, once training runs again, and let the policy decide whether to fold
    it back in (the plan changes at a step boundary, state migrates to it)."""
    faults: tuple[str, ...] = ()
    """Injected faults, each ``rank=R,step=S,kind=kill|hang|stall|error|glitch[,phase=...]``
    or ``rank=R,step=S,kind=slow,factor=F,steps=N``."""
    activation_checkpointing: str = ActivationCheckpointing.NONE.value
    """``none``, or ``full``: each layer keeps only its input and recomputes its forward in
    its backward (the same parameters, less activation memory). One switch with
    ``[profile] recompute``: set either and the other follows (``full`` with ``full``;
    ``none`` with ``none``, or with ``selective``, which the runtime does not do and only
    the planner prices); setting both so that one is ``full`` and the other not is an
    error."""

    def __post_init__(self) -> None:
        check_int("steps", self.steps)
        check_choice("dtype", self.dtype, TRAIN_DTYPES)
        check_choice("activation_checkpointing", self.activation_checkpointing,
                     [a.value for a in ActivationCheckpointing])
        check_int("seed", self.seed, minimum=0)
        check_positive("lr", self.lr)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_choice("backend", self.backend, ("auto", "gloo", "nccl"))
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        if self.backend == "nccl" and self.device == "cpu":
            fail("backend", "nccl needs CUDA devices; set device = \"cuda\" or use gloo")
        for name in ("storage_gb_per_s", "bulk_gb_per_s", "drain_timeout_s"):
            check_positive(name, getattr(self, name))
        check_positive("heartbeat_s", self.heartbeat_s)
        for name in ("timeout_s", "collective_timeout_s", "hang_timeout_s"):
            check_positive(name, getattr(self, name), allow_zero=True)
        check_positive("join_timeout_s", self.join_timeout_s)
        check_positive("coordinator_grace_s", self.coordinator_grace_s, allow_zero=True)
        check_int("checkpoint_every", self.checkpoint_every, minimum=0)
        check_int("max_retries", self.max_retries, minimum=0)
        check_int("keep_checkpoints", self.keep_checkpoints, minimum=1)
        if self.heartbeat_s * 2 > self.hang_s:
            fail("heartbeat_s", f"{self.heartbeat_s} must be at most half of hang_timeout_s "
                 f"{self.hang_s:g}, or healthy workers would be declared hung")
        for text in self.faults:
            parse_fault(text)

    @property
    def hang_s(self) -> float:
        """The hang threshold in effect (``hang_timeout_s``, the shorthand, or the default)."""
        if self.hang_timeout_s > 0:
            return self.hang_timeout_s
        if self.timeout_s > 0:
            return self.timeout_s
        return max(2.0, 20 * self.heartbeat_s)

    @property
    def collective_floor_s(self) -> float:
        """The collective deadline set by the user (0: none, derived per plan only)."""
        return self.collective_timeout_s or self.timeout_s

    @property
    def fault_plan(self) -> tuple[Fault, ...]:
        """The parsed faults."""
        return tuple(parse_fault(t) for t in self.faults)
