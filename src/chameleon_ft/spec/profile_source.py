"""Where a job's per-layer profile comes from (section ``[profile]``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from chameleon_ft.spec._fields import check_choice, check_int, check_positive, fail


class ProfileKind(StrEnum):
    """Profile sources."""

    ANALYTIC = "analytic"
    UNIFORM = "uniform"
    FILE = "file"


class Recompute(StrEnum):
    """Activation recomputation assumed by the analytic profile."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@dataclass(frozen=True, kw_only=True)
class ProfileSource:
    """The ``[profile]`` table."""

    kind: str = ProfileKind.ANALYTIC.value
    """``analytic`` (from the model and device), ``uniform`` (identical layers) or ``file``."""
    path: str = ""
    """JSON profile to read, for ``kind = "file"`` (relative to the config file)."""
    recompute: str = Recompute.SELECTIVE.value
    """For ``analytic``: activation recomputation, ``none``, ``selective`` (the attention
    core) or ``full`` (the whole block). One switch with ``[train]
    activation_checkpointing``, which the runtime executes: set either, the other follows."""
    fused_attention: bool = True
    """For ``analytic``: attention by a fused kernel (FlashAttention) that skips the causal
    half and never writes the score matrix; ``false`` prices the score matrix's memory
    traffic (softmax, dropout) and keeps it for the backward unless recomputed, as
    Megatron-LM did before 2022."""
    shard_optimizer: bool = False
    """For ``analytic``: each data-parallel replica keeps ``1 / dp`` of the optimizer state
    and of the gradients (ZeRO-2; FSDP as Llama 3 runs it). The memory model only:
    recoveries move a worker's share as if its replicas could supply it."""
    num_layers: int = 0
    """For ``uniform``: number of identical layers. Its figures are a whole layer's on one
    device; at ``[job] tp = k`` each device holds and computes ``1/k`` of it (times,
    parameter, optimizer, activation and output bytes and the optimizer step divided by
    ``k``) plus the layer's collectives in the worker's group (``tp_collectives``) and the
    framework's host time per sharded layer (``tp_host_fwd_s``, ``tp_host_bwd_s``)."""
    fwd_s: float = 0.0
    """For ``uniform``: forward seconds per layer per micro-batch."""
    bwd_input_s: float = 0.0
    """For ``uniform``: input-gradient seconds per layer per micro-batch."""
    bwd_weight_s: float = 0.0
    """For ``uniform``: weight-gradient seconds per layer per micro-batch."""
    param_bytes: float = 0.0
    """For ``uniform``: parameter bytes per layer (on one device at tp 1)."""
    optimizer_bytes: float = 0.0
    """For ``uniform``: optimizer-state bytes per layer (on one device at tp 1)."""
    activation_bytes: float = 0.0
    """For ``uniform``: activation bytes kept per in-flight micro-batch per layer."""
    output_bytes: float = 0.0
    """For ``uniform``: bytes sent to the next stage per micro-batch."""
    optimizer_step_s: float = 0.0
    """For ``uniform``: optimizer-step seconds for the whole model on one worker."""
    tp_collectives: int = 0
    """For ``uniform`` at ``[job] tp > 1``: the collectives one layer runs inside its
    worker's tensor-parallel group per micro-batch and direction, counted in ring halves
    (an all-gather or a reduce-scatter 1, an all-reduce 2: a ring runs one of each), each
    priced over the intra-node link as ``(tp - 1) / tp`` of ``tp_collective_bytes`` plus
    ``tp - 1`` latencies."""
    tp_collective_bytes: float = 0.0
    """For ``uniform``: bytes of the whole tensor each of those collectives gathers or
    reduces (a layer's ``B x hidden`` output for a row-parallel linear)."""
    tp_collective_latency_s: float = 0.0
    """For ``uniform`` at ``[job] tp > 1``: the latency of one hop of those collectives
    when it differs from the intra-node link's; 0 (the default): the link's. The link's
    latency is what the runtime's pipeline sends measure, and a send carries per-message
    work a collective inside the group does not (``benchmarks/tp_layer_overhead.py``
    measures it)."""
    tp_host_fwd_s: float = 0.0
    """For ``uniform`` at ``[job] tp > 1``: host seconds a sharded layer adds to its
    forward per micro-batch, beyond its device share and its collectives: the
    tensor-parallel framework's dispatch (sharding propagation, redistributions, DTensor's
    autograd). A host that waits for its device (a CPU, the emulated-device testbed) pays
    it in series; an accelerator overlaps it with its kernels, so there it is 0 unless
    the layer is host-bound (``benchmarks/tp_layer_overhead.py`` measures it)."""
    tp_host_bwd_s: float = 0.0
    """For ``uniform`` at ``[job] tp > 1``: the same for a sharded layer's input gradient
    per micro-batch (its weight gradient runs in the same backward and is counted here)."""

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, [k.value for k in ProfileKind])
        check_choice("recompute", self.recompute, [r.value for r in Recompute])
        for name in ("fwd_s", "bwd_input_s", "bwd_weight_s", "param_bytes", "optimizer_bytes",
                     "activation_bytes", "output_bytes", "optimizer_step_s",
                     "tp_collective_bytes", "tp_collective_latency_s", "tp_host_fwd_s",
                     "tp_host_bwd_s"):
            check_positive(name, getattr(self, name), allow_zero=True)
        check_int("tp_collectives", self.tp_collectives, minimum=0)
        if self.kind == ProfileKind.UNIFORM:
            check_int("num_layers", self.num_layers)
        if self.kind == ProfileKind.FILE and not self.path:
            fail("path", 'is required when kind = "file"; give the JSON profile to read')
