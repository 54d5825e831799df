"""Schedules as data: the per-worker order of forward and backward operations of a plan.

One function, :func:`simulate`, turns a plan into a timed schedule by list scheduling
over the dependency graph of docs/design.md section 3.1. Every schedule uses the same
graph and the same scheduler; they differ only in each stage's operation order:

- an operation is F (forward), B (backward) or W (weight gradient) of one micro-batch on
  one model chunk of one (pipeline, stage). B is the fused backward (input gradient then
  weight gradient) unless the schedule splits it, then B is the input gradient alone and
  W the weight gradient, which nothing downstream waits for;
- F(p, s, r, j) after F(p, s-1, r, j), and the first stage's chunk r after the last
  stage's chunk r-1, plus the activation transfer between their workers; B(p, s, r, j)
  after F(p, s, r, j) and after the next chunk's B plus the gradient transfer; W after
  its B;
- each (pipeline, stage) is a *stream* of operations in the schedule's order
  (:func:`stage_order`): ``1f1b``, ``gpipe``, ``interleaved`` (v chunks per worker,
  Narayanan et al. 2021) and ``zero-bubble`` (ZB-H1, Qi et al. 2024). A stream runs its
  operations in order.

A worker normally runs one stream, so its order is exactly the schedule's and the step
time is the longest path of the graph (paper Eq. 11). A worker that also runs a rerouted
stage's micro-batches runs several streams; when it is free it starts one of the stream
heads that are ready, chosen by a priority rule, so the merge never deadlocks (list
scheduling of a DAG) and never idles while work is ready. When its backward is split
(``zero-bubble`` plans, or any plan with ``defer_weight_grad``), its W operations form
streams of their own that run only when no F or B is ready: weight gradients deferred
into the worker's bubbles, as ReCycle does on rerouted peers. :func:`best_timeline` tries
two rules and keeps the faster; serving rerouted work first keeps a rerouted step within
Eq. 13 computed with whole micro-batches. The resulting per-worker op lists are what the
runtime executes (``1f1b`` and ``gpipe`` only, fused backward, one chunk), so the runtime
runs exactly the schedule the estimator timed.

With the fused backward Eq. 9 holds exactly for uniform 1F1B stages, and interleaving v
chunks gives ``(m + (S - 1) / v) (t_f + t_b)`` for ``m >= S``
(:mod:`chameleon_ft.perf.closed_form`).

The parts, each a module: each stage's order per schedule kind (:mod:`.orders`), the
operation graph (:mod:`.graph`), the list scheduler with its Python reference run
(:mod:`.list_scheduler`; the compiled kernel behind :mod:`.kernel`), and the timed schedule
of a plan (:mod:`.timeline`). This module holds the runtime's contract (:class:`Schedule`)
and names the parts' public functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from chameleon_ft.perf.graph import (
    FUSED_VARIANT,
    ChunkCosts,
    build_graph,
    component_order,
    schedule_variants,
    splits_backward,
)
from chameleon_ft.perf.kernel import COMPILED
from chameleon_ft.perf.list_scheduler import PRIORITIES, Timeline
from chameleon_ft.perf.orders import (
    SPLIT_SCHEDULES,
    Op,
    OpKind,
    peak_activation,
    stage_order,
    stream_order,
    zero_bubble_lags,
)
from chameleon_ft.perf.sync import Bucket
from chameleon_ft.perf.timeline import DEFAULT_RULES, SECOND_RULE_MAX_OPS, best_timeline, simulate


@dataclass(frozen=True)
class Schedule:
    """What each worker executes in one step, in order: the runtime's contract."""

    ops: Mapping[int, tuple[Op, ...]]
    """Per live worker, its operations in execution order: F and fused B for ``1f1b`` and
    ``gpipe`` (what the runtime executes); chunks and W operations for the others."""
    sync_rounds: tuple[tuple[Bucket, ...], ...]
    """Gradient all-reduce rounds; the buckets of one round share no worker."""


__all__ = ["COMPILED", "DEFAULT_RULES", "FUSED_VARIANT", "PRIORITIES", "SECOND_RULE_MAX_OPS",
           "SPLIT_SCHEDULES", "Bucket", "ChunkCosts", "Op", "OpKind", "Schedule", "Timeline",
           "best_timeline", "build_graph", "component_order", "peak_activation",
           "schedule_variants", "simulate", "splits_backward", "stage_order", "stream_order",
           "zero_bubble_lags"]
