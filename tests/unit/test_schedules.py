"""One schedule representation for 1F1B, GPipe, interleaved 1F1B and zero-bubble: orders,
closed forms, memory, W deferral on rerouted peers, and the folded (interleaved) profile."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from plan_shapes import even_pipelines

from chameleon_ft.perf import Topology, build_schedule, estimate, list_scheduler
from chameleon_ft.perf import graph as graph_module
from chameleon_ft.perf import kernel as kernel_module
from chameleon_ft.perf.closed_form import (
    in_flight,
    step_1f1b,
    step_interleaved,
    step_zero_bubble,
)
from chameleon_ft.perf.estimator import Estimator
from chameleon_ft.perf.orders import OpKind, stage_order, stream_order
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.profile import (
    Profile,
    chunk_sums,
    fold_profile,
    stage_sums,
    uniform_profile,
)
from chameleon_ft.recovery.templates import memory_bounds, stage_memory_bytes
from chameleon_ft.spec import RUNTIME_SCHEDULES, ClusterSpec, JobSpec, Schedule

SCHEDULES = [s.value for s in Schedule]


def free_links(num_workers: int) -> Topology:
    return Topology(ClusterSpec(num_nodes=num_workers, devices_per_node=1,
                                ideal_network=True), 1)


def real_links(num_workers: int, per_node: int = 2) -> Topology:
    nodes = -(-num_workers // per_node)
    cluster = ClusterSpec(num_nodes=nodes, devices_per_node=per_node,
                          inter_node_gb_per_s=1e-9, intra_node_gb_per_s=1e-8,
                          inter_node_latency_us=3e5, intra_node_latency_us=1e5)
    return Topology(cluster, per_node)


# ---------------------------------------------------------------- orders

@settings(max_examples=150, deadline=None)
@given(st.integers(1, 7), st.data(), st.integers(1, 20), st.sampled_from(SCHEDULES),
       st.integers(1, 4))
def test_every_order_runs_each_operation_once(stages: int, data: st.DataObject, m: int,
                                              schedule: str, v: int) -> None:
    stage = data.draw(st.integers(0, stages - 1))
    v = v if schedule == "interleaved" else 1
    order = stage_order(stages, stage, m, schedule, v)
    kinds = [OpKind.F, OpKind.B] + ([OpKind.W] if schedule == "zero-bubble" else [])
    expected = {(k, r, j) for k in kinds for r in range(v) for j in range(m)}
    assert len(order) == len(expected) and set(order) == expected
    position = {op: i for i, op in enumerate(order)}
    for r, j in itertools.product(range(v), range(m)):
        assert position[(OpKind.F, r, j)] < position[(OpKind.B, r, j)]
        if schedule == "zero-bubble":
            assert position[(OpKind.B, r, j)] < position[(OpKind.W, r, j)]


def test_one_chunk_orders_are_1f1b() -> None:
    for stages, m in itertools.product(range(1, 6), range(1, 10)):
        for stage in range(stages):
            plain = stage_order(stages, stage, m, "1f1b")
            assert stage_order(stages, stage, m, "interleaved", 1) == plain
            assert stream_order(stages, stage, m) == tuple((k, j) for k, _, j in plain)
            zb = [op for op in stage_order(stages, stage, m, "zero-bubble", lag=0)]
            fused = [op for op in zb if op[0] is not OpKind.W]
            assert tuple(fused) == plain  # ZB keeps 1F1B's F/B order


def test_interleaved_order_is_megatrons_depth_first() -> None:
    # S = 2, v = 2, m = 4 on stage 0: 2(S-1) + (v-1)S + 1 = 5 forwards first, groups of 2
    order = stage_order(2, 0, 4, "interleaved", 2)
    f, b = OpKind.F, OpKind.B
    assert order[:5] == ((f, 0, 0), (f, 0, 1), (f, 1, 0), (f, 1, 1), (f, 0, 2))
    assert order[5] == (b, 1, 0)
    backwards = [op for op in order if op[0] is b]
    assert backwards[:4] == [(b, 1, 0), (b, 1, 1), (b, 0, 0), (b, 0, 1)]
    # five micro-batches on two stages: groups of 3 and 2 (at least S each), warm-up 2 + 3
    odd = stage_order(2, 0, 5, "interleaved", 2)
    assert odd[:6] == ((f, 0, 0), (f, 0, 1), (f, 0, 2), (f, 1, 0), (f, 1, 1), (f, 1, 2))
    assert odd[6] == (b, 1, 0)


def test_chunks_need_the_interleaved_schedule() -> None:
    with pytest.raises(ValueError, match="virtual_stages"):
        stage_order(2, 0, 4, "1f1b", 2)
    with pytest.raises(ValueError, match="schedule"):
        stage_order(2, 0, 4, "pipedream")


# ---------------------------------------------------------------- closed forms

@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 3), st.integers(0, 4),
       st.integers(1, 2), st.integers(1, 3), st.floats(0.1, 3.0), st.floats(0.1, 3.0),
       st.floats(0.0, 2.0))
def test_interleaved_reproduces_its_closed_form(stages: int, v: int, groups: int, extra: int,
                                                per_chunk: int, dp: int, f: float, bi: float,
                                                bw: float) -> None:
    """Uniform stages, free links, at least S micro-batches (a multiple of S or not):
    bubble (S - 1) / (v m) exactly."""
    m = groups * stages + min(extra, stages - 1)
    profile = fold_profile(uniform_profile(stages * v * per_chunk, fwd_s=f, bwd_input_s=bi,
                                           bwd_weight_s=bw), v)
    plan = ExecutionPlan.uniform(dp=dp, pp=stages, num_layers=profile.num_layers,
                                 num_microbatches=m * dp, schedule="interleaved")
    est = estimate(plan, profile, free_links(dp * stages))
    tf, tb = v * per_chunk * f, v * per_chunk * (bi + bw)
    expected = step_interleaved(stages, m, v, tf, tb)
    assert est.step_s == pytest.approx(expected, rel=1e-9)
    ideal = m * (tf + tb)
    assert (est.step_s - ideal) / ideal == pytest.approx((stages - 1) / (v * m), rel=1e-9,
                                                         abs=1e-12)
    if v == 1:
        assert est.step_s == pytest.approx(step_1f1b(stages, m, tf, tb), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 14), st.floats(0.1, 3.0),
       st.floats(0.1, 3.0))
def test_interleaved_any_microbatch_count_runs_and_never_beats_the_closed_form(
        stages: int, v: int, m: int, f: float, b: float) -> None:
    profile = fold_profile(uniform_profile(stages * v, fwd_s=f, bwd_input_s=b), v)
    plan = ExecutionPlan.uniform(dp=1, pp=stages, num_layers=profile.num_layers,
                                 num_microbatches=m, schedule="interleaved")
    est = estimate(plan, profile, real_links(stages))
    assert est.step_s >= step_interleaved(stages, m, v, v * f, v * b) * (1 - 1e-12)
    ops = build_schedule(plan, profile, real_links(stages)).ops
    assert sum(len(seq) for seq in ops.values()) == 2 * stages * v * m


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(2, 4), st.integers(1, 3), st.integers(1, 1000),
       st.integers(0, 1000), st.integers(1, 1000))
def test_interleaved_memory_is_its_in_flight_chunks(stages: int, v: int, groups: int, mp: int,
                                                     mo: int, ma: int) -> None:
    m = (groups + 1) * stages  # enough micro-batches for the whole warm-up
    profile = fold_profile(uniform_profile(stages * v, fwd_s=1.0, bwd_input_s=1.0,
                                           param_bytes=mp, optimizer_bytes=mo,
                                           activation_bytes=ma), v)
    plan = ExecutionPlan.uniform(dp=1, pp=stages, num_layers=profile.num_layers,
                                 num_microbatches=m, schedule="interleaved")
    est = estimate(plan, profile, free_links(stages))
    for i in range(stages):
        worker = plan.pipelines[0].stages[i].worker
        static = v * (2 * mp + mo)
        expected = static + in_flight("interleaved", stages, i, v) * v * ma
        assert est.peak_memory_bytes[worker] == pytest.approx(expected, rel=1e-12)
        # the template's memory model agrees
        assert stage_memory_bytes(profile, i, i + 1, in_flight("interleaved", stages, i, v)) \
            == pytest.approx(expected, rel=1e-12)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.integers(0, 8), st.integers(1, 3), st.floats(0.1, 3.0),
       st.floats(0.1, 3.0), st.floats(0.0, 1.0))
def test_zero_bubble_reproduces_zb_h1(stages: int, extra: int, dp: int, f: float, b: float,
                                      share: float) -> None:
    """m >= S and t_w <= min(t_f, t_b): the bubble shrinks to (S - 1)(t_f + t_b - t_w)."""
    m = stages + extra
    w = share * min(f, b)
    profile = uniform_profile(stages, fwd_s=f, bwd_input_s=b, bwd_weight_s=w,
                              activation_bytes=1.0)
    plan = ExecutionPlan.uniform(dp=dp, pp=stages, num_layers=stages,
                                 num_microbatches=m * dp, schedule="zero-bubble")
    est = estimate(plan, profile, free_links(dp * stages))
    assert est.step_s == pytest.approx(step_zero_bubble(stages, m, f, b, w), rel=1e-9)
    # ZB-H1's memory: every stage holds at most S micro-batches (stage 0's 1F1B peak)
    assert est.max_memory_bytes <= stages + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 3), st.integers(1, 10),
       st.floats(0.1, 3.0), st.floats(0.1, 3.0), st.floats(0.0, 3.0), st.booleans(),
       st.data())
def test_zero_bubble_never_slower_than_1f1b(stages: int, per_stage: int, dp: int, m: int,
                                            f: float, bi: float, bw: float, ideal: bool,
                                            data: st.DataObject) -> None:
    layers = stages * per_stage
    profile = uniform_profile(layers, fwd_s=f, bwd_input_s=bi, bwd_weight_s=bw,
                              output_bytes=1e2, activation_bytes=1.0)
    plan = ExecutionPlan.uniform(dp=dp, pp=stages, num_layers=layers, num_microbatches=m * dp)
    if dp > 1 and data.draw(st.booleans()):
        failed = data.draw(st.lists(st.sampled_from(list(plan.workers)), min_size=1,
                                    max_size=dp - 1, unique=True))
        assume(all(sum(1 for w in failed if w // dp == s) < dp for s in range(stages)))
        plan = reroute_plan(plan, failed)
    topology = free_links(dp * stages) if ideal else real_links(dp * stages)
    one = Estimator(profile, topology).estimate(plan)
    zb = Estimator(profile, topology).estimate(dataclasses.replace(plan,
                                                                    schedule="zero-bubble"))
    assert zb.step_s <= one.step_s * (1 + 1e-9)


# ---------------------------------------------------------------- W deferral on peers

def test_rerouted_peers_defer_weight_gradients_into_bubbles() -> None:
    """D = 4, S = 4, m = 8, stage 1 of pipeline 0 lost (ReCycle's worked case): splitting
    the peers' backward and deferring W beats the fused 1F1B merge, and only the peers
    run W operations."""
    profile = uniform_profile(4, fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0)
    plan = ExecutionPlan.uniform(dp=4, pp=4, num_layers=4, num_microbatches=32)
    dead = plan.pipelines[0].stages[1].worker
    rerouted = reroute_plan(plan, [dead])
    deferred = dataclasses.replace(rerouted, defer_weight_grad=True)
    topology = free_links(16)
    fused_s = Estimator(profile, topology).estimate(rerouted).step_s
    deferred_s = Estimator(profile, topology).estimate(deferred).step_s
    assert deferred_s < fused_s
    assert deferred_s >= (8 + 3) * 3.0  # never better than the failure-free step
    peers = {w for w, _ in deferred.reroutes[0].shares}
    ops = build_schedule(deferred, profile, topology).ops
    for worker, seq in ops.items():
        kinds = collections.Counter(op.kind for op in seq)
        if worker in peers:
            assert kinds[OpKind.W] == kinds[OpKind.B] > 8
            done = set()
            for op in seq:  # every W after its own B on the same worker
                key = (op.pipeline, op.stage, op.microbatch)
                if op.kind is OpKind.B:
                    done.add(key)
                elif op.kind is OpKind.W:
                    assert key in done
        else:
            assert kinds[OpKind.W] == 0 and kinds[OpKind.B] == 8
    plain = build_schedule(rerouted, profile, topology).ops
    assert all(op.kind is not OpKind.W for seq in plain.values() for op in seq)


def folded_plan(lengths: list[int], m: int, schedule: str, defer: bool, v: int,
                fwd_s: float = 1.0) -> tuple[Profile, ExecutionPlan]:
    """A six-column profile folded into ``v`` chunks (forward ``fwd_s``, split backward,
    bytes that make transfers and memory count) and a plan of near-even pipelines of
    ``lengths`` stages, ``m`` micro-batches each."""
    base = uniform_profile(6 * v, fwd_s=fwd_s, bwd_input_s=0.7, bwd_weight_s=0.5,
                           param_bytes=1e3, optimizer_bytes=2e3, activation_bytes=10,
                           output_bytes=1e2, optimizer_step_s=0.3)
    profile = fold_profile(base, v)
    plan = ExecutionPlan(num_layers=profile.num_layers,
                         pipelines=even_pipelines(profile.num_layers, lengths, m),
                         schedule=schedule, defer_weight_grad=defer)
    return profile, plan


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(1, 6), st.data(),
       st.sampled_from(SCHEDULES), st.booleans(), st.booleans())
def test_symmetric_and_brute_force_agree_for_every_schedule(
        lengths: list[int], m: int, data: st.DataObject, schedule: str, defer: bool,
        ideal: bool) -> None:
    """Heterogeneous pipelines, reroutes, chunks and split backwards: the estimator's
    shortcuts (shared pipelines, shared components) change nothing."""
    v = data.draw(st.integers(1, 3)) if schedule == "interleaved" else 1
    profile, plan = folded_plan(lengths, m, schedule, defer, v)
    plan.validate()
    if data.draw(st.booleans()):
        with contextlib.suppress(ValueError):  # some stage lost every replica
            plan = reroute_plan(plan, data.draw(st.lists(st.sampled_from(list(plan.workers)),
                                                         min_size=1, max_size=2)))
    workers = sum(lengths)
    topology = free_links(workers) if ideal else real_links(workers)
    fast = Estimator(profile, topology).estimate(plan)
    slow = Estimator(profile, topology).estimate(plan, brute_force=True)
    assert fast.step_s == pytest.approx(slow.step_s, rel=1e-12)
    assert fast.peak_memory_bytes == pytest.approx(slow.peak_memory_bytes, rel=1e-12)


def test_peers_that_defer_weight_gradients_can_beat_their_failure_free_makespan() -> None:
    # Stages 0 and 1 of pipeline 1 rerouted into pipelines 2 and 3, which split their
    # backwards: their input gradients go upstream sooner than fused, so the component
    # ends before pipelines 2 and 3 alone would. The estimator must not take their
    # failure-free makespan as a bound (it did: 4 s slower than the exact simulation).
    base = uniform_profile(12, fwd_s=1.0, bwd_input_s=0.7, bwd_weight_s=0.5, param_bytes=1e3,
                           optimizer_bytes=2e3, activation_bytes=10, output_bytes=1e2,
                           optimizer_step_s=0.3)
    profile = fold_profile(base, 2)
    plan = ExecutionPlan(num_layers=profile.num_layers,
                         pipelines=even_pipelines(profile.num_layers, [2, 3, 3, 3], 4),
                         schedule="interleaved", defer_weight_grad=True)
    plan = reroute_plan(plan, [2, 3])
    topology = real_links(11)
    fast = Estimator(profile, topology).estimate(plan)
    slow = Estimator(profile, topology).estimate(plan, brute_force=True)
    assert fast.step_s == pytest.approx(slow.step_s, rel=1e-12)


def test_runtime_schedules_keep_the_runtime_format() -> None:
    """1f1b and gpipe: F and fused B only, chunk 0, as the runtime executes them."""
    profile = uniform_profile(6, fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=0.5)
    for schedule in sorted(RUNTIME_SCHEDULES):
        plan = ExecutionPlan.uniform(dp=2, pp=3, num_layers=6, num_microbatches=8,
                                     schedule=schedule)
        rerouted = dataclasses.replace(reroute_plan(plan, [1]))
        for p in (plan, rerouted):
            ops = build_schedule(p, profile, free_links(6)).ops
            assert {op.kind for seq in ops.values() for op in seq} == {OpKind.F, OpKind.B}
            assert {op.chunk for seq in ops.values() for op in seq} == {0}


# ---------------------------------------------------------------- folded profiles

@settings(max_examples=80, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.data())
def test_folding_keeps_every_layer_once(num_layers: int, v: int, data: st.DataObject) -> None:
    assume(v <= num_layers)
    base = Profile(layers=tuple(
        uniform_profile(1, fwd_s=i + 1.0, bwd_input_s=2 * i + 1.0, param_bytes=i,
                        activation_bytes=3 * i, output_bytes=7.0).layers[0]
        for i in range(num_layers)), optimizer_step_s=2.0)
    folded = fold_profile(base, v)
    assert folded.virtual_stages == v
    assert folded.num_layers == -(-num_layers // v)
    rounds = folded.rounds or (folded.layers,)  # one round: the profile itself
    assert tuple(itertools.chain.from_iterable(rounds)) == base.layers
    for name in ("fwd_s", "bwd_s", "param_bytes", "activation_bytes", "static_bytes"):
        assert sum(getattr(c, name) for c in folded.layers) == pytest.approx(
            sum(getattr(c, name) for c in base.layers))
    lo = data.draw(st.integers(0, folded.num_layers - 1))
    hi = data.draw(st.integers(lo + 1, folded.num_layers))
    chunks = chunk_sums(folded, lo, hi)
    assert len(chunks) == v
    assert sum(c.fwd_s for c in chunks) == pytest.approx(stage_sums(folded, range(lo, hi)).fwd_s)
    again = Profile.from_json(folded.to_json())
    assert again.rounds == folded.rounds and again.layers == folded.layers
    assert fold_profile(base, 1) is base


def test_folding_errors_name_the_field() -> None:
    base = uniform_profile(4, fwd_s=1.0)
    with pytest.raises(ValueError, match=r"job\.virtual_stages"):
        fold_profile(base, 5)
    with pytest.raises(ValueError, match=r"job\.virtual_stages"):
        fold_profile(base, 0)
    with pytest.raises(ValueError, match="already folded"):
        fold_profile(fold_profile(base, 2), 2)
    with pytest.raises(ValueError, match="virtual_stages"):
        JobSpec(pp=2, dp=1, global_batch=4, virtual_stages=2)
    JobSpec(pp=2, dp=1, global_batch=4, schedule="interleaved", virtual_stages=2)


def test_in_flight_matches_each_schedule() -> None:
    assert in_flight("1f1b", 4, 1) == 3
    assert in_flight("gpipe", 4, 3) == 4
    assert in_flight("zero-bubble", 4, 3) == 4
    assert in_flight("interleaved", 4, 0, 1) == 4
    assert in_flight("interleaved", 4, 0, 2) == (2 * 3 + 4 + 1) / 2
    with pytest.raises(ValueError, match="stage_index"):
        in_flight("1f1b", 4, 4)
    with pytest.raises(ValueError, match="schedule"):
        in_flight("pipedream", 4, 0)


def test_memory_bounds_use_each_schedules_in_flight_count() -> None:
    """Stage 3 of 4 holds 1 micro-batch under 1F1B but 4 under zero-bubble: a capacity
    that fits the former's even split does not fit the latter's."""
    profile = uniform_profile(8, fwd_s=1.0, bwd_input_s=1.0, param_bytes=1.0,
                              activation_bytes=10.0)
    capacity = 2 * 2 + 4 * 2 * 10.0  # stage 0 under 1F1B with two layers
    even = ((0, 2), (2, 4), (4, 6), (6, 8))
    assert memory_bounds(profile, 4, capacity, "1f1b") == even
    zb = memory_bounds(profile, 4, capacity, "zero-bubble")
    assert zb == even  # every stage now holds 4, still fits two layers each
    assert memory_bounds(profile, 4, capacity - 1, "zero-bubble") is None
    folded = fold_profile(profile, 2)
    chunks = memory_bounds(folded, 2, 1e9, "interleaved")
    assert chunks is not None and len(chunks) == 2


def test_plan_round_trips_its_schedule_and_deferral() -> None:
    for schedule in SCHEDULES:
        plan = ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=4,
                                     schedule=schedule)
        for defer in (False, True):
            value = dataclasses.replace(plan, defer_weight_grad=defer)
            again = ExecutionPlan.from_dict(json.loads(value.to_json()))
            assert again == value and hash(again) == hash(value)
    with pytest.raises(ValueError, match=r"plan\.schedule"):
        ExecutionPlan.uniform(dp=1, pp=1, num_layers=1, num_microbatches=1, schedule="x")


# ---------------------------------------------------------------- the planner keeps the job's schedule

@pytest.mark.parametrize(("schedule", "virtual_stages"),
                         [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zero-bubble", 1)])
def test_planner_recovers_with_the_jobs_own_schedule(schedule: str,
                                                     virtual_stages: int) -> None:
    """Every candidate plan keeps ``[job] schedule``: the planner never switches a runtime
    job to a schedule the runtime cannot execute, and an interleaved job's recoveries move
    whole columns (every chunk of a stage) between workers."""
    from chameleon_ft.policy import Planner
    from chameleon_ft.spec.config import config_from_mapping

    config = config_from_mapping({
        "cluster": {"num_nodes": 2, "devices_per_node": 4},
        "job": {"pp": 2, "dp": 4, "global_batch": 16, "schedule": schedule,
                "virtual_stages": virtual_stages},
        "profile": {"kind": "uniform", "num_layers": 8, "fwd_s": 0.01, "bwd_input_s": 0.01,
                    "bwd_weight_s": 0.005, "param_bytes": 1e6, "optimizer_bytes": 2e6,
                    "output_bytes": 1e4},
    })
    planner = Planner(config)
    assert planner.profile.num_layers == 8 // virtual_stages
    assert planner.initial_plan.schedule == schedule
    for failed in ([1], [0, 1], [2, 6]):
        decision = planner.decide(planner.initial_plan, failed, horizon_s=3600.0)
        for c in decision.candidates:
            if c.feasible:
                assert c.plan is not None and c.plan.schedule == schedule, c.strategy
                c.plan.validate()
                assert c.plan.num_layers == planner.profile.num_layers


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 7), st.data(), st.integers(1, 40), st.sampled_from(SCHEDULES),
       st.booleans())
def test_peak_activation_is_the_orders_peak(stages: int, data: st.DataObject, m: int,
                                            schedule: str, padded: bool) -> None:
    """The closed-form walk of :func:`peak_activation` equals walking the order itself
    (zero-bubble: the variant with each W right after its B)."""
    from chameleon_ft.perf.orders import peak_activation

    stage = data.draw(st.integers(0, stages - 1))
    v = data.draw(st.integers(1, 4)) if schedule == "interleaved" else 1
    acts = data.draw(st.lists(st.integers(0, 9).map(float), min_size=v, max_size=v))
    kwargs = {"padded": padded} if schedule == "interleaved" else {}
    if schedule == "zero-bubble":
        kwargs = {"lag": 0}
    held = peak = 0.0
    for kind, r, _ in stage_order(stages, stage, m, schedule, v, **kwargs):
        if kind is OpKind.F:
            held += acts[r]
            peak = max(peak, held)
        elif kind is OpKind.W or schedule != "zero-bubble":
            held -= acts[r]
    assert peak_activation(acts, stages, stage, m, schedule,
                           padded and schedule == "interleaved") == pytest.approx(peak)


# ---------------------------------------------------------------- the compiled scheduler

def drawn_damage(plan: ExecutionPlan, data: st.DataObject, ideal: bool, *,
                 dead: tuple[int, int], speeds: list[float]
                 ) -> tuple[ExecutionPlan, Topology, dict[int, float] | None]:
    """``plan`` with ``dead[0]`` to ``dead[1]`` drawn workers rerouted (as it is when some
    stage would lose every replica), its links (free, or two workers a node), and either
    unit speeds or a speed drawn from ``speeds`` for every worker."""
    with contextlib.suppress(ValueError):  # some stage lost every replica
        plan = reroute_plan(plan, data.draw(st.lists(st.sampled_from(list(plan.workers)),
                                                     min_size=dead[0], max_size=dead[1])))
    workers = sum(pipe.num_stages for pipe in plan.pipelines)
    topology = free_links(workers) if ideal else real_links(workers)
    drawn = data.draw(st.none() | st.fixed_dictionaries(
        {w: st.sampled_from(speeds) for w in plan.workers}))
    return plan, topology, drawn


@pytest.mark.skipif(not kernel_module.COMPILED, reason="the compiled kernel is not built")
@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.integers(1, 8), st.data(),
       st.sampled_from(SCHEDULES), st.booleans(), st.booleans())
def test_compiled_scheduler_gives_the_python_timeline_bit_for_bit(
        lengths: list[int], m: int, data: st.DataObject, schedule: str, defer: bool,
        ideal: bool) -> None:
    """Every rule, variant, speed mix and reroute: the kernel's timeline (end times, busy
    seconds, activation peaks, op orders, critical path) equals the reference's exactly."""
    v = data.draw(st.integers(1, 3)) if schedule == "interleaved" else 1
    profile, plan = folded_plan(lengths, m, schedule, defer, v,
                                fwd_s=data.draw(st.sampled_from([1.0, 0.3, 1.7])))
    plan, topology, speeds = drawn_damage(plan, data, ideal, dead=(1, 3),
                                          speeds=[0.5, 0.8, 1.0, 1.3])
    for variant in graph_module.schedule_variants(plan, range(plan.num_pipelines), v):
        graph = graph_module.build_graph(plan, profile, topology, None, speeds, None,
                                            variant)
        for rule in list_scheduler.PRIORITIES:
            with_ops = data.draw(st.booleans())
            python = list_scheduler._list_schedule(graph, rule, with_ops, compiled=False)
            kernel = list_scheduler._list_schedule(graph, rule, with_ops, compiled=True)
            assert kernel == python
        assert (kernel_module._listsched.stream_totals(graph.op_dur, graph.op_act,
                                                         graph.streams)
                == graph.stream_totals_python())


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=2, max_size=6), st.integers(1, 6), st.data(),
       st.sampled_from(SCHEDULES), st.booleans(), st.booleans())
def test_copied_pipelines_build_the_graph_stage_by_stage_would(
        lengths: list[int], m: int, data: st.DataObject, schedule: str, defer: bool,
        ideal: bool) -> None:
    """Intact pipelines alike (same costs, backward, speeds, link kinds) are copied from the
    first one: every array of the graph, ids, streams and edge order equal building every
    pipeline stage by stage, with reroutes, deferred W's, speeds and two workers a node."""
    v = data.draw(st.integers(1, 3)) if schedule == "interleaved" else 1
    profile, plan = folded_plan(sorted(lengths), m, schedule, defer, v)
    plan, topology, speeds = drawn_damage(plan, data, ideal, dead=(0, 2), speeds=[0.5, 1.0])
    for variant in graph_module.schedule_variants(plan, range(plan.num_pipelines), v):
        copied = graph_module.build_graph(plan, profile, topology, None, speeds, None,
                                             variant)
        built = graph_module.build_graph(plan, profile, topology, None, speeds, None,
                                            variant, copy_intact=False)
        assert dataclasses.asdict(copied) == dataclasses.asdict(built)


def test_alike_pipelines_are_copied() -> None:
    """Eight identical pipelines, two workers a node: the links of even and odd pipelines
    differ in kind (workers 0-1 share a node, 3-4 do not), so one of each is built and the
    other six are copied."""
    profile, plan = folded_plan([3] * 8, 2, "1f1b", False, 1)
    builder_calls = []
    original = graph_module._GraphBuilder.add_stage

    def counting(self: graph_module._GraphBuilder, p: int, s: int, chunks: object) -> None:
        builder_calls.append(p)
        original(self, p, s, chunks)  # type: ignore[arg-type]

    graph_module._GraphBuilder.add_stage = counting  # type: ignore[method-assign]
    try:
        graph_module.build_graph(plan, profile, real_links(24))
    finally:
        graph_module._GraphBuilder.add_stage = original  # type: ignore[method-assign]
    assert sorted(set(builder_calls)) == [0, 1]


@pytest.mark.skipif(not kernel_module.COMPILED, reason="the compiled kernel is not built")
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**6)), st.data(), st.integers(-10**6, 10**6))
def test_compiled_shift_is_the_python_one(ids: list[int], data: st.DataObject,
                                          delta: int) -> None:
    lo = data.draw(st.integers(0, len(ids)))
    hi = data.draw(st.integers(lo, len(ids)))
    assert (kernel_module._listsched.shifted(ids, lo, hi, delta)
            == kernel_module._shifted_python(ids, lo, hi, delta))
    with pytest.raises(ValueError, match="not a range"):
        kernel_module._listsched.shifted(ids, 0, len(ids) + 1, delta)


@pytest.mark.skipif(not kernel_module.COMPILED, reason="the compiled kernel is not built")
def test_compiled_scheduler_refuses_a_malformed_graph() -> None:
    """A graph whose tables disagree is a ValueError, never a crash."""
    plan = reroute_plan(ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=2),
                        [1])
    graph = graph_module.build_graph(plan, uniform_profile(4, fwd_s=1.0), free_links(4))
    run = list_scheduler._ListRun(graph, "rerouted-first", True)

    def kernel(**change: object) -> object:
        args = dict(op_dur=graph.op_dur, op_act=graph.op_act,
                    edge_src=graph.edge_src, edge_dst=graph.edge_dst,
                    edge_delay=graph.edge_delay, wi_streams=run.wi_streams,
                    streams=graph.streams, op_kind=graph.op_kind, op_pipeline=graph.op_pipeline,
                    op_stage=graph.op_stage, op_mb=graph.op_mb, op_chunk=graph.op_chunk,
                    op_foreign=graph.op_foreign, ranks=[0, 1], rule=0,
                    with_order=True)
        args.update(change)
        return kernel_module._listsched.run(*args.values())

    assert kernel()  # the graph as built runs
    with pytest.raises(ValueError, match="out of range"):
        kernel(edge_dst=[*graph.edge_dst[:-1], len(graph.op_kind) + 5])
    with pytest.raises(ValueError, match="edge_delay"):
        kernel(edge_delay=graph.edge_delay[:-1])
    with pytest.raises(ValueError, match="op_act"):
        kernel(op_act=graph.op_act[:-1])
    with pytest.raises(ValueError, match="rule"):
        kernel(rule=7)
    with pytest.raises(ValueError, match="exactly one"):
        kernel(streams=[ids[:-1] if i == 0 else ids for i, ids in enumerate(graph.streams)])
    with pytest.raises(ValueError, match="another's"):
        kernel(streams=[[*ids, graph.streams[0][0]] if i == 1 else ids
                        for i, ids in enumerate(graph.streams)])
