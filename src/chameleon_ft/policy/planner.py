"""The planner: prices every recovery strategy for a failure and picks one.

``Planner(config)`` builds the profile, the topology, the failure-free plan and the
pipeline templates once. ``decide(plan, failed)`` builds (or takes from the cache) the
candidates of every strategy from the CURRENT plan, scores them for the horizon and picks
one with the policy:

- ``chameleon``: the highest score among all feasible candidates (its rerouting is
  ``recycle`` when the job's system can defer weight gradients, else ``reroute``). With
  a horizon given (argument or ``policy.horizon_s``) the score is Eq. 8; otherwise it is
  the expected work over an exponential horizon whose mean comes from the failure-rate
  estimate (``horizon.py``), divided by that mean.
- ``reroute`` / ``recycle`` / ``dynamic`` / ``restart`` / ``shrink`` /
  ``reroute-then-dynamic`` / ``swap``: that strategy; ``restart`` only when it is
  infeasible.

Idle live workers (warm spares, ``[cluster] spare_nodes``; repaired or left-over workers)
are passed in ``alive``: ``swap`` puts them in the failed workers' places, and a re-formed
plan may use them, never more workers than the job's layout has.

Expedient search: ``precompute(plan)`` fills the cache for every single-worker and
single-node failure while training is healthy; a decision that hits the cache only
re-scores (the dynamic search time then counts as hidden, 0 s). ``prepared.py`` runs it in
the background, within a budget, with a second planner sharing the cache
(:class:`DecisionCache`), so that a decision never waits for it.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from chameleon_ft.perf import Estimate, Topology, estimator_for
from chameleon_ft.plan import ExecutionPlan, initial_plan
from chameleon_ft.policy.horizon import LiveExposure, mean_horizon_s, worker_rate_per_s
from chameleon_ft.policy.score import candidate_score, score_ceiling
from chameleon_ft.policy.symmetry import (
    canonical_renaming,
    carried_estimate,
    interchangeable_form,
    rename_candidate,
)
from chameleon_ft.profile import Profile, build_profile
from chameleon_ft.recovery import dynamic, reroute, restart, shrink, swap
from chameleon_ft.recovery.reroute_then_dynamic import combine
from chameleon_ft.recovery.restorer import copy_in, fatal_nodes, load_matching
from chameleon_ft.recovery.templates import Templates
from chameleon_ft.recovery.transition import (
    lost_progress_s,
    lost_step_s,
    memory_load_s,
    memory_lost_progress_s,
)
from chameleon_ft.recovery.types import (
    Candidate,
    CheckpointSource,
    Migration,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.recovery import POLICY_NAMES

_ORDER = {s: i for i, s in enumerate(
    (Strategy.KEEP, Strategy.REROUTE, Strategy.RECYCLE, Strategy.SWAP,
     Strategy.REROUTE_THEN_DYNAMIC, Strategy.DYNAMIC, Strategy.SHRINK, Strategy.RESTART))}
"""Final tie-break between equal scores: cheaper, less disruptive strategies first."""

_Bar = Callable[[Candidate, RecoveryState], "dynamic.Beaten | None"]
"""A decision's first candidate (in canonical names, with its state) -> the test it sets
for the dynamic search, or ``None`` when it sets none."""
_BEATEN_MARGIN = 1e-6
"""Relative margin of :meth:`Planner._beaten_by`: far above float noise and the 9 digits
step times are compared to (``dynamic._rounded``)."""

_FAILURE_BUILDERS = {Strategy.REROUTE: reroute.candidates,
                     Strategy.RECYCLE: reroute.recycle_candidates,
                     Strategy.DYNAMIC: dynamic.candidates,
                     Strategy.RESTART: restart.candidates, Strategy.SHRINK: shrink.candidates,
                     Strategy.SWAP: swap.candidates}
_OWN = {Strategy.REROUTE: (Strategy.REROUTE,), Strategy.RECYCLE: (Strategy.RECYCLE,),
        Strategy.DYNAMIC: (Strategy.DYNAMIC,), Strategy.RESTART: (Strategy.RESTART,),
        Strategy.SHRINK: (Strategy.SHRINK,), Strategy.SWAP: (Strategy.SWAP,)}
"""The candidates a fixed-strategy policy needs when it does not compare
(reroute-then-dynamic: the job's rerouting and dynamic, see ``Planner._own``)."""
_REJOIN: dict[str, tuple[Strategy, ...]] = {
    s: (Strategy.KEEP, s)
    for s in (Strategy.DYNAMIC, Strategy.REROUTE, Strategy.RECYCLE, Strategy.SHRINK)}
"""What a rejoin is answered with, per fixed policy (chameleon: see ``Planner._rejoin``;
others: keep, or dynamic to compare)."""


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


class _Stopped(Exception):
    """A precompute asked to stop in the middle of a failure set (``Planner._stop``)."""


_CacheKey = tuple[ExecutionPlan, frozenset[int], frozenset[int], str]
"""(plan, failed or returned workers, live workers, event kind); a canonical key names
the workers not alive instead of the live ones (the same state, cheaper to hash)."""


@dataclass(frozen=True)
class _Found:
    """Candidates from :meth:`Planner._lookup`, in the canonical names."""

    candidates: tuple[Candidate, ...]
    hit: bool
    """Whether every candidate came from the cache."""
    search_s: float
    back: Callable[[Candidate], Candidate] | None
    """Renames a candidate to the caller's names (``None``: the names are the caller's)."""

    def named(self) -> tuple[Candidate, ...]:
        """Every candidate in the caller's names."""
        back = self.back
        return self.candidates if back is None else tuple(back(c) for c in self.candidates)


@dataclass
class _Entry:
    """The candidates priced so far for one event, by strategy."""

    plan: ExecutionPlan
    """The plan they were computed from (the key's, as an object: answers share its
    pipelines)."""
    candidates: dict[Strategy, Candidate] = field(default_factory=dict)


def _only_ints(workers: Collection[object]) -> bool:
    """Whether every item is a plain ``int`` (not a bool, not a float equal to one),
    checked at C speed."""
    return operator.countOf(map(type, workers), int) == len(workers)


class DecisionCache:
    """Decisions' candidates by event, the least recently used dropped first.

    Safe to share between planners of one job on different threads (a background
    precompute and the decisions, ``prepared.py``): a look-up or an insert holds the lock
    for one dictionary operation, never while anything is priced. Entries only ever gain
    candidates, each an immutable value, so a reader sees an entry whole or without a
    strategy another thread is adding (it then prices that one itself).

    Args:
        size: entries kept. An entry holds a few whole plans with their estimates: about
            4 MB on 2,048 workers, a few kB on 32.

    Raises:
        ValueError: for a size below 1.
    """

    def __init__(self, size: int = 512) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"cache_size: must be an integer >= 1, got {size!r}")
        self.size = size
        self._entries: OrderedDict[_CacheKey, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: _CacheKey) -> _Entry | None:
        """The entry of ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: _CacheKey, entry: _Entry) -> None:
        """Keep ``entry`` for ``key`` as the most recently used."""
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class Planner:
    """Recovery planning for one job.

    Args:
        config: the job.
        profile: per-layer costs; default: built from the config.
        policy: overrides ``config.policy.name``.
        cache_size: decisions' candidates kept (least recently used dropped first; see
            :class:`DecisionCache`).
        cache: a decision cache shared with other planners of the same job (then
            ``cache_size`` is its size).

    Raises:
        ValueError: for an unknown policy or a job that does not fit.
    """

    def __init__(self, config: Config, *, profile: Profile | None = None,
                 policy: str | None = None, cache_size: int = 512,
                 cache: DecisionCache | None = None) -> None:
        self._cache = cache if cache is not None else DecisionCache(cache_size)
        self.config = config
        self._profile = profile if profile is not None else build_profile(config)
        self._topology = Topology.from_config(config)
        self.policy = _check_policy(policy if policy is not None else config.policy.name)
        self._estimator = estimator_for(self._profile, self._topology)
        self._initial_plan = initial_plan(config, self._profile)
        self._failure_free = self._estimator.estimate(self._initial_plan)
        self.templates = Templates(
            self._profile, capacity_bytes=self._topology.memory_capacity_bytes,
            micro_batch=config.job.micro_batch, schedule=config.job.schedule,
            num_workers=self.config.num_workers,
            workers_per_node=self._topology.workers_per_node,
            pipeline_estimate=self._pipeline_estimate,
            num_microbatches=self._initial_plan.num_microbatches)
        self._failure_events: set[tuple[float, frozenset[int]]] = set()
        self._others: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())
        """The last set of workers checked whole, and the cluster's other workers."""
        self._issued: weakref.WeakValueDictionary[int, ExecutionPlan] = (
            weakref.WeakValueDictionary({id(self._initial_plan): self._initial_plan}))
        """Plans this planner made and handed out, by identity (while they live): their
        workers are the cluster's, so a decision from one need not check them again."""
        self._exposure = LiveExposure(config.num_workers)
        """Live worker-seconds so far, from the live workers each decision is told."""
        self._stop: Callable[[], bool] | None = None
        """While :meth:`precompute` runs: whether to stop (asked before every estimate)."""
        start = time.perf_counter()
        if not self._topology.placement_free:
            load_matching()  # the Hungarian matching's libraries, once per job
        self._warm_templates()
        self.setup_s = time.perf_counter() - start
        """Seconds spent building the pipeline templates (once per job), and loading the
        matching's libraries where placement matters."""

    def _warm_templates(self) -> None:
        """Time every template at the micro-batch counts a single-worker or single-node
        failure asks for, so a decision only prices whole plans (once per job)."""
        plan = self._initial_plan
        spec = self.config.recovery
        n = len(plan.workers)
        if n <= spec.search_exhaustive_workers:
            return  # small jobs: the search is cheap enough to fill the table itself
        longest = min(n, self._profile.num_layers, self.config.job.pp + spec.search_extra_stages)
        total = plan.num_microbatches
        for length in self.templates.feasible_lengths(longest):
            for lost in sorted({1, self._topology.workers_per_node}):
                survivors = n - lost
                if survivors < length:
                    continue
                share = total * length / survivors
                wanted = set(range(max(1, math.floor(share) - 1), math.ceil(share) + 3))
                base = max(1, total // max(1, survivors // length))
                wanted.update((base, base + 1))
                for m in sorted(wanted):
                    self.templates.length_step_s(length, m)

    # ------------------------------------------------------------------ properties
    @property
    def cache_size(self) -> int:
        """Decisions' candidates kept."""
        return self._cache.size

    @property
    def cache(self) -> DecisionCache:
        """The decision cache (shareable with another planner of this job)."""
        return self._cache

    @property
    def initial_plan(self) -> ExecutionPlan:
        """The failure-free plan of the job."""
        return self._initial_plan

    @property
    def failure_free(self) -> Estimate:
        """The estimate of the failure-free plan."""
        return self._failure_free

    @property
    def topology(self) -> Topology:
        """Workers, nodes and links."""
        return self._topology

    @property
    def profile(self) -> Profile:
        """Per-layer costs."""
        return self._profile

    @property
    def num_failure_events(self) -> int:
        """Failure events observed by :meth:`decide` (for the rate estimate)."""
        return len(self._failure_events)

    def estimate(self, plan: ExecutionPlan) -> Estimate:
        """The estimator's view of ``plan`` (shared cache)."""
        return self._estimator.estimate(plan)

    def _pipeline_estimate(self, plan: ExecutionPlan) -> tuple[float, bool]:
        est = self._checked_estimate(plan)
        return est.step_s, est.memory_fits

    def _checked_estimate(self, plan: ExecutionPlan) -> Estimate:
        """The estimator's view of ``plan``, unless the precompute under way was asked to
        stop (every search is a sequence of estimates: it stops between two)."""
        if self._stop is not None and self._stop():
            raise _Stopped
        return self._estimator.estimate(plan)

    # ------------------------------------------------------------------ checks
    def _workers(self, field: str, workers: Iterable[int]) -> frozenset[int]:
        n = self._topology.num_workers
        if type(workers) is frozenset:  # a set of the cluster's workers already?
            everyone = self._topology.all_workers
            if len(workers) * 2 <= len(everyone):  # few: looked up one by one
                if workers <= everyone and _only_ints(workers):
                    return workers
            else:
                # Most of the cluster (the simulator's live workers): the cluster's other
                # workers, found once, say that it is its workers (``n - k`` of them
                # leave ``k``), and are kept for the event's canonical form.
                others = everyone - workers
                if len(others) == len(everyone) - len(workers) and _only_ints(workers):
                    self._others = (workers, others)
                    return workers
        items = list(workers)
        if set(map(type, items)) <= {int} and (not items or (min(items) >= 0
                                                            and max(items) < n)):
            return frozenset(items)  # the common case, checked in bulk (plain ints only)
        for w in items:
            if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < n:
                raise ValueError(f"{field}: worker {w!r} is not in the cluster (workers 0.."
                                 f"{n - 1})")
        return frozenset(items)

    @staticmethod
    def _horizon(horizon_s: float | None) -> float | None:
        if horizon_s is None:
            return None
        if isinstance(horizon_s, bool) or not isinstance(horizon_s, (int, float)) or (
                math.isnan(horizon_s) or horizon_s < 0):
            raise ValueError(f"horizon_s: must be a number >= 0, got {horizon_s!r}")
        return float(horizon_s)

    @property
    def rerouting(self) -> Strategy:
        """Chameleon's rerouting: ReCycle's (``recycle``, weight gradients deferred on the
        peers) when the job's system can split the backward, else ``reroute``."""
        return Strategy.RECYCLE if self.config.recovery.decoupled_backward else Strategy.REROUTE

    def _failure_strategies(self) -> tuple[Strategy, ...]:
        """What Chameleon answers a failure with, in the order decisions list them."""
        return (self.rerouting, Strategy.DYNAMIC, Strategy.RESTART, Strategy.SHRINK,
                Strategy.SWAP)

    def _own(self, policy: str) -> tuple[Strategy, ...]:
        """The strategies a fixed policy takes."""
        if policy == Strategy.REROUTE_THEN_DYNAMIC:
            return (self.rerouting, Strategy.DYNAMIC)
        return _OWN[Strategy(policy)]

    def _rejoin(self, policy: str) -> tuple[Strategy, ...]:
        """What a rejoin is answered with under ``policy``."""
        if policy == "chameleon":
            return (Strategy.KEEP, Strategy.DYNAMIC, self.rerouting, Strategy.SHRINK)
        return _REJOIN.get(policy, (Strategy.KEEP, Strategy.DYNAMIC))

    def recovery_state(self, plan: ExecutionPlan, alive: Iterable[int]) -> RecoveryState:
        """What a strategy needs to price a change of ``plan`` with ``alive`` workers (for
        policies that build their own candidates, such as the simulator's peers).

        Raises:
            ValueError: for a worker outside the cluster.
        """
        return self._state(plan, self._workers("alive", alive), None)

    def _state(self, plan: ExecutionPlan, alive: frozenset[int],
               since_checkpoint_s: float | None) -> RecoveryState:
        return RecoveryState(config=self.config, profile=self._profile,
                             topology=self._topology, plan=plan, alive=alive,
                             templates=self.templates, estimate=self._checked_estimate,
                             since_checkpoint_s=since_checkpoint_s,
                             max_workers=self.config.num_workers)

    # ------------------------------------------------------------------ candidates
    def _build(self, kind: str, strategy: Strategy, state: RecoveryState,
               marked: frozenset[int], beaten: dynamic.Beaten | None = None) -> Candidate:
        """One strategy's candidate from the current plan, not yet scored.

        ``kind`` is ``fail`` (``marked``: the newly failed workers; restart priced with the
        default lost work) or ``rejoin`` (``marked``: the returned workers): ``keep``, a
        dynamic re-plan over every live worker (announced, so without detection),
        ``reroute`` (ReCycle's re-join: returned workers take their stages back) or
        ``shrink`` (TorchFT's: idle workers form whole new replicas). ``beaten``: a
        dynamic search's test of its fastest step (:meth:`_beaten_by`).
        """
        if kind == "fail":
            if strategy == Strategy.DYNAMIC:
                return dynamic.candidates(state, marked, beaten=beaten)[0]
            return _FAILURE_BUILDERS[strategy](state, marked)[0]
        if strategy == Strategy.KEEP:
            return candidate_from_estimate(Strategy.KEEP, state.plan,
                                           self._estimator.estimate(state.plan), {},
                                           "keep the current plan; returned workers stay idle")
        if strategy == Strategy.DYNAMIC:
            return dynamic.candidates(state, frozenset(), failure=False, beaten=beaten)[0]
        if strategy == Strategy.SHRINK:
            return shrink.grow(state)
        return self._reroute_back(state, marked, strategy)

    def _lookup(self, kind: str, state: RecoveryState, marked: frozenset[int],
                wanted: tuple[Strategy, ...], bar: _Bar | None = None) -> _Found:
        """The ``wanted`` candidates for an event, from the cache when an equivalent event
        was priced.

        The event is first renamed to a canonical form (``symmetry.py``): the whole state
        when workers are interchangeable (one per node), else a failure of a plan of
        identical pipelines. The candidates come back in the canonical names, with the
        function that renames one back (renaming is the costly part of a cache hit on
        2,048 workers, so a caller renames only what it returns). ``bar``: see
        :meth:`_lookup_exact`.
        """
        plan, alive = state.plan, state.alive
        others = self._others
        form = interchangeable_form(plan, alive, (marked,), self._topology,
                                    dead=others[1] if others[0] is alive else None,
                                    own=self._issued.get(id(plan)) is plan)
        if form is not None:
            # keyed by the few workers not alive (the live ones are every other id)
            canon_alive, canon_dead = form.rename_alive(alive)
            canon_marked = form.rename(marked)
            self._carry(plan, form.plan)
            key = (form.plan, canon_marked, canon_dead, kind)
            raw, hit, search_s, stored = self._lookup_exact(
                key, replace(state, plan=form.plan, alive=canon_alive), canon_marked, wanted,
                bar)
            return _Found(raw, hit, search_s, form.answerer(plan, stored))
        renaming = (canonical_renaming(plan, marked, alive, self._topology)
                    if kind == "fail" else None)
        if not renaming:  # not symmetric, or already canonical
            raw, hit, search_s, _ = self._lookup_exact((plan, marked, alive, kind), state,
                                                       marked, wanted, bar)
            return _Found(raw, hit, search_s, None)
        canon_marked = frozenset(renaming.get(w, w) for w in marked)
        canon_alive = frozenset(renaming.get(w, w) for w in alive)
        raw, hit, search_s, _ = self._lookup_exact(
            (plan, canon_marked, canon_alive, kind), replace(state, alive=canon_alive),
            canon_marked, wanted, bar)
        back = {v: k for k, v in renaming.items()}
        return _Found(raw, hit, search_s, lambda c: rename_candidate(c, back, plan))

    def _carry(self, plan: ExecutionPlan, canonical: ExecutionPlan) -> None:
        """Keep ``plan``'s estimate, when one is kept, as ``canonical``'s (the same plan
        renamed: :func:`carried_estimate`): the current plan of each event is estimated
        once, not again in each event's canonical names."""
        known = self._estimator.known(plan)
        if known is not None:
            self._estimator.remember(canonical, carried_estimate(
                known, functools.partial(self._estimator.uncached, canonical)))

    def _lookup_exact(self, key: _CacheKey, state: RecoveryState, marked: frozenset[int],
                      wanted: tuple[Strategy, ...], bar: _Bar | None = None
                      ) -> tuple[tuple[Candidate, ...], bool, float, ExecutionPlan]:
        """The ``wanted`` candidates of ``key`` (priced now when missing), whether all came
        from the cache, the seconds spent, and the plan they were computed from.

        ``bar`` turns the first wanted candidate into a test for the dynamic search
        (:meth:`_beaten_by`); a search that test stopped depends on this call's scoring,
        so it is not kept."""
        start = time.perf_counter()
        entry = self._cache.get(key)
        if entry is None:
            entry = _Entry(state.plan)
        found = entry.candidates
        missing = [s for s in wanted if s not in found]
        out = []
        beaten = None
        for strategy in wanted:
            if strategy in found:
                # Precomputed while healthy: the search is hidden behind training.
                cached = found[strategy]
                out.append(_with_term(cached, "search_s", 0.0)
                           if strategy == Strategy.DYNAMIC else cached)
            else:
                built = self._build(key[3], strategy, state, marked,
                                    beaten if strategy == Strategy.DYNAMIC else None)
                if beaten is None or built.feasible or strategy != Strategy.DYNAMIC:
                    found[strategy] = built
                out.append(built)
            if bar is not None and strategy == wanted[0]:
                beaten = bar(out[-1], state)
        self._cache.put(key, entry)
        return tuple(out), not missing, time.perf_counter() - start, entry.plan

    def clear_cache(self) -> None:
        """Forget every cached decision (the pipeline templates stay)."""
        self._cache.clear()

    def likely_failures(self, plan: ExecutionPlan) -> list[frozenset[int]]:
        """The failures :meth:`precompute` prepares by default: every single worker of
        ``plan``, pipeline by pipeline and stage by stage, then every node's workers (nodes
        with more than one).

        Failures of the same stage of identical pipelines share one answer (the symmetric
        cache), and the first pipeline meets every stage: a budget that runs out still
        leaves most failures prepared (by worker id, the 16k job's first 128 failures are
        all of stage 0).
        """
        sets = [frozenset({w}) for w in plan.stage_of_worker]
        by_node: dict[int, set[int]] = {}
        for w in plan.workers:
            by_node.setdefault(self._topology.node_of(w), set()).add(w)
        sets.extend(frozenset(ws) for ws in by_node.values() if len(ws) > 1)
        return sets

    def precompute(self, plan: ExecutionPlan, *,
                   failures: Iterable[Iterable[int]] | None = None,
                   budget_s: float | None = None,
                   stop: Callable[[], bool] | None = None,
                   on_prepared: Callable[[frozenset[int]], None] | None = None,
                   idle: Iterable[int] = ()) -> float:
        """Fill the cache for likely failures of ``plan`` while training is healthy.

        Every failure set costs one cold search (tens of milliseconds on 32 workers, a few
        hundred on 2,048), so a large job may pass ``budget_s`` and call again later: sets
        already cached are skipped. It stops when the cache is full rather than evict what
        it just prepared (on 2,048 workers prepare the likeliest failures via
        ``failures``, or raise ``cache_size``).

        Args:
            plan: the plan now running.
            failures: failure sets to prepare; default: every single live worker and every
                node's live workers.
            budget_s: stop starting new searches after this many seconds.
            stop: asked before each failure set and before every estimate while one is
                prepared: True stops at once, the set under way left unprepared (a real
                failure wants the machine, ``prepared.py``).
            on_prepared: called with each failure set once it is prepared.
            idle: live workers ``plan`` does not run (warm spares): alive in every prepared
                failure, as the decision will be told (``decide``'s ``alive``).

        Returns:
            Seconds spent.

        Raises:
            ValueError: for a worker outside the cluster or a negative budget.
        """
        if budget_s is not None and not budget_s >= 0:
            raise ValueError(f"budget_s: must be >= 0, got {budget_s}")
        start = time.perf_counter()
        if failures is None:
            sets = self.likely_failures(plan)
        else:
            sets = [self._workers("failures", ws) for ws in failures]
        base_alive = frozenset(plan.workers) | self._workers("idle", idle)
        added = 0
        self._stop = stop
        try:
            for failed in dict.fromkeys(sets):
                if budget_s is not None and time.perf_counter() - start >= budget_s:
                    break
                if added >= self.cache_size:
                    break
                if stop is not None and stop():
                    break
                alive = base_alive - failed
                if not alive:
                    continue
                # Equivalent failures of a symmetric plan share one cache entry.
                found = self._lookup("fail", self._state(plan, alive, None), failed,
                                     self._failure_strategies())
                added += 0 if found.hit else 1
                if on_prepared is not None:
                    on_prepared(failed)
        except _Stopped:
            pass  # the set under way stays unprepared; what it priced is kept
        finally:
            self._stop = None
        return time.perf_counter() - start

    # ------------------------------------------------------------------ decisions
    def _worker_rate_per_s(self, now_s: float) -> float:
        """The failure-rate estimate of one worker at ``now_s`` (``horizon.py``)."""
        return worker_rate_per_s(self.config.policy,
                                 workers_per_node=self._topology.workers_per_node,
                                 num_failures=len(self._failure_events),
                                 exposure_worker_s=self._exposure.at(now_s))

    def horizon(self, *, num_live: int, now_s: float) -> float:
        """The expected time to the next change for ``num_live`` workers (``horizon.py``)."""
        return mean_horizon_s(self._worker_rate_per_s(now_s), num_live,
                              self.config.policy.repair_hours)

    def decide(self, plan: ExecutionPlan, failed: Iterable[int], *,
               alive: Iterable[int] | None = None, now_s: float = 0.0,
               horizon_s: float | None = None, policy: str | None = None,
               since_checkpoint_s: float | None = None, compare: bool = True,
               detail: bool = True, hide_search: bool = False,
               since_memory_checkpoint_s: float | None = None) -> Decision:
        """Choose how to recover from ``failed`` starting from the CURRENT ``plan``.

        Args:
            plan: the plan running when the failure happened (may be rerouted or
                heterogeneous).
            failed: the newly failed workers.
            alive: every live worker after the failure, idle ones included; default: the
                plan's workers minus ``failed``.
            now_s: seconds since the job began (updates the failure-rate estimate).
            horizon_s: the window for Eq. 8; default ``policy.horizon_s``, else estimated.
            policy: overrides the planner's policy for this decision.
            since_checkpoint_s: exact progress since the last checkpoint on storage (the
                work a reload from it loses); default: half the checkpoint interval.
            compare: price every strategy, so the decision lists them all (reports, the
                CLI). False lets a fixed-strategy policy price only its own strategy (and
                the rest only when its own is infeasible): the simulator's fast path.
            detail: every candidate carries its plan, estimate and migration. False: only
                the chosen one does, the others keep their prices and reasons (renaming
                plans back from a cached, canonical answer is most of a cache hit's cost
                on 2,048 workers; the simulator needs only the winner).
            hide_search: price a dynamic plan's search as hidden (0 s), as if computed
                while training was healthy (``precompute``); the simulator does, so its
                results do not depend on how fast this machine searches.
            since_memory_checkpoint_s: exact progress since the last copy of the state in
                memory (``[recovery] memory_checkpoint``: the work a reload from memory
                loses); default: half the interval between copies.

        Returns:
            The decision with every candidate.

        Raises:
            ValueError: for a worker outside the cluster, a negative horizon, an unknown
                policy, or a layer left without replicas when checkpoints are off.
        """
        failed_set, alive_set = self._failure_inputs(plan, failed, alive, now_s,
                                                     since_checkpoint_s,
                                                     since_memory_checkpoint_s)
        horizon = self._horizon(horizon_s)
        chosen_policy = _check_policy(policy if policy is not None else self.policy)
        if failed_set:
            self._failure_events.add((float(now_s), failed_set))
        # Cached candidates must not depend on this call's checkpoint age: restart's lost
        # work is set below for this decision only.
        state = self._state(plan, alive_set, None)
        missing = [] if self.config.recovery.checkpoint else state.missing_layers()
        if missing:
            raise ValueError(
                f"failed: losing workers {sorted(failed_set)} leaves layer {missing[0]} with no "
                "live replica and recovery.checkpoint is false, so nothing can restore it")
        every = self._failure_strategies()
        own = () if chosen_policy == "chameleon" else self._own(chosen_policy)
        wanted = own if not compare and own else tuple(dict.fromkeys((*every, *own)))
        bar = (self._beaten_by(failure=True, horizon_s=horizon, num_live=len(alive_set),
                               now_s=now_s)
               if chosen_policy == "chameleon" and not detail else None)
        found = self._lookup("fail", state, failed_set, wanted, bar)
        if not set(every) <= set(wanted) and not all(c.feasible for c in found.candidates):
            # The policy's own strategy is infeasible: it falls back on restart, or on the
            # best of all when restart is infeasible too.
            more = self._lookup("fail", state, failed_set, tuple(dict.fromkeys((*every, *own))))
            found = replace(more, search_s=found.search_s + more.search_s)
        raw, back = _detail(found, detail, hide_search)
        raw = _reloads_lose(raw, {CheckpointSource.STORAGE: since_checkpoint_s,
                                  CheckpointSource.MEMORY: since_memory_checkpoint_s})
        by_strategy = {c.strategy: c for c in raw}
        candidates = raw
        first = by_strategy.get(self.rerouting)
        if first is not None and Strategy.DYNAMIC in by_strategy:
            candidates = (*raw, combine(state, first, by_strategy[Strategy.DYNAMIC]))
        return self._choose(candidates, plan=plan, policy=chosen_policy, horizon_s=horizon,
                            num_live=len(alive_set), now_s=now_s, search_s=found.search_s,
                            num_idle=len(alive_set) - len(plan.stage_of_worker) + sum(
                                1 for w in failed_set if w in plan.stage_of_worker),
                            cache_hit=found.hit, back=back)

    def _failure_inputs(self, plan: ExecutionPlan, failed: Iterable[int],
                        alive: Iterable[int] | None, now_s: float,
                        since_checkpoint_s: float | None,
                        since_memory_checkpoint_s: float | None,
                        ) -> tuple[frozenset[int], frozenset[int]]:
        """:meth:`decide`'s arguments checked: the failed workers and the live ones.

        Raises:
            ValueError: naming the argument that is out of range.
        """
        failed_set = self._workers("failed", failed)
        if since_checkpoint_s is not None:
            lost_progress_s(self.config.recovery, since_checkpoint_s)  # validates
        if since_memory_checkpoint_s is not None:
            memory_lost_progress_s(self.config.recovery, 0.0, since_memory_checkpoint_s)
        if now_s < 0 or math.isnan(now_s):
            raise ValueError(f"now_s: must be >= 0, got {now_s}")
        alive_set = (frozenset(plan.workers) if alive is None
                     else self._workers("alive", alive))
        if not failed_set.isdisjoint(alive_set):
            alive_set -= failed_set
        self._exposure.observe(now_s, len(alive_set))
        if not alive_set:
            raise ValueError("failed: no worker is left alive")
        return failed_set, alive_set

    def decide_rejoin(self, plan: ExecutionPlan, returned: Iterable[int], *,
                      alive: Iterable[int] | None = None, now_s: float = 0.0,
                      horizon_s: float | None = None, policy: str | None = None,
                      detail: bool = True, hide_search: bool = False) -> Decision:
        """Decide whether and how to use workers that came back (repaired).

        Candidates: ``keep`` (the current plan, no transition), ``dynamic`` (re-plan over
        every live worker, copying state to the returned ones; no detection term, the
        return is announced), ``reroute-then-dynamic`` (keep training on the current plan
        while the state is copied in the background, then switch), ``reroute`` (returned
        workers take back their rerouted stages, ReCycle's re-join) and ``shrink`` (idle
        workers form whole new replicas that load in the background, TorchFT's re-join).
        Chameleon prices them all and the same rule as :meth:`decide` picks one; ``keep``
        wins when using the workers does not pay off.

        Args:
            plan: the plan now running.
            returned: the workers that came back.
            alive: every live worker including the returned ones; default: the plan's
                workers plus ``returned``.
            now_s: seconds since the job began.
            horizon_s: the window; default as in :meth:`decide`.
            policy: ``reroute`` gives returned workers their stages back (ReCycle's
                re-join), ``shrink`` re-admits whole replicas of idle workers (TorchFT's);
                ``restart`` and ``reroute-then-dynamic`` keep the plan, ``dynamic``
                re-plans.
            detail: as in :meth:`decide`.
            hide_search: as in :meth:`decide`.

        Returns:
            The decision (strategy ``keep`` when not worth it).

        Raises:
            ValueError: for a worker outside the cluster or a negative horizon.
        """
        returned_set = self._workers("returned", returned)
        horizon = self._horizon(horizon_s)
        if now_s < 0 or math.isnan(now_s):
            raise ValueError(f"now_s: must be >= 0, got {now_s}")
        chosen_policy = _check_policy(policy if policy is not None else self.policy)
        alive_set = (frozenset(plan.workers) if alive is None
                     else self._workers("alive", alive))
        if not returned_set <= alive_set:
            alive_set |= returned_set
        self._exposure.observe(now_s, len(alive_set))
        state = self._state(plan, alive_set, None)
        wanted = self._rejoin(chosen_policy)
        bar = (self._beaten_by(failure=False, horizon_s=horizon, num_live=len(alive_set),
                               now_s=now_s)
               if chosen_policy == "chameleon" and not detail else None)
        found = self._lookup("rejoin", state, returned_set, wanted, bar)
        raw, back = _detail(found, detail, hide_search)
        start = time.perf_counter()
        by_strategy = {c.strategy: c for c in raw}
        keep = by_strategy[Strategy.KEEP]
        running = replace(keep, terms={}, transition_s=0.0)
        candidates = [keep]
        if Strategy.DYNAMIC in by_strategy:
            dyn = by_strategy[Strategy.DYNAMIC]
            candidates += [dyn, combine(state, running, dyn, first_phase="keep the current plan")]
        for rerouting in (Strategy.REROUTE, Strategy.RECYCLE):
            if rerouting in by_strategy:
                candidates.append(by_strategy[rerouting])
        if Strategy.SHRINK in by_strategy:
            grown = by_strategy[Strategy.SHRINK]
            two_phase = combine(state, running, grown, first_phase="keep training")
            candidates.append(replace(two_phase, strategy=Strategy.SHRINK,
                                      reason=f"{grown.reason}: {two_phase.reason}")
                              if two_phase.feasible else
                              infeasible(Strategy.SHRINK, two_phase.reason))
        search_s = found.search_s + time.perf_counter() - start
        if chosen_policy in (Strategy.REROUTE, Strategy.RECYCLE, Strategy.SHRINK):
            own = next(c for c in candidates if c.strategy == chosen_policy)
            chosen_policy = chosen_policy if own.feasible else "keep"
        elif chosen_policy not in ("chameleon", "dynamic"):
            chosen_policy = "keep"
        return self._choose(tuple(candidates), plan=plan, policy=chosen_policy,
                            horizon_s=horizon, num_live=len(alive_set), now_s=now_s,
                            num_idle=len(alive_set) - len(plan.stage_of_worker),
                            search_s=search_s, cache_hit=found.hit, back=back)

    def _reroute_back(self, state: RecoveryState, returned: frozenset[int],
                      strategy: Strategy) -> Candidate:
        """ReCycle's re-join: a returned worker copies its stage's parameters and optimizer
        state from a live replica and takes its micro-batches back; the other dead stages
        stay rerouted (``recycle``: their peers keep deferring weight gradients when memory
        allows). Infeasible when no returned worker had a rerouted stage."""
        plan = state.plan
        if not any(r in plan.dead_workers for r in returned):
            return infeasible(strategy, "no returned worker had a rerouted stage")
        found = reroute.rerouted_plan(state, defer=strategy == Strategy.RECYCLE
                                      and state.config.recovery.decoupled_backward)
        if isinstance(found, str):
            return infeasible(strategy, found)
        new_plan = found[0]
        return copy_in(state, strategy, new_plan,
                       f"returned workers take their stages back ({len(new_plan.reroutes)} "
                       "stage(s) still rerouted)")

    def _fragility_exposure_s(self, num_live: int, window_s: float, now_s: float,
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
        live_nodes = max(1, -(-num_live // self._topology.workers_per_node))
        p_fail = min(1.0, num_live * self._worker_rate_per_s(now_s) * window_s
                     * self.config.policy.node_failure_share)
        restart_s = spec.restart_s
        if (self.config.cluster.spare_nodes > 0
                and num_idle >= self._topology.workers_per_node):
            restart_s = 0.0
        if spec.memory_checkpoint:
            reload_s = self._memory_reload_s
        else:
            reload_s = spec.checkpoint_load_s + spec.checkpoint_interval_s / 2
        extra_s = max(0.0, restart_s + reload_s - spec.detect_s)
        return p_fail * extra_s / live_nodes

    @functools.cached_property
    def _memory_reload_s(self) -> float:
        """A reload of the failure-free plan from memory: its read and half the interval
        between copies of the state (``memory_checkpoint``)."""
        spec = self.config.recovery
        return (self.memory_load_s(self._initial_plan)
                + memory_lost_progress_s(spec, self._failure_free.step_s))

    def memory_load_s(self, plan: ExecutionPlan) -> float:
        """Seconds every worker of ``plan`` takes to read its checkpointed state from
        another host's memory (``transition.memory_load_s``): a reload from memory."""
        return memory_load_s(plan, self._profile, self._topology, self.config.recovery)

    def _with_fragility(self, candidate: Candidate, batch: int, window_s: float,
                        exposure_s: float) -> Candidate:
        """``candidate`` with its expected score lowered by what a fragile plan risks:
        ``X * |fatal nodes| * exposure_s / window`` samples/s (:func:`fatal_nodes`,
        :meth:`_fragility_exposure_s`). Eq. 8 with a given window is left as the paper
        has it."""
        if (exposure_s <= 0 or not candidate.feasible or candidate.plan is None
                or candidate.score <= 0):
            return candidate
        fatal = fatal_nodes(candidate.plan, self._topology)
        if not fatal:
            return candidate
        risk = (batch / candidate.step_s) * len(fatal) * exposure_s
        return replace(candidate, score=max(0.0, candidate.score - risk / window_s))

    def _window(self, horizon_s: float | None, num_live: int, now_s: float
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

    def _beaten_by(self, *, failure: bool, horizon_s: float | None, num_live: int,
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
        window, expected = self._window(horizon_s, num_live, now_s)
        detect_s = self.config.recovery.detect_s

        def bar(first: Candidate, state: RecoveryState) -> dynamic.Beaten | None:
            if (not first.feasible or first.plan is None
                    or fatal_nodes(first.plan, self._topology)):
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

    def _choose(self, candidates: tuple[Candidate, ...], *, plan: ExecutionPlan, policy: str,
                horizon_s: float | None, num_live: int, now_s: float, search_s: float,
                cache_hit: bool, back: Callable[[Candidate], Candidate] | None = None,
                num_idle: int = 0) -> Decision:
        window, expected = self._window(horizon_s, num_live, now_s)
        num_live = min(num_live, self.config.num_workers)
        batch = plan.global_batch
        scored = tuple(replace(c, score=candidate_score(c, batch, horizon_s=window,
                                                        expected=expected))
                       for c in candidates)
        if expected and math.isfinite(window):
            exposure_s = self._fragility_exposure_s(num_live, window, now_s, num_idle)
            scored = tuple(self._with_fragility(c, batch, window, exposure_s) for c in scored)
        feasible = [c for c in scored if c.feasible]
        if not feasible:
            reasons = "; ".join(f"{c.strategy}: {c.reason}" for c in scored)
            raise ValueError(f"failed: no feasible recovery ({reasons})")

        def rank(c: Candidate) -> tuple[float, float, int, float]:
            # exact ties (e.g. a window shorter than any switch) go to the least disruptive
            return (-c.score, c.transition_s, _ORDER[c.strategy], c.step_s)

        best = min(feasible, key=rank)
        window_text = (f"expected horizon {_duration(window)}" if expected
                       else f"horizon {_duration(window)}")
        if policy == "chameleon":
            runner_up = min((c for c in feasible if c is not best), key=rank, default=None)
            versus = (f" vs {runner_up.strategy} {runner_up.score:.6g}"
                      if runner_up is not None else "")
            reason = (f"{best.strategy} scores {best.score:.6g} samples/s over the "
                      f"{window_text}{versus} (step {best.step_s:.3f} s, transition "
                      f"{best.transition_s:.1f} s)")
        else:
            wanted = Strategy(policy)
            own = next((c for c in feasible if c.strategy == wanted), None)
            fallback = next((c for c in feasible if c.strategy == Strategy.RESTART), None)
            if own is not None:
                best = own
                reason = f"policy {policy}: fixed strategy (step {best.step_s:.3f} s)"
            elif fallback is not None:
                best = fallback
                why = next(c.reason for c in scored if c.strategy == wanted)
                reason = f"policy {policy}: infeasible ({why}); falling back to restart"
            else:
                why = next(c.reason for c in scored if c.strategy == wanted)
                reason = (f"policy {policy}: infeasible ({why}) and restart too; taking the "
                          f"best feasible, {best.strategy}")
        if back is not None:
            # Only the winner is renamed to the caller's workers; the others keep their
            # prices (see ``detail``).
            named = back(best)
            if named.plan is not None and named.estimate is not None:
                # the next event's canonical form starts from this plan's estimate
                self._estimator.hold(named.plan, carried_estimate(
                    named.estimate, functools.partial(self._estimator.uncached, named.plan)))
            scored = tuple(named if c is best else _priced_only(c) for c in scored)
            best = named
        assert best.plan is not None
        for issued in (best.plan, best.interim_plan):
            if issued is not None:
                self._issued[id(issued)] = issued
        return Decision(strategy=str(best.strategy), plan=best.plan, candidates=scored,
                        reason=reason, transition_s=best.transition_s, horizon_s=window,
                        search_s=search_s, cache_hit=cache_hit, migration=best.migration,
                        horizon_expected=expected)


def _check_policy(name: str) -> str:
    if name not in POLICY_NAMES:
        raise ValueError(f"policy: unknown policy {name!r}; choose one of "
                         f"{', '.join(POLICY_NAMES)}")
    return name


def _with_term(candidate: Candidate, name: str, value: float) -> Candidate:
    if not candidate.feasible or name not in candidate.terms:
        return candidate
    terms = dict(candidate.terms)
    terms[name] = value
    return replace(candidate, terms=terms, transition_s=sum(terms.values()))


def _detail(found: _Found, detail: bool, hide_search: bool
            ) -> tuple[tuple[Candidate, ...], Callable[[Candidate], Candidate] | None]:
    """The candidates to choose among, and what renames the winner: all renamed now with
    ``detail``, else left in the canonical names for :meth:`Planner._choose`. With
    ``hide_search`` a dynamic plan's search counts as done while training was healthy."""
    raw = found.named() if detail else found.candidates
    if hide_search:
        raw = tuple(_without_search(c) for c in raw)
    return raw, (None if detail else found.back)


def _without_search(candidate: Candidate) -> Candidate:
    """``candidate`` with no plan-search term."""
    if not candidate.feasible or "search_s" not in candidate.terms:
        return candidate
    terms = {k: v for k, v in candidate.terms.items() if k != "search_s"}
    return replace(candidate, terms=terms, transition_s=math.fsum(terms.values()))


def _priced_only(candidate: Candidate) -> Candidate:
    """``candidate`` without its plans, estimate and migration (prices and reason kept)."""
    return replace(candidate, plan=None, estimate=None, migration=None, interim_plan=None)


def _reloads_lose(candidates: tuple[Candidate, ...],
                  lost: dict[CheckpointSource, float | None]) -> tuple[Candidate, ...]:
    """A reload loses exactly the work since the checkpoint it reads, where the caller
    knows it (``lost[source]`` not None); other candidates are unchanged."""
    return tuple(_with_lost(c, lost[c.rollback])
                 if c.rollback is not None and c.feasible else c for c in candidates)


def _with_lost(candidate: Candidate, lost_s: float | None) -> Candidate:
    """A reload's candidate with its ``lost_s`` term set to ``lost_s`` (unchanged when
    ``None``: the default, half an interval)."""
    if lost_s is None:
        return candidate
    terms = dict(candidate.terms)
    terms["lost_s"] = float(lost_s)
    return replace(candidate, terms=terms, transition_s=sum(terms.values()))


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "inf"
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h" if seconds < 3600 * 1000 else f"{seconds / 3600:.0f} h"
    return f"{seconds:.0f} s"


__all__ = ["Decision", "DecisionCache", "Planner", "infeasible"]
