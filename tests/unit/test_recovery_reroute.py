"""Rerouting: feasible exactly when every stage keeps a live replica; shares balanced."""

from __future__ import annotations

import functools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.plan.reroute import _live_peers
from chameleon_ft.policy import Planner
from chameleon_ft.spec.config import Config, config_from_mapping

GIB = 2**30


def make_config(dp: int, pp: int, *, memory_bytes: float | None = None,
                activation_bytes: float = 0.0, param_bytes: float = 0.0) -> Config:
    cluster: dict[str, object] = {"num_nodes": dp, "devices_per_node": pp}
    if memory_bytes is not None:
        cluster["device"] = {"name": "test", "peak_flops": 1e12, "mfu": 0.5,
                             "memory_bytes": int(memory_bytes), "memory_gb_per_s": 100.0}
    return config_from_mapping({
        "cluster": cluster,
        "job": {"pp": pp, "dp": dp, "global_batch": 4 * dp},
        "profile": {"kind": "uniform", "num_layers": 2 * pp, "fwd_s": 0.01,
                    "bwd_input_s": 0.01, "bwd_weight_s": 0.01, "param_bytes": param_bytes,
                    "activation_bytes": activation_bytes, "output_bytes": 1e3},
    })


@functools.cache
def planner(dp: int, pp: int) -> Planner:
    return Planner(make_config(dp, pp))


@st.composite
def failures(draw: st.DrawFn) -> tuple[int, int, frozenset[int]]:
    dp = draw(st.integers(2, 4))
    pp = draw(st.integers(1, 3))
    failed = draw(st.sets(st.integers(0, dp * pp - 1), min_size=1, max_size=dp * pp - 1))
    return dp, pp, frozenset(failed)


@settings(max_examples=25, deadline=None)
@given(failures())
def test_reroute_infeasible_exactly_when_a_stage_has_no_replica(
        case: tuple[int, int, frozenset[int]]) -> None:
    dp, pp, failed = case
    p = planner(dp, pp)
    plan = p.initial_plan
    stage_of = {st.worker: s for _, s, st in plan.iter_stages()}
    wiped = any(all(st.worker in failed for _, s2, st in plan.iter_stages() if s2 == s)
                for s in range(pp))
    decision = p.decide(plan, failed, horizon_s=3600.0)
    cand = next(c for c in decision.candidates if c.strategy == "reroute")
    assert cand.feasible is (not wiped), cand.reason
    if wiped:
        assert "no live replica" in cand.reason
        assert decision.strategy == "restart"
        return
    new = cand.plan
    assert new is not None
    new.validate()
    dead = {(r.pipeline, r.stage) for r in new.reroutes}
    assert {(q, s) for q, s, st in plan.iter_stages() if st.worker in failed} == dead
    for r in new.reroutes:
        for worker, _ in r.shares:
            assert worker not in failed
            assert stage_of[worker] == r.stage
    # shares of one dead stage differ by at most one micro-batch between its peers when it
    # is the only dead stage of its stage index
    for r in new.reroutes:
        if sum(1 for x in new.reroutes if x.stage == r.stage) == 1:
            counts = [n for _, n in r.shares]
            assert max(counts) - min(counts) <= 1


def test_reroute_from_a_rerouted_plan_respreads_over_survivors() -> None:
    p = planner(4, 2)
    first = p.decide(p.initial_plan, [0], policy="reroute", horizon_s=3600.0)
    assert first.strategy == "reroute"
    # worker 1 (stage 0 of pipeline 1) was a peer of the dead stage; now it dies too
    second = p.decide(first.plan, [1], policy="reroute", horizon_s=3600.0)
    assert second.strategy == "reroute"
    peers = {w for r in second.plan.reroutes for w, _ in r.shares}
    assert 0 not in peers and 1 not in peers
    assert len(second.plan.reroutes) == 2


def test_reroute_infeasible_when_peers_run_out_of_memory() -> None:
    # Each worker has room for its own in-flight activations and barely more.
    config = make_config(2, 2, memory_bytes=4.5 * GIB, activation_bytes=1 * GIB,
                         param_bytes=0.1 * GIB)
    p = Planner(config)
    assert p.failure_free.memory_fits
    decision = p.decide(p.initial_plan, [0], horizon_s=3600.0)
    cand = next(c for c in decision.candidates if c.strategy == "reroute")
    assert not cand.feasible
    assert "memory" in cand.reason
    for c in decision.candidates:
        if c.feasible:
            assert c.peak_memory_bytes <= 4.5 * GIB


def test_live_peers_are_every_other_holder_of_a_range_in_pipeline_order() -> None:
    """Mixed layouts (two rows of range objects, interleaved), skipped stages: the holders
    of each wanted range, as a walk over every stage lists them."""
    rng = random.Random(7)
    for _ in range(20):
        pipelines, worker = [], 0
        for _ in range(9):
            bounds = rng.choice([(0, 4, 8), (0, 2, 8), (0, 4, 8)])
            pipelines.append(Pipeline(tuple(Stage(worker + s, bounds[s], bounds[s + 1])
                                            for s in range(2)), 2))
            worker += 2
        plan = ExecutionPlan(num_layers=8, pipelines=tuple(pipelines))
        wanted = {(0, 4), (4, 8), (2, 8), (0, 2), (1, 3)}
        skip = {(rng.randrange(9), rng.randrange(2)) for _ in range(rng.randrange(4))}
        expected: dict[tuple[int, int], list[tuple[int, int]]] = {b: [] for b in wanted}
        for p, pipe in enumerate(plan.pipelines):
            for s, stage in enumerate(pipe.stages):
                key = (stage.first_layer, stage.end_layer)
                if key in wanted and (p, s) not in skip:
                    expected[key].append((p, stage.worker))
        assert _live_peers(plan, wanted, skip) == expected
