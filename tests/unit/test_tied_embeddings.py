"""A head tied to the embedding in the planning core: the profile carries the shared
weight's bytes, both copies count in memory, and the estimator prices the copies' sum."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_shapes import even_pipelines

from chameleon_ft.perf import Topology, build_schedule, estimate, tie_members
from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.profile import (
    Profile,
    analytic_profile,
    fold_profile,
    unfold_profile,
    uniform_profile,
)
from chameleon_ft.runtime.step_sync import tie_reductions
from chameleon_ft.spec import ClusterSpec, ModelSpec, device_preset, model_preset

SMALL = ModelSpec(name="small", num_blocks=6, hidden_size=256, num_heads=4,
                  vocab_size=5000, seq_len=128, tied_embeddings=True)
"""8 planner layers: embedding, 6 blocks, head; tied."""
CLUSTER = ClusterSpec(num_nodes=4, devices_per_node=2)


def _profiles(model: ModelSpec = SMALL, tp: int = 1,
              train_dtype: str | None = None) -> tuple[Profile, Profile]:
    """(tied, untied) analytic profiles of ``model`` on an A100."""
    return tuple(  # type: ignore[return-value]
        analytic_profile(dataclasses.replace(model, tied_embeddings=tied),
                         device_preset("a100-80g"), cluster=CLUSTER, tp=tp,
                         train_dtype=train_dtype)
        for tied in (True, False))


# ------------------------------------------------------------------ the profile


@pytest.mark.parametrize(("tp", "train_dtype", "weight_bytes"),
                         [(1, None, 2), (2, None, 2), (1, "float32", 4), (2, "float64", 8)])
def test_analytic_tied_bytes_are_the_shared_matrix_per_device(
        tp: int, train_dtype: str | None, weight_bytes: int) -> None:
    tied, untied = _profiles(tp=tp, train_dtype=train_dtype)
    v, h = SMALL.vocab_size, SMALL.hidden_size
    assert tied.tied_bytes == weight_bytes * v * h / tp
    # the same convention as the layers' parameter bytes: the embedding is exactly it
    assert tied.tied_bytes == tied.layers[0].param_bytes
    assert untied.tied_bytes == 0.0


def test_tied_profile_round_trips_json() -> None:
    tied, _ = _profiles(tp=2)
    text = tied.to_json()
    assert json.loads(text)["tied_bytes"] == tied.tied_bytes > 0
    again = Profile.from_json(text)
    assert again == tied and again.tied_bytes == tied.tied_bytes


def test_a_profile_file_without_tied_bytes_loads_untied() -> None:
    tied, _ = _profiles()
    doc = json.loads(tied.to_json())
    del doc["tied_bytes"]  # as written before ties were priced
    old = Profile.from_json(json.dumps(doc))
    assert old.tied_bytes == 0.0 and old.layers == tied.layers


@pytest.mark.parametrize("value", [-1.0, "1e6", float("nan"), True])
def test_bad_tied_bytes_are_refused_by_name(value: object) -> None:
    doc = json.loads(uniform_profile(4).to_json())
    doc["tied_bytes"] = value
    with pytest.raises(ValueError, match=r"profile\.tied_bytes"):
        Profile.from_json(json.dumps(doc))
    with pytest.raises(ValueError, match=r"profile\.tied_bytes"):
        dataclasses.replace(uniform_profile(4), tied_bytes=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("v", "attach", "head_column"), [(3, False, 1), (2, False, 3),
                                                          (3, True, 1), (2, True, 2)])
def test_folding_keeps_the_tie_in_the_head_s_column(v: int, attach: bool,
                                                    head_column: int) -> None:
    """8 layers in 3 rounds are cut 3, 3, 2: the head is column 1 of 3, not the last.
    Attached ends leave 6 slots (3 of 2, or 2 of 3)."""
    tied, _ = _profiles()
    folded = fold_profile(tied, v, attach_ends=attach)
    assert folded.tied_bytes == tied.tied_bytes
    assert folded.tied_layers == (0, head_column)
    assert folded.rounds[-1][-1].name.endswith("head")
    assert Profile.from_json(folded.to_json()).tied_layers == (0, head_column)
    unfolded = unfold_profile(folded)  # attached ends stay joined to their blocks
    assert unfolded.tied_layers == (0, unfolded.num_layers - 1)
    assert unfolded.layers[-1].name.endswith("head") and unfolded.tied_bytes == tied.tied_bytes


# ------------------------------------------------------------------ memory


def test_each_holder_is_charged_its_own_copy() -> None:
    """Tied or not, the embedding and the head each hold the V x h matrix (parameters,
    gradients, optimizer state): the layers, and so every memory figure, are the same."""
    for tp in (1, 2):
        tied, untied = _profiles(tp=tp)
        assert tied.layers == untied.layers
        v, h = SMALL.vocab_size, SMALL.hidden_size
        assert tied.layers[0].param_bytes == 2 * v * h / tp
        assert tied.layers[-1].param_bytes == 2 * (v * h + h) / tp  # matrix + final norm
        assert tied.layers[-1].static_bytes == 16 * (v * h + h) / tp
        assert tied.total_param_bytes == pytest.approx(
            2 * (2 * v * h + h + SMALL.num_blocks * SMALL.block_params()) / tp)
    topo = Topology(CLUSTER, 2)
    for dp, pp in ((1, 1), (2, 2), (1, 4)):
        plan = ExecutionPlan.uniform(dp=dp, pp=pp, num_layers=tied.num_layers,
                                     num_microbatches=4 * dp)
        a, b = estimate(plan, tied, topo), estimate(plan, untied, topo)
        assert dict(a.peak_memory_bytes) == dict(b.peak_memory_bytes)
        # the first and the last stage each carry a full copy's 16 bytes a parameter
        first, last = plan.pipelines[0].stages[0].worker, plan.pipelines[0].stages[-1].worker
        assert a.peak_memory_bytes[first] >= 16 * v * h / 2
        assert a.peak_memory_bytes[last] >= 16 * v * h / 2


# ------------------------------------------------------------------ the estimator


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_pp2_adds_one_allreduce_of_the_tied_bytes_over_both_ends(dp: int) -> None:
    """With two stages every worker holds the embedding or the head: the copies' sum runs
    after every bucket, so the step grows by exactly its ring time over ``2 dp`` workers."""
    tied, untied = _profiles()
    topo = Topology(CLUSTER, 2)
    plan = ExecutionPlan.uniform(dp=dp, pp=2, num_layers=tied.num_layers,
                                 num_microbatches=4 * dp)
    a, b = estimate(plan, tied, topo), estimate(plan, untied, topo)
    union = tuple(sorted({*plan.holders(0), *plan.holders(tied.num_layers - 1)}))
    assert len(union) == 2 * dp and a.tie_workers == union and b.tie_workers == ()
    expected = topo.allreduce_s(union, tied.tied_bytes)
    assert expected > 0
    assert a.step_s - b.step_s == pytest.approx(expected, rel=1e-9)
    assert a.breakdown.allreduce_s - b.breakdown.allreduce_s == pytest.approx(expected,
                                                                             rel=1e-9)
    assert a.sync_rounds == b.sync_rounds  # the buckets themselves are unchanged


def test_a_longer_pipeline_pays_the_sum_over_its_ends_only() -> None:
    """dp 2 x pp 4: the group is the 2 dp workers of the first and the last stage; the
    middle stages take no part. It costs at most its own ring time."""
    tied, untied = _profiles()
    topo = Topology(CLUSTER, 2)
    plan = ExecutionPlan.uniform(dp=2, pp=4, num_layers=tied.num_layers, num_microbatches=8)
    a, b = estimate(plan, tied, topo), estimate(plan, untied, topo)
    ends = [st.worker for pipe in plan.pipelines for st in (pipe.stages[0], pipe.stages[-1])]
    assert a.tie_workers == tuple(sorted(ends)) and len(a.tie_workers) == 4
    ring = topo.allreduce_s(a.tie_workers, tied.tied_bytes)
    assert 0 < a.step_s - b.step_s <= ring * (1 + 1e-9)


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_holding_both_ends_is_a_local_sum(dp: int) -> None:
    """pp 1: each worker holds both copies and adds them itself, whatever dp is (its
    replicas have already all-reduced each copy in the buckets)."""
    tied, untied = _profiles()
    topo = Topology(CLUSTER, 2)
    plan = ExecutionPlan.uniform(dp=dp, pp=1, num_layers=tied.num_layers,
                                 num_microbatches=4 * dp)
    a, b = estimate(plan, tied, topo), estimate(plan, untied, topo)
    assert a.tie_workers == () and a.step_s == b.step_s
    assert a.breakdown == b.breakdown


def test_the_group_is_the_runtime_s() -> None:
    """The estimator's group is the one the workers reduce over (``step_sync``), and
    empty exactly when the runtime sums locally."""
    tied, _ = _profiles()
    last = tied.num_layers - 1
    pair = ((0, "embed.weight"), (last, "head.weight"))
    plans = [
        ExecutionPlan.uniform(dp=2, pp=2, num_layers=8, num_microbatches=4),
        ExecutionPlan.uniform(dp=3, pp=4, num_layers=8, num_microbatches=6,
                              placement="pipeline-major"),
        ExecutionPlan.uniform(dp=2, pp=1, num_layers=8, num_microbatches=4),
        ExecutionPlan(num_layers=8, pipelines=(
            Pipeline((Stage(0, 0, 4), Stage(2, 4, 8)), 2), Pipeline((Stage(3, 0, 8),), 2))),
    ]
    plans.append(reroute_plan(plans[1], [0]))
    for plan in plans:
        (tie,) = tie_reductions(plan, [pair])
        assert tie_members(plan, tied) == (() if tie["local"] else tuple(tie["members"]))
    assert tie_members(plans[0], dataclasses.replace(tied, tied_bytes=0.0)) == ()


def test_the_runtime_s_rounds_do_not_carry_the_tie() -> None:
    """``sync_rounds`` is what the workers all-reduce layer by layer: every member of a
    bucket holds its layers, so the tie, over workers holding one end only, stays out."""
    tied, untied = _profiles()
    topo = Topology(CLUSTER, 2)
    plan = ExecutionPlan.uniform(dp=2, pp=2, num_layers=8, num_microbatches=4)
    assert build_schedule(plan, tied, topo).sync_rounds == \
        build_schedule(plan, untied, topo).sync_rounds
    for rnd in build_schedule(plan, tied, topo).sync_rounds:
        for bucket in rnd:
            assert all(set(bucket.workers) <= set(plan.holders(i)) for i in bucket.layers)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(1, 6), st.data(),
       st.floats(1e2, 1e4))
def test_brute_force_agrees_on_tied_plans(lengths: list[int], m: int, data: st.DataObject,
                                          tied_bytes: float) -> None:
    """Heterogeneous pipelines, optional reroutes, real links: the symmetric shortcut and
    the caches price the tie as a full simulation does."""
    num_layers = 6
    profile = dataclasses.replace(
        uniform_profile(num_layers, fwd_s=1.0, bwd_input_s=0.7, bwd_weight_s=0.5,
                        param_bytes=1e4, optimizer_bytes=2e4, activation_bytes=10,
                        output_bytes=1e2, optimizer_step_s=0.3),
        tied_bytes=tied_bytes)
    plan = ExecutionPlan(num_layers=num_layers, pipelines=even_pipelines(num_layers, lengths, m))
    if data.draw(st.booleans()):
        failed = data.draw(st.sampled_from(list(plan.workers)))
        with contextlib.suppress(ValueError):
            plan = reroute_plan(plan, [failed])
    nodes = -(-sum(lengths) // 3)
    topo = Topology(ClusterSpec(num_nodes=nodes, devices_per_node=3,
                                inter_node_gb_per_s=1e-5, intra_node_gb_per_s=1e-4), 3)
    fast = estimate(plan, profile, topo)
    again = estimate(plan, profile, topo)  # from the cache
    slow = estimate(plan, profile, topo, brute_force=True)
    assert fast.step_s == pytest.approx(slow.step_s, rel=1e-12) and again is fast
    assert fast.tie_workers == slow.tie_workers == tie_members(plan, profile)
    assert fast.breakdown.allreduce_s == pytest.approx(slow.breakdown.allreduce_s,
                                                       rel=1e-12, abs=1e-12)
    untied = estimate(plan, dataclasses.replace(profile, tied_bytes=0.0), topo)
    if fast.tie_workers:
        ring = topo.allreduce_s(fast.tie_workers, tied_bytes)
        assert untied.step_s <= fast.step_s <= untied.step_s + ring * (1 + 1e-9)
    else:
        assert fast.step_s == untied.step_s


def test_published_gpt_presets_are_tied_and_priced() -> None:
    """The GPT-3 presets tie their head: a pipelined plan pays the sum, on top of the
    same memory."""
    model = model_preset("gpt3-1.3b")
    assert model.tied_embeddings
    tied, untied = _profiles(model, tp=2)
    topo = Topology(CLUSTER, 2)
    plan = ExecutionPlan.uniform(dp=2, pp=2, num_layers=tied.num_layers, num_microbatches=8)
    a, b = estimate(plan, tied, topo), estimate(plan, untied, topo)
    assert a.max_memory_bytes == b.max_memory_bytes
    assert a.step_s - b.step_s == pytest.approx(topo.allreduce_s(a.tie_workers,
                                                                 tied.tied_bytes))
