"""An estimate's rows: each pipeline's live stages with their simulated figures, and what
the estimate computes from them once per shared (timeline, layout) rather than per worker
(each layer range's latest finish, the optimizer steps, the peak bytes, the idle terms),
in the worker-by-worker order, so every figure is the worker-by-worker one, bit for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import NamedTuple

from chameleon_ft.perf.list_scheduler import Timeline


class _Row(NamedTuple):
    """One pipeline's live stages in an estimate, in stage order, with their simulated
    figures. Lone pipelines that share a timeline and a layout share a ``key`` (and every
    figure but their workers): what depends only on the stages is computed once per key."""

    pipeline: int
    key: tuple[int, int] | None
    """(timeline, layout) identity of a lone pipeline; ``None`` for a rerouted component's."""
    timeline: Timeline
    """The timeline the figures come from, kept with the row so that the identity in
    ``key`` stays unique while rows live (a brute-force estimate keeps no timeline)."""
    workers: tuple[int, ...]
    ranges: tuple[range, ...]
    finish: tuple[float, ...]
    busy: tuple[float, ...]
    activation: tuple[float, ...]


def _per_key(keys: list[tuple[int, int] | None], figure: Callable[[int], tuple[float, ...]]
             ) -> list[tuple[float, ...]]:
    """``figure(i)`` for every row ``i``, computed once per shared key (``None``: never
    shared)."""
    known: dict[tuple[int, int], tuple[float, ...]] = {}
    out = []
    for i, key in enumerate(keys):
        if key is None:
            out.append(figure(i))
            continue
        found = known.get(key)
        if found is None:
            found = known[key] = figure(i)
        out.append(found)
    return out


def _ready_by_range(rows: list[_Row]) -> dict[range, float]:
    """Each live layer range's latest finish, ranges in order of first appearance."""
    ready: dict[range, float] = {}
    seen: set[tuple[int, int]] = set()
    for row in rows:
        if row.key is not None:
            if row.key in seen:
                continue
            seen.add(row.key)
        for layers, done in zip(row.ranges, row.finish, strict=True):
            latest = ready.get(layers)
            if latest is None or done > latest:
                ready[layers] = done
    return ready


def _optimizer_rows(rows: list[_Row], costs: Mapping[range, tuple[float, float, float]],
                    speeds: Mapping[int, float]) -> list[tuple[float, ...]]:
    """Each stage's optimizer step in seconds, at its worker's speed."""
    def opts(i: int) -> tuple[float, ...]:
        row = rows[i]
        if not speeds:
            return tuple([costs[layers][0] for layers in row.ranges])
        return tuple([costs[layers][0] / speeds[w] if w in speeds else costs[layers][0]
                      for w, layers in zip(row.workers, row.ranges, strict=True)])

    return _per_key([None if speeds else row.key for row in rows], opts)


def _peak_rows(rows: list[_Row], costs: Mapping[range, tuple[float, float, float]]
               ) -> list[tuple[float, ...]]:
    """Each stage's peak bytes per device: parameters, gradients and optimizer state of
    the layers held, plus the activations of the micro-batches in flight at the worst
    moment, plus one layer's backward workspace (recomputed activations)."""
    def peaks(i: int) -> tuple[float, ...]:
        row = rows[i]
        return tuple([costs[layers][1] + act + costs[layers][2]
                      for layers, act in zip(row.ranges, row.activation, strict=True)])

    return _per_key([row.key for row in rows], peaks)


def _idle_sum(rows: list[_Row], opt_rows: list[tuple[float, ...]],
              sync_s: Mapping[range, float], step_s: float, control_s: float,
              shared: bool) -> float:
    """Summed over live workers in the plan's order: step - busy - reducing - optimizer -
    control (each stage's term computed once per shared key when the optimizer rows are
    ``shared`` by key, then summed at C speed in the same order)."""
    def terms(i: int) -> tuple[float, ...]:
        row = rows[i]
        return tuple([step_s - busy - sync_s[layers] - opt - control_s
                      for busy, layers, opt in zip(row.busy, row.ranges, opt_rows[i],
                                                   strict=True)])

    keys = [row.key if shared else None for row in rows]
    return sum(itertools.chain.from_iterable(_per_key(keys, terms)))
