"""Fail-slows drawn into a failure trace: workers that keep running, slower, for a while.

Published figures (docs/design.md section 6): Falcon's study of a production cluster of
over 10,000 GPUs (Wu et al., arXiv:2410.12588; USENIX ATC'25 as Greyhound) found fail-slows
from CPU, GPU and cross-node network causes lasting "from tens of seconds to nearly ten
hours", delaying the average job by 1.34x. So a fail-slow here lasts a time log-uniform
over ``[slow_min_s, slow_max_s]`` (30 s to 10 h by default), slows one worker by a factor
uniform over ``[slow_min_factor, slow_max_factor]``, and starts on each node at a rate of
one per ``slow_node_mtbf_hours`` (a Poisson stream over the fleet; the worker is drawn
uniformly on its node). No per-node rate or per-episode factor is published: the presets
set the rate so that their job, left slow, loses what Falcon's average job lost (section 6).

The fail-slows are a stream of their own (their own generator, seeded from the trace's
seed), merged with the failures: a trace with fail-slows meets exactly the failures of the
same seed without them (a paired comparison). A fail-slow that would start on a dead or an
already slow worker is dropped; one whose worker dies ends with it (no ``slow-end``: a
repaired worker comes back at full speed).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

import numpy as np

from chameleon_ft.failures import FAILURE_KINDS, EventKind, Trace, TraceEvent
from chameleon_ft.spec.scenario import FailureSpec

_FACTOR_DIGITS = 2
"""Factors are drawn to two decimals (a measured slowdown is no more precise)."""


def draw_fail_slows(failures: FailureSpec, *, num_nodes: int, workers_per_node: int,
                    duration_s: float, rng: np.random.Generator, first_node: int = 0
                    ) -> list[tuple[float, float, int, float]]:
    """Draw fail-slow episodes on ``num_nodes`` nodes (their ids from ``first_node``),
    ignoring failures.

    Args:
        failures: the fail-slow rate, durations and factors.
        num_nodes: nodes that may slow down.
        workers_per_node: workers per node.
        duration_s: no episode starts at or after it.
        rng: the stream's generator; per episode it draws, in order, the gap, the node,
            the worker on it, the duration and the factor.
        first_node: the id of the first of those nodes.

    Returns:
        ``(start_s, end_s, worker, factor)`` per episode, by start time (``end_s`` may lie
        past ``duration_s``); empty when ``slow_node_mtbf_hours`` is unset.
    """
    if failures.slow_node_mtbf_hours is None or num_nodes < 1:
        return []
    mean_gap_s = failures.slow_node_mtbf_hours * 3600.0 / num_nodes
    low, high = math.log(failures.slow_min_s), math.log(failures.slow_max_s)
    episodes: list[tuple[float, float, int, float]] = []
    now = 0.0
    while True:
        now += float(rng.exponential(mean_gap_s))
        if now >= duration_s:
            return episodes
        node = first_node + int(rng.integers(num_nodes))
        worker = node * workers_per_node + int(rng.integers(workers_per_node))
        length_s = math.exp(float(rng.uniform(low, high)))
        factor = round(float(rng.uniform(failures.slow_min_factor, failures.slow_max_factor)),
                       _FACTOR_DIGITS)
        episodes.append((now, now + length_s, worker, factor))


def _deaths(trace: Trace, workers_per_node: int) -> dict[int, list[tuple[float, bool]]]:
    """Per worker, the times its liveness changes in ``trace``: ``(time, alive after)``."""
    changes: dict[int, list[tuple[float, bool]]] = defaultdict(list)
    for event in trace.events:
        if event.kind in FAILURE_KINDS:
            for worker in event.workers(workers_per_node):
                changes[worker].append((event.time_s, False))
        elif event.kind == EventKind.REPAIR:
            for worker in event.workers(workers_per_node):
                changes[worker].append((event.time_s, True))
    return changes


def _alive_until(changes: list[tuple[float, bool]], at_s: float) -> tuple[bool, float]:
    """Whether a worker with these liveness ``changes`` is alive at ``at_s`` (a change at
    that very time counts as done), and when it next dies (infinity: never)."""
    times = [t for t, _ in changes]
    i = bisect.bisect_right(times, at_s)
    alive = changes[i - 1][1] if i else True
    death = next((t for t, up in changes[i:] if not up), math.inf)
    return alive, death


def with_fail_slows(trace: Trace, episodes: list[tuple[float, float, int, float]], *,
                    workers_per_node: int) -> Trace:
    """``trace`` with the ``slow`` and ``slow-end`` events of ``episodes`` merged in.

    Args:
        trace: a failure trace without fail-slows.
        episodes: ``(start_s, end_s, worker, factor)`` by start time (:func:`draw_fail_slows`).
        workers_per_node: workers per node.

    Returns:
        The merged trace (at equal times a failure or repair comes first); an episode on a
        dead or already slow worker is dropped, one whose worker dies first ends with it.
    """
    if not episodes:
        return trace
    changes = _deaths(trace, workers_per_node)
    slow_until: dict[int, float] = {}
    added: list[TraceEvent] = []
    for start_s, end_s, worker, factor in episodes:
        alive, death_s = _alive_until(changes.get(worker, []), start_s)
        if not alive or slow_until.get(worker, -math.inf) > start_s:
            continue
        added.append(TraceEvent(start_s, EventKind.SLOW, (worker,), factor))
        if end_s < min(death_s, trace.duration_s):
            added.append(TraceEvent(end_s, EventKind.SLOW_END, (worker,)))
        slow_until[worker] = min(end_s, death_s)
    merged = sorted([*trace.events, *added],
                    key=lambda e: (e.time_s, e.kind in (EventKind.SLOW, EventKind.SLOW_END)))
    return Trace(events=tuple(merged), duration_s=trace.duration_s)
