"""Values shared by the recovery strategies: strategy names, candidates, migrations, state.

A strategy turns ``(state, failed workers)`` into :class:`Candidate` values; the policy
scores them. Everything here is an immutable value so decisions can be cached and compared.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from chameleon_ft.perf import Estimate
from chameleon_ft.plan import ExecutionPlan

if TYPE_CHECKING:
    from chameleon_ft.perf.network import Topology
    from chameleon_ft.profile import Profile
    from chameleon_ft.recovery.templates import Templates
    from chameleon_ft.spec.config import Config


class Strategy(StrEnum):
    """Ways to recover (docs/design.md section 2); ``keep`` only answers a rejoin or a slow
    worker; ``recycle`` is ``reroute`` with ReCycle's decoupled backward; ``swap`` puts idle
    (spare) workers in the failed (or slow) workers' places of the same plan; ``rebalance``
    and ``evict`` answer a slow worker only (fewer micro-batches to its pipeline; out of the
    plan as if it had died, docs/design.md 3.4)."""

    REROUTE = "reroute"
    RECYCLE = "recycle"
    DYNAMIC = "dynamic"
    RESTART = "restart"
    SHRINK = "shrink"
    REROUTE_THEN_DYNAMIC = "reroute-then-dynamic"
    SWAP = "swap"
    KEEP = "keep"
    REBALANCE = "rebalance"
    EVICT = "evict"


class CheckpointSource(StrEnum):
    """Where a recovery that rolls back to the last checkpoint reads it from."""

    STORAGE = "storage"
    """The periodic checkpoint on storage (``checkpoint_load_s``)."""
    MEMORY = "memory"
    """The copies in other hosts' memory (``[recovery] memory_checkpoint``)."""


EstimateFn = Callable[[ExecutionPlan], Estimate]
"""``plan -> estimate`` with the job's profile and topology already bound."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One piece of one layer's state moving between two workers during migration."""

    layer: int
    src: int
    dst: int
    part: int
    """Which slice of the layer (0-based) this transfer carries."""
    num_parts: int
    """How many replicas the layer is split across."""
    num_bytes: float
    """Per-device bytes of this slice (parameters plus optimizer state)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {"layer": self.layer, "src": self.src, "dst": self.dst, "part": self.part,
                "num_parts": self.num_parts, "num_bytes": self.num_bytes}


class _LazyField:
    """A field of a :class:`LazyFields` object: computed at its first read (with the other
    lazy fields), then an ordinary attribute (a non-data descriptor yields to the
    instance's own value)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        state = obj.__dict__
        lazy = state.get("_lazy")
        if lazy is not None:  # two threads may both fill: they store the same values
            state.update(obj._fill(*lazy))
            state.pop("_lazy", None)
        return state[self._name]


class LazyFields:
    """Mixed into a subclass of a frozen dataclass (``_base``) whose ``_lazy_fields`` are
    computed by :meth:`_fill` when first read: a per-worker table that most readers never
    read (thousands of entries on a large job) costs nothing until one does. The object
    compares and hashes as ``_base`` does, field by field, so it is interchangeable with
    one built eagerly."""

    _base: ClassVar[type]
    _lazy_fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls._lazy_fields:
            setattr(cls, name, _LazyField(name))

    @classmethod
    def lazily(cls, given: Mapping[str, Any], *args: Any) -> Any:
        """An object with the fields ``given`` set now and the lazy ones filled from
        ``_fill(*args)`` at the first read of any."""
        out = object.__new__(cls)
        for name, value in given.items():
            object.__setattr__(out, name, value)
        out.__dict__["_lazy"] = args
        return out

    def _fill(self, *args: Any) -> dict[str, Any]:
        """The lazy fields' values."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, self._base):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self._base))

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self._base)))


@dataclass(frozen=True, slots=True)
class Migration:
    """How state moves into a new plan: who takes which slot, which bytes move, in what rounds."""

    slots: tuple[tuple[int, int, int], ...]
    """``(worker, pipeline, stage)`` for every slot of the new plan."""
    moved_bytes: float
    """Per-device bytes received over all workers."""
    transfers: tuple[Transfer, ...]
    rounds: tuple[tuple[int, ...], ...]
    """Indices into ``transfers``; no worker sends or receives twice within a round."""
    time_s: float
    """Sum over rounds of the slowest transfer of the round, at full migration bandwidth."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {
            "slots": [list(s) for s in self.slots],
            "moved_bytes": self.moved_bytes,
            "transfers": [t.to_dict() for t in self.transfers],
            "rounds": [list(r) for r in self.rounds],
            "time_s": self.time_s,
        }


def _num(value: float) -> float | None:
    """JSON has no infinity or NaN: report them as null."""
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Candidate:
    """One way to recover, priced: the plan, its step time, memory and transition cost."""

    strategy: Strategy
    feasible: bool
    plan: ExecutionPlan | None
    estimate: Estimate | None
    step_s: float
    """Estimated step time after the transition (the final plan's for two-phase); inf when
    infeasible."""
    throughput_samples_s: float
    transition_s: float
    """Time during which no training happens: the sum of ``terms``."""
    terms: Mapping[str, float]
    """The named transition terms (detect_s, comm_s, build_s, warmup_s, search_s,
    migrate_s, lost_step_s, ...; ``recovery/transition.py``)."""
    peak_memory_bytes: float
    """Largest per-device peak over the plan's workers."""
    reason: str
    """Why infeasible, or what the plan does (one line)."""
    score: float = 0.0
    """Set by the policy: average samples/s over the horizon (Eq. 8 or its expectation)."""
    migration: Migration | None = None
    interim_plan: ExecutionPlan | None = None
    """Two-phase only: the rerouted plan that runs while state migrates."""
    interim_step_s: float | None = None
    """Two-phase only: the step time while state migrates in the background."""
    interim_s: float = 0.0
    """Two-phase only: seconds of background migration (run at ``interim_step_s``)."""
    switch_s: float = 0.0
    """Two-phase only: the pause when switching to the final plan (the sum of
    ``switch_terms``)."""
    switch_terms: Mapping[str, float] = field(default_factory=dict)
    """Two-phase only: the switch's terms (communicators the final plan adds, warm-up)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Free-form details for reports (e.g. the pipeline lengths of a dynamic plan)."""
    rollback: CheckpointSource | None = None
    """Set when every worker of the plan reloads the last checkpoint (a restart, a swap
    whose slot lost every replica): from where; the work since that checkpoint is lost
    (the ``lost_s`` term). ``None``: training goes on from the live state."""

    def to_dict(self, *, with_plan: bool = False) -> dict[str, Any]:
        """A JSON-ready form (infinities become null)."""
        out: dict[str, Any] = {
            "strategy": str(self.strategy),
            "feasible": self.feasible,
            "step_s": _num(self.step_s),
            "throughput_samples_s": _num(self.throughput_samples_s),
            "transition_s": _num(self.transition_s),
            "terms": {k: _num(v) for k, v in self.terms.items()},
            "score": _num(self.score),
            "peak_memory_bytes": _num(self.peak_memory_bytes),
            "reason": self.reason,
        }
        if self.rollback is not None:
            out["rollback"] = str(self.rollback)
        if self.interim_step_s is not None:
            out["interim_step_s"] = _num(self.interim_step_s)
            out["interim_s"] = _num(self.interim_s)
            out["switch_s"] = _num(self.switch_s)
            out["switch_terms"] = {k: _num(v) for k, v in self.switch_terms.items()}
        if self.extra:
            out["extra"] = dict(self.extra)
        if with_plan and self.plan is not None:
            out["plan"] = self.plan.to_dict()
        return out


def infeasible(strategy: Strategy, reason: str) -> Candidate:
    """A candidate that cannot be used, with the reason."""
    return Candidate(strategy=strategy, feasible=False, plan=None, estimate=None,
                     step_s=math.inf, throughput_samples_s=0.0, transition_s=math.inf,
                     terms={}, peak_memory_bytes=0.0, reason=reason)


@dataclass(frozen=True)
class RecoveryState:
    """Everything a strategy needs: the job, the CURRENT plan, who is alive.

    ``alive`` already excludes the failed workers; it may contain idle workers that the
    current plan does not use (for instance after a shrink, or a returned node).
    """

    config: Config
    profile: Profile
    topology: Topology
    plan: ExecutionPlan
    alive: frozenset[int]
    """Every live worker, idle ones too: workers of ``topology`` (the planner checks)."""
    templates: Templates
    estimate: EstimateFn
    since_checkpoint_s: float | None = None
    """Exact progress since the last checkpoint, when the caller knows it."""
    max_workers: int | None = None
    """The most workers a plan may use (the job's layout, ``Config.num_workers``): idle
    workers beyond it (warm spares) replace lost workers, they never add pipelines.
    ``None``: every live worker."""

    @property
    def num_usable(self) -> int:
        """Live workers a re-formed plan may use: ``alive``, at most ``max_workers``."""
        n = len(self.alive)
        return n if self.max_workers is None else min(n, self.max_workers)

    def idle_workers(self) -> list[int]:
        """Live workers the current plan does not run (spares, returned or left-over
        workers), in id order."""
        used = self.plan.stage_of_worker
        return sorted(w for w in self.alive if w not in used)

    @property
    def global_batch(self) -> int:
        """Samples per step, constant through every recovery."""
        return self.plan.global_batch

    def held_layers(self) -> Mapping[int, range]:
        """Layers held by each live worker of the current plan (idle workers hold none);
        computed once per state (every candidate of a decision asks)."""
        return self._held

    @cached_property
    def _held(self) -> Mapping[int, range]:
        by_worker = self.plan.layers_by_worker
        gone = by_worker.keys() - self.alive  # few: the failed workers
        if not gone:
            return MappingProxyType(by_worker)
        held = dict(by_worker)
        for w in gone:
            del held[w]
        return MappingProxyType(held)

    def named_dead(self) -> frozenset[int]:
        """Workers the current plan names (a rerouted stage's dead one too) that are not
        alive, old and new dead; computed once per state (every rerouting asks)."""
        return self._named_dead

    @cached_property
    def _named_dead(self) -> frozenset[int]:
        return frozenset(itertools.filterfalse(
            self.alive.__contains__, itertools.chain.from_iterable(self.plan.worker_rows())))

    def missing_layers(self) -> list[int]:
        """Layers with no live replica."""
        # Every pipeline holds every layer, and one without a dead worker holds them all
        # alive: with fewer dead workers in the cluster than pipelines, none is missing.
        if self.topology.num_workers - len(self.alive) < self.plan.num_pipelines:
            return []
        covered = [False] * self.plan.num_layers
        held = list(self.held_layers().values())
        for layers in dict(zip(map(id, held), held, strict=True)).values():  # each object once
            for layer in layers:
                covered[layer] = True
        return [i for i, c in enumerate(covered) if not c]


def candidate_from_estimate(strategy: Strategy, plan: ExecutionPlan, est: Estimate,
                            terms: Mapping[str, float], reason: str,
                            migration: Migration | None = None,
                            extra: Mapping[str, Any] | None = None,
                            rollback: CheckpointSource | None = None) -> Candidate:
    """A feasible candidate, or an infeasible one when the plan does not fit memory."""
    if not est.memory_fits:
        return Candidate(strategy=strategy, feasible=False, plan=plan, estimate=est,
                         step_s=est.step_s, throughput_samples_s=est.throughput_samples_s,
                         transition_s=sum(terms.values()), terms=dict(terms),
                         peak_memory_bytes=est.max_memory_bytes,
                         reason=f"does not fit device memory ({est.max_memory_bytes / 2**30:.1f} "
                                f"GiB peak); {reason}", migration=migration,
                         extra=dict(extra or {}), rollback=rollback)
    return Candidate(strategy=strategy, feasible=True, plan=plan, estimate=est,
                     step_s=est.step_s, throughput_samples_s=est.throughput_samples_s,
                     transition_s=sum(terms.values()), terms=dict(terms),
                     peak_memory_bytes=est.max_memory_bytes, reason=reason,
                     migration=migration, extra=dict(extra or {}), rollback=rollback)
