"""Closed forms of the paper (Eq. 9, 12/13, 14) and of the other schedules: fast paths and
test oracles.

They hold for ``num_stages`` uniform stages with per-stage, per-micro-batch forward time
``fwd_s`` and fused backward time ``bwd_s``, no communication, and ``num_microbatches``
micro-batches *per pipeline*. The graph estimator reproduces Eq. 9 and Eq. 14 exactly
under those conditions; for rerouted plans it assigns whole micro-batches and fills
bubbles, so it lies between the busiest worker's total work and Eq. 13 computed with
whole extra micro-batches. It also reproduces the interleaved schedule's step (Narayanan
et al. 2021) for at least S micro-batches, and ZB-H1's (Qi et al. 2024)
for ``m >= S`` and a weight gradient no longer than the forward or the input gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _positive_int(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")


def _check(counts: dict[str, int], times: dict[str, float]) -> None:
    """Every count a positive integer, every time a finite non-negative number."""
    for name, count in counts.items():
        _positive_int(name, count)
    for name, value in times.items():
        _non_negative(name, value)


def step_1f1b(num_stages: int, num_microbatches: int, fwd_s: float, bwd_s: float) -> float:
    """Failure-free 1F1B step time, paper Eq. 9: ``(S + m - 1) (t_f + t_b)``.

    Args:
        num_stages: S, stages per pipeline.
        num_microbatches: m, micro-batches per pipeline.
        fwd_s: t_f, forward seconds of one stage for one micro-batch.
        bwd_s: t_b, backward seconds of one stage for one micro-batch.

    Returns:
        Seconds per step.

    Raises:
        ValueError: for non-positive counts or negative times.
    """
    _check({"num_stages": num_stages, "num_microbatches": num_microbatches},
           {"fwd_s": fwd_s, "bwd_s": bwd_s})
    return (num_stages + num_microbatches - 1) * (fwd_s + bwd_s)


def step_interleaved(num_stages: int, num_microbatches: int, virtual_stages: int,
                     fwd_s: float, bwd_s: float) -> float:
    """Interleaved 1F1B step time: ``(m + (S - 1) / v) (t_f + t_b)``.

    The bubble is ``(S - 1) / (v m)`` of the ideal step ``m (t_f + t_b)`` (Narayanan et al.
    2021, section 2.2.2; the Llama 3 report's ``(PP - 1) / (V M)``). Exact for the
    estimator's order when ``m >= S`` (groups of at least ``S`` micro-batches).

    Args:
        num_stages: S.
        num_microbatches: m, micro-batches per pipeline.
        virtual_stages: v, model chunks per stage.
        fwd_s: t_f, forward seconds of one stage (all its chunks) for one micro-batch.
        bwd_s: t_b, backward seconds of one stage for one micro-batch.

    Returns:
        Seconds per step.

    Raises:
        ValueError: for non-positive counts or negative times.
    """
    _check({"num_stages": num_stages, "num_microbatches": num_microbatches,
            "virtual_stages": virtual_stages}, {"fwd_s": fwd_s, "bwd_s": bwd_s})
    return (num_microbatches + (num_stages - 1) / virtual_stages) * (fwd_s + bwd_s)


def step_zero_bubble(num_stages: int, num_microbatches: int, fwd_s: float,
                     bwd_input_s: float, bwd_weight_s: float) -> float:
    """ZB-H1 step time: ``m (t_f + t_b + t_w) + (S - 1)(t_f + t_b - t_w)``.

    Qi et al. (2024), section 2.1: deferring W shrinks 1F1B's bubble from
    ``(S - 1)(t_f + t_b + t_w)`` to ``(S - 1)(t_f + t_b - t_w)``. Exact for the estimator's
    order when ``m >= S`` and ``t_w <= min(t_f, t_b)``.

    Args:
        num_stages: S.
        num_microbatches: m.
        fwd_s: t_f.
        bwd_input_s: t_b, the input-gradient part of the backward.
        bwd_weight_s: t_w, the weight-gradient part.

    Returns:
        Seconds per step.

    Raises:
        ValueError: for non-positive counts or negative times.
    """
    _check({"num_stages": num_stages, "num_microbatches": num_microbatches},
           {"fwd_s": fwd_s, "bwd_input_s": bwd_input_s, "bwd_weight_s": bwd_weight_s})
    return (num_microbatches * (fwd_s + bwd_input_s + bwd_weight_s)
            + (num_stages - 1) * (fwd_s + bwd_input_s - bwd_weight_s))


def in_flight(schedule: str, num_stages: int, stage_index: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage ``stage_index`` holds at its peak, in units
    of the whole stage's activations of one micro-batch (the memory model of templates).

    ``1f1b``: ``S - i`` (Eq. 14). ``gpipe``: ``S`` (a conservative cap: it holds every
    micro-batch). ``zero-bubble``: ``S`` on every stage (ZB-H1 defers W on stage i by i
    micro-batches; the W keeps its activations). ``interleaved``: the chunks started
    before the first backward, ``2 (S - i - 1) + (v - 1) S + 1``, over ``v`` (groups of
    ``S`` micro-batches; larger groups hold ``(v - 1) / v`` more per extra micro-batch).
    All assume at least that many micro-batches; the estimator measures the exact peak.

    Raises:
        ValueError: for a bad index or an unknown schedule.
    """
    _positive_int("num_stages", num_stages)
    _positive_int("virtual_stages", virtual_stages)
    if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not (
            0 <= stage_index < num_stages):
        raise ValueError(f"stage_index: must be in 0..{num_stages - 1}, got {stage_index!r}")
    if schedule == "1f1b" or (schedule == "interleaved" and virtual_stages == 1):
        return float(num_stages - stage_index)
    if schedule in ("gpipe", "zero-bubble"):
        return float(num_stages)
    if schedule == "interleaved":
        v = virtual_stages
        return (2 * (num_stages - stage_index - 1) + (v - 1) * num_stages + 1) / v
    raise ValueError(f"schedule: unknown schedule {schedule!r}")


def step_rerouted(num_stages: int, num_microbatches: int, num_pipelines: int,
                  failed_per_stage: Sequence[int], fwd_s: float, bwd_s: float) -> float:
    """Rerouted 1F1B step time, paper Eq. 12/13.

    ``(S + m - 1 + sum_i m F_i / (D - F_i)) (t_f + t_b)``: the dead replicas'
    micro-batches of stage i are spread evenly (fractionally) over its ``D - F_i`` live
    replicas.

    Args:
        num_stages: S.
        num_microbatches: m, micro-batches per pipeline.
        num_pipelines: D, pipelines of the layout.
        failed_per_stage: F_i, dead replicas of each stage (length S).
        fwd_s: t_f.
        bwd_s: t_b.

    Returns:
        Seconds per step, or ``math.inf`` when some stage has no live replica
        (``F_i >= D``): rerouting is infeasible.

    Raises:
        ValueError: for malformed arguments.
    """
    _check({"num_stages": num_stages, "num_microbatches": num_microbatches,
            "num_pipelines": num_pipelines}, {"fwd_s": fwd_s, "bwd_s": bwd_s})
    if len(failed_per_stage) != num_stages:
        raise ValueError(f"failed_per_stage: needs one count per stage ({num_stages}), got "
                         f"{len(failed_per_stage)}")
    extra = 0.0
    for i, f in enumerate(failed_per_stage):
        _positive_int(f"failed_per_stage[{i}]", f, minimum=0)
        if f >= num_pipelines:
            return math.inf
        extra += num_microbatches * f / (num_pipelines - f)
    return (num_stages + num_microbatches - 1 + extra) * (fwd_s + bwd_s)


def stage_memory(stage_index: int, num_stages: int, num_layers: int, param_bytes: float,
                 optimizer_bytes: float, activation_bytes: float) -> float:
    """Peak memory of a stage, paper Eq. 14: ``L_i (2 m_p + m_o) + (S - i) L_i m_a``.

    Gradients take as many bytes as parameters; under 1F1B stage i (0-based) keeps
    ``S - i`` micro-batches in flight (not capped by the micro-batch count, as in the paper).

    Args:
        stage_index: i, 0-based.
        num_stages: S.
        num_layers: L_i, layers on the stage.
        param_bytes: m_p, parameter bytes per layer.
        optimizer_bytes: m_o, optimizer-state bytes per layer.
        activation_bytes: m_a, activation bytes per layer per in-flight micro-batch.

    Returns:
        Bytes.

    Raises:
        ValueError: for an index outside ``0..S-1`` or negative sizes.
    """
    _positive_int("num_stages", num_stages)
    if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not (
            0 <= stage_index < num_stages):
        raise ValueError(f"stage_index: must be in 0..{num_stages - 1}, got {stage_index!r}")
    _positive_int("num_layers", num_layers, minimum=0)
    for name, value in (("param_bytes", param_bytes), ("optimizer_bytes", optimizer_bytes),
                        ("activation_bytes", activation_bytes)):
        _non_negative(name, value)
    return num_layers * (2 * param_bytes + optimizer_bytes) + (
        num_stages - stage_index) * num_layers * activation_bytes
