"""Recovery and policy settings: transition-cost terms, plan-search limits, the horizon.

Defaults come from published measurements (see docs/design.md, "Sources of the defaults"):

- detection: about 30 s with active inspection (ByteRobust; default collective timeouts
  take about 10 min); a killed gloo peer is seen in 10-50 ms, a hung one only at the
  timeout, so 30 s is the realistic figure for a production job;
- communicator creation: about 1 s per NCCL communicator plus 10 ms per rank (0.66-3 s for
  8 ranks inside a node, 2-5 s across nodes; 2.5 min on several thousand GPUs, where the
  bootstrap all-gathers take a step per rank); gloo on a few local ranks: milliseconds
  (measured by ``chameleon_ft.runtime.profiler``);
- layer re-instantiation: a fixed cost per layer plus its state at the host-to-device rate;
  a new layout's first step is a warm-up step;
- job restart: 5-15 min at scale (scheduler, containers, imports, NCCL init): 10 min;
- checkpoint load: about 2 min for a large model from remote storage;
- checkpoints every ~1 h (Clockwork's TorchPass page assumes 1.5 h), so restart loses half;
- node MTBF about 264 days (Llama 3: 419 unexpected interruptions in 54 days on 2,048 nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chameleon_ft.spec._fields import check_choice, check_int, check_positive, fail

POLICY_NAMES = ("chameleon", "reroute", "recycle", "dynamic", "restart", "shrink",
                "reroute-then-dynamic", "swap")
"""Accepted values of ``policy.name``."""

SLOW_POLICY_NAMES = ("chameleon", "keep", "rebalance", "dynamic", "swap", "evict")
"""Accepted values of ``recovery.slow_policy``."""

FALCON_SLOW_MIN_S = 30.0
"""Shortest fail-slow Falcon reports (Wu et al., arXiv:2410.12588: "tens of seconds")."""
FALCON_SLOW_MAX_S = 36_000.0
"""Longest fail-slow Falcon reports ("nearly ten hours")."""
FALCON_SLOW_MEAN_S = (FALCON_SLOW_MAX_S - FALCON_SLOW_MIN_S) / math.log(
    FALCON_SLOW_MAX_S / FALCON_SLOW_MIN_S)
"""The mean duration, about 5,070 s, of a fail-slow log-uniform over Falcon's range (our
reading of "tens of seconds to nearly ten hours"; the study publishes no mean)."""

LLAMA3_NODE_MTBF_HOURS = 2048 * 54 * 24 / 419
"""Llama 3's unexpected-interruption rate per 8-GPU node: about 6,335 hours (264 days)."""


@dataclass(frozen=True, kw_only=True)
class RecoverySpec:
    """The named terms of a transition, in seconds unless stated (section ``[recovery]``)."""

    detect_s: float = 30.0
    """Time from a failure to its detection (heartbeat deadline or collective error);
    about 30 s with active inspection (ByteRobust)."""
    rebuild_s: float | None = None
    """Shorthand for the three rebuild terms below: a flat time every recovery pays for
    communicators, layers and warm-up alike (the model before transition costs followed
    what changes). Unset: ``comm_s``, ``build_s`` and ``warmup_s`` are computed per plan."""
    comm_init_s: float = 1.0
    """Creating one communicator, fixed part: topology detection, buffers, connections
    (NCCL: 0.66-3 s for 8 ranks inside a node, 2-5 s across nodes; docs/design.md,
    "Sources of the defaults")."""
    comm_per_rank_s: float = 0.01
    """Creating one communicator, per rank: the bootstrap all-gathers take a step per rank
    (NCCL: 2.5 min on several thousand GPUs)."""
    rebuild_all_groups: bool = False
    """Every recovery builds the new plan's groups afresh as this project's runtime does: a
    world group over its workers that carries point-to-point traffic and exchanges a
    first message between every pair at once, and a group per gradient bucket that is
    only formed (``comm_init_s`` each). False: only groups whose members change are
    created, each at its full cost."""
    layer_build_s: float = 0.05
    """Re-instantiating one layer on a worker that receives it: constructing its modules
    (fixed part)."""
    layer_build_gb_per_s: float = 20.0
    """Re-instantiating a layer: its parameters, gradients and optimizer state allocated and
    initialised at this rate, GB/s (a host-built layer copied over PCIe 4.0 x16)."""
    warmup_steps: float = 1.0
    """Extra steps of the new plan's step time that its first step takes when some worker
    built new layers (allocator growth, kernel selection, first-use connections)."""
    restart_s: float = 600.0
    """Restarting every process of the job (scheduler, container, imports, init); 5-15 min
    at scale."""
    checkpoint_load_s: float = 120.0
    """Reading the last checkpoint back into device memory."""
    checkpoint_interval_s: float = 3600.0
    """Time between periodic checkpoints; restart loses half of it on average."""
    checkpoint: bool = True
    """Whether periodic checkpoints exist; without them restart is impossible."""
    memory_checkpoint: bool = False
    """Checkpoints in memory (Gemini, SOSP 2023): each worker's checkpointed state (its
    layers' parameters and optimizer state) is also kept in host memory, its own host's
    and the next live node's, so a reload (a restart, a swap from the checkpoint, a
    software fault) reads it over the network in seconds instead of ``checkpoint_load_s``
    from storage, and loses only the work since the last copy in memory; a layer whose
    every copy sat on hosts that died comes from storage (docs/design.md 3.3)."""
    memory_checkpoint_every: int = 1
    """Committed steps between two copies of the state in memory (with
    ``memory_checkpoint``). Gemini copies to memory at every iteration, its traffic
    scheduled into the network's idle time, with no throughput loss (a figure known from
    secondary sources); the copies to storage keep their own cadence
    (``checkpoint_interval_s``, ``[train] checkpoint_every``)."""
    migration_efficiency: float = 0.8
    """Fraction of the link bandwidth state migration achieves."""
    background_share: float = 0.5
    """Share of the bandwidth ``reroute-then-dynamic`` may use while training runs."""
    decoupled_backward: bool = False
    """The training system can split a rerouted peer's backward into input- and
    weight-gradient operations and defer the weight gradients into its idle time
    (ReCycle's decoupled backward): the ``recycle`` strategy, and Chameleon's rerouting,
    use it. This project's runtime runs fused backwards: keep it false for
    ``chameleon train``."""
    search_hidden: bool = True
    """Whether plan search for likely failures runs ahead of time while training is healthy."""
    search_extra_stages: int = 2
    """Dynamic search: the longest pipeline considered is the job's ``pp`` plus this."""
    search_exhaustive_workers: int = 8
    """Dynamic search: up to this many survivors every integer partition into pipeline
    lengths is tried; above it at most two distinct lengths are mixed (see
    ``recovery/dynamic.py``)."""
    migration_max_parts: int = 1
    """A migrated layer is split across at most this many live replicas (senders). 1 by
    default: the restorer already spreads a receiver's layers over different senders, and
    the receiver's own link bounds the time, so splitting barely shortens migration while
    the DSATUR colouring of the transfers grows quadratically with their number."""
    slow_policy: str = "chameleon"
    """The answer to a slow worker (a fail-slow, docs/design.md 3.4): ``chameleon`` prices
    keep, rebalance, dynamic, swap and evict and takes the best over the expected slowdown
    (a fixed-strategy policy evicts, as if the worker had died, the common practice);
    ``keep``, ``rebalance`` (fewer micro-batches to its pipeline), ``dynamic`` (the slow
    worker's pipeline re-split at its measured speed), ``swap`` (an idle worker takes its
    place) or ``evict`` fix the answer."""
    slow_expected_s: float = FALCON_SLOW_MEAN_S
    """Expected length of a fail-slow, the window a slow worker's answer is scored over
    (with the expected time to the next failure): the mean of Falcon's range, about 1.4 h."""
    slow_detect_steps: int = 5
    """Steps a slowdown (or its end) runs before the job notices it (the runtime detects
    one within 5 steps); the simulator decides that much later."""

    def __post_init__(self) -> None:
        check_int("search_extra_stages", self.search_extra_stages, minimum=0)
        check_int("search_exhaustive_workers", self.search_exhaustive_workers, minimum=1)
        check_int("migration_max_parts", self.migration_max_parts)
        check_int("memory_checkpoint_every", self.memory_checkpoint_every)
        check_choice("slow_policy", self.slow_policy, SLOW_POLICY_NAMES)
        check_positive("slow_expected_s", self.slow_expected_s)
        check_int("slow_detect_steps", self.slow_detect_steps, minimum=0)
        if self.memory_checkpoint and not self.checkpoint:
            fail("memory_checkpoint", "needs checkpoints (recovery.checkpoint = true): the "
                 "copies in memory are of the checkpointed state")
        for name in ("detect_s", "restart_s", "checkpoint_load_s", "comm_init_s",
                     "comm_per_rank_s", "layer_build_s", "warmup_steps"):
            check_positive(name, getattr(self, name), allow_zero=True)
        if self.rebuild_s is not None:
            check_positive("rebuild_s", self.rebuild_s, allow_zero=True)
        check_positive("layer_build_gb_per_s", self.layer_build_gb_per_s)
        check_positive("checkpoint_interval_s", self.checkpoint_interval_s)
        for name in ("migration_efficiency", "background_share"):
            value = getattr(self, name)
            check_positive(name, value)
            if value > 1:
                fail(name, f"is a fraction and must be <= 1, got {value}")


@dataclass(frozen=True, kw_only=True)
class PolicySpec:
    """How a decision is taken (section ``[policy]``)."""

    name: str = "chameleon"
    """``chameleon`` (adaptive) or a fixed strategy: reroute, recycle, dynamic, restart,
    shrink, reroute-then-dynamic, swap (spare workers take the failed ones' places; a
    restart when too few are idle)."""
    horizon_s: float | None = None
    """Fixed time until the plan next changes; unset means estimate it."""
    node_mtbf_hours: float = LLAMA3_NODE_MTBF_HOURS
    """Prior mean time between failures of one node, hours."""
    repair_hours: float | None = None
    """Expected time for a failed node to come back; caps the horizon. Unset: no cap."""
    node_failure_share: float = 0.26
    """Share of failures that take down a whole node or more (Llama 3: 18 % host, 8 %
    switch or cable). Chameleon prices the risk that such a failure leaves a layer of a
    plan without a live replica (a restart) with it; 1.0 for preemptible nodes."""
    precompute_budget_s: float = 60.0
    """Seconds the policy may spend, in the background after each change of plan,
    preparing the decisions of likely failures (every single worker and node); a real
    failure stops it at once. The 16k job prepares all of them in about 10 s."""

    def __post_init__(self) -> None:
        check_choice("name", self.name, POLICY_NAMES)
        check_positive("precompute_budget_s", self.precompute_budget_s, allow_zero=True)
        check_positive("node_failure_share", self.node_failure_share, allow_zero=True)
        if self.node_failure_share > 1:
            fail("node_failure_share", f"must be between 0 and 1, got {self.node_failure_share}")
        if self.horizon_s is not None:
            check_positive("horizon_s", self.horizon_s)
        check_positive("node_mtbf_hours", self.node_mtbf_hours)
        if self.repair_hours is not None:
            check_positive("repair_hours", self.repair_hours)
