"""Decisions' candidates by event: the cache planners of one job share, its entries and
keys, the look-up that prices what an entry lacks, and what one look-up found.

A key names an event in the planner's canonical names (``symmetry.py``), so equivalent
events of a symmetric plan share one entry; the candidates come back in those names with
the function that renames one back.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.policy.candidates import _Bar, _with_term, _without_search
from chameleon_ft.recovery import dynamic
from chameleon_ft.recovery.types import Candidate, RecoveryState, Strategy

_CacheKey = tuple[ExecutionPlan, frozenset[int], frozenset[int], str]
"""(plan, failed or returned workers, live workers, event kind); a canonical key names
the workers not alive instead of the live ones (the same state, cheaper to hash)."""

_Build = Callable[[str, Strategy, RecoveryState, frozenset[int], "dynamic.Beaten | None"],
                  Candidate]
"""Builds one strategy's candidate for an event: ``(kind, strategy, state, marked,
beaten)`` (``candidates.build_candidate``)."""


@dataclass(frozen=True)
class _Found:
    """Candidates from ``Planner._lookup``, in the canonical names."""

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

    def to_choose(self, detail: bool, hide_search: bool
                  ) -> tuple[tuple[Candidate, ...], Callable[[Candidate], Candidate] | None]:
        """The candidates to choose among, and what renames the winner: all renamed now
        with ``detail``, else left in the canonical names for ``Planner._choose``. With
        ``hide_search`` a dynamic plan's search counts as done while training was
        healthy."""
        raw = self.named() if detail else self.candidates
        if hide_search:
            raw = tuple(_without_search(c) for c in raw)
        return raw, (None if detail else self.back)


@dataclass
class _Entry:
    """The candidates priced so far for one event, by strategy."""

    plan: ExecutionPlan
    """The plan they were computed from (the key's, as an object: answers share its
    pipelines)."""
    candidates: dict[Strategy, Candidate] = field(default_factory=dict)


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


def lookup_exact(cache: DecisionCache, key: _CacheKey, state: RecoveryState,
                 marked: frozenset[int], wanted: tuple[Strategy, ...], build: _Build,
                 bar: _Bar | None = None
                 ) -> tuple[tuple[Candidate, ...], bool, float, ExecutionPlan]:
    """The ``wanted`` candidates of ``key`` (priced now with ``build`` when missing),
    whether all came from the cache, the seconds spent, and the plan they were computed
    from.

    ``bar`` turns the first wanted candidate into a test for the dynamic search
    (``Planner._beaten_by``); a search that test stopped depends on this call's scoring,
    so it is not kept."""
    start = time.perf_counter()
    entry = cache.get(key)
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
            built = build(key[3], strategy, state, marked,
                          beaten if strategy == Strategy.DYNAMIC else None)
            if beaten is None or built.feasible or strategy != Strategy.DYNAMIC:
                found[strategy] = built
            out.append(built)
        if bar is not None and strategy == wanted[0]:
            beaten = bar(out[-1], state)
    cache.put(key, entry)
    return tuple(out), not missing, time.perf_counter() - start, entry.plan
