"""``ExecutionPlan``: who runs which layers of which pipeline, on how many micro-batches.

A plan is an immutable value consumed alike by the estimator, the simulator and the
runtime. Pipelines may differ in length (after a dynamic recovery), and a stage whose
worker died may be *rerouted*: its micro-batches run on live workers holding the same
layers in other pipelines.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from chameleon_ft.plan.checks import _SCHEDULE_CODES, validate_plan
from chameleon_ft.plan.pipeline import (
    _ROW_RANGES,
    _ROW_WORKERS,
    _TABLE_OF,
    Pipeline,
    Stage,
    _pipeline_table,
    _Table,
    pipeline_on,
    placeholder_pipeline,
    shared_stage,
)
from chameleon_ft.plan.tables import (
    _position_rows,
    _range_rows,
    fatal_nodes,
    holders_by_layer,
    indices_by_object,
    live_table,
)


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
        return live_table(self, self._tables(), "layers", _range_rows)

    @cached_property
    def stage_of_worker(self) -> dict[int, tuple[int, int]]:
        """``worker -> (pipeline, stage)`` for every live worker."""
        return self._live_positions_of(self._tables())

    def _live_positions_of(self, tables: list[_Table]) -> dict[int, tuple[int, int]]:
        """``worker -> (pipeline, stage)`` for every live stage of the pipelines' tables."""
        return live_table(self, tables, "positions", _position_rows)

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

    @cached_property
    def holders_by_layer(self) -> tuple[tuple[int, ...], ...]:
        """For each layer, the live workers holding it, sorted."""
        return holders_by_layer(self)

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
        found = fatal_nodes(self, workers_per_node)
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
        """Check the plan's invariants (:func:`~chameleon_ft.plan.checks.validate_plan`).

        Args:
            num_microbatches: when given, the micro-batches of all pipelines must sum to it
                (the global batch is kept through every recovery).

        Raises:
            ValueError: saying which pipeline, stage, worker or reroute is wrong.
        """
        validate_plan(self, num_microbatches)


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


__all__ = ["ExecutionPlan", "Pipeline", "Reroute", "Stage", "even_bounds", "indices_by_object",
           "pipeline_on", "placeholder_pipeline", "shared_stage", "sharing_stages",
           "workers_of"]
