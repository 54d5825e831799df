"""Runtime training settings (section ``[train]``): used by ``chameleon train`` only.

Also the fault-injection plan: ``rank=R,step=S,kind=kill|hang|error[,phase=...]`` strings,
parsed here (pure Python) so that the CLI, the config file and the tests share one format.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from chameleon_ft.spec._fields import check_choice, check_int, check_positive, fail


class FaultKind(StrEnum):
    """How an injected fault takes a worker out."""

    KILL = "kill"
    """SIGKILL: the process disappears, its sockets close."""
    HANG = "hang"
    """SIGSTOP: the process stops answering but keeps its sockets open."""
    ERROR = "error"
    """An exception raised inside the worker's training code."""


class FaultPhase(StrEnum):
    """Where in a step the fault fires."""

    FORWARD = "forward"
    """After the worker's first forward operation of the step."""
    BACKWARD = "backward"
    """After the worker's first backward operation of the step."""
    OPTIMIZER = "optimizer"
    """After the step was committed, before the worker applies it."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault: worker ``rank`` fails at step ``step`` (0-based) in ``phase``."""

    rank: int
    """Worker id that fails."""
    step: int
    """0-based index of the step during which it fails (fires on the first attempt only)."""
    kind: str = FaultKind.KILL.value
    """``kill``, ``hang`` or ``error``."""
    phase: str = FaultPhase.FORWARD.value
    """``forward``, ``backward`` or ``optimizer``."""

    def __post_init__(self) -> None:
        check_int("rank", self.rank, minimum=0)
        check_int("step", self.step, minimum=0)
        check_choice("kind", self.kind, [k.value for k in FaultKind])
        check_choice("phase", self.phase, [p.value for p in FaultPhase])

    def to_text(self) -> str:
        """The ``rank=R,step=S,kind=K,phase=P`` form."""
        return f"rank={self.rank},step={self.step},kind={self.kind},phase={self.phase}"


def parse_fault(text: str) -> Fault:
    """Parse ``rank=R,step=S,kind=kill|hang|error[,phase=forward|backward|optimizer]``.

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
        if key not in ("rank", "step", "kind", "phase"):
            fail("fault", f"{text!r}: unknown key {key!r}; use rank, step, kind, phase")
        values[key] = value.strip()
    for required in ("rank", "step"):
        if required not in values:
            fail("fault", f"{text!r}: {required}= is required")
    try:
        rank, step = int(values["rank"]), int(values["step"])
    except ValueError:
        fail("fault", f"{text!r}: rank and step must be integers")
    try:
        return Fault(rank=rank, step=step, kind=values.get("kind", FaultKind.KILL.value),
                     phase=values.get("phase", FaultPhase.FORWARD.value))
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
    """``float32``, or ``float64`` for bit-comparable recovery checks."""
    seed: int = 0
    """Seed of the parameter initialisation (data order is fixed by the step number)."""
    lr: float = 1e-3
    """Learning rate: a shorthand for ``[optimizer] lr``, which wins when set (a different
    value in both places is an error)."""
    weight_decay: float = 0.0
    """Weight decay of every parameter: a shorthand for ``[optimizer] weight_decay``, as
    ``lr``."""
    backend: str = "auto"
    """``gloo``, ``nccl``, or ``auto`` (NCCL when every worker has a GPU, else gloo)."""
    heartbeat_s: float = 0.1
    """Interval of worker heartbeats into the store."""
    timeout_s: float = 3.0
    """Deadline of every blocking call; a worker silent this long is declared hung."""
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
    """Injected faults, each ``rank=R,step=S,kind=kill|hang|error[,phase=...]``."""

    def __post_init__(self) -> None:
        check_int("steps", self.steps)
        check_choice("dtype", self.dtype, ("float32", "float64"))
        check_int("seed", self.seed, minimum=0)
        check_positive("lr", self.lr)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_choice("backend", self.backend, ("auto", "gloo", "nccl"))
        check_positive("heartbeat_s", self.heartbeat_s)
        check_positive("timeout_s", self.timeout_s)
        check_positive("join_timeout_s", self.join_timeout_s)
        check_int("checkpoint_every", self.checkpoint_every, minimum=0)
        if self.heartbeat_s * 2 > self.timeout_s:
            fail("heartbeat_s", f"{self.heartbeat_s} must be at most half of timeout_s "
                 f"{self.timeout_s}, or healthy workers would be declared hung")
        for text in self.faults:
            parse_fault(text)

    @property
    def fault_plan(self) -> tuple[Fault, ...]:
        """The parsed faults."""
        return tuple(parse_fault(t) for t in self.faults)
