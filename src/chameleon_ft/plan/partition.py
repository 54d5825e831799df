"""Layer partitioning: contiguous stages balanced by a min-max dynamic programme."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate

_REL_TOL = 1e-9


def _min_max(prefix: Sequence[float], n: int, num_stages: int) -> float:
    """Smallest achievable cost of the most expensive stage (O(S n^2) DP)."""
    best = [math.inf] * (n + 1)
    best[0] = 0.0
    for k in range(1, num_stages + 1):
        new = [math.inf] * (n + 1)
        for i in range(k, n - (num_stages - k) + 1):
            value = math.inf
            for j in range(k - 1, i):
                candidate = max(best[j], prefix[i] - prefix[j])
                if candidate < value:
                    value = candidate
            new[i] = value
        best = new
    return best[n]


def balanced_bounds(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Split layers with per-layer ``costs`` into ``num_stages`` contiguous, non-empty stages
    minimising the most expensive stage.

    Among the partitions reaching that minimum it takes the one with the smallest sum of
    squared stage costs (the most even), and among those the one putting more layers on
    later stages (earlier stages keep more micro-batches in flight under 1F1B, so they
    need the memory). Uniform costs therefore split as evenly as possible.

    Raises:
        ValueError: when there are fewer layers than stages.
    """
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages: must be >= 1, got {num_stages}")
    if num_stages > n:
        raise ValueError(f"num_stages: {num_stages} stages need at least as many layers, "
                         f"there are {n}")
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    limit = _min_max(prefix, n, num_stages)
    limit += max(abs(limit), 1e-30) * _REL_TOL
    # squares[k][i]: minimal sum of squared stage costs for the first i layers in k stages,
    # every stage within ``limit``; cut[k][i] is where the k-th stage starts.
    squares = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    squares[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            value, arg = math.inf, -1
            for j in range(k - 1, i):
                stage = prefix[i] - prefix[j]
                if stage > limit or squares[k - 1][j] == math.inf:
                    continue
                candidate = squares[k - 1][j] + stage * stage
                # strict ``<`` keeps the earliest cut on ties: the later stage gets more layers
                if candidate < value * (1 - _REL_TOL) - 1e-300:
                    value, arg = candidate, j
            squares[k][i], cut[k][i] = value, arg
    return bounds_from_cuts(cut, n, num_stages)


def bounds_from_cuts(cut: Sequence[Sequence[int]], num_layers: int,
                     num_stages: int) -> list[tuple[int, int]]:
    """Walk a partition DP's table back: ``cut[k][i]`` is where stage k (1-based) starts
    when the first ``i`` layers fill ``k`` stages."""
    bounds = []
    i = num_layers
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    bounds.reverse()
    return bounds


def stage_costs(costs: Sequence[float], bounds: Sequence[tuple[int, int]]) -> list[float]:
    """Total cost of each stage."""
    return [sum(costs[lo:hi]) for lo, hi in bounds]
