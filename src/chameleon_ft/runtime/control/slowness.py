"""Fail-slow detection, pure: the workers' own op timings in, slow workers declared and
cleared out (docs/design.md 4.3, "Slow workers").

Each committed step every worker of the plan reports the compute seconds of its forward
and backward operations (measured on the device, without waits on peers). A worker's
*ratio* is that time over what the plan's estimate gives it (its share of micro-batches,
reroutes and layers, at unit speed), and its step's *log factor* is the log of its ratio
over a reference: the median ratio of its same-stage peers (workers holding the same
layers in other pipelines), else of every other worker of the plan. The reference cancels
what the estimate gets wrong alike for a stage's workers, and a loaded host that slows
every worker.

A host shared with other work adds noise with heavy tails: most steps measure within a
percent of the peers, a few are off by tens of percent, sometimes two or three in a row
(measured on a 2-core host under a load of 15: a median over three steps still reached
1.45x). So a worker is declared slow only when the *median* of its log factors over a
window stays above a bar, with longer windows for lower bars (:class:`SlowRule`: 3x is
seen in 3 slow steps, 1.2x after 11): a burst of outliers shorter than half a window
never declares one. A window also spans at least ``min_span_s`` of time: the operating
system starves a process of a loaded host for tens to hundreds of milliseconds at a time,
ten steps of a job whose steps take 20 ms (a tiny model on the CPU read 2.3x over ten
steps that way), so a short step's window holds as many more steps. The bar of each
window is also at least ``noise_z`` robust standard deviations of that window's median (a
MAD of every worker's recent factors around its own median, which a steady offset cannot
inflate), so a host whose noise is wide everywhere declares nothing it cannot tell from
it (six: four let a tiny CPU model's noise through once in 1,800 recorded steps). A
declared worker is cleared once the median of its last ``clear_steps`` factors (over the
same span) falls to ``clear_factor``: a gap between the bars (hysteresis) keeps a worker
near the bar from flapping.

A slow worker out of the plan (evicted, swapped out) computes nothing the steps measure:
while it is idle it times a probe (one forward and backward of one layer) against its
own probe at start, and reports the factor; the same clearing rule reads those.

Every number read from a report is bounded first (finite, not negative, lists of at most
``MAX_OPS`` operations): a worker's report is sealed, but a defect must not steer this.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from chameleon_ft.plan import ExecutionPlan

MAX_OPS = 1 << 16
"""Operations one worker's step report may list (a step of the largest plans has fewer)."""
MAX_FACTOR = 100.0
"""A step's factor is clipped to [1 / this, this] (one wild reading weighs as any outlier)."""
MAD_TO_SIGMA = 1.4826
"""A normal distribution's standard deviation per median absolute deviation."""
MEDIAN_EFFICIENCY = 1.2533
"""A median of n normal readings spreads this many times more than their mean
(sqrt(pi / 2)), for large n."""


@dataclass(frozen=True)
class SlowRule:
    """When a worker is declared slow and when it is fast again."""

    windows: tuple[tuple[int, float], ...] = ((5, 2.0), (10, 1.4), (20, 1.2))
    """``(steps, factor)``: declared when the median factor of its last ``steps`` steps is
    at least ``factor`` (the shortest window that holds decides first)."""
    clear_steps: int = 5
    """Steps (or probes, out of the plan) whose median factor clears a slow worker."""
    clear_factor: float = 1.1
    """That median must be at most this."""
    noise_z: float = 6.0
    """A window's bar is at least this many robust standard deviations of its median."""
    min_span_s: float = 1.5
    """A window (and the clearing one) spans at least this long, from its first reading
    to its last: more steps than it names when steps are short."""
    max_history: int = 256
    """Readings kept per worker at most (a window of short steps is cut there)."""

    def __post_init__(self) -> None:
        if not self.windows or any(n < 1 or f <= 1.0 for n, f in self.windows):
            raise ValueError("windows: each needs steps >= 1 and a factor > 1")
        if self.clear_steps < 1 or not 1.0 <= self.clear_factor < min(f for _, f in
                                                                       self.windows):
            raise ValueError("clear_factor: must be >= 1 and below every window's factor")
        if not (self.min_span_s >= 0 and self.max_history >= self.history_steps):
            raise ValueError("max_history: must hold the longest window; min_span_s >= 0")

    @property
    def history_steps(self) -> int:
        """The most readings a window names: the longest window, or the clearing one."""
        return max(max(n for n, _ in self.windows), self.clear_steps)


class Phase(StrEnum):
    """Where a slow worker's answer stands."""

    ASK = "ask"
    """Declared: the policy is to be asked (again, when an answer could not be taken)."""
    HELD = "held"
    """Answered: the plan the policy chose runs, or is pending."""
    END = "end"
    """Fast again: the policy is to be asked how to plan without the slowdown."""


@dataclass(frozen=True)
class Mark:
    """A worker declared slow."""

    factor: float
    """The measured factor when declared (the window's median)."""
    step: int
    """The step whose report declared it."""
    declared_s: float
    phase: Phase = Phase.ASK


@dataclass(frozen=True)
class Declared:
    """A worker is slow now."""

    worker: int
    factor: float
    window: int
    """The window (steps) that declared it."""


@dataclass(frozen=True)
class Cleared:
    """A slow worker runs at full speed again."""

    worker: int
    factor: float
    """The factor it was declared with."""
    measured: float
    """The median factor of the readings that cleared it."""


Change = Declared | Cleared

Reading = tuple[float, float]
"""``(time_s, log factor)``: one step's (or probe's) reading of one worker."""


@dataclass(frozen=True)
class SlowWatch:
    """What detection remembers: each worker's recent log factors, the slow workers, and
    the probes of slow workers out of the plan."""

    history: Mapping[int, tuple[Reading, ...]] = field(default_factory=dict)
    """Per worker of the plan, its newest readings (oldest first)."""
    marks: Mapping[int, Mark] = field(default_factory=dict)
    probes: Mapping[int, tuple[Reading, ...]] = field(default_factory=dict)
    """Per slow worker out of the plan, its newest probe readings."""
    probe_seq: Mapping[int, int] = field(default_factory=dict)
    """Per slow worker out of the plan, the last probe read."""

    def slow(self) -> dict[int, float]:
        """Every worker still slow (not cleared) and its factor."""
        return {w: k.factor for w, k in sorted(self.marks.items()) if k.phase is not Phase.END}


def compute_seconds(timing: Mapping[str, Any]) -> float | None:
    """A worker's compute seconds in one step, from its report (``f_s`` and ``b_s``: each
    operation's seconds); None when the report is missing them or out of bounds."""
    total = 0.0
    for name in ("f_s", "b_s"):
        values = timing.get(name)
        if not isinstance(values, list) or len(values) > MAX_OPS:
            return None
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not math.isfinite(v) or v < 0:
                return None
            total += float(v)
    return total if math.isfinite(total) else None


def plan_compute(plan: ExecutionPlan, costs: tuple[float, ...] | None) -> dict[int, float]:
    """Each live worker's estimated compute in one step of ``plan``: per micro-batch it
    runs (its stage's, and its shares of rerouted stages'), the forward and backward of
    its stage's layers (``costs``: per layer, seconds; None: one per layer)."""
    def cost(first: int, end: int) -> float:
        if costs is None or len(costs) < end:
            return float(end - first)
        return math.fsum(costs[first:end])

    rerouted = {(r.pipeline, r.stage) for r in plan.reroutes}
    out: dict[int, float] = {}
    for p, s, stage in plan.iter_stages():
        if (p, s) in rerouted:
            continue
        out[stage.worker] = out.get(stage.worker, 0.0) + \
            plan.pipelines[p].num_microbatches * cost(stage.first_layer, stage.end_layer)
    for r in plan.reroutes:
        stage = plan.pipelines[r.pipeline].stages[r.stage]
        for peer, n in r.shares:
            out[peer] = out.get(peer, 0.0) + n * cost(stage.first_layer, stage.end_layer)
    return out


def plan_peers(plan: ExecutionPlan) -> dict[int, tuple[int, ...]]:
    """Each live worker's same-stage peers: the other live workers holding its layers."""
    by_range: dict[tuple[int, int], list[int]] = {}
    for w, layers in plan.layers_by_worker.items():
        by_range.setdefault((layers.start, layers.stop), []).append(w)
    return {w: tuple(v for v in by_range[(layers.start, layers.stop)] if v != w)
            for w, layers in plan.layers_by_worker.items()}


def _ratios(measured: Mapping[int, float], expected: Mapping[int, float]) -> dict[int, float]:
    """Measured over expected compute, for each worker with both, positive and finite."""
    out = {}
    for w, t in measured.items():
        e = expected.get(w)
        if e is None or not (math.isfinite(t) and math.isfinite(e)) or t <= 0 or e <= 0:
            continue
        out[w] = t / e
    return out


def step_factors(measured: Mapping[int, float], expected: Mapping[int, float],
                 peers: Mapping[int, Iterable[int]]) -> dict[int, float]:
    """Each worker's log factor in one step (module docstring): its ratio over the median
    ratio of its same-stage peers that reported, else of every other worker; none for a
    worker alone."""
    ratio = _ratios(measured, expected)
    limit = math.log(MAX_FACTOR)
    out = {}
    for w, r in ratio.items():
        ref = [ratio[v] for v in peers.get(w, ()) if v in ratio and v != w] or \
            [x for v, x in ratio.items() if v != w]
        if ref:
            out[w] = max(-limit, min(limit, math.log(r / statistics.median(ref))))
    return out


def noise_sigma(history: Mapping[int, tuple[Reading, ...]]) -> float:
    """The robust standard deviation of one step's log factor over time: the median of
    every recent reading's distance to its own worker's median, pooled over the workers
    (a MAD). A worker slow all along, and the peer whose reference it is, stay at their
    own median and add nothing; a pooled MAD around one centre would count their offset as
    noise, half the readings of a plan of two pipelines."""
    pooled = [abs(x - centre) for readings in history.values() if len(readings) >= 2
              for values in ([f for _, f in readings],)
              for centre in (statistics.median(values),) for x in values]
    if len(pooled) < 3:
        return 0.0
    return MAD_TO_SIGMA * statistics.median(pooled)


def _span_start(readings: tuple[Reading, ...], span_s: float) -> int | None:
    """The index of the newest reading at least ``span_s`` older than the last (None:
    none is)."""
    after = bisect.bisect_right(readings, readings[-1][0] - span_s, key=lambda r: r[0])
    return after - 1 if after else None


def window(readings: tuple[Reading, ...], n: int, rule: SlowRule) -> list[float] | None:
    """The log factors of the newest window of at least ``n`` readings that spans
    ``rule.min_span_s``, or all of them once ``rule.max_history`` are kept (None: the
    readings do not reach that far yet)."""
    if len(readings) < n:
        return None
    start = _span_start(readings, rule.min_span_s)
    if start is None and len(readings) < rule.max_history:
        return None
    first = min(len(readings) - n, 0 if start is None else start)
    return [f for _, f in readings[first:]]


def _declares(readings: tuple[Reading, ...], rule: SlowRule,
              sigma: Callable[[], float]) -> Declared | None:
    """The window that declares a worker with these readings (newest last), if any
    (``sigma``: the noise, computed only for a window above its factor's bar)."""
    medians: dict[int, float] = {}  # short steps stretch every window alike: one median
    for n, factor in sorted(rule.windows):
        values = window(readings, n, rule)
        if values is None:
            continue
        median = medians.get(len(values))
        if median is None:
            median = medians[len(values)] = statistics.median(values)
        if median >= math.log(factor) and median >= \
                rule.noise_z * sigma() * MEDIAN_EFFICIENCY / math.sqrt(len(values)):
            return Declared(-1, math.exp(median), len(values))
    return None


def _clears(readings: tuple[Reading, ...], rule: SlowRule) -> float | None:
    """The median factor that clears a slow worker with these readings, if it does."""
    values = window(readings, rule.clear_steps, rule)
    if values is None:
        return None
    median = statistics.median(values)
    return math.exp(median) if median <= math.log(rule.clear_factor) else None


def observe_step(watch: SlowWatch, rule: SlowRule, *, step: int, now_s: float,
                 measured: Mapping[int, float], expected: Mapping[int, float],
                 peers: Mapping[int, Iterable[int]]) -> tuple[SlowWatch, list[Change]]:
    """One committed step's timings of the plan's workers.

    Args:
        watch: what detection remembers.
        rule: the bars.
        step: the step.
        now_s: when it was read.
        measured: worker -> its compute seconds in the step (bounded: see
            :func:`compute_seconds`).
        expected: worker -> the plan's estimate of them (only the plan's workers).
        peers: worker -> its same-stage peers in the plan.

    Returns:
        The new value, and the workers declared and cleared (in worker order).
    """
    factors = step_factors(measured, expected, peers)
    history = {w: _kept((*watch.history.get(w, ()), (now_s, f)), rule)
               for w, f in factors.items()}
    history |= {w: v for w, v in watch.history.items() if w in expected and w not in history}
    sigma = functools.cache(lambda: noise_sigma(history))  # rarely needed: computed once
    marks = dict(watch.marks)
    changes: list[Change] = []
    for w in sorted(factors):
        mark = marks.get(w)
        if mark is None or mark.phase is Phase.END:
            found = _declares(history[w], rule, sigma)
            if found is not None:
                marks[w] = Mark(found.factor, step, now_s)
                changes.append(replace(found, worker=w))
                history[w] = ()  # the readings since it was declared clear it
            continue
        back = _clears(history[w], rule)
        if back is not None:
            marks[w] = replace(mark, phase=Phase.END)
            changes.append(Cleared(w, mark.factor, back))
            history[w] = ()  # the slow readings must not declare it again
    return replace(watch, history=history, marks=marks), changes


def _kept(readings: tuple[Reading, ...], rule: SlowRule) -> tuple[Reading, ...]:
    """The readings a window may still need: the newest ``history_steps``, and those
    back to the first at least ``min_span_s`` before the newest; ``max_history`` at most."""
    start = _span_start(readings, rule.min_span_s)
    first = min(len(readings) - rule.history_steps, 0 if start is None else start)
    return readings[max(first, len(readings) - rule.max_history, 0):]


def observe_probe(watch: SlowWatch, rule: SlowRule, worker: int, seq: int,
                  factor: float, now_s: float) -> tuple[SlowWatch, list[Change]]:
    """A probe of a slow worker out of the plan, read at ``now_s``: ``factor`` is its
    probe's time over its own at start (bounded here: only a new, finite, positive
    reading counts)."""
    mark = watch.marks.get(worker)
    if mark is None or mark.phase is Phase.END or seq <= watch.probe_seq.get(worker, -1) \
            or isinstance(factor, bool) or not isinstance(factor, (int, float)) \
            or not math.isfinite(factor) or factor <= 0:
        return watch, []
    limit = math.log(MAX_FACTOR)
    value = max(-limit, min(limit, math.log(factor)))
    values = _kept((*watch.probes.get(worker, ()), (now_s, value)), rule)
    watch = replace(watch, probes={**watch.probes, worker: values},
                    probe_seq={**watch.probe_seq, worker: seq})
    back = _clears(values, rule)
    if back is None:
        return watch, []
    marks = {**watch.marks, worker: replace(mark, phase=Phase.END)}
    return replace(watch, marks=marks), [Cleared(worker, mark.factor, back)]


def answered(watch: SlowWatch, worker: int) -> SlowWatch:
    """The policy's answer about ``worker`` was taken: a slow one is held, one fast again
    is forgotten (with its probes)."""
    mark = watch.marks.get(worker)
    if mark is None:
        return watch
    if mark.phase is Phase.END:
        return forget(watch, (worker,))
    return replace(watch, marks={**watch.marks, worker: replace(mark, phase=Phase.HELD)})


def ask_again(watch: SlowWatch, workers: Iterable[int]) -> SlowWatch:
    """Held slow workers among ``workers`` are asked about again (their plan changed
    under them: a failure's recovery)."""
    chosen = frozenset(workers)
    marks = {w: replace(k, phase=Phase.ASK) if w in chosen and k.phase is Phase.HELD else k
             for w, k in watch.marks.items()}
    return replace(watch, marks=marks)


def forget(watch: SlowWatch, workers: Iterable[int]) -> SlowWatch:
    """Drop what is remembered of ``workers`` (dead, or fast again and answered)."""
    gone = frozenset(workers)
    if not gone & (watch.history.keys() | watch.marks.keys() | watch.probes.keys()):
        return watch
    return SlowWatch(history={w: v for w, v in watch.history.items() if w not in gone},
                     marks={w: k for w, k in watch.marks.items() if w not in gone},
                     probes={w: v for w, v in watch.probes.items() if w not in gone},
                     probe_seq={w: v for w, v in watch.probe_seq.items() if w not in gone})


def out_of(watch: SlowWatch, plan_workers: Iterable[int]) -> frozenset[int]:
    """Slow workers (not cleared) outside the plan: they probe, and no decision uses them
    until they are fast again."""
    inside = frozenset(plan_workers)
    return frozenset(w for w, k in watch.marks.items()
                     if k.phase is not Phase.END and w not in inside)


def next_question(watch: SlowWatch) -> tuple[int, Mark] | None:
    """The slow worker whose answer is due first (declared or cleared earliest)."""
    due = [(k.step, w, k) for w, k in watch.marks.items() if k.phase is not Phase.HELD]
    if not due:
        return None
    _, w, k = min(due)
    return w, k
