"""Each stage's operation order, per schedule kind: ``1f1b``, ``gpipe``, ``interleaved``
(v chunks per worker, Narayanan et al. 2021) and ``zero-bubble`` (ZB-H1, Qi et al. 2024).

An operation is F (forward), B (backward) or W (weight gradient) of one micro-batch on one
model chunk of one (pipeline, stage). B is the fused backward (input gradient then weight
gradient) unless the schedule splits it, then B is the input gradient alone and W the
weight gradient. A stage runs its operations in the order :func:`stage_order` gives
(docs/design.md section 3.1); :mod:`chameleon_ft.perf.graph` turns the orders of every
stage into the dependency graph the list scheduler times.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from chameleon_ft.spec.job import Schedule as ScheduleName


class OpKind(StrEnum):
    """Operation kinds: forward; backward (fused input and weight gradient, or the input
    gradient alone when the schedule splits it); weight gradient."""

    F = "F"
    B = "B"
    W = "W"


_F, _B, _W = 0, 1, 2
_KINDS = (OpKind.F, OpKind.B, OpKind.W)


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of one micro-batch of one (pipeline, stage), on one model chunk."""

    kind: OpKind
    pipeline: int
    stage: int
    microbatch: int
    chunk: int = 0
    """The model chunk (0 .. virtual_stages - 1); always 0 outside ``interleaved``."""



SPLIT_SCHEDULES = frozenset({ScheduleName.ZERO_BUBBLE.value})
"""Schedules whose every stage splits the backward into B and W."""


def zero_bubble_lags(num_stages: int, stage: int) -> tuple[int, ...]:
    """How many micro-batches stage ``stage`` defers its W behind its B, per variant tried.

    ZB-H1 (Qi et al. 2024) delays W on stage ``s`` by ``s`` micro-batches, so every stage
    holds at most ``S`` micro-batches (stage 0's 1F1B peak) while the deferred W's fill the
    drain; lag 0 (W right after its B) is 1F1B with the input gradient sent upstream
    before the weight gradient runs, never slower than 1F1B. The estimator keeps the
    faster of the two.
    """
    return (stage, 0) if stage else (0,)


@functools.lru_cache(maxsize=8192)
def stage_order(num_stages: int, stage: int, num_microbatches: int,
                schedule: str = "1f1b", virtual_stages: int = 1,
                lag: int | None = None,
                padded: bool = False) -> tuple[tuple[OpKind, int, int], ...]:
    """The schedule's op order for one stage: ``(kind, chunk, micro-batch)`` triples.

    - ``1f1b``: ``S - s`` forwards, then one backward one forward, then the remaining
      backwards; at most ``S - s`` micro-batches in flight.
    - ``gpipe``: every forward, then every backward.
    - ``interleaved``: Megatron's depth-first interleaving: micro-batches in groups of
      ``N >= S`` (:func:`_groups`), each group through chunk 0, then chunk 1, ...;
      backwards in the reverse chunk order; ``2 (S - s - 1) + (v - 1) N + 1`` forwards
      before the first backward, then one backward one forward. ``padded``: groups of
      exactly ``S``, the order of the next multiple of ``S`` without the missing
      micro-batches (``1f1b``'s memory, more bubble). With ``v = 1`` it is ``1f1b``.
    - ``zero-bubble``: ``1f1b``'s F and B (B the input gradient alone), W of micro-batch
      ``j`` right after B of ``j + lag`` (default ``lag = s``, ZB-H1), the rest at the end.

    Args:
        num_stages: S, stages of the pipeline.
        stage: s, 0-based.
        num_microbatches: m, micro-batches of the pipeline.
        schedule: a :class:`~chameleon_ft.spec.job.Schedule` value.
        virtual_stages: v, chunks per stage (``interleaved`` only).
        lag: ``zero-bubble`` only: how far W trails its B (see :func:`zero_bubble_lags`).
        padded: ``interleaved`` only: groups of exactly ``S`` (see above).

    Raises:
        ValueError: for an unknown schedule, or chunks with a schedule other than
            ``interleaved``.
    """
    m, v = num_microbatches, virtual_stages
    if v > 1 and schedule != ScheduleName.INTERLEAVED:
        raise ValueError(f"virtual_stages: {v} chunks per stage need the interleaved "
                         f"schedule, got {schedule!r}")
    if schedule == ScheduleName.GPIPE:
        return _gpipe_order(m)
    if schedule == ScheduleName.INTERLEAVED and v > 1:
        return _interleaved_order(num_stages, stage, m, v, padded)
    if schedule not in (ScheduleName.ONE_F_ONE_B, ScheduleName.INTERLEAVED,
                        ScheduleName.ZERO_BUBBLE):
        raise ValueError(f"schedule: unknown schedule {schedule!r}")
    order = _one_f_one_b_order(num_stages, stage, m)
    if schedule != ScheduleName.ZERO_BUBBLE:
        return order
    return _zero_bubble_order(order, m, stage if lag is None else lag)


def _gpipe_order(m: int) -> tuple[tuple[OpKind, int, int], ...]:
    """``gpipe``: every forward, then every backward."""
    return tuple([(OpKind.F, 0, j) for j in range(m)] + [(OpKind.B, 0, j) for j in range(m)])


def _interleaved_order(num_stages: int, stage: int, m: int, v: int,
                       padded: bool) -> tuple[tuple[OpKind, int, int], ...]:
    """``interleaved`` with ``v > 1`` chunks: Megatron's depth-first order (:func:`_groups`),
    the missing micro-batches of a padded or short last group dropped."""
    groups = _groups(num_stages, max(m, -(-m // num_stages) * num_stages)
                     if padded else m)
    forwards = [(OpKind.F, r, j) for g in groups for r in range(v) for j in g]
    backwards = [(OpKind.B, r, j) for g in groups for r in reversed(range(v)) for j in g]
    warm = 2 * (num_stages - stage - 1) + (v - 1) * len(groups[0]) + 1
    full = _one_forward_one_backward(forwards, backwards, warm)
    return full if len(forwards) == m * v else tuple(op for op in full if op[2] < m)


def _one_f_one_b_order(num_stages: int, stage: int,
                       m: int) -> tuple[tuple[OpKind, int, int], ...]:
    """``1f1b`` (and one-chunk ``interleaved``): ``S - s`` forwards, then one backward one
    forward, then the remaining backwards."""
    forwards = [(OpKind.F, 0, j) for j in range(m)]
    backwards = [(OpKind.B, 0, j) for j in range(m)]
    return _one_forward_one_backward(forwards, backwards, num_stages - stage)


def _zero_bubble_order(order: tuple[tuple[OpKind, int, int], ...], m: int,
                       delay: int) -> tuple[tuple[OpKind, int, int], ...]:
    """``zero-bubble``: ``order`` (1F1B's, B the input gradient alone) with the W of
    micro-batch ``j`` right after the B of ``j + delay``, the rest at the end."""
    out: list[tuple[OpKind, int, int]] = []
    done = 0  # W's placed so far, in micro-batch order
    for kind, r, j in order:
        out.append((kind, r, j))
        if kind is OpKind.B and j - delay >= done:
            out.append((OpKind.W, 0, done))
            done += 1
    out.extend((OpKind.W, 0, k) for k in range(done, m))
    return tuple(out)


def _groups(num_stages: int, num_microbatches: int) -> list[range]:
    """The interleaved order's groups of micro-batches (each runs through chunk 0, then
    chunk 1, ...).

    ``m >= S``: ``m // S`` groups of at least ``S``, sizes as even as possible (Megatron's
    groups of ``S`` when ``m`` is a multiple of it; Llama 3's tunable group size
    otherwise): a chunk's round trip through the ``S`` stages never outlasts a group, so
    no stage waits between chunks, but a group of ``N > S`` keeps ``(v - 1)(N - S)`` more
    chunks in flight. ``m < S``: one group of ``S`` whose missing micro-batches the caller
    drops (removing operations from deadlock-free fixed orders cannot create a cycle).
    """
    if num_microbatches < num_stages:
        return [range(num_stages)]
    count = num_microbatches // num_stages
    base, extra = divmod(num_microbatches, count)
    out, lo = [], 0
    for i in range(count):
        hi = lo + base + (1 if i < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


def peak_activation(activation_bytes: Sequence[float], num_stages: int, stage: int,
                    num_microbatches: int, schedule: str = "1f1b",
                    padded: bool = False) -> float:
    """The most activation bytes one stage holds running its order alone, without building
    the order: the bytes of the first ``w`` forwards, then after each backward-forward pair
    of the steady state (fused backward; for ``zero-bubble`` the order with each W right
    after its B, which holds the same). ``activation_bytes`` has one entry per chunk.

    Args:
        activation_bytes: per model chunk, the bytes one micro-batch keeps.
        num_stages: S.
        stage: s.
        num_microbatches: m.
        schedule: a :class:`~chameleon_ft.spec.job.Schedule` value.
        padded: ``interleaved`` only: the padded variant (:func:`stage_order`).

    Returns:
        Bytes.
    """
    m, v = num_microbatches, len(activation_bytes)
    if schedule == ScheduleName.GPIPE:
        return m * activation_bytes[0]
    if schedule != ScheduleName.INTERLEAVED or v == 1:
        return min(num_stages - stage, m) * activation_bytes[0]
    if padded:
        groups = _groups(num_stages, -(-m // num_stages) * num_stages)
    else:
        groups = _groups(num_stages, m)
    forwards: list[float] = []
    backwards: list[float] = []
    for group in groups:
        real = sum(1 for j in group if j < m)  # missing micro-batches hold nothing
        for r in range(v):
            forwards.extend([activation_bytes[r]] * real + [0.0] * (len(group) - real))
        for r in reversed(range(v)):
            backwards.extend([activation_bytes[r]] * real + [0.0] * (len(group) - real))
    held = list(itertools.accumulate(forwards, initial=0.0))
    freed = list(itertools.accumulate(backwards, initial=0.0))
    warm = min(2 * (num_stages - stage - 1) + (v - 1) * len(groups[0]) + 1, len(forwards))
    steady = map(operator.sub, held[warm + 1:], freed[1:len(forwards) - warm + 1])
    return max(held[warm], max(steady, default=0.0))


def _one_forward_one_backward(forwards: list[tuple[OpKind, int, int]],
                              backwards: list[tuple[OpKind, int, int]],
                              warm: int) -> tuple[tuple[OpKind, int, int], ...]:
    """``warm`` forwards, then alternately one backward and one forward, then the rest."""
    warm = min(warm, len(forwards))
    order = forwards[:warm]
    nxt = warm
    for op in backwards:
        order.append(op)
        if nxt < len(forwards):
            order.append(forwards[nxt])
            nxt += 1
    return tuple(order)


@functools.lru_cache(maxsize=4096)
def stream_order(num_stages: int, stage: int, num_microbatches: int,
                 schedule: str = "1f1b") -> tuple[tuple[OpKind, int], ...]:
    """The op order of one stage of a one-chunk schedule: ``(kind, micro-batch)`` pairs
    (:func:`stage_order` without the chunk).

    1F1B keeps at most ``num_stages - stage`` micro-batches in flight on the stage.
    """
    return tuple((kind, j) for kind, _, j in
                 stage_order(num_stages, stage, num_microbatches, schedule))

