"""Fail-slows in the trace format and the generator: the ``factor`` column, validation, old
traces still read, a seeded stream at the configured (published) rates beside unchanged
failures."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import numpy as np
import pytest

from chameleon_ft.failures import (
    EventKind,
    Trace,
    TraceEvent,
    trace_from_csv,
    trace_to_csv,
    validate_trace,
)
from chameleon_ft.sim.traces import generate_trace
from chameleon_ft.spec.recovery import FALCON_SLOW_MAX_S, FALCON_SLOW_MEAN_S, FALCON_SLOW_MIN_S
from chameleon_ft.spec.scenario import FailureSpec

DAY_S = 86400.0
SLOW = EventKind.SLOW
END = EventKind.SLOW_END


def test_old_three_column_traces_read_and_write_unchanged() -> None:
    text = "time_s,event,target\n5.0,worker-fail,3\n9.0,repair,0\n100.0,end,\n"
    trace = trace_from_csv(text, num_nodes=2, workers_per_node=4)
    assert trace_to_csv(trace) == text
    assert not trace.has_slow


def test_slow_rows_round_trip_with_a_factor_column() -> None:
    trace = Trace(events=(TraceEvent(10.0, SLOW, (2,), 2.5), TraceEvent(20.0, EventKind.NODE_FAIL, (1,)),
                          TraceEvent(30.0, SLOW, (2,), 1.3), TraceEvent(40.0, END, (2,))),
                  duration_s=100.0)
    text = trace_to_csv(trace)
    assert text.splitlines()[0] == "time_s,event,target,factor"
    assert text.splitlines()[1] == "10.0,slow,2,2.5"
    assert text.splitlines()[-1] == "100.0,end,,"
    assert trace_from_csv(text, num_nodes=2, workers_per_node=4) == trace
    assert trace.num_failures == 1  # fail-slows are not failures


@pytest.mark.parametrize(("rows", "message"), [
    ("5.0,slow,3,\n", "trace row 1: a slow event needs its factor"),
    ("5.0,slow,3,0.5\n", "factor must be a number > 1"),
    ("5.0,slow,3,abc\n", "trace row 1: factor 'abc' is not a number"),
    ("5.0,worker-fail,3,2\n", "trace row 1: factor '2' is given for a worker-fail event"),
    ("5.0,slow-end,3,\n", "worker 3 is not slow"),
    ("5.0,slow,3 4,2\n", "names exactly one worker"),
    ("5.0,slow,99,2\n", "worker 99 is outside the cluster"),
    ("5.0,worker-fail,3,\n6.0,slow,3,2\n", "trace row 2 (slow at 6.0 s): worker 3 is dead"),
    ("5.0,slow,3,2\n6.0,node-fail,0,\n7.0,slow-end,3,\n", "trace row 3 (slow-end at 7.0 s): "
                                                          "worker 3 is dead"),
])
def test_bad_slow_rows_are_refused_with_one_line_naming_the_row(rows: str,
                                                                message: str) -> None:
    text = "time_s,event,target,factor\n" + rows + "100.0,end,,\n"
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        trace_from_csv(text, num_nodes=2, workers_per_node=4)


def test_a_factor_column_in_a_three_column_file_is_refused() -> None:
    with pytest.raises(ValueError, match="trace row 1: expected 3 columns time_s,event,target"):
        trace_from_csv("time_s,event,target\n5.0,slow,3,2\n10.0,end,\n", num_nodes=1,
                       workers_per_node=4)


def test_a_repaired_worker_is_no_longer_slow_and_a_slow_one_may_slow_again() -> None:
    trace = Trace(events=(TraceEvent(1.0, SLOW, (0,), 2.0), TraceEvent(2.0, SLOW, (0,), 3.0),
                          TraceEvent(3.0, EventKind.WORKER_FAIL, (0,)),
                          TraceEvent(4.0, EventKind.REPAIR, (0,)),
                          TraceEvent(5.0, SLOW, (0,), 1.5), TraceEvent(6.0, END, (0,))),
                  duration_s=10.0)
    validate_trace(trace, num_nodes=1, workers_per_node=2)
    with pytest.raises(ValueError, match=r"trace row 5 .*only a slow event has a factor"):
        validate_trace(Trace(events=(*trace.events[:4], TraceEvent(5.0, END, (0,), 2.0)),
                             duration_s=10.0), num_nodes=1, workers_per_node=2)


SLOWS = FailureSpec(node_mtbf_hours=500.0, repair="uniform", slow_node_mtbf_hours=200.0)


def _gen(failures: FailureSpec, seed: int, days: float = 60.0, nodes: int = 64,
         spares: int = 0) -> Trace:
    return generate_trace(failures, num_nodes=nodes, workers_per_node=2,
                          duration_s=days * DAY_S, seed=seed, spare_nodes=spares)


def test_fail_slows_leave_the_seed_s_failures_unchanged() -> None:
    for seed in range(3):
        with_slows = _gen(SLOWS, seed, spares=2)
        without = _gen(replace(SLOWS, slow_node_mtbf_hours=None), seed, spares=2)
        assert with_slows.has_slow and not without.has_slow
        assert tuple(e for e in with_slows.events
                     if e.kind not in (SLOW, END)) == without.events
        assert with_slows == _gen(SLOWS, seed, spares=2)  # seeded
        assert with_slows != _gen(SLOWS, seed + 10, spares=2)


def _episodes(trace: Trace, per_node: int = 2) -> list[tuple[float, float | None, int, float]]:
    """(start, end or None, worker, factor) of every fail-slow; ``None``: cut by a failure
    or the trace's end."""
    open_: dict[int, tuple[float, float]] = {}
    out: list[tuple[float, float | None, int, float]] = []
    for event in trace.events:
        if event.kind == SLOW:
            assert event.target[0] not in open_
            assert event.factor is not None
            open_[event.target[0]] = (event.time_s, event.factor)
        elif event.kind == END:
            start, factor = open_.pop(event.target[0])
            out.append((start, event.time_s, event.target[0], factor))
        elif event.kind != EventKind.REPAIR and event.kind != EventKind.SOFTWARE:
            for worker in event.workers(per_node):
                if worker in open_:
                    start, factor = open_.pop(worker)
                    out.append((start, None, worker, factor))
    out += [(start, None, w, factor) for w, (start, factor) in open_.items()]
    return out


def test_generator_draws_the_configured_rates_durations_and_factors() -> None:
    failures = replace(SLOWS, node_mtbf_hours=1e9)  # (almost) no failure cuts a slowdown
    days, nodes = 200.0, 64
    episodes = [e for seed in range(4) for e in _episodes(_gen(failures, seed, days, nodes))]
    assert failures.slow_node_mtbf_hours is not None
    expected = 4 * days * 24 * nodes / failures.slow_node_mtbf_hours
    # drawn onsets on an already slow worker are dropped: a few percent at this rate
    assert 0.85 * expected < len(episodes) < 1.05 * expected
    lengths = [end - start for start, end, _, _ in episodes if end is not None]
    assert min(lengths) >= FALCON_SLOW_MIN_S * (1 - 1e-9)
    assert max(lengths) <= FALCON_SLOW_MAX_S * (1 + 1e-9)
    # log-uniform over Falcon's range: its mean and its median (the geometric mean)
    assert statistics.fmean(lengths) == pytest.approx(FALCON_SLOW_MEAN_S, rel=0.1)
    assert statistics.median(lengths) == pytest.approx(
        math.sqrt(FALCON_SLOW_MIN_S * FALCON_SLOW_MAX_S), rel=0.15)
    factors = [f for *_, f in episodes]
    assert min(factors) >= 1.3 and max(factors) <= 3.0
    assert statistics.fmean(factors) == pytest.approx(2.15, abs=0.05)


def test_a_slowdown_ends_with_its_worker_and_never_starts_on_a_dead_one() -> None:
    failures = FailureSpec(node_mtbf_hours=50.0, repair="fixed", repair_hours=24.0,
                           slow_node_mtbf_hours=20.0)
    trace = _gen(failures, 1, days=30.0, nodes=8)
    validate_trace(trace, num_nodes=8, workers_per_node=2)  # no slow row on a dead worker
    cut = [e for e in _episodes(trace) if e[1] is None]
    assert cut  # some slowdowns ended with their worker's death (or the trace's end)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("slow_node_mtbf_hours", 0.0, "failures.slow_node_mtbf_hours: must be > 0"),
    ("slow_min_factor", 1.0, "slow_min_factor: must be a number > 1"),
    ("slow_max_factor", 1.2, "slow_max_factor: must be between"),
    ("slow_max_s", 10.0, "slow_max_s: 10.0 is below slow_min_s"),
])
def test_bad_fail_slow_settings_name_the_field(field: str, value: float,
                                                 message: str) -> None:
    from chameleon_ft.spec.scenario import scenario_specs

    with pytest.raises(ValueError, match=message):
        scenario_specs({"failures": {field: value}})


def test_the_slow_preset_draws_within_falcon_s_published_ranges() -> None:
    # llama3-16k-slow: durations within "tens of seconds to nearly ten hours", factors
    # 1.3x..3x, about the configured number of onsets, and llama3-16k's failures seed for
    # seed; the same seed draws the same trace.
    from chameleon_ft.sim.scenarios import preset_scenario

    slow, plain = preset_scenario("llama3-16k-slow"), preset_scenario("llama3-16k")
    failures = slow.failures
    assert (failures.slow_min_s, failures.slow_max_s) == (FALCON_SLOW_MIN_S, FALCON_SLOW_MAX_S)
    assert (FALCON_SLOW_MIN_S, FALCON_SLOW_MAX_S) == (30.0, 36_000.0)
    assert (failures.slow_min_factor, failures.slow_max_factor) == (1.3, 3.0)
    assert replace(failures, slow_node_mtbf_hours=None) == plain.failures
    nodes, per_node = slow.config.cluster.num_nodes, slow.config.workers_per_node

    def draw(spec: FailureSpec, seed: int) -> Trace:
        return generate_trace(spec, num_nodes=nodes, workers_per_node=per_node,
                              duration_s=slow.simulation.duration_s, seed=seed)

    trace = draw(failures, 0)
    episodes = _episodes(trace, per_node)
    assert failures.slow_node_mtbf_hours is not None
    expected = slow.simulation.duration_s / 3600 * nodes / failures.slow_node_mtbf_hours
    assert 0.85 * expected < len(episodes) < 1.1 * expected
    ended = [end - start for start, end, _, _ in episodes if end is not None]
    assert ended and all(30.0 * (1 - 1e-9) <= s <= 36_000.0 * (1 + 1e-9) for s in ended)
    assert all(1.3 <= f <= 3.0 and f == round(f, 2) for *_, f in episodes)
    assert {w // per_node for _, _, w, _ in episodes} <= set(range(nodes))
    assert draw(failures, 0) == trace and draw(failures, 1) != trace
    assert tuple(e for e in trace.events if e.kind not in (SLOW, END)) == draw(
        plain.failures, 0).events


def test_draws_are_a_seeded_stream_of_their_own() -> None:
    from chameleon_ft.sim.slowtraces import draw_fail_slows

    def draw(seed: int, **kwargs: object) -> list[tuple[float, float, int, float]]:
        return draw_fail_slows(SLOWS, num_nodes=8, workers_per_node=4, duration_s=30 * DAY_S,
                               rng=np.random.default_rng(seed), **kwargs)  # type: ignore[arg-type]

    first = draw(7)
    assert first == draw(7) and first != draw(8)
    assert [start for start, *_ in first] == sorted(start for start, *_ in first)
    assert all(start < 30 * DAY_S and end > start for start, end, *_ in first)
    assert {w // 4 for _, _, w, _ in first} <= set(range(8))
    # the spares' stream numbers their nodes after the job's, with the same draws
    spares = draw(7, first_node=8)
    assert [(s, e, w - 32, f) for s, e, w, f in spares] == first
    assert draw_fail_slows(replace(SLOWS, slow_node_mtbf_hours=None), num_nodes=8,
                           workers_per_node=4, duration_s=DAY_S,
                           rng=np.random.default_rng(0)) == []
