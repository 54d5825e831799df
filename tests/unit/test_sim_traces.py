"""Failure traces: generation statistics, determinism, CSV round trip and validation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from trace_oracle import reference_trace

from chameleon_ft.failures import (
    EventKind,
    Trace,
    TraceEvent,
    trace_from_csv,
    trace_to_csv,
    validate_trace,
)
from chameleon_ft.sim.traces import generate_trace
from chameleon_ft.spec.scenario import FailureSpec, scenario_specs

NODES, PER_NODE = 16, 8
DAY_S = 86400.0


def gen(failures: FailureSpec, seed: int = 0, days: float = 30.0) -> Trace:
    return generate_trace(failures, num_nodes=NODES, workers_per_node=PER_NODE,
                          duration_s=days * DAY_S, seed=seed)


def test_same_seed_same_trace_other_seed_differs():
    failures = FailureSpec(node_mtbf_hours=48.0)
    assert gen(failures, 3) == gen(failures, 3)
    assert gen(failures, 3) != gen(failures, 4)


@pytest.mark.parametrize("failures", [
    FailureSpec(node_mtbf_hours=20.0, repair="exponential", repair_hours=3.0),
    FailureSpec(node_mtbf_hours=5.0, repair="uniform", group_nodes=4),
    FailureSpec(node_mtbf_hours=8.0, repair="none"),
    FailureSpec(node_mtbf_hours=2.7, interarrival="weibull", weibull_shape=0.7,
                single_worker=0.0, single_node=0.9, multi_node=0.1, software=0.0,
                group_nodes=2, repair="exponential", repair_hours=0.75),
    FailureSpec(node_mtbf_hours=30.0, single_worker=1.0, single_node=0.0, multi_node=0.0,
                software=0.0, repair="fixed", repair_hours=48.0),
], ids=["exponential", "uniform-groups", "no-repair", "weibull-spot", "workers-only"])
def test_split_generator_draws_the_traces_of_the_original(failures):
    # generate_trace was split into named steps; the original is kept as the oracle.
    for seed in range(12):
        trace = gen(failures, seed, days=20.0)
        assert trace.events
        assert trace == reference_trace(failures, num_nodes=NODES, workers_per_node=PER_NODE,
                                        duration_s=20.0 * DAY_S, seed=seed)


def test_split_generator_matches_the_original_at_llama3_scale():
    failures = FailureSpec(repair="uniform")  # Llama 3's rate and mix
    trace = generate_trace(failures, num_nodes=2048, workers_per_node=1,
                           duration_s=54 * DAY_S, seed=0)
    assert trace.num_failures > 300
    assert trace == reference_trace(failures, num_nodes=2048, workers_per_node=1,
                                    duration_s=54 * DAY_S, seed=0)


def test_rate_and_mix_match_the_spec():
    # No repairs would shrink the cluster; with fast repairs the rate stays ~NODES / MTBF.
    failures = FailureSpec(node_mtbf_hours=100.0, repair="fixed", repair_hours=0.1)
    counts = {k: 0 for k in EventKind}
    total_days = 0.0
    for seed in range(4):
        trace = gen(failures, seed, days=60.0)
        total_days += 60.0
        for e in trace.events:
            counts[e.kind] += 1
    failures_n = sum(counts[k] for k in (EventKind.WORKER_FAIL, EventKind.NODE_FAIL,
                                         EventKind.GROUP_FAIL, EventKind.SOFTWARE))
    expected = NODES * total_days * 24 / 100.0
    assert failures_n == pytest.approx(expected, rel=0.1)
    assert counts[EventKind.SOFTWARE] / failures_n == pytest.approx(0.15, abs=0.04)
    assert counts[EventKind.WORKER_FAIL] / failures_n == pytest.approx(0.59, abs=0.05)
    # Every hardware failure is repaired (fixed 6 min), except those cut by the end.
    hardware = failures_n - counts[EventKind.SOFTWARE]
    assert hardware - 8 <= counts[EventKind.REPAIR] <= hardware + 3 * counts[EventKind.GROUP_FAIL]


def test_spare_nodes_fail_like_the_others_but_raise_no_software_fault():
    # 8 job nodes and 8 spares
    failures = FailureSpec(node_mtbf_hours=100.0, repair="fixed", repair_hours=0.1)
    job_hits = spare_hits = software = 0
    for seed in range(4):
        alone = generate_trace(failures, num_nodes=8, workers_per_node=PER_NODE,
                               duration_s=60 * DAY_S, seed=seed)
        trace = generate_trace(failures, num_nodes=8, workers_per_node=PER_NODE,
                               duration_s=60 * DAY_S, seed=seed, spare_nodes=8)
        # the job's nodes meet exactly the failures they meet without spares
        assert tuple(e for e in trace.events if not e.target or
                     min(e.workers(PER_NODE)) < 8 * PER_NODE) == alone.events
        for e in trace.events:
            if e.kind == EventKind.SOFTWARE:
                software += 1
            elif e.kind != EventKind.REPAIR:
                if min(e.workers(PER_NODE)) >= 8 * PER_NODE:
                    spare_hits += 1
                else:
                    job_hits += 1
    # the spares' hardware fails at the job nodes' hardware rate, and raises no software
    # fault
    assert spare_hits == pytest.approx(job_hits, rel=0.15)
    assert software == pytest.approx(job_hits * 0.15 / 0.85, rel=0.25)


def test_group_failures_take_the_aligned_switch_group():
    failures = FailureSpec(node_mtbf_hours=50.0, single_worker=0.0, single_node=0.0,
                           multi_node=1.0, software=0.0, group_nodes=4, repair="none")
    trace = gen(failures, 1)
    groups = [e.target for e in trace.events if e.kind == EventKind.GROUP_FAIL]
    assert groups
    for group in groups:
        assert len({n // 4 for n in group}) == 1


def test_no_repair_never_brings_hardware_back_and_cluster_can_empty():
    failures = FailureSpec(node_mtbf_hours=10.0, repair="none")
    trace = gen(failures, 2, days=60.0)
    assert trace.count([EventKind.REPAIR]) == 0
    dead = set()
    for e in trace.events:
        if e.kind in (EventKind.NODE_FAIL, EventKind.GROUP_FAIL):
            dead.update(e.target)
    assert len(dead) == NODES  # with nothing repaired, 60 days at 10 h MTBF kills all


def test_weibull_keeps_the_mean_rate():
    base = FailureSpec(node_mtbf_hours=100.0, repair="fixed", repair_hours=0.1)
    weibull = replace(base, interarrival="weibull", weibull_shape=0.7)
    n_exp = sum(gen(base, s, 60.0).num_failures for s in range(4))
    n_wei = sum(gen(weibull, s, 60.0).num_failures for s in range(4))
    assert n_wei == pytest.approx(n_exp, rel=0.2)


def test_csv_round_trip_is_exact():
    trace = gen(FailureSpec(node_mtbf_hours=24.0, repair="exponential", repair_hours=3.0), 5)
    text = trace_to_csv(trace)
    assert text.startswith("time_s,event,target\n")
    back = trace_from_csv(text, num_nodes=NODES, workers_per_node=PER_NODE)
    assert back == trace
    assert trace_to_csv(back) == text


@pytest.mark.parametrize(("rows", "message"), [
    ("10,node-fail,16\n100,end,\n", "row 1 .*node 16 is outside the cluster"),
    ("10,worker-fail,128\n100,end,\n", "row 1 .*worker 128 is outside the cluster"),
    ("10,node-fail,1\n5,node-fail,2\n100,end,\n", "row 2 .*out of time order"),
    ("10,node-fail,1\n20,node-fail,1\n100,end,\n", "row 2 .*already dead"),
    ("10,repair,1\n100,end,\n", "row 1 .*not broken"),
    ("10,explode,1\n100,end,\n", "row 1: unknown event 'explode'"),
    ("ten,node-fail,1\n100,end,\n", "row 1: time_s 'ten' is not a number"),
    ("200,node-fail,1\n100,end,\n", "row 1 .*after the end"),
    ("10,node-fail,1\n", "no 'end' row"),
    ("10,node-fail,x\n100,end,\n", "row 1: target 'x'"),
])
def test_bad_csv_names_the_row(rows, message):
    with pytest.raises(ValueError, match=message) as info:
        trace_from_csv("time_s,event,target\n" + rows, num_nodes=NODES,
                       workers_per_node=PER_NODE)
    assert "\n" not in str(info.value)


def test_bad_header():
    with pytest.raises(ValueError, match="header"):
        trace_from_csv("when,what\n", num_nodes=2, workers_per_node=1)


def test_worker_failure_then_node_failure_is_valid_and_repair_restores_all():
    trace = Trace((TraceEvent(1.0, EventKind.WORKER_FAIL, (3,)),
                   TraceEvent(2.0, EventKind.NODE_FAIL, (0,)),
                   TraceEvent(3.0, EventKind.REPAIR, (0,)),
                   TraceEvent(4.0, EventKind.WORKER_FAIL, (3,))), 10.0)
    validate_trace(trace, num_nodes=2, workers_per_node=8)


def test_generated_traces_are_valid_and_end_before_duration():
    for seed in range(3):
        trace = gen(FailureSpec(node_mtbf_hours=5.0, repair="uniform"), seed, days=5.0)
        assert all(e.time_s < trace.duration_s for e in trace.events)
        assert [e.time_s for e in trace.events] == sorted(e.time_s for e in trace.events)


def test_failure_spec_validation():
    with pytest.raises(ValueError, match=r"failures\.single_worker: the failure mix"):
        scenario_specs({"failures": {"single_worker": 0.5}})
    with pytest.raises(ValueError, match=r"failures\.repair: unknown value 'sometimes'"):
        scenario_specs({"failures": {"repair": "sometimes"}})
    with pytest.raises(ValueError, match=r"simulation\.policies\[1\]: unknown value 'magic'"):
        scenario_specs({"simulation": {"policies": ["chameleon", "magic"]}})
    with pytest.raises(ValueError, match=r"simulation\.nonsense: unknown key"):
        scenario_specs({"simulation": {"nonsense": 1}})
    sim, _ = scenario_specs({"simulation": {"sweep_node_mtbf_hours": [1.0],
                                            "sweep_repair_hours": [math.inf]}})
    assert sim.is_sweep
