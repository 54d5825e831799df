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

A slow worker (a fail-slow) is answered by ``decide_slow`` and the end of its slowdown by
``decide_slow_end`` (``slow.py``, mixed in).

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
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace

from chameleon_ft.perf import Estimate, Topology, estimator_for
from chameleon_ft.plan import ExecutionPlan, initial_plan
from chameleon_ft.policy.cache import DecisionCache, _Found, lookup_exact
from chameleon_ft.policy.candidates import (
    _OWN,
    _REJOIN,
    _Bar,
    _priced_only,
    _reloads_lose,
    build_candidate,
    failure_candidates,
    rejoin_candidates,
)
from chameleon_ft.policy.choice import Chooser, Decision, pick, rejoin_policy
from chameleon_ft.policy.inputs import DecisionInputs, check_horizon, check_policy
from chameleon_ft.policy.renaming import carried_estimate, rename_candidate
from chameleon_ft.policy.slow import SlowDecisions
from chameleon_ft.policy.symmetry import canonical_renaming, interchangeable_form
from chameleon_ft.profile import Profile, build_profile
from chameleon_ft.recovery import dynamic
from chameleon_ft.recovery.restorer import load_matching
from chameleon_ft.recovery.templates import Templates
from chameleon_ft.recovery.transition import memory_load_s, memory_lost_progress_s
from chameleon_ft.recovery.types import (
    Candidate,
    CheckpointSource,
    RecoveryState,
    Strategy,
    infeasible,
)
from chameleon_ft.spec.config import Config


class _Stopped(Exception):
    """A precompute asked to stop in the middle of a failure set (``Planner._stop``)."""


class Planner(SlowDecisions):
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
        self.policy = check_policy(policy if policy is not None else config.policy.name)
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
        self._chooser = Chooser(config, self._topology, self._memory_reload_s)
        """Scores candidates; keeps the failure-rate estimate."""
        self._inputs = DecisionInputs(config, self._topology, self._chooser.exposure)
        """Checks decisions' arguments."""
        self._issued: weakref.WeakValueDictionary[int, ExecutionPlan] = (
            weakref.WeakValueDictionary({id(self._initial_plan): self._initial_plan}))
        """Plans this planner made and handed out, by identity (while they live): their
        workers are the cluster's, so a decision from one need not check them again."""
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
        """Time the templates a single-worker or single-node failure asks for, so a
        decision only prices whole plans (once per job; small jobs' searches are cheap
        enough to fill the table themselves)."""
        plan, spec = self._initial_plan, self.config.recovery
        n = len(plan.workers)
        if n > spec.search_exhaustive_workers:
            self.templates.warm(
                n, min(n, self._profile.num_layers, self.config.job.pp + spec.search_extra_stages),
                plan.num_microbatches, self._topology.workers_per_node)

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
        return len(self._chooser.failure_events)

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
        return self._state(plan, self._inputs.workers("alive", alive), None)

    def _state(self, plan: ExecutionPlan, alive: frozenset[int],
               since_checkpoint_s: float | None) -> RecoveryState:
        return RecoveryState(config=self.config, profile=self._profile,
                             topology=self._topology, plan=plan, alive=alive,
                             templates=self.templates, estimate=self._checked_estimate,
                             since_checkpoint_s=since_checkpoint_s,
                             max_workers=self.config.num_workers)

    # ------------------------------------------------------------------ candidates
    def _lookup(self, kind: str, state: RecoveryState, marked: frozenset[int],
                wanted: tuple[Strategy, ...], bar: _Bar | None = None) -> _Found:
        """The ``wanted`` candidates for an event, from the cache when an equivalent event
        was priced.

        The event is first renamed to a canonical form (``symmetry.py``): the whole state
        when workers are interchangeable (one per node), else a failure of a plan of
        identical pipelines. The candidates come back in the canonical names, with the
        function that renames one back (renaming is the costly part of a cache hit on
        2,048 workers, so a caller renames only what it returns). ``bar``: see
        :func:`~chameleon_ft.policy.cache.lookup_exact`.
        """
        plan, alive = state.plan, state.alive
        others = self._inputs.others
        form = interchangeable_form(plan, alive, (marked,), self._topology,
                                    dead=others[1] if others[0] is alive else None,
                                    own=self._issued.get(id(plan)) is plan)
        if form is not None:
            # keyed by the few workers not alive (the live ones are every other id)
            canon_alive, canon_dead = form.rename_alive(alive)
            canon_marked = form.rename(marked)
            self._carry(plan, form.plan)
            key = (form.plan, canon_marked, canon_dead, kind)
            raw, hit, search_s, stored = lookup_exact(
                self._cache, key, replace(state, plan=form.plan, alive=canon_alive),
                canon_marked, wanted, self._build, bar)
            return _Found(raw, hit, search_s, form.answerer(plan, stored))
        renaming = (canonical_renaming(plan, marked, alive, self._topology)
                    if kind == "fail" else None)
        if not renaming:  # not symmetric, or already canonical
            raw, hit, search_s, _ = lookup_exact(self._cache, (plan, marked, alive, kind),
                                                  state, marked, wanted, self._build, bar)
            return _Found(raw, hit, search_s, None)
        canon_marked = frozenset(renaming.get(w, w) for w in marked)
        canon_alive = frozenset(renaming.get(w, w) for w in alive)
        raw, hit, search_s, _ = lookup_exact(
            self._cache, (plan, canon_marked, canon_alive, kind),
            replace(state, alive=canon_alive), canon_marked, wanted, self._build, bar)
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

    def _build(self, kind: str, strategy: Strategy, state: RecoveryState,
               marked: frozenset[int], beaten: dynamic.Beaten | None = None) -> Candidate:
        """One strategy's candidate from the current plan, not yet scored
        (:func:`~chameleon_ft.policy.candidates.build_candidate`; ``keep`` priced by the
        estimator unchecked)."""
        return build_candidate(kind, strategy, state, marked, self._estimator.estimate,
                               beaten)

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
        sets = (self.likely_failures(plan) if failures is None
                else [self._inputs.workers("failures", ws) for ws in failures])
        base_alive = frozenset(plan.workers) | self._inputs.workers("idle", idle)
        self._stop = stop
        try:
            self._prepare(plan, dict.fromkeys(sets), base_alive, start=start,
                          budget_s=budget_s, stop=stop, on_prepared=on_prepared)
        except _Stopped:
            pass  # the set under way stays unprepared; what it priced is kept
        finally:
            self._stop = None
        return time.perf_counter() - start

    def _prepare(self, plan: ExecutionPlan, sets: Iterable[frozenset[int]],
                 base_alive: frozenset[int], *, start: float, budget_s: float | None,
                 stop: Callable[[], bool] | None,
                 on_prepared: Callable[[frozenset[int]], None] | None) -> None:
        """:meth:`precompute`'s loop: each failure set of ``sets`` looked up in turn (priced
        when missing) until the budget from ``start`` is spent, the cache is full or
        ``stop`` says so."""
        added = 0
        for failed in sets:
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

    # ------------------------------------------------------------------ decisions
    def horizon(self, *, num_live: int, now_s: float) -> float:
        """The expected time to the next change for ``num_live`` workers (``horizon.py``)."""
        return self._chooser.horizon(num_live=num_live, now_s=now_s)

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
        failed_set, alive_set = self._inputs.failure(plan, failed, alive, now_s,
                                                     since_checkpoint_s,
                                                     since_memory_checkpoint_s)
        horizon = check_horizon(horizon_s)
        chosen_policy = check_policy(policy if policy is not None else self.policy)
        if failed_set:
            self._chooser.failure_events.add((float(now_s), failed_set))
        state = self._failure_state(plan, alive_set, failed_set)
        found = self._failure_found(state, failed_set, chosen_policy, compare=compare,
                                    detail=detail, horizon_s=horizon, now_s=now_s)
        raw, back = found.to_choose(detail, hide_search)
        raw = _reloads_lose(raw, {CheckpointSource.STORAGE: since_checkpoint_s,
                                  CheckpointSource.MEMORY: since_memory_checkpoint_s})
        return self._choose(failure_candidates(state, raw, self.rerouting), plan=plan,
                            policy=chosen_policy, horizon_s=horizon, num_live=len(alive_set),
                            now_s=now_s, search_s=found.search_s,
                            num_idle=len(alive_set) - len(plan.stage_of_worker) + sum(
                                1 for w in failed_set if w in plan.stage_of_worker),
                            cache_hit=found.hit, back=back)

    def _failure_state(self, plan: ExecutionPlan, alive: frozenset[int],
                       failed: frozenset[int]) -> RecoveryState:
        """A failure's state, checked: every layer keeps a live replica unless
        checkpoints can restore it.

        Cached candidates must not depend on this call's checkpoint age: restart's lost
        work is set by the decision, for itself only.

        Raises:
            ValueError: for a layer left without replicas when checkpoints are off.
        """
        state = self._state(plan, alive, None)
        missing = [] if self.config.recovery.checkpoint else state.missing_layers()
        if missing:
            raise ValueError(
                f"failed: losing workers {sorted(failed)} leaves layer {missing[0]} with no "
                "live replica and recovery.checkpoint is false, so nothing can restore it")
        return state

    def _failure_found(self, state: RecoveryState, failed: frozenset[int], policy: str, *,
                       compare: bool, detail: bool, horizon_s: float | None,
                       now_s: float) -> _Found:
        """The candidates a failure's decision chooses among under ``policy``: every
        strategy's (chameleon, or ``compare``), else the policy's own, and every one when
        its own is infeasible (it falls back on restart, or on the best of all when
        restart is infeasible too)."""
        every = self._failure_strategies()
        own = () if policy == "chameleon" else self._own(policy)
        wanted = own if not compare and own else tuple(dict.fromkeys((*every, *own)))
        bar = (self._chooser.beaten_by(failure=True, horizon_s=horizon_s,
                                       num_live=len(state.alive), now_s=now_s)
               if policy == "chameleon" and not detail else None)
        found = self._lookup("fail", state, failed, wanted, bar)
        if not set(every) <= set(wanted) and not all(c.feasible for c in found.candidates):
            more = self._lookup("fail", state, failed, tuple(dict.fromkeys((*every, *own))))
            found = replace(more, search_s=found.search_s + more.search_s)
        return found

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
        returned_set, alive_set, horizon, chosen_policy = self._inputs.rejoin(
            plan, returned, alive, now_s, horizon_s,
            policy if policy is not None else self.policy)
        state = self._state(plan, alive_set, None)
        bar = (self._chooser.beaten_by(failure=False, horizon_s=horizon,
                                       num_live=len(alive_set), now_s=now_s)
               if chosen_policy == "chameleon" and not detail else None)
        found = self._lookup("rejoin", state, returned_set, self._rejoin(chosen_policy), bar)
        raw, back = found.to_choose(detail, hide_search)
        start = time.perf_counter()
        candidates = rejoin_candidates(state, raw)
        search_s = found.search_s + time.perf_counter() - start
        return self._choose(candidates, plan=plan,
                            policy=rejoin_policy(chosen_policy, candidates),
                            horizon_s=horizon, num_live=len(alive_set), now_s=now_s,
                            num_idle=len(alive_set) - len(plan.stage_of_worker),
                            search_s=search_s, cache_hit=found.hit, back=back)

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

    def _choose(self, candidates: tuple[Candidate, ...], *, plan: ExecutionPlan, policy: str,
                horizon_s: float | None, num_live: int, now_s: float, search_s: float,
                cache_hit: bool, back: Callable[[Candidate], Candidate] | None = None,
                num_idle: int = 0) -> Decision:
        """Score ``candidates`` over the decision's window, take the one ``policy`` takes
        (:func:`~chameleon_ft.policy.choice.pick`) and answer with it in the caller's names
        (``back`` renames the winner)."""
        window, expected = self._chooser.window(horizon_s, num_live, now_s)
        scored = self._chooser.scored(candidates, batch=plan.global_batch, window_s=window,
                                      expected=expected,
                                      num_live=min(num_live, self.config.num_workers),
                                      now_s=now_s, num_idle=num_idle)
        best, reason = pick(scored, policy, window, expected)
        if back is not None:
            best, scored = self._named(best, scored, back)
        assert best.plan is not None
        for issued in (best.plan, best.interim_plan):
            if issued is not None:
                self._issued[id(issued)] = issued
        return Decision(strategy=str(best.strategy), plan=best.plan, candidates=scored,
                        reason=reason, transition_s=best.transition_s, horizon_s=window,
                        search_s=search_s, cache_hit=cache_hit, migration=best.migration,
                        horizon_expected=expected)

    def _named(self, best: Candidate, scored: tuple[Candidate, ...],
               back: Callable[[Candidate], Candidate]
               ) -> tuple[Candidate, tuple[Candidate, ...]]:
        """The winner renamed to the caller's workers, and the candidates with only the
        winner renamed (the others keep their prices, see ``detail``)."""
        named = back(best)
        if named.plan is not None and named.estimate is not None:
            # the next event's canonical form starts from this plan's estimate
            self._estimator.hold(named.plan, carried_estimate(
                named.estimate, functools.partial(self._estimator.uncached, named.plan)))
        return named, tuple(named if c is best else _priced_only(c) for c in scored)


__all__ = ["Decision", "DecisionCache", "Planner", "infeasible"]
