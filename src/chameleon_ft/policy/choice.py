"""How a planner chooses among priced candidates, and what it answers.

The :class:`Chooser` keeps what scores depend on besides the candidates: the failure-rate
estimate (the failures and live worker-seconds seen so far, ``horizon.py``), the window a
decision scores over (given, or the expected time to the next change), the fragility of a
plan that one node's loss would end, and the bar a decision's first candidate sets for its
dynamic search. :func:`pick` then takes the best score (ties to the least disruptive
strategy), or a fixed policy's own strategy, and says why in one line.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from chameleon_ft.perf import Topology
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.policy.candidates import _Bar
from chameleon_ft.policy.horizon import LiveExposure, mean_horizon_s, worker_rate_per_s
from chameleon_ft.policy.score import candidate_score, score_ceiling
from chameleon_ft.recovery import dynamic
from chameleon_ft.recovery.restorer import fatal_nodes
from chameleon_ft.recovery.transition import lost_step_s
from chameleon_ft.recovery.types import (
    Candidate,
    CheckpointSource,
    Migration,
    RecoveryState,
    Strategy,
)
from chameleon_ft.spec.config import Config

_ORDER = {s: i for i, s in enumerate(
    (Strategy.KEEP, Strategy.REBALANCE, Strategy.REROUTE, Strategy.RECYCLE, Strategy.SWAP,
     Strategy.REROUTE_THEN_DYNAMIC, Strategy.DYNAMIC, Strategy.SHRINK, Strategy.EVICT,
     Strategy.RESTART))}
"""Final tie-break between equal scores: cheaper, less disruptive strategies first."""

_BEATEN_MARGIN = 1e-6
"""Relative margin of :meth:`Chooser.beaten_by`: far above float noise and the 9 digits
step times are compared to (``dynamic._rounded``)."""


@dataclass(frozen=True)
class Decision:
    """What to do after a failure (or a rejoin), with every candidate and why."""

    strategy: str
    plan: ExecutionPlan
    candidates: tuple[Candidate, ...]
    reason: str
    """One line: why this candidate won."""
    transition_s: float
    horizon_s: float
    """The window used: given, or the expected time to the next change."""
    search_s: float
    """Seconds this decision spent building candidates (about 0 on a cache hit)."""
    cache_hit: bool
    migration: Migration | None
    horizon_expected: bool = False
    """True when ``horizon_s`` is an estimated mean (expected-work rule), not given."""

    @property
    def rollback(self) -> CheckpointSource | None:
        """Where every worker of :attr:`plan` reloads the last checkpoint from (a restart,
        a swap whose slot lost every replica), ``None`` when training goes on from the
        live state (``Candidate.rollback``)."""
        return self.chosen.rollback

    @property
    def chosen(self) -> Candidate:
        """The winning candidate."""
        for candidate in self.candidates:
            if candidate.strategy == self.strategy and candidate.feasible:
                return candidate
        raise AssertionError("a decision always lists its choice")  # pragma: no cover

    def to_dict(self, *, with_plans: bool = False) -> dict[str, Any]:
        """A JSON-ready form (the chosen plan and migration included)."""
        return {
            "strategy": self.strategy,
            "reason": self.reason,
            "transition_s": self.transition_s,
            "horizon_s": self.horizon_s if math.isfinite(self.horizon_s) else None,
            "horizon_expected": self.horizon_expected,
            "search_s": self.search_s,
            "cache_hit": self.cache_hit,
            "candidates": [c.to_dict(with_plan=with_plans) for c in self.candidates],
            "plan": self.plan.to_dict(),
            "migration": self.migration.to_dict() if self.migration is not None else None,
        }


class Chooser:
    """Scores a decision's candidates over its window (Eq. 8, or the expected-work rule
    with the fragility term) from the failure-rate estimate it keeps.

    Args:
        config: the job.
        topology: workers, nodes and links.
        memory_reload_s: a reload of the failure-free plan from memory (its read and half
            the interval between copies), asked for once when first needed.
    """

    def __init__(self, config: Config, topology: Topology,
                 memory_reload_s: Callable[[], float]) -> None:
        self.config = config
        self.topology = topology
        self._reload = memory_reload_s
        self.failure_events: set[tuple[float, frozenset[int]]] = set()
        """Failure events seen (time, workers): the rate estimate's count."""
        self.exposure = LiveExposure(config.num_workers)
        """Live worker-seconds so far, from the live workers each decision is told."""

    def worker_rate_per_s(self, now_s: float) -> float:
        """The failure-rate estimate of one worker at ``now_s`` (``horizon.py``)."""
        return worker_rate_per_s(self.config.policy,
                                 workers_per_node=self.topology.workers_per_node,
                                 num_failures=len(self.failure_events),
                                 exposure_worker_s=self.exposure.at(now_s))

    def horizon(self, *, num_live: int, now_s: float) -> float:
        """The expected time to the next change for ``num_live`` workers (``horizon.py``)."""
        return mean_horizon_s(self.worker_rate_per_s(now_s), num_live,
                              self.config.policy.repair_hours)

    def window(self, horizon_s: float | None, num_live: int, now_s: float
               ) -> tuple[float, bool]:
        """The window candidates are scored over, and whether it is expected (exponential
        with that mean) rather than given."""
        # The next change of plan is a failure of a worker in use: idle workers beyond the
        # job's layout (warm spares) fail without changing it.
        num_live = min(num_live, self.config.num_workers)
        if horizon_s is None:
            horizon_s = self.config.policy.horizon_s
        if horizon_s is None:
            return self.horizon(num_live=num_live, now_s=now_s), True
        return horizon_s, False

    def scored(self, candidates: tuple[Candidate, ...], *, batch: int, window_s: float,
               expected: bool, num_live: int, now_s: float,
               num_idle: int) -> tuple[Candidate, ...]:
        """``candidates`` with their scores over the window (an expected window lowers the
        score of a fragile plan, :meth:`with_fragility`)."""
        scored = tuple(replace(c, score=candidate_score(c, batch, horizon_s=window_s,
                                                        expected=expected))
                       for c in candidates)
        if expected and math.isfinite(window_s):
            exposure_s = self.fragility_exposure_s(num_live, window_s, now_s, num_idle)
            scored = tuple(self.with_fragility(c, batch, window_s, exposure_s) for c in scored)
        return scored

    def fragility_exposure_s(self, num_live: int, window_s: float, now_s: float,
                             num_idle: int = 0) -> float:
        """Seconds of training a plan expects to lose in the window per node whose loss
        would be fatal to it.

        If the next change is a node failure and that node holds the last live replica
        of some layer of a plan, only a restart can follow: it costs the restart, the
        checkpoint load and on average half a checkpoint interval of work, instead of a
        survivable recovery's detection (``extra_s``). A node is the one that
        fails with probability ``1 / live_nodes`` given ``p_fail``, the expected
        node-level failures in the window (at most 1: ``policy.node_failure_share`` of all
        failures). 0 without checkpoints (no restart to price). A survivable recovery's own
        rebuild is small next to ``extra_s`` and depends on the plan; it is left out.

        With checkpoints in memory the reload reads the failure-free plan's state from
        another host's memory and loses half the interval between copies (the copies of a
        node's layers live on the next node, so one node's loss leaves them); with a whole
        node's worth of idle workers on a job launched with spares, a swap from the
        checkpoint follows instead of a restart, without ``restart_s``.
        """
        spec = self.config.recovery
        if not spec.checkpoint:
            return 0.0
        live_nodes = max(1, -(-num_live // self.topology.workers_per_node))
        p_fail = min(1.0, num_live * self.worker_rate_per_s(now_s) * window_s
                     * self.config.policy.node_failure_share)
        restart_s = spec.restart_s
        if (self.config.cluster.spare_nodes > 0
                and num_idle >= self.topology.workers_per_node):
            restart_s = 0.0
        if spec.memory_checkpoint:
            reload_s = self._memory_reload_s
        else:
            reload_s = spec.checkpoint_load_s + spec.checkpoint_interval_s / 2
        extra_s = max(0.0, restart_s + reload_s - spec.detect_s)
        return p_fail * extra_s / live_nodes

    @functools.cached_property
    def _memory_reload_s(self) -> float:
        return self._reload()

    def with_fragility(self, candidate: Candidate, batch: int, window_s: float,
                       exposure_s: float) -> Candidate:
        """``candidate`` with its expected score lowered by what a fragile plan risks:
        ``X * |fatal nodes| * exposure_s / window`` samples/s (:func:`fatal_nodes`,
        :meth:`fragility_exposure_s`). Eq. 8 with a given window is left as the paper
        has it."""
        if (exposure_s <= 0 or not candidate.feasible or candidate.plan is None
                or candidate.score <= 0):
            return candidate
        fatal = fatal_nodes(candidate.plan, self.topology)
        if not fatal:
            return candidate
        risk = (batch / candidate.step_s) * len(fatal) * exposure_s
        return replace(candidate, score=max(0.0, candidate.score - risk / window_s))

    def beaten_by(self, *, failure: bool, horizon_s: float | None, num_live: int,
                  now_s: float) -> _Bar:
        """The bar a decision's first candidate (a failure's rerouting, a rejoin's keep)
        sets for its dynamic re-plan: a search whose fastest plan scores below it however
        short its transition stops before matching survivors (``dynamic.search``).

        Exact: the re-plan scores at most :func:`score_ceiling` of its step and of the
        terms it surely pays (a failure's detection and lost step); the two-phase
        candidate that starts with the first one then switches to the re-plan trains no
        faster than the first alone; and the fragility term only lowers scores. So when
        the first candidate has no fatal node (no fragility lowers it) neither can win.
        """
        window, expected = self.window(horizon_s, num_live, now_s)
        detect_s = self.config.recovery.detect_s

        def bar(first: Candidate, state: RecoveryState) -> dynamic.Beaten | None:
            if (not first.feasible or first.plan is None
                    or fatal_nodes(first.plan, self.topology)):
                return None
            batch = state.plan.global_batch
            best = candidate_score(first, batch, horizon_s=window, expected=expected)
            floor_s = (detect_s + lost_step_s(state.estimate(state.plan).step_s)
                       if failure else 0.0)

            def beaten(step_s: float) -> bool:
                return (score_ceiling(batch, step_s, floor_s, horizon_s=window,
                                      expected=expected)
                        < best * (1.0 - _BEATEN_MARGIN))
            return beaten
        return bar


def pick(scored: tuple[Candidate, ...], policy: str, window_s: float,
         expected: bool) -> tuple[Candidate, str]:
    """The candidate ``policy`` takes among ``scored``, and why (one line): chameleon's
    highest score; a fixed policy's own strategy, else restart, else the best.

    Raises:
        ValueError: when no candidate is feasible.
    """
    feasible = [c for c in scored if c.feasible]
    if not feasible:
        reasons = "; ".join(f"{c.strategy}: {c.reason}" for c in scored)
        raise ValueError(f"failed: no feasible recovery ({reasons})")

    def rank(c: Candidate) -> tuple[float, float, int, float]:
        # exact ties (e.g. a window shorter than any switch) go to the least disruptive
        return (-c.score, c.transition_s, _ORDER[c.strategy], c.step_s)

    best = min(feasible, key=rank)
    if policy == "chameleon":
        window_text = (f"expected horizon {_duration(window_s)}" if expected
                       else f"horizon {_duration(window_s)}")
        runner_up = min((c for c in feasible if c is not best), key=rank, default=None)
        versus = (f" vs {runner_up.strategy} {runner_up.score:.6g}"
                  if runner_up is not None else "")
        return best, (f"{best.strategy} scores {best.score:.6g} samples/s over the "
                      f"{window_text}{versus} (step {best.step_s:.3f} s, transition "
                      f"{best.transition_s:.1f} s)")
    wanted = Strategy(policy)
    own = next((c for c in feasible if c.strategy == wanted), None)
    if own is not None:
        return own, f"policy {policy}: fixed strategy (step {own.step_s:.3f} s)"
    fallback = next((c for c in feasible if c.strategy == Strategy.RESTART), None)
    why = next(c.reason for c in scored if c.strategy == wanted)
    if fallback is not None:
        return fallback, f"policy {policy}: infeasible ({why}); falling back to restart"
    return best, (f"policy {policy}: infeasible ({why}) and restart too; taking the "
                  f"best feasible, {best.strategy}")


def rejoin_policy(policy: str, candidates: tuple[Candidate, ...]) -> str:
    """The policy a re-join's choice follows: a rerouting or shrink policy its own strategy
    when feasible, else keep; chameleon and dynamic as they are; any other policy keeps
    the current plan."""
    if policy in (Strategy.REROUTE, Strategy.RECYCLE, Strategy.SHRINK):
        own = next(c for c in candidates if c.strategy == policy)
        return policy if own.feasible else "keep"
    if policy not in ("chameleon", "dynamic"):
        return "keep"
    return policy


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "inf"
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h" if seconds < 3600 * 1000 else f"{seconds / 3600:.0f} h"
    return f"{seconds:.0f} s"
