"""Fail-slow detection and handling without processes: synthetic step timings through
``control.slowness`` (noise that must never declare a worker slow, slowdowns that must),
and the control plane's answer to a slow worker, row by row (``machine.step``)."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest
from test_runtime_control import SETTINGS, Chosen, Run, of, published, two_stage

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.plan import Pipeline, Reroute, Stage
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import slowness as sw
from chameleon_ft.runtime.control.model import Mode, mode

PLAN8 = ExecutionPlan.uniform(dp=2, pp=4, num_layers=8, num_microbatches=8)
"""The testbed's layout: 2 pipelines x 4 stages, 4 micro-batches each."""
RULE = sw.SlowRule()
TABLE = replace(SETTINGS, slow_rule=sw.SlowRule(min_span_s=0.0))
"""The rows below step through observations 10 ms apart: windows in steps only."""


def heavy_tailed(rng: random.Random) -> float:
    """One worker's step on a loaded host, as measured on a 2-core host under a load of
    15 (a peer ratio's quantiles: 25-75% within 1%, 5-95% within 20%, 1-99% within 45%):
    mostly a percent of jitter, sometimes a delay of tens of percent."""
    u = rng.random()
    if u < 0.80:
        return math.exp(rng.gauss(0.0, 0.01))
    if u < 0.97:
        return 1.0 + rng.uniform(0.05, 0.35)
    return 1.0 + rng.uniform(0.35, 1.0)


def _run(steps: int, rng: random.Random, noise: Any, slow: dict[int, tuple[int, int, float]],
         plan: ExecutionPlan = PLAN8, rule: sw.SlowRule = RULE,
         stuck: dict[int, tuple[int, int]] | None = None) -> list[tuple[int, sw.Change]]:
    """Feed ``steps`` steps of synthetic timings; ``slow``: worker -> (first step, steps,
    factor); ``stuck``: worker -> (first step, steps) of a burst of delays on one worker
    (the host starving it for a while). Returns every change with its step."""
    expected = sw.plan_compute(plan, None)
    peers = sw.plan_peers(plan)
    watch, out = sw.SlowWatch(), []
    for step in range(steps):
        measured = {}
        for w, e in expected.items():
            t = e * 0.012 * noise(rng)
            first, n, factor = slow.get(w, (0, 0, 1.0))
            if first <= step < first + n:
                t *= factor
            if stuck and w in stuck and stuck[w][0] <= step < sum(stuck[w]):
                t *= 1.0 + rng.uniform(0.1, 0.5)
            measured[w] = t
        watch, changes = sw.observe_step(watch, rule, step=step, now_s=float(step),
                                         measured=measured, expected=expected, peers=peers)
        out += [(step, x) for x in changes]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_no_alarm_on_a_loaded_host_over_thousands_of_steps(seed: int) -> None:
    changes = _run(2000, random.Random(seed), heavy_tailed, {})
    assert changes == []


def test_no_alarm_when_the_host_starves_one_worker_for_a_few_steps() -> None:
    rng = random.Random(7)
    changes = _run(400, rng, heavy_tailed, {},
                   stuck={w: (20 + 37 * w, 2) for w in range(8)})  # two bad steps each
    assert changes == []


def test_no_alarm_when_every_reading_is_noisy_even_at_three_times() -> None:
    """A host whose every step is off by tens of percent (a 2-core host running a CPU
    model under load: quartiles at +-0.4 in log): the MAD raises the bars, and 3x
    readings that such noise can produce declare nothing."""
    changes = _run(600, random.Random(3), lambda r: math.exp(r.gauss(0.0, 0.6)), {})
    assert changes == []


@pytest.mark.parametrize("factor", [1.3, 1.5, 2.0, 3.0])
def test_a_persistent_slowdown_is_declared_with_its_factor(factor: float) -> None:
    changes = _run(120, random.Random(11), heavy_tailed, {3: (40, 60, factor)})
    declared = [(s, x) for s, x in changes if isinstance(x, sw.Declared)]
    assert [x.worker for _, x in declared] == [3]
    step, found = declared[0]
    # the median of a short window: a noisy peer reading takes up to a quarter off
    assert found.factor == pytest.approx(factor, rel=0.25)
    assert step - 40 + 1 <= {1.3: 20, 1.5: 10, 2.0: 10, 3.0: 5}[factor]


def test_three_times_is_declared_within_five_steps_whatever_the_seed() -> None:
    for seed in range(30):
        changes = _run(60, random.Random(seed), heavy_tailed, {5: (20, 30, 3.0)})
        declared = [s for s, x in changes if isinstance(x, sw.Declared)]
        assert declared and declared[0] - 20 + 1 <= 5, (seed, changes)


def test_the_end_is_cleared_after_a_gap_below_the_bar() -> None:
    changes = _run(140, random.Random(2), heavy_tailed, {3: (20, 60, 3.0)})
    kinds = [(type(x).__name__, x.worker) for _, x in changes]
    assert kinds == [("Declared", 3), ("Cleared", 3)]
    cleared_at = next(s for s, x in changes if isinstance(x, sw.Cleared))
    assert 80 <= cleared_at <= 80 + RULE.clear_steps
    cleared = next(x for _, x in changes if isinstance(x, sw.Cleared))
    assert cleared.factor == pytest.approx(3.0, rel=0.25) and cleared.measured < 1.1


def test_a_worker_between_the_bars_is_neither_cleared_nor_declared_again() -> None:
    """Hysteresis: declared at 1.5x, then at 1.15x (above the clear bar, below the
    declaring ones) it stays slow: one declaration, no clearing."""
    expected = sw.plan_compute(PLAN8, None)
    peers = sw.plan_peers(PLAN8)
    watch, seen = sw.SlowWatch(), []
    for step in range(100):
        factor = 1.5 if 10 <= step < 40 else (1.15 if step >= 40 else 1.0)
        measured = {w: e * (factor if w == 2 else 1.0) for w, e in expected.items()}
        watch, changes = sw.observe_step(watch, RULE, step=step, now_s=step * 0.5,
                                         measured=measured,
                                         expected=expected, peers=peers)
        seen += changes
    assert [type(x).__name__ for x in seen] == ["Declared"]


def test_a_whole_slow_host_is_no_slow_worker() -> None:
    """Every worker twice as slow at once (another job took the host): the reference
    moves with them."""
    changes = _run(80, random.Random(5), heavy_tailed,
                   {w: (20, 40, 2.0) for w in range(8)})
    assert changes == []


def test_the_reference_is_the_same_stage_peers_first() -> None:
    # the estimate gets the last stage wrong by 3x for both its workers alike: no alarm
    expected = sw.plan_compute(PLAN8, None)
    peers = sw.plan_peers(PLAN8)
    last = {w for w, (_, s) in PLAN8.stage_of_worker.items() if s == 3}
    measured = {w: e * (3.0 if w in last else 1.0) for w, e in expected.items()}
    factors = sw.step_factors(measured, expected, peers)
    assert all(abs(f) < 1e-12 for f in factors.values())
    # without peers (a re-split pipeline), every other worker is the reference
    factors = sw.step_factors({0: 3.0, 1: 1.0, 2: 1.0}, {0: 1.0, 1: 1.0, 2: 1.0}, {})
    assert factors[0] == pytest.approx(math.log(3.0)) and factors[1] < 0


def test_a_rerouted_plan_expects_the_peers_shares() -> None:
    stages = lambda a, b: (Stage(a, 0, 2), Stage(b, 2, 4))  # noqa: E731
    plan = ExecutionPlan(num_layers=4, pipelines=(Pipeline(stages(0, 2), 2),
                                                  Pipeline(stages(1, 3), 2)),
                         reroutes=(Reroute(0, 1, ((3, 2),)),))
    assert sw.plan_compute(plan, None) == {0: 4.0, 1: 4.0, 3: 8.0}
    assert sw.plan_compute(plan, (1.0, 1.0, 2.0, 2.0)) == {0: 4.0, 1: 4.0, 3: 16.0}


@pytest.mark.parametrize("timing", [{}, {"f_s": [0.1], "b_s": "x"}, {"f_s": [-1.0], "b_s": []},
                                    {"f_s": [float("nan")], "b_s": []},
                                    {"f_s": [True], "b_s": []},
                                    {"f_s": [0.0] * (sw.MAX_OPS + 1), "b_s": []},
                                    {"f_s": [1e308, 1e308], "b_s": []}])
def test_a_report_out_of_bounds_is_no_reading(timing: dict[str, Any]) -> None:
    assert sw.compute_seconds(timing) is None


def test_a_report_is_the_sum_of_its_operations() -> None:
    assert sw.compute_seconds({"f_s": [0.1, 0.2], "b_s": [0.3], "lr": 1}) == \
        pytest.approx(0.6)


def test_probes_clear_a_slow_worker_out_of_the_plan() -> None:
    watch = sw.SlowWatch(marks={3: sw.Mark(3.0, 20, 1.0, sw.Phase.HELD)})
    for seq in range(1, 6):  # about every half second
        watch, changes = sw.observe_probe(watch, RULE, 3, seq, 3.0, seq / 2)
        assert changes == []
    watch, changes = sw.observe_probe(watch, RULE, 3, 5, 1.0, 3.0)  # a replay: ignored
    assert changes == []
    seen: list[sw.Change] = []
    for seq, factor in zip(range(6, 9), (1.0, 1.02, 1.3), strict=True):
        watch, changes = sw.observe_probe(watch, RULE, 3, seq, factor, seq / 2)
        seen += changes
    assert seen == []  # the median of the last five is still slow
    watch, changes = sw.observe_probe(watch, RULE, 3, 9, 0.98, 4.5)
    assert [type(x).__name__ for x in changes] == ["Cleared"]
    assert watch.marks[3].phase is sw.Phase.END
    for bad in (float("nan"), -1.0, 0.0, float("inf")):
        assert sw.observe_probe(watch, RULE, 3, 99, bad, 9.0)[1] == []


def test_the_rule_refuses_bars_that_cannot_work() -> None:
    with pytest.raises(ValueError, match="windows"):
        sw.SlowRule(windows=((5, 1.0),))
    with pytest.raises(ValueError, match="clear_factor"):
        sw.SlowRule(clear_factor=1.3)


# ---------------------------------------------------------------------- the control plane
def _started() -> Run:
    """A run with five clean steps of readings (a window needs as many)."""
    run = Run(TABLE).start()
    _slow_steps(run, 0, 1.0, 6)
    return run


def _slow_steps(run: Run, worker: int, factor: float, steps: int) -> list[m.Effect]:
    """Commit ``steps`` steps with ``worker`` computing ``factor`` times slower."""
    out: list[m.Effect] = []
    for _ in range(steps):
        s = run.c.run
        step = s.next_step
        out += run.commit()
        expected = sw.plan_compute(s.plan, None)
        times = {w: e * (factor if w == worker else 1.0) for w, e in expected.items()}
        out += run.feed(m.OpTimes(run.at(), s.gen, step, times))
    return out


def test_a_slow_worker_is_recorded_and_the_policy_asked() -> None:
    run = _started()
    out = _slow_steps(run, 2, 3.0, 3)
    (event,) = of(out, m.SlowEvent)
    assert (event.worker, event.cause) == (2, "slow")
    assert event.factor == pytest.approx(3.0)
    (ask,) = of(out, m.DecideSlow)
    assert (ask.worker, ask.end, ask.plan) == (2, False, run.c.run.plan)
    assert mode(run.c) is Mode.TRAINING and run.c.slow_ask == (2, False, run.c.run.gen)
    # asked once: later steps wait for the answer
    assert not of(_slow_steps(run, 2, 3.0, 2), m.DecideSlow)


def test_a_rebalance_switches_at_the_next_boundary_and_its_end_switches_back() -> None:
    run = _started()
    _slow_steps(run, 2, 3.0, 3)
    ask = run.c.slow_ask
    assert ask is not None
    uneven = ExecutionPlan(num_layers=4, pipelines=(
        Pipeline((Stage(0, 0, 2), Stage(2, 2, 4)), 1),
        Pipeline((Stage(1, 0, 2), Stage(3, 2, 4)), 3)))
    out = run.feed(m.SlowDecision(run.at(), 2, False, ask[2], Chosen("rebalance", uneven)))
    (resolved,) = of(out, m.SlowResolved)
    assert resolved.strategy == "rebalance" and resolved.plan == uneven
    gen = run.c.run.gen
    out = _slow_steps(run, 2, 3.0, 1)
    assert published(out) == [gen + 1] and run.c.run.plan == uneven
    # still slow under the new plan (its reading is per expected compute): nothing new
    assert not of(_slow_steps(run, 2, 3.0, 4), m.SlowEvent)
    out = _slow_steps(run, 2, 1.0, 6)
    (end,) = of(out, m.SlowEvent)
    assert end.cause == "slow-end" and end.measured == pytest.approx(1.0)
    (ask_end,) = of(out, m.DecideSlow)
    assert ask_end.end and ask_end.worker == 2
    out = run.feed(m.SlowDecision(run.at(), 2, True, ask_end.gen, Chosen("rebalance", run.p.initial_plan)))
    _slow_steps(run, 2, 1.0, 1)
    assert run.c.run.plan == run.p.initial_plan and not run.c.slow.marks


def test_an_eviction_probes_the_worker_and_its_end_folds_it_back_in() -> None:
    run = _started()
    _slow_steps(run, 3, 3.0, 3)
    ask = run.c.slow_ask
    assert ask is not None
    without = two_stage((0, 2), (1, 2))
    run.feed(m.SlowDecision(run.at(), 3, False, ask[2], Chosen("evict", without)))
    out = _slow_steps(run, 3, 3.0, 1)
    (pub,) = of(out, m.Publish)
    assert pub.plan == without and pub.probe == frozenset({3})
    assert 3 in run.c.run.idle
    # no re-join question about it while it is slow; no recovery uses it either
    assert not of(_slow_steps(run, 3, 3.0, 3), m.DecideRejoin)
    run.kill(0)
    (decide,) = of(run.effects[-5:], m.Decide)
    assert 3 not in decide.ask.usable
    run.answer(Chosen("reroute", two_stage((1, 2))))
    run.commit()
    assert run.c.run.plan == two_stage((1, 2))


def test_probes_end_an_eviction_and_the_policy_re_plans() -> None:
    run = _started()
    _slow_steps(run, 3, 3.0, 4)
    ask = run.c.slow_ask
    assert ask is not None
    run.feed(m.SlowDecision(run.at(), 3, False, ask[2], Chosen("evict", two_stage((0, 2), (1, 2)))))
    _slow_steps(run, 3, 1.0, 2)
    assert run.c.run.plan.workers == (0, 1, 2)
    out: list[m.Effect] = []
    for seq in range(1, 6):
        out += run.feed(m.Probes(run.at(), {3: (seq, 1.0), 0: (seq, 9.0)}))
    (end,) = of(out, m.SlowEvent)
    assert (end.worker, end.cause) == (3, "slow-end")
    (ask_end,) = of(out, m.DecideSlow)
    assert ask_end.end and 3 in ask_end.alive
    back = run.p.initial_plan
    out = run.feed(m.SlowDecision(run.at(), 3, True, ask_end.gen, Chosen("dynamic", back)))
    assert run.c.run.pending is not None and run.c.run.pending.rejoin == (3,)
    out = _slow_steps(run, 3, 1.0, 1)
    assert run.c.run.plan == back and 3 not in run.c.run.idle


def test_an_answer_after_the_plan_moved_is_asked_again() -> None:
    run = Run(replace(TABLE, num_workers=5, num_local=5), workers=5).start()
    _slow_steps(run, 0, 1.0, 6)
    _slow_steps(run, 2, 3.0, 4)
    ask = run.c.slow_ask
    assert ask is not None
    run.kill(3)  # the generation breaks before the answer comes
    run.answer(Chosen("reroute", two_stage((0, 2), (1, 2))))
    out = run.feed(m.SlowDecision(run.at(), 2, False, ask[2], Chosen("rebalance", PLAN8)))
    assert not of(out, m.SlowResolved) and run.c.run.pending is None
    out = _slow_steps(run, 2, 3.0, 2)
    (again,) = of(out, m.DecideSlow)
    assert again.worker == 2 and again.gen == run.c.run.gen


def test_a_slow_worker_that_dies_is_forgotten() -> None:
    run = _started()
    _slow_steps(run, 2, 3.0, 4)
    run.kill(2)
    assert 2 not in run.c.slow.marks
    ask = run.c.slow_ask
    assert ask is not None
    out = run.feed(m.SlowDecision(run.at(), 2, False, ask[2], Chosen("keep", None)))
    assert not of(out, m.SlowResolved)


@pytest.mark.parametrize("decision", [None, Chosen("restart", two_stage((0, 2), (1, 3))),
                                      Chosen("dynamic", two_stage((0, 9)))])
def test_an_answer_that_cannot_be_taken_keeps_the_plan(decision: Any) -> None:
    run = _started()
    _slow_steps(run, 2, 3.0, 4)
    ask = run.c.slow_ask
    assert ask is not None
    out = run.feed(m.SlowDecision(run.at(), 2, False, ask[2], decision, "policy raised"))
    (resolved,) = of(out, m.SlowResolved)
    assert resolved.strategy == "keep" and run.c.run.pending is None
    assert run.c.slow.marks[2].phase is sw.Phase.HELD
    assert not of(_slow_steps(run, 2, 3.0, 3), m.DecideSlow)


def test_the_first_step_of_a_generation_is_no_reading() -> None:
    run = Run(TABLE).start()
    s = run.c.run
    out = run.commit() + run.feed(m.OpTimes(run.at(), s.gen, s.next_step, {0: 1.0, 1: 1.0,
                                                                           2: 50.0, 3: 1.0}))
    assert run.c.slow.history == {}
    assert not out or not of(out, m.SlowEvent)


# ---------------------------------------------------------------------- the fault kind
def test_a_slow_fault_reads_and_prints_the_same() -> None:
    from chameleon_ft.spec.train import Fault, FaultKind, parse_fault

    fault = parse_fault("rank=3,step=20,kind=slow,factor=3,steps=60")
    assert fault == Fault(rank=3, step=20, kind=FaultKind.SLOW, factor=3.0, steps=60)
    assert parse_fault(fault.to_text()) == fault
    assert parse_fault("rank=1,step=2,kind=kill").to_text() == \
        "rank=1,step=2,kind=kill,phase=forward"


@pytest.mark.parametrize(("text", "message"), [
    ("rank=3,step=2,kind=slow,factor=3", "steps: a slow fault needs factor=F"),
    ("rank=3,step=2,kind=slow,steps=3", "factor: a slow fault needs factor=F"),
    ("rank=3,step=2,kind=slow,factor=1,steps=3", "factor: must be > 1"),
    ("rank=3,step=2,kind=slow,factor=0.5,steps=3", "factor: must be > 1"),
    ("rank=3,step=2,kind=slow,factor=nan,steps=3", "factor: must be finite"),
    ("rank=3,step=2,kind=slow,factor=inf,steps=3", "factor: must be finite"),
    ("rank=3,step=2,kind=slow,factor=x,steps=3", "factor must be a number"),
    ("rank=3,step=2,kind=slow,factor=2,steps=0", "steps: must be >= 1"),
    ("rank=3,step=2,kind=slow,factor=2,steps=1.5", "rank, step and steps must be integers"),
    ("rank=3,step=2,kind=slow,factor=2,steps=3,phase=backward", "phase: a slow fault"),
    ("rank=3,step=2,kind=kill,factor=2", "factor: only a slow fault takes one"),
    ("rank=3,step=2,kind=hang,steps=2", "steps: only a slow fault takes one"),
    ("rank=3,step=2,kind=slow,speed=2", "unknown key 'speed'"),
])
def test_a_bad_slow_fault_is_one_line_naming_the_field(text: str, message: str) -> None:
    from chameleon_ft.spec.train import parse_fault

    with pytest.raises(ValueError, match=message) as info:
        parse_fault(text)
    assert str(info.value).startswith("fault: ") and "\n" not in str(info.value)


def test_a_window_of_short_steps_spans_its_time() -> None:
    """Steps of 20 ms (a tiny model on the CPU): the host starving one worker for ten of
    them (0.2 s) declares nothing, as ten 0.5 s steps would; 3x held for 2 s does."""
    expected = sw.plan_compute(PLAN8, None)
    peers = sw.plan_peers(PLAN8)

    def run(step_s: float, slow_steps: range) -> list[sw.Change]:
        watch, seen = sw.SlowWatch(), []
        for step in range(400):
            factor = 3.0 if step in slow_steps else 1.0
            measured = {w: e * (factor if w == 2 else 1.0) for w, e in expected.items()}
            watch, changes = sw.observe_step(watch, RULE, step=step, now_s=step * step_s,
                                             measured=measured, expected=expected,
                                             peers=peers)
            seen += changes
        return seen

    assert run(0.02, range(100, 110)) == []
    assert [type(x).__name__ for x in run(0.5, range(100, 110))] == ["Declared", "Cleared"]
    found = run(0.02, range(100, 200))
    assert [type(x).__name__ for x in found] == ["Declared", "Cleared"]
    assert isinstance(found[0], sw.Declared) and found[0].window >= 1.5 / 0.02


def test_a_window_that_cannot_span_its_time_is_cut_at_the_history_kept() -> None:
    rule = sw.SlowRule(max_history=30)
    expected = sw.plan_compute(PLAN8, None)
    peers = sw.plan_peers(PLAN8)
    watch, seen = sw.SlowWatch(), []
    for step in range(200):  # 1 ms steps: 1.5 s would be 1,500 of them
        factor = 3.0 if step >= 100 else 1.0
        measured = {w: e * (factor if w == 5 else 1.0) for w, e in expected.items()}
        watch, changes = sw.observe_step(watch, rule, step=step, now_s=step * 0.001,
                                         measured=measured, expected=expected, peers=peers)
        seen += [(step, x) for x in changes]
        assert all(len(v) <= 30 for v in watch.history.values())
    # every window is the 30 readings kept: with half of them at 3x their median is
    # sqrt(3), past the 1.4x bar
    assert [(s, type(x).__name__, x.worker) for s, x in seen] == [(114, "Declared", 5)]


def test_a_replacement_under_a_rerouted_id_is_not_offered_to_the_slow_answer() -> None:
    """Chaos found it: worker 3 died and its stage was rerouted, its replacement was up
    (idle, holding nothing) when worker 2 was declared slow; the eviction's plan took the
    replacement for the stage's own worker and handed it the layers without copying them
    ("no state for layers")."""
    stages = lambda a, b: (Stage(a, 0, 2), Stage(b, 2, 4))  # noqa: E731
    rerouted = ExecutionPlan(num_layers=4, pipelines=(Pipeline(stages(0, 2), 2),
                                                      Pipeline(stages(1, 3), 2)),
                             reroutes=(Reroute(1, 1, ((2, 2),)),))
    assert rerouted.dead_workers == {3}
    run = Run(replace(TABLE, rejoin=True)).start()
    run.commit()
    run.kill(3)
    run.answer(Chosen("reroute", rerouted))
    run.commit()
    run.feed(m.Tick(run.at()))
    run.launch([3], replacement=True)
    run.feed(m.Registered(run.at(), (3,)))
    assert 3 in run.c.run.alive and 3 in run.c.run.stateless
    _slow_steps(run, 0, 1.0, 6)
    out = _slow_steps(run, 2, 3.0, 3)
    (ask,) = of(out, m.DecideSlow)
    assert ask.worker == 2 and ask.plan == rerouted
    assert 3 not in ask.alive and {0, 1, 2} <= ask.alive
