"""``ExecutionPlan``: who runs which layers of which pipeline, on how many micro-batches.

A plan is an immutable value consumed alike by the estimator, the simulator and the
runtime. Pipelines may differ in length (after a dynamic recovery), and a stage whose
worker died may be *rerouted*: its micro-batches run on live workers holding the same
layers in other pipelines.
"""

from __future__ import annotations

import itertools
import json
import operator
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, TypeVar, cast

from chameleon_ft.spec.job import Schedule

_SCHEDULE_CODES = {s.value: i for i, s in enumerate(Schedule)}

_POSITIONS: dict[tuple[int, int], tuple[int, int]] = {}
"""One ``(pipeline, stage)`` tuple per position, shared by every plan's table."""

_POSITION_ROWS: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}
"""The shared positions of stages ``0..n-1`` of one pipeline, by ``(pipeline, n)``."""


def _position(pipeline: int, stage: int) -> tuple[int, int]:
    key = (pipeline, stage)
    return _POSITIONS.setdefault(key, key)


_LAYER_RANGES: dict[tuple[int, int], range] = {}
"""One range object per ``(first, end)`` layer range, shared by every plan's table."""

_RANGE_ROWS: dict[tuple[tuple[int, int], ...], tuple[tuple[range, ...], int]] = {}
"""Per layout (each stage's ``(first, end)``), its row of shared range objects and the end
of the layers it covers (:func:`_pipeline_table`): pipelines of one layout share the row,
so a walk over a plan's pipelines can tell a layout it has seen by the row's identity."""

_RANGE_ROWS_MAX = 1 << 14


def _range_row(layout: tuple[tuple[int, int], ...]) -> tuple[tuple[range, ...], int]:
    """``_RANGE_ROWS[layout]``, built."""
    ranges = []
    end = 0
    for first, last in layout:
        layers = _LAYER_RANGES.get((first, last))
        if layers is None:
            layers = _LAYER_RANGES.setdefault((first, last), range(first, last))
        ranges.append(layers)
        end = last if end >= 0 and first == end < last else -1
    if len(_RANGE_ROWS) >= _RANGE_ROWS_MAX:
        _RANGE_ROWS.clear()
    row = _RANGE_ROWS[layout] = (tuple(ranges), end if ranges else -1)
    return row

_V = TypeVar("_V")


_Table = tuple[tuple[int, ...], tuple[range, ...], int]
"""A pipeline's stage workers, their layer ranges, and the layers they cover
(:func:`_pipeline_table`)."""

_TABLE_OF = operator.attrgetter("_table")
_ROW_WORKERS = operator.itemgetter(0)
_ROW_RANGES = operator.itemgetter(1)
_ROW_END = operator.itemgetter(2)
_MICROBATCHES_OF = operator.attrgetter("num_microbatches")
_START = operator.attrgetter("start")
_STOP = operator.attrgetter("stop")


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


def _pipeline_table(pipe: Pipeline) -> _Table:
    """The workers of ``pipe``'s stages, their layer ranges (shared range objects), and
    the end of the layers they cover: ``n`` when the stages hold layers ``0..n-1`` in
    order, each exactly once, none empty; ``-1`` otherwise.

    Built on first use and kept with the pipeline: plans share pipeline objects, so most
    of a new plan's tables come from rows already built."""
    table = pipe._table
    if table is not None:
        return table
    stages = pipe.stages
    workers = tuple([st.worker for st in stages])
    layout = pipe._layout
    if layout is None:
        layout = tuple([(st.first_layer, st.end_layer) for st in stages])
        object.__setattr__(pipe, "_layout", layout)
    row = _RANGE_ROWS.get(layout)
    if row is None:
        row = _range_row(layout)
    table = (workers, row[0], row[1])
    object.__setattr__(pipe, "_table", table)
    return table


_STAGES: dict[tuple[int, int, int], Stage] = {}
"""One stage object per ``(worker, first layer, end layer)`` built through
:func:`shared_stage`; cleared when it reaches :data:`_STAGES_MAX` entries."""

_STAGES_MAX = 1 << 18


def shared_stage(worker: int, first_layer: int, end_layer: int) -> Stage:
    """``Stage(worker, first_layer, end_layer)``, the same object every time (a frozen
    dataclass takes several times longer to build than to look up, and re-plans of
    thousands of workers build the same stages again and again)."""
    key = (worker, first_layer, end_layer)
    found = _STAGES.get(key)
    if found is None:
        if len(_STAGES) >= _STAGES_MAX:
            _STAGES.clear()
        found = _STAGES[key] = Stage(worker, first_layer, end_layer)
    return found


_PLACEHOLDERS: dict[tuple[int, int, int], tuple[Any, Pipeline]] = {}
"""Placeholder pipelines by (layout identity, micro-batches, first slot), kept with their
layout so that the identity stays valid: searches build the same skeleton pipelines
again and again (the templates hand out one layout object per shape)."""


def placeholder_pipeline(layout: tuple[tuple[int, int], ...], num_microbatches: int,
                         slot: int) -> Pipeline:
    """A pipeline of ``layout`` (each stage's first and end layer) on placeholder workers
    ``-1 - slot``, ``-2 - slot``, ... (a re-plan's skeleton), the same object every time."""
    key = (id(layout), num_microbatches, slot)
    found = _PLACEHOLDERS.get(key)
    if found is not None and found[0] is layout:
        return found[1]
    if len(_PLACEHOLDERS) >= 1 << 16:
        _PLACEHOLDERS.clear()
    pipe = Pipeline(tuple(shared_stage(-1 - slot - s, lo, hi)
                          for s, (lo, hi) in enumerate(layout)), num_microbatches)
    _PLACEHOLDERS[key] = (layout, pipe)
    return pipe


def pipeline_on(layout: tuple[tuple[int, int], ...], num_microbatches: int,
                workers: Iterable[int]) -> Pipeline:
    """A pipeline of ``layout`` with ``num_microbatches`` on ``workers`` (one per stage),
    put on them from the shared placeholder pipeline (its layer ranges and layout are not
    rebuilt stage by stage)."""
    return placeholder_pipeline(layout, num_microbatches, 0).on_workers(workers)


def _range_rows(tables: list[_Table]) -> list[tuple[range, ...]]:
    """Each table's layer ranges (the values of :attr:`ExecutionPlan.layers_by_worker`)."""
    return list(map(_ROW_RANGES, tables))


def _position_rows(tables: list[_Table]) -> list[tuple[tuple[int, int], ...]]:
    """Each table's ``(pipeline, stage)`` positions (those of
    :attr:`ExecutionPlan.stage_of_worker`)."""
    return list(map(_position_row, itertools.count(), map(len, map(_ROW_WORKERS, tables))))


_WHOLE_TABLES: dict[tuple[int, str], tuple[tuple[Any, ...], dict[int, Any] | None]] = {}
"""``worker -> value`` over every stage of a tuple of pipelines, dead ones included, by
(the tuple's id, the table's kind), kept with the tuple (:meth:`ExecutionPlan._live_table`);
``None`` when a worker is named twice. The oldest entry goes at :data:`_WHOLE_TABLES_MAX`."""

_WHOLE_TABLES_MAX = 32


def _position_row(pipeline: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """:func:`_position` of every stage of a pipeline of ``num_stages`` stages."""
    key = (pipeline, num_stages)
    row = _POSITION_ROWS.get(key)
    if row is None:
        row = _POSITION_ROWS[key] = tuple(_position(pipeline, s) for s in range(num_stages))
    return row


@dataclass(frozen=True, slots=True)
class Stage:
    """A contiguous range of layers ``[first_layer, end_layer)`` run by one worker."""

    worker: int
    first_layer: int
    end_layer: int

    @property
    def layers(self) -> range:
        """The layer indices of this stage."""
        return range(self.first_layer, self.end_layer)

    @property
    def num_layers(self) -> int:
        """How many layers the stage holds."""
        return self.end_layer - self.first_layer


@dataclass(frozen=True, slots=True)
class Pipeline:
    """One data-parallel replica: stages covering every layer, and its micro-batch count."""

    stages: tuple[Stage, ...]
    num_microbatches: int
    _layout: tuple[tuple[int, int], ...] | None = field(
        init=False, default=None, repr=False, compare=False)
    _hash: int | None = field(init=False, default=None, repr=False, compare=False)
    _table: _Table | None = field(
        init=False, default=None, repr=False, compare=False)
    """:func:`_pipeline_table`'s row, once built."""

    def __hash__(self) -> int:
        # The dataclass's own hash (of the compared fields), kept: plans share pipeline
        # objects, and every new plan that keys a cache hashes all of them.
        cached = self._hash
        if cached is None:
            cached = hash((_pipeline_table(self)[0], self.layout, self.num_microbatches))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __eq__(self, other: object) -> bool:
        # The dataclass's own equality (of the compared fields), from the pipelines' kept
        # rows: plans key caches, and an equal plan built anew compares every stage.
        if self is other:
            return True
        if not isinstance(other, Pipeline):
            return NotImplemented
        if self._hash is not None and other._hash is not None and self._hash != other._hash:
            return False
        return (self.num_microbatches == other.num_microbatches
                and (self.table is other.table
                     or (self.workers == other.workers and self.layout == other.layout)))

    @property
    def layout(self) -> tuple[tuple[int, int], ...]:
        """Layer bounds of each stage, without the workers (computed on first use, then
        kept: the planner's searches and symmetry checks read it often)."""
        layout = self._layout
        if layout is None:
            _pipeline_table(self)
            layout = self._layout
            assert layout is not None
        return layout

    @property
    def workers(self) -> tuple[int, ...]:
        """The stage workers, in stage order (built on first use, kept with the pipeline)."""
        table = self._table
        return (table if table is not None else _pipeline_table(self))[0]

    @property
    def table(self) -> _Table:
        """The stage workers, their layer ranges and the end of the layers they cover, as
        one tuple kept with the pipeline (:func:`_pipeline_table`): pipelines of the same
        stages with other micro-batch counts share it."""
        table = self._table
        return table if table is not None else _pipeline_table(self)

    @property
    def layer_ranges(self) -> tuple[range, ...]:
        """Each stage's layer range, in stage order: one shared range object per distinct
        ``(first, end)`` (built on first use, kept with the pipeline)."""
        table = self._table
        return (table if table is not None else _pipeline_table(self))[1]

    @property
    def num_stages(self) -> int:
        """Stages in this pipeline."""
        return len(_pipeline_table(self)[0])

    def with_microbatches(self, num_microbatches: int) -> Pipeline:
        """This pipeline running ``num_microbatches``: itself when it already does, else a
        pipeline of the very same stages that starts with this one's table and layout."""
        if num_microbatches == self.num_microbatches:
            return self
        table = _pipeline_table(self)
        if type(self) is _PlacedPipeline:  # its stages stay unbuilt
            return _with_rows(None, num_microbatches, table, self._layout)
        return _with_rows(self.stages, num_microbatches, table, self.layout)

    def on_workers(self, workers: Iterable[int],
                   num_microbatches: int | None = None) -> Pipeline:
        """This pipeline's stages on ``workers`` (one per stage, in stage order), with its
        micro-batch count unless ``num_microbatches`` is given. The new pipeline starts
        with this one's layer ranges and layout (a renamed or re-placed pipeline does not
        rebuild them stage by stage); its stage objects are looked up when first read.

        Raises:
            ValueError: when ``workers`` does not name one worker per stage.
        """
        row = tuple(workers)
        _, ranges, end = _pipeline_table(self)
        if len(row) != len(ranges):
            raise ValueError(f"workers: {len(row)} given for a pipeline of {len(ranges)} "
                             "stages")
        return _with_rows(None, self.num_microbatches if num_microbatches is None
                          else num_microbatches, (row, ranges, end), self._layout)


def _stages_of(row: tuple[int, ...], ranges: tuple[range, ...]) -> tuple[Stage, ...]:
    """The shared stages (:func:`shared_stage`) of workers ``row`` on ``ranges``, looked up
    at C speed."""
    known = tuple(map(_STAGES.get, zip(row, map(_START, ranges), map(_STOP, ranges),
                                       strict=True)))
    if all(known):
        return cast("tuple[Stage, ...]", known)
    return tuple([st or shared_stage(w, layers.start, layers.stop)
                  for st, w, layers in zip(known, row, ranges, strict=True)])


class _PlacedPipeline(Pipeline):
    """A pipeline put on workers (:meth:`Pipeline.on_workers`) whose stage objects are
    looked up when :attr:`stages` is first read: re-plans of thousands of workers build
    pipelines by the hundred and most are read through their table only."""

    __slots__ = ()

    @property
    def stages(self) -> tuple[Stage, ...]:
        try:
            return _GET_STAGES(self)  # type: ignore[no-any-return]
        except AttributeError:
            row, ranges, _ = _TABLE_OF(self)
            stages = _stages_of(row, ranges)
            _SET_STAGES(self, stages)
            return stages

    @stages.setter
    def stages(self, stages: tuple[Stage, ...]) -> None:  # unpickling, replace()
        _SET_STAGES(self, stages)

    def __repr__(self) -> str:  # as the pipeline built directly
        return f"Pipeline(stages={self.stages!r}, num_microbatches={self.num_microbatches!r})"


def _with_rows(stages: tuple[Stage, ...] | None, num_microbatches: int, table: _Table,
               layout: tuple[tuple[int, int], ...] | None) -> Pipeline:
    """A pipeline of ``stages`` that starts with its table and layout, known already
    (:func:`_pipeline_table`, :attr:`Pipeline.layout`): ``Pipeline(stages,
    num_microbatches)`` with those two fields set, its slots filled directly (re-plans of
    thousands of workers build pipelines by the hundred; the frozen dataclass's own
    constructor sets each field through ``object.__setattr__`` in Python). ``stages``
    ``None``: the stages the table describes, looked up when first read
    (:class:`_PlacedPipeline`)."""
    pipe = _NEW_PIPELINE(Pipeline if stages is not None else _PlacedPipeline)
    if stages is not None:
        _SET_STAGES(pipe, stages)
    _SET_MICROBATCHES(pipe, num_microbatches)
    _SET_LAYOUT(pipe, layout)
    _SET_HASH(pipe, None)
    _SET_TABLE(pipe, table)
    return pipe


_NEW_PIPELINE = object.__new__
_GET_STAGES = vars(Pipeline)["stages"].__get__
_SET_STAGES, _SET_MICROBATCHES, _SET_LAYOUT, _SET_HASH, _SET_TABLE = (
    vars(Pipeline)[name].__set__
    for name in ("stages", "num_microbatches", "_layout", "_hash", "_table"))


@dataclass(frozen=True, slots=True)
class Reroute:
    """The stage ``stage`` of pipeline ``pipeline`` lost its worker; peers run its work.

    ``shares`` lists ``(peer worker, number of micro-batches)``; every peer holds exactly
    the dead stage's layers as a live stage of another pipeline.
    """

    pipeline: int
    stage: int
    shares: tuple[tuple[int, int], ...]

    def assignment(self) -> tuple[int, ...]:
        """The peer that runs each micro-batch of the pipeline, in micro-batch order.

        Smooth weighted round robin: each peer gets exactly its share, spread evenly over
        the step so that no peer receives a burst.
        """
        total = sum(n for _, n in self.shares)
        credit = [0] * len(self.shares)
        out: list[int] = []
        for _ in range(total):
            for i, (_, n) in enumerate(self.shares):
                credit[i] += n
            best = max(range(len(self.shares)), key=lambda i: (credit[i], -i))
            credit[best] -= total
            out.append(self.shares[best][0])
        return tuple(out)


@dataclass(frozen=True)
class ExecutionPlan:
    """Pipelines -> stages -> (worker, layer range), micro-batches, and the reroute map."""

    num_layers: int
    """Layers of the model (embedding + blocks + head)."""
    pipelines: tuple[Pipeline, ...]
    """The data-parallel replicas; may differ in length."""
    reroutes: tuple[Reroute, ...] = ()
    """Dead stage replicas whose micro-batches run on peers."""
    micro_batch: int = 1
    """Samples per micro-batch."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``1f1b``, ``gpipe``, ``interleaved`` or ``zero-bubble``
    (docs/design.md section 3.1). For ``interleaved`` the plan's layers are the profile's
    *columns* (:func:`chameleon_ft.profile.fold_profile`): a stage holding columns
    ``[a, b)`` holds those positions of every model chunk."""
    defer_weight_grad: bool = False
    """Whether workers that run several streams (rerouted peers) split each backward into
    input gradient (B) and weight gradient (W) and run W only when no F or B is ready
    (ReCycle's decoupled backward). Single-stream workers keep the schedule's order."""

    def __hash__(self) -> int:
        # Plans key the planner's and the estimator's caches; a 2,048-worker plan hashes
        # thousands of stages, so the hash is computed once (the plan is immutable). Only
        # integers go in, so a pickled plan's cached hash holds in another process too.
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.num_layers, self.pipelines, self.reroutes, self.micro_batch,
                           _SCHEDULE_CODES.get(self.schedule, -1), self.defer_weight_grad))
            object.__setattr__(self, "_hash", cached)
        return cached

    # ---------------------------------------------------------------- construction
    @classmethod
    def uniform(
        cls,
        *,
        dp: int,
        pp: int,
        num_layers: int,
        num_microbatches: int,
        micro_batch: int = 1,
        placement: str = "stage-major",
        layer_bounds: Sequence[tuple[int, int]] | None = None,
        schedule: str = "1f1b",
    ) -> ExecutionPlan:
        """The failure-free dp x pp layout.

        Args:
            dp: pipelines.
            pp: stages per pipeline.
            num_layers: layers of the model.
            num_microbatches: micro-batches per step over all pipelines (divisible by dp).
            micro_batch: samples per micro-batch.
            placement: ``stage-major`` numbers workers ``s * dp + p``; ``pipeline-major``
                ``p * pp + s``.
            layer_bounds: ``(first, end)`` per stage; default: as even as possible.
            schedule: a :class:`~chameleon_ft.spec.job.Schedule` value.

        Raises:
            ValueError: when the shapes do not fit.
        """
        if pp > num_layers:
            raise ValueError(f"job.pp: {pp} stages need at least {pp} layers, the model has "
                             f"{num_layers}")
        if num_microbatches % dp:
            raise ValueError(f"job.global_batch: {num_microbatches} micro-batches do not split "
                             f"evenly over {dp} pipelines")
        bounds = list(layer_bounds) if layer_bounds is not None else even_bounds(num_layers, pp)
        if len(bounds) != pp:
            raise ValueError(f"layer_bounds: {len(bounds)} stages given, pp is {pp}")
        per_pipeline = num_microbatches // dp
        pipelines = []
        for p in range(dp):
            stages = []
            for s, (lo, hi) in enumerate(bounds):
                worker = p * pp + s if placement == "pipeline-major" else s * dp + p
                stages.append(Stage(worker, lo, hi))
            pipelines.append(Pipeline(tuple(stages), per_pipeline))
        plan = cls(num_layers=num_layers, pipelines=tuple(pipelines), micro_batch=micro_batch,
                   schedule=schedule)
        plan.validate()
        return plan

    # ---------------------------------------------------------------- queries
    @property
    def num_pipelines(self) -> int:
        """Data-parallel replicas."""
        return len(self.pipelines)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step over all pipelines."""
        return sum(p.num_microbatches for p in self.pipelines)

    @property
    def global_batch(self) -> int:
        """Samples per step."""
        return self.num_microbatches * self.micro_batch

    @cached_property
    def reroute_map(self) -> dict[tuple[int, int], Reroute]:
        """``(pipeline, stage) -> Reroute`` for every rerouted stage."""
        return {(r.pipeline, r.stage): r for r in self.reroutes}

    @cached_property
    def dead_workers(self) -> frozenset[int]:
        """Workers named by rerouted stages (they no longer run anything)."""
        return frozenset(self.pipelines[r.pipeline].stages[r.stage].worker for r in self.reroutes)

    @cached_property
    def workers(self) -> tuple[int, ...]:
        """Live workers that run something, sorted."""
        return tuple(sorted(self.stage_of_worker))

    # The tables below are kept with the plan (the planner's and the estimator's caches keep
    # thousands of plans of thousands of workers), so their values are shared: one range
    # object per distinct layer range, one tuple per (pipeline, stage) position.
    @cached_property
    def layers_by_worker(self) -> dict[int, range]:
        """The layer range each live worker holds."""
        return self._live_table(self._tables(), "layers", _range_rows)

    @cached_property
    def stage_of_worker(self) -> dict[int, tuple[int, int]]:
        """``worker -> (pipeline, stage)`` for every live worker."""
        return self._live_positions_of(self._tables())

    def _live_positions_of(self, tables: list[_Table]) -> dict[int, tuple[int, int]]:
        """``worker -> (pipeline, stage)`` for every live stage of the pipelines' tables."""
        return self._live_table(tables, "positions", _position_rows)

    def _tables(self) -> list[_Table]:
        """Each pipeline's table (:func:`_pipeline_table`), read at C speed where built, and
        kept with the plan (every reader only reads it)."""
        tables: list[_Table] | None = self.__dict__.get("_kept_tables")
        if tables is None:
            tables = list(map(_TABLE_OF, self.pipelines))
            if None in tables:
                tables = list(map(_pipeline_table, self.pipelines))
            self.__dict__["_kept_tables"] = tables
        return tables

    def _live_table(self, tables: list[_Table], kind: str,
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
        pipelines = self.pipelines
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
        dead = self.reroute_map
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

    @cached_property
    def holders_by_layer(self) -> tuple[tuple[int, ...], ...]:
        """For each layer, the live workers holding it, sorted."""
        # Few distinct layer ranges: gather workers per range, then per layer.
        by_range: dict[range, list[int]] = {}
        dead = self.reroute_map
        rerouted = {p for p, _ in dead}
        tables = self._tables()
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
        cover: list[list[range]] = [[] for _ in range(self.num_layers)]
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

    @cached_property
    def layers_by_holders(self) -> dict[tuple[int, ...], list[int]]:
        """The layers of each distinct holders tuple (:attr:`holders_by_layer`), in layer
        order, the tuples in the order of their first layer: the all-reduce buckets. Read,
        not changed, by its callers."""
        by_holders: dict[tuple[int, ...], list[int]] = {}
        # The plan shares one holders tuple between layers with the same holders: each
        # tuple object (thousands of workers) is hashed once, not once per layer.
        by_object: dict[int, list[int]] = {}
        for layer, holders in enumerate(self.holders_by_layer):
            layers = by_object.get(id(holders))
            if layers is None:
                layers = by_object[id(holders)] = by_holders.setdefault(holders, [])
            layers.append(layer)
        return by_holders

    def fatal_nodes(self, workers_per_node: int) -> frozenset[int]:
        """Nodes (``worker // workers_per_node``) whose loss leaves some layer without a
        live replica: the single node holding every replica of a layer. Kept with the plan
        (the policy asks for every candidate of every decision, cached ones included)."""
        known: tuple[int, frozenset[int]] | None = self.__dict__.get("_fatal_nodes")
        if known is not None and known[0] == workers_per_node:
            return known[1]
        # Per distinct layer range: the one node holding it, or -1 once two nodes do (few
        # ranges, so this stays cheap on thousands of workers).
        dead = self.reroute_map
        by_range: dict[range, int] = {}  # by the pipelines' shared range objects
        get = by_range.get
        settled: set[int] = set()  # ids of range rows whose every range two nodes hold
        for p, pipe in enumerate(self.pipelines):
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
            for layer in range(self.num_layers):
                nodes = {node for layers, node in by_range.items() if layer in layers}
                if len(nodes) == 1:
                    (node,) = nodes
                    if node >= 0:
                        out.add(node)
        found = frozenset(out)
        object.__setattr__(self, "_fatal_nodes", (workers_per_node, found))
        return found

    def holders(self, layer: int) -> tuple[int, ...]:
        """Live workers holding ``layer`` (they all-reduce its gradient), sorted."""
        return self.holders_by_layer[layer]

    def microbatch_offsets(self) -> tuple[int, ...]:
        """Index of each pipeline's first micro-batch in the global step's micro-batch list.

        Pipeline p runs global micro-batches ``offsets[p] .. offsets[p] + m_p - 1``; the
        runtime draws each step's samples by global index, so every plan sees the same data.
        """
        out, acc = [], 0
        for pipe in self.pipelines:
            out.append(acc)
            acc += pipe.num_microbatches
        return tuple(out)

    def executor(self, pipeline: int, stage: int) -> tuple[int, ...]:
        """The worker running each micro-batch of ``(pipeline, stage)``."""
        pipe = self.pipelines[pipeline]
        reroute = self.reroute_map.get((pipeline, stage))
        if reroute is None:
            return (pipe.stages[stage].worker,) * pipe.num_microbatches
        return reroute.assignment()

    def worker_rows(self) -> list[tuple[int, ...]]:
        """Each pipeline's stage workers (a rerouted stage's dead one too), in stage order:
        tuples kept with the pipeline objects, so asking again is cheap."""
        return list(map(_ROW_WORKERS, self._tables()))

    def range_rows(self) -> list[tuple[range, ...]]:
        """Each pipeline's layer ranges (:attr:`Pipeline.layer_ranges`: pipelines of one
        layout share one row object), in stage order."""
        return list(map(_ROW_RANGES, self._tables()))

    def iter_stages(self) -> Iterator[tuple[int, int, Stage]]:
        """Yield ``(pipeline, stage index, stage)`` over the whole plan."""
        for p, pipe in enumerate(self.pipelines):
            for s, st in enumerate(pipe.stages):
                yield p, s, st

    # ---------------------------------------------------------------- checks
    def validate(self, num_microbatches: int | None = None) -> None:
        """Check the plan's invariants.

        Args:
            num_microbatches: when given, the micro-batches of all pipelines must sum to it
                (the global batch is kept through every recovery).

        Raises:
            ValueError: saying which pipeline, stage, worker or reroute is wrong.
        """
        if self.num_layers < 1:
            raise ValueError(f"plan.num_layers: must be >= 1, got {self.num_layers}")
        if not self.pipelines:
            raise ValueError("plan.pipelines: a plan needs at least one pipeline")
        if self.micro_batch < 1:
            raise ValueError(f"plan.micro_batch: must be >= 1, got {self.micro_batch}")
        if self.schedule not in _SCHEDULE_CODES:
            raise ValueError(f"plan.schedule: unknown schedule {self.schedule!r}; choose one "
                             f"of {', '.join(_SCHEDULE_CODES)}")
        rerouted = set()
        for r in self.reroutes:
            key = (r.pipeline, r.stage)
            if key in rerouted:
                raise ValueError(f"plan.reroutes: pipeline {r.pipeline} stage {r.stage} is "
                                 "rerouted twice")
            rerouted.add(key)
        seen = self._live_positions(rerouted)
        sound = seen is not None
        if seen is None:
            seen = self._checked_stages(rerouted)
        for r in self.reroutes:
            self._validate_reroute(r, seen, rerouted)
        if num_microbatches is not None and self.num_microbatches != num_microbatches:
            raise ValueError(f"plan: pipelines run {self.num_microbatches} micro-batches per "
                             f"step, the global batch needs {num_microbatches}")
        if sound:
            # the very table stage_of_worker builds (same pairs, same order): keep it
            self.__dict__.setdefault("stage_of_worker", seen)

    def _live_positions(self, rerouted: set[tuple[int, int]]
                        ) -> dict[int, tuple[int, int]] | None:
        """``worker -> (pipeline, stage)`` of every live stage when every pipeline is sound
        (micro-batches, contiguous non-empty stages covering every layer, no worker used
        twice), checked from the pipelines' shared tables at C speed; ``None`` when some
        check fails (:meth:`_checked_stages` then says which)."""
        tables = self._tables()
        if (min(map(_MICROBATCHES_OF, self.pipelines)) < 1
                or set(map(_ROW_END, tables)) != {self.num_layers}):
            return None
        # the positions of the live stages (validate's rerouted stages are the plan's),
        # from the plan's own table when it was read already
        seen = self.__dict__.get("stage_of_worker") or self._live_positions_of(tables)
        live = sum(map(len, map(_ROW_WORKERS, tables))) - len(rerouted)
        return seen if len(seen) == live else None  # shorter: a worker named twice

    def _checked_stages(self, rerouted: set[tuple[int, int]]) -> dict[int, tuple[int, int]]:
        """:meth:`_live_positions`, stage by stage, raising at the first fault."""
        seen: dict[int, tuple[int, int]] = {}
        for p, pipe in enumerate(self.pipelines):
            if pipe.num_microbatches < 1:
                raise ValueError(f"plan.pipelines[{p}]: needs at least one micro-batch, "
                                 f"has {pipe.num_microbatches}")
            if not pipe.stages:
                raise ValueError(f"plan.pipelines[{p}]: has no stages")
            expected = 0
            for s, st in enumerate(pipe.stages):
                if st.first_layer != expected:
                    raise ValueError(
                        f"plan.pipelines[{p}].stages[{s}]: starts at layer {st.first_layer}, "
                        f"expected {expected} (layers must be contiguous, each exactly once)")
                if st.end_layer <= st.first_layer:
                    raise ValueError(f"plan.pipelines[{p}].stages[{s}]: empty layer range "
                                     f"[{st.first_layer}, {st.end_layer})")
                expected = st.end_layer
                if (p, s) in rerouted:
                    continue
                if st.worker in seen:
                    q, t = seen[st.worker]
                    raise ValueError(f"plan: worker {st.worker} is used twice (pipeline {q} "
                                     f"stage {t} and pipeline {p} stage {s})")
                seen[st.worker] = (p, s)
            if expected != self.num_layers:
                raise ValueError(f"plan.pipelines[{p}]: covers layers 0..{expected - 1}, the "
                                 f"model has {self.num_layers}")
        return seen

    def _validate_reroute(self, r: Reroute, live: dict[int, tuple[int, int]],
                          rerouted: set[tuple[int, int]]) -> None:
        where = f"plan.reroutes[pipeline {r.pipeline} stage {r.stage}]"
        if not 0 <= r.pipeline < len(self.pipelines):
            raise ValueError(f"{where}: no such pipeline")
        pipe = self.pipelines[r.pipeline]
        if not 0 <= r.stage < len(pipe.stages):
            raise ValueError(f"{where}: no such stage")
        dead = pipe.stages[r.stage]
        if not r.shares:
            raise ValueError(f"{where}: no peer workers")
        total = 0
        peers = set()
        for worker, count in r.shares:
            if count < 1:
                raise ValueError(f"{where}: peer {worker} has {count} micro-batches; list only "
                                 "peers with at least one")
            if worker in peers:
                raise ValueError(f"{where}: peer {worker} listed twice")
            peers.add(worker)
            total += count
            if worker not in live:
                raise ValueError(f"{where}: peer {worker} is not a live worker of the plan")
            q, t = live[worker]
            if q == r.pipeline:
                raise ValueError(f"{where}: peer {worker} belongs to the same pipeline")
            held = self.pipelines[q].stages[t]
            if (held.first_layer, held.end_layer) != (dead.first_layer, dead.end_layer):
                raise ValueError(
                    f"{where}: peer {worker} holds layers [{held.first_layer}, {held.end_layer}), "
                    f"the stage needs [{dead.first_layer}, {dead.end_layer})")
        if total != pipe.num_microbatches:
            raise ValueError(f"{where}: shares sum to {total} micro-batches, the pipeline runs "
                             f"{pipe.num_microbatches}")
        if dead.worker in live:
            raise ValueError(f"{where}: the dead worker {dead.worker} still runs another stage")

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {
            "num_layers": self.num_layers,
            "micro_batch": self.micro_batch,
            "schedule": self.schedule,
            **({"defer_weight_grad": True} if self.defer_weight_grad else {}),
            "pipelines": [
                {"num_microbatches": p.num_microbatches,
                 "stages": [[st.worker, st.first_layer, st.end_layer] for st in p.stages]}
                for p in self.pipelines
            ],
            "reroutes": [
                {"pipeline": r.pipeline, "stage": r.stage, "shares": [list(x) for x in r.shares]}
                for r in self.reroutes
            ],
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ExecutionPlan:
        """Inverse of :meth:`to_dict` (validates)."""
        plan = cls(
            num_layers=int(doc["num_layers"]),
            micro_batch=int(doc.get("micro_batch", 1)),
            schedule=str(doc.get("schedule", "1f1b")),
            defer_weight_grad=bool(doc.get("defer_weight_grad", False)),
            pipelines=tuple(
                Pipeline(tuple(Stage(int(w), int(a), int(b)) for w, a, b in p["stages"]),
                         int(p["num_microbatches"]))
                for p in doc["pipelines"]
            ),
            reroutes=tuple(
                Reroute(int(r["pipeline"]), int(r["stage"]),
                        tuple((int(w), int(n)) for w, n in r["shares"]))
                for r in doc.get("reroutes", [])
            ),
        )
        plan.validate()
        return plan

    def to_json(self) -> str:
        """Compact JSON text."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def describe(self) -> str:
        """A short human-readable summary, one line per pipeline."""
        lines = []
        for p, pipe in enumerate(self.pipelines):
            parts = []
            for s, st in enumerate(pipe.stages):
                tag = f"w{st.worker}[{st.first_layer}:{st.end_layer}]"
                if (p, s) in self.reroute_map:
                    peers = ",".join(f"w{w}x{n}" for w, n in self.reroute_map[(p, s)].shares)
                    tag = f"dead w{st.worker}[{st.first_layer}:{st.end_layer}]->{peers}"
                parts.append(tag)
            lines.append(f"pipeline {p} ({pipe.num_microbatches} mb): " + " | ".join(parts))
        return "\n".join(lines)


def even_bounds(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split ``num_layers`` into ``num_stages`` contiguous ranges differing by at most one."""
    base, extra = divmod(num_layers, num_stages)
    out, lo = [], 0
    for s in range(num_stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def sharing_stages(plan: ExecutionPlan, source: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with each pipeline whose stages equal a pipeline's of ``source`` holding
    that pipeline's very stage tuple (the same plan, shared objects).

    A decision renamed back from the planner's canonical form renames a pipeline whose
    stage tuple it knows without building its stages again: a dynamic plan that keeps
    most pipelines of the plan it replaces (thousands of stages on 2,048 workers) then
    costs a warm decision little more than the pipelines it changes.
    """
    known = {pipe.workers: pipe for pipe in source.pipelines}  # workers: a cheap key
    pipelines = []
    changed = False
    for pipe in plan.pipelines:
        old = known.get(pipe.workers)
        if (old is None or _pipeline_table(old) is _pipeline_table(pipe)
                or old.layout != pipe.layout):
            pipelines.append(pipe)  # new, or sharing the stages already
        else:  # the very pipeline, or its stages with this pipeline's micro-batches
            pipelines.append(old.with_microbatches(pipe.num_microbatches))
            changed = True
    return replace(plan, pipelines=tuple(pipelines)) if changed else plan


def workers_of(plans: Iterable[ExecutionPlan]) -> set[int]:
    """All live workers used by any of ``plans``."""
    out: set[int] = set()
    for plan in plans:
        out.update(plan.workers)
    return out
