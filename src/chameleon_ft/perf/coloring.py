"""DSATUR greedy graph colouring (Brelaz 1979).

Used twice: per-layer gradient all-reduces that share a worker cannot run at once, and
migration transfers that share a sender or receiver cannot either. Each colour is a round
of concurrent operations; rounds run one after another.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet


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
    return _colour(neighbours)


def _colour(neighbours: Sequence[AbstractSet[int]]) -> list[int]:
    """:func:`dsatur` of the graph given by each vertex's neighbours (itself excluded).

    The order a vertex's neighbours are visited in does not matter: every heap entry is
    distinct (a vertex is pushed again only when its saturation grew), so the pops are
    the same whichever order the entries went in."""
    num_vertices = len(neighbours)
    colour = [-1] * num_vertices
    saturation: list[set[int]] = [set() for _ in range(num_vertices)]
    neg_degree = [-len(ns) for ns in neighbours]
    # A heap of (-saturation, -degree, vertex); an entry is stale once the vertex is
    # coloured or its saturation grew (a fresher entry was pushed then).
    heap = [(0, neg_degree[v], v) for v in range(num_vertices)]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        neg_sat, _, v = pop(heap)
        used = saturation[v]
        if colour[v] >= 0 or -neg_sat != len(used):
            continue
        c = 0
        while c in used:
            c += 1
        colour[v] = c
        for u in neighbours[v]:
            if colour[u] < 0:
                sat = saturation[u]
                if c not in sat:
                    sat.add(c)
                    push(heap, (-len(sat), neg_degree[u], u))
    return colour


def _shared_worker_neighbours(groups: Sequence[Iterable[int]]) -> list[set[int]]:
    """Each group's neighbours in the graph of :func:`conflict_edges`: the other groups
    that share a worker with it (built from the groups of each worker, without listing
    the edges one by one)."""
    members = [set(group) for group in groups]
    by_member: dict[int, list[int]] = {}
    for i, group in enumerate(members):
        for member in group:
            by_member.setdefault(member, []).append(i)
    neighbours: list[set[int]] = []
    for i, group in enumerate(members):
        found: set[int] = set()
        for member in group:
            found.update(by_member[member])
        found.discard(i)
        neighbours.append(found)
    return neighbours


def conflict_edges(groups: Sequence[Iterable[int]]) -> list[tuple[int, int]]:
    """Edges between groups (sets of workers) that share a worker."""
    return sorted((i, j) for i, found in enumerate(_shared_worker_neighbours(groups))
                  for j in found if i < j)


def _rounds_of(colours: Sequence[int]) -> list[list[int]]:
    """The groups of each colour, colour by colour, each in index order."""
    out: list[list[int]] = [[] for _ in range(max(colours, default=-1) + 1)]
    for i, c in enumerate(colours):
        out[c].append(i)
    return out


def rounds(groups: Sequence[Iterable[int]],
           edges: Iterable[tuple[int, int]] | None = None) -> list[list[int]]:
    """Partition groups into rounds where no two groups of a round share a worker.

    ``edges``: the pairs of groups that share a worker, when the caller knows them faster
    than :func:`conflict_edges` finds them.
    """
    return _rounds_of(_colour(_shared_worker_neighbours(groups)) if edges is None
                      else dsatur(len(groups), edges))


def pair_rounds(pairs: Sequence[tuple[int, int]]) -> list[list[int]]:
    """:func:`rounds` of groups of two workers each (a transfer's sender and receiver).

    The same colouring, found per set of groups of the same two workers (a receiver
    pulls several layers from one sender) instead of per group. The groups of one set
    share every neighbour, so they have one degree, and at every moment one saturation:
    the colours used at either worker (each coloured group sharing a worker is a
    neighbour). :func:`_colour` therefore takes the set's lowest uncoloured group
    whenever it takes one of them, and a heap of ``(-saturation, -degree, lowest
    uncoloured group)`` per set pops the groups in its order; colouring one visits the
    sets at its two workers rather than every group there.
    """
    members, ends, count = _pair_sets(pairs)
    sets_at, neg_degree = _sets_at_workers(members, ends, count)
    return _rounds_of(_colour_pair_sets(len(pairs), members, ends, count, sets_at,
                                        neg_degree))


def _pair_sets(pairs: Sequence[tuple[int, int]]
               ) -> tuple[list[list[int]], list[tuple[int, int]], dict[int, int]]:
    """The sets of groups of the same two workers: each set's groups in index order, its
    two workers (the smaller first), and how many groups each worker is in."""
    index: dict[tuple[int, int], int] = {}
    members: list[list[int]] = []  # each set's groups, in index order
    ends: list[tuple[int, int]] = []
    count: dict[int, int] = {}  # groups per worker
    for i, (a, b) in enumerate(pairs):
        key = (a, b) if a <= b else (b, a)
        k = index.get(key)
        if k is None:
            k = index[key] = len(members)
            members.append([])
            ends.append(key)
        members[k].append(i)
        count[a] = count.get(a, 0) + 1
        if b != a:
            count[b] = count.get(b, 0) + 1
    return members, ends, count


def _sets_at_workers(members: list[list[int]], ends: list[tuple[int, int]],
                     count: dict[int, int]) -> tuple[dict[int, list[int]], list[int]]:
    """The sets at each worker, and each set's negated degree (the groups of one set
    share every neighbour, so they have one degree)."""
    sets_at: dict[int, list[int]] = {x: [] for x in count}
    neg_degree = []
    for k, (a, b) in enumerate(ends):
        sets_at[a].append(k)
        if b != a:
            sets_at[b].append(k)
        # groups at a or b, less the groups at both (this set) and the group itself
        shared = count[a] if a == b else count[a] + count[b] - len(members[k])
        neg_degree.append(1 - shared)
    return sets_at, neg_degree


def _colour_pair_sets(num_groups: int, members: list[list[int]],
                      ends: list[tuple[int, int]], count: dict[int, int],
                      sets_at: dict[int, list[int]], neg_degree: list[int]) -> list[int]:
    """Each group's colour: DSATUR's order kept per set by a heap of ``(-saturation,
    -degree, lowest uncoloured group)`` (:func:`pair_rounds`)."""
    used: dict[int, set[int]] = {x: set() for x in count}
    saturation = [0] * len(ends)
    next_member = [0] * len(ends)
    colour = [-1] * num_groups
    heap = [(0, neg_degree[k], group[0], k) for k, group in enumerate(members)]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        neg_sat, _, v, k = pop(heap)
        group = members[k]
        if -neg_sat != saturation[k] or next_member[k] >= len(group) \
                or group[next_member[k]] != v:
            continue
        a, b = ends[k]
        at_a, at_b = used[a], used[b]
        c = 0
        while c in at_a or c in at_b:
            c += 1
        colour[v] = c
        next_member[k] += 1
        # ``c`` is used at neither a nor b yet: new to this set, and to another set at a
        # (or b) unless its other worker uses it already
        for here in (a, b) if b != a else (a,):
            for j in sets_at[here]:
                if j == k or next_member[j] >= len(members[j]):
                    continue
                x, y = ends[j]
                other = y if x == here else x
                if other == here or c not in used[other]:
                    saturation[j] += 1
                    push(heap, (-saturation[j], neg_degree[j], members[j][next_member[j]], j))
        at_a.add(c)
        at_b.add(c)
        saturation[k] += 1
        if next_member[k] < len(group):
            push(heap, (-saturation[k], neg_degree[k], group[next_member[k]], k))
    return colour
