"""Stages and pipelines, and the tables they share.

A :class:`Pipeline` is one data-parallel replica: its stages (a worker and a contiguous
layer range each) and its micro-batch count. Plans of thousands of workers share their
pipeline objects and, through them, one table per pipeline (:func:`_pipeline_table`: its
stage workers, its row of shared layer-range objects, the layers it covers), one stage
object per (worker, layer range) (:func:`shared_stage`) and one ``(pipeline, stage)`` tuple
per position: a re-plan builds few new objects, and a walk over a plan's pipelines can
tell a layout it has seen by its row's identity.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

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
