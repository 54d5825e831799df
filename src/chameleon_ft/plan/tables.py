"""A plan's worker tables, built from its pipelines' shared tables at C speed where it can:
``worker -> layer range`` and ``worker -> (pipeline, stage)`` of every live stage, each
layer's live holders, and the nodes whose loss would leave a layer without a replica.

:class:`~chameleon_ft.plan.plan.ExecutionPlan` keeps each table once built; this module
builds them (and keeps the whole tables of a tuple of pipelines, which plans that differ
only in their reroutes share).
"""

from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from chameleon_ft.plan.pipeline import (
    _ROW_RANGES,
    _ROW_WORKERS,
    _pipeline_table,
    _position_row,
    _Table,
)

if TYPE_CHECKING:
    from chameleon_ft.plan.plan import ExecutionPlan

_V = TypeVar("_V")


def indices_by_object(items: Sequence[object]) -> dict[int, list[int]]:
    """The indices of each distinct object of ``items`` (by identity), increasing, objects
    in order of first appearance: plans share their range objects and range rows, so there
    are few, and where they come in long runs (survivors in id order on a stage-major
    layout) the runs are added whole."""
    ids = list(map(id, items))
    head = ids[:257]  # how long the runs are, judged from the first items
    if ids and sum(map(operator.ne, head, head[1:])) * 8 <= len(head):
        ends = list(itertools.compress(range(1, len(ids)), map(operator.ne, ids, ids[1:])))
        if len(ends) * 8 <= len(ids):
            by_object: dict[int, list[int]] = defaultdict(list)
            for start, end in zip([0, *ends], [*ends, len(ids)], strict=True):
                by_object[ids[start]].extend(range(start, end))
            return by_object
    # Short runs: index by index (on 8,192 items 2.5x faster than sorting the indices by
    # object with a key function and cutting the runs).
    grouped: dict[int, list[int]] = defaultdict(list)
    for index, key in enumerate(ids):
        grouped[key].append(index)
    return grouped


def _range_rows(tables: list[_Table]) -> list[tuple[range, ...]]:
    """Each table's layer ranges (the values of :attr:`ExecutionPlan.layers_by_worker`)."""
    return list(map(_ROW_RANGES, tables))


def _position_rows(tables: list[_Table]) -> list[tuple[tuple[int, int], ...]]:
    """Each table's ``(pipeline, stage)`` positions (those of
    :attr:`ExecutionPlan.stage_of_worker`)."""
    return list(map(_position_row, itertools.count(), map(len, map(_ROW_WORKERS, tables))))


_WHOLE_TABLES: dict[tuple[int, str], tuple[tuple[Any, ...], dict[int, Any] | None]] = {}
"""``worker -> value`` over every stage of a tuple of pipelines, dead ones included, by
(the tuple's id, the table's kind), kept with the tuple (:func:`live_table`);
``None`` when a worker is named twice. The oldest entry goes at :data:`_WHOLE_TABLES_MAX`."""

_WHOLE_TABLES_MAX = 32


def live_table(plan: ExecutionPlan, tables: list[_Table], kind: str,
               rows_of: Callable[[list[_Table]], Sequence[Sequence[_V]]]
               ) -> dict[int, _V]:
    """``worker -> rows_of(tables)[p][s]`` for every live stage ``s`` of every pipeline
    ``p`` (``tables``: the pipelines' :meth:`_tables`), in stage order, built as one
    dictionary from the chained rows at C speed (a worker named twice keeps its first
    place and its last value); a rerouted pipeline's dead stages are left out.

    The table of every stage is kept per tuple of pipelines and ``kind`` (a few):
    plans that differ only in their reroutes (a rerouted plan and the plan it
    reroutes, a re-join that hands stages back) share their pipelines, and each
    copies the kept table without its dead workers instead of building it anew.
    """
    pipelines = plan.pipelines
    key = (id(pipelines), kind)
    found = _WHOLE_TABLES.get(key)
    if found is not None and found[0] is pipelines:  # kept with it: the id is its own
        whole: dict[int, _V] | None = found[1]
    else:
        whole = dict(zip(itertools.chain.from_iterable(map(_ROW_WORKERS, tables)),
                         itertools.chain.from_iterable(rows_of(tables)), strict=True))
        if len(whole) != sum(map(len, map(_ROW_WORKERS, tables))):
            whole = None  # a worker named twice: built below, stage by stage
        if len(_WHOLE_TABLES) >= _WHOLE_TABLES_MAX:
            # the oldest; a planner preparing decisions on another thread may have
            # taken it out already
            _WHOLE_TABLES.pop(next(iter(_WHOLE_TABLES)), None)
        _WHOLE_TABLES[key] = (pipelines, whole)
    dead = plan.reroute_map
    if whole is not None:
        if not dead:
            return whole
        kept = whole.copy()
        for p, s in dead:
            if 0 <= p < len(tables) and 0 <= s < len(tables[p][0]):
                del kept[tables[p][0][s]]  # each worker named once
        return kept
    worker_rows: list[Sequence[int]] = list(map(_ROW_WORKERS, tables))
    value_rows: list[Sequence[_V]] = list(rows_of(tables))
    for p in sorted({p for p, _ in dead if 0 <= p < len(worker_rows)}):
        live = [s for s in range(len(worker_rows[p])) if (p, s) not in dead]
        worker_rows[p] = [worker_rows[p][s] for s in live]
        value_rows[p] = [value_rows[p][s] for s in live]
    return dict(zip(itertools.chain.from_iterable(worker_rows),
                    itertools.chain.from_iterable(value_rows), strict=True))


def holders_by_layer(plan: ExecutionPlan) -> tuple[tuple[int, ...], ...]:
    """For each layer, the live workers holding it, sorted."""
    # Few distinct layer ranges: gather workers per range, then per layer.
    by_range: dict[range, list[int]] = {}
    dead = plan.reroute_map
    rerouted = {p for p, _ in dead}
    tables = plan._tables()
    for p in sorted(rerouted):  # few: worker by worker
        workers, ranges, _ = tables[p]
        for s, (worker, layers) in enumerate(zip(workers, ranges, strict=True)):
            if (p, s) not in dead:
                by_range.setdefault(layers, []).append(worker)
    # Pipelines of one layout share their range row (grouped by it at C speed): their
    # worker rows are gathered stage by stage at C speed too (a transposition).
    range_rows = list(map(_ROW_RANGES, tables))
    for indices in indices_by_object(range_rows).values():
        intact = [p for p in indices if p not in rerouted] if rerouted else indices
        if not intact:
            continue
        ranges = range_rows[intact[0]]
        rows = list(map(_ROW_WORKERS, map(tables.__getitem__, intact)))
        for layers, column in zip(ranges, zip(*rows, strict=True), strict=True):
            found = by_range.get(layers)
            if found is None:
                by_range[layers] = list(column)
            else:
                found.extend(column)
    # Layers held by the same ranges have the same holders: one sorted tuple each.
    cover: list[list[range]] = [[] for _ in range(plan.num_layers)]
    for layers in by_range:
        for layer in layers:
            cover[layer].append(layers)
    known: dict[tuple[range, ...], tuple[int, ...]] = {}
    out = []
    for ranges_of_layer in cover:
        key = tuple(ranges_of_layer)
        holders = known.get(key)
        if holders is None:
            holders = known[key] = tuple(sorted(itertools.chain.from_iterable(
                map(by_range.__getitem__, ranges_of_layer))))
        out.append(holders)
    return tuple(out)


def fatal_nodes(plan: ExecutionPlan, workers_per_node: int) -> frozenset[int]:
    """Nodes (``worker // workers_per_node``) whose loss leaves some layer without a
    live replica: the single node holding every replica of a layer
    (:meth:`ExecutionPlan.fatal_nodes <chameleon_ft.plan.plan.ExecutionPlan.fatal_nodes>`
    keeps it with the plan)."""
    # Per distinct layer range: the one node holding it, or -1 once two nodes do (few
    # ranges, so this stays cheap on thousands of workers).
    dead = plan.reroute_map
    by_range: dict[range, int] = {}  # by the pipelines' shared range objects
    get = by_range.get
    settled: set[int] = set()  # ids of range rows whose every range two nodes hold
    for p, pipe in enumerate(plan.pipelines):
        workers, ranges, _ = _pipeline_table(pipe)
        if id(ranges) in settled:
            continue  # this pipeline can only add nodes to ranges already shared
        for s, (worker, layers) in enumerate(zip(workers, ranges, strict=True)):
            if dead and (p, s) in dead:
                continue
            seen = get(layers)
            node = worker // workers_per_node
            if seen is None:
                by_range[layers] = node
            elif seen >= 0 and seen != node:
                by_range[layers] = -1
        if all(by_range.get(layers, 0) < 0 for layers in ranges):
            settled.add(id(ranges))
    out: set[int] = set()
    if any(node >= 0 for node in by_range.values()):
        for layer in range(plan.num_layers):
            nodes = {node for layers, node in by_range.items() if layer in layers}
            if len(nodes) == 1:
                (node,) = nodes
                if node >= 0:
                    out.add(node)
    return frozenset(out)
