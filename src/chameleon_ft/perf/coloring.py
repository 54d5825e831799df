"""DSATUR greedy graph colouring (Brelaz 1979).

Used twice: per-layer gradient all-reduces that share a worker cannot run at once, and
migration transfers that share a sender or receiver cannot either. Each colour is a round
of concurrent operations; rounds run one after another.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence


def dsatur(num_vertices: int, edges: Iterable[tuple[int, int]]) -> list[int]:
    """Colour vertices ``0..num_vertices-1`` so that no edge joins two equal colours.

    Picks, at each step, the uncoloured vertex with the most distinct colours among its
    neighbours (saturation), ties broken by degree, then by the lowest index, and gives
    it the smallest free colour. Deterministic.

    Returns:
        The colour (0-based round number) of each vertex.
    """
    neighbours: list[set[int]] = [set() for _ in range(num_vertices)]
    for a, b in edges:
        if a != b:
            neighbours[a].add(b)
            neighbours[b].add(a)
    colour = [-1] * num_vertices
    saturation: list[set[int]] = [set() for _ in range(num_vertices)]
    # A heap of (-saturation, -degree, vertex); an entry is stale once the vertex is
    # coloured or its saturation grew (a fresher entry was pushed then).
    heap = [(0, -len(neighbours[v]), v) for v in range(num_vertices)]
    heapq.heapify(heap)
    while heap:
        neg_sat, _, v = heapq.heappop(heap)
        if colour[v] >= 0 or -neg_sat != len(saturation[v]):
            continue
        used = saturation[v]
        c = 0
        while c in used:
            c += 1
        colour[v] = c
        for u in neighbours[v]:
            if colour[u] < 0 and c not in saturation[u]:
                saturation[u].add(c)
                heapq.heappush(heap, (-len(saturation[u]), -len(neighbours[u]), u))
    return colour


def conflict_edges(groups: Sequence[Iterable[int]]) -> list[tuple[int, int]]:
    """Edges between groups (sets of workers) that share a worker."""
    by_member: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        for member in set(group):
            by_member.setdefault(member, []).append(i)
    edges: set[tuple[int, int]] = set()
    for members in by_member.values():
        for x in range(len(members)):
            for y in range(x + 1, len(members)):
                edges.add((members[x], members[y]))
    return sorted(edges)


def rounds(groups: Sequence[Iterable[int]],
           edges: Iterable[tuple[int, int]] | None = None) -> list[list[int]]:
    """Partition groups into rounds where no two groups of a round share a worker.

    ``edges``: the pairs of groups that share a worker, when the caller knows them faster
    than :func:`conflict_edges` finds them.
    """
    colours = dsatur(len(groups), conflict_edges(groups) if edges is None else edges)
    out: list[list[int]] = [[] for _ in range(max(colours, default=-1) + 1)]
    for i, c in enumerate(colours):
        out[c].append(i)
    return out
