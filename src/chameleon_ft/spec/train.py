"""Runtime training settings (section ``[train]``): used by ``chameleon train`` only."""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_ft.spec._fields import check_choice, check_int, check_positive


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
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    backend: str = "auto"
    """``gloo``, ``nccl``, or ``auto`` (NCCL when every worker has a GPU, else gloo)."""
    heartbeat_s: float = 0.1
    """Interval of worker heartbeats into the store."""
    timeout_s: float = 3.0
    """Deadline of every blocking call; a worker silent this long is declared hung."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many committed steps (0: never)."""
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
        check_int("checkpoint_every", self.checkpoint_every, minimum=0)
