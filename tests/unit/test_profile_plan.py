"""Profiles (analytic, uniform, JSON) and execution plans (construction, validation)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.plan import ExecutionPlan, Pipeline, Reroute, Stage, balanced_bounds
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.profile import Profile, analytic_profile, uniform_profile
from chameleon_ft.spec import ClusterSpec, device_preset, model_preset


def test_profile_json_round_trip(tmp_path: Path) -> None:
    profile = analytic_profile(model_preset("llama3-8b"), device_preset("h100-80g"), tp=2,
                               cluster=ClusterSpec(num_nodes=1, devices_per_node=8))
    path = tmp_path / "p.json"
    profile.save(path)
    again = Profile.load(path)
    assert again == profile
    assert again.meta["model"] == "llama3-8b"


def test_profile_rejects_malformed_documents(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        Profile.from_json("{")
    with pytest.raises(ValueError, match="format"):
        Profile.from_json('{"format": "other"}')
    doc = uniform_profile(2, fwd_s=1.0).to_json().replace('"fwd_s": 1.0', '"fwd_s": -1.0')
    with pytest.raises(ValueError, match="fwd_s"):
        Profile.from_json(doc)
    with pytest.raises(ValueError, match="cannot read"):
        Profile.load(tmp_path / "none.json")


def test_analytic_profile_matches_the_formulas() -> None:
    """Under the flat ``mfu`` model a block's time is its FLOPs over ``peak * mfu``: the
    products, and causal fused attention (half the scores; 2.5 forwards backward)."""
    model = model_preset("llama2-7b")
    device = dataclasses.replace(device_preset("a100-80g"), mfu=0.5)
    profile = analytic_profile(model, device, recompute="none")
    assert profile.num_layers == model.num_layers
    params = sum(layer.param_bytes for layer in profile.layers) / 2
    assert 6.6e9 < params < 6.9e9  # Llama 2 7B has 6.74 B parameters
    b, s, h, f = 1, model.seq_len, model.hidden_size, model.ffn
    products = 2 * b * s * (4 * h * h + 3 * h * f)
    attention = 4 * b * s * s * h / 2
    assert profile.layers[1].fwd_s == pytest.approx((products + attention) / device.flops)
    assert profile.layers[1].bwd_s == pytest.approx((2 * products + 2.5 * attention)
                                                    / device.flops)
    assert profile.layers[1].bwd_weight_s == pytest.approx(products / device.flops)
    # tensor parallelism divides compute and per-device bytes (free links here)
    tp2 = analytic_profile(model, device, tp=2, recompute="none")
    assert tp2.layers[1].fwd_s == pytest.approx(profile.layers[1].fwd_s / 2)
    assert tp2.layers[1].param_bytes == pytest.approx(profile.layers[1].param_bytes / 2)
    # ... and costs communication when the links are not free
    cluster = ClusterSpec(num_nodes=1, devices_per_node=8)
    tp2c = analytic_profile(model, device, tp=2, cluster=cluster, recompute="none")
    assert tp2c.layers[1].fwd_s > tp2.layers[1].fwd_s
    full = analytic_profile(model, device, recompute="full")
    assert full.layers[1].activation_bytes < profile.layers[1].activation_bytes
    assert full.layers[1].bwd_input_s > profile.layers[1].bwd_input_s


def test_uniform_plan_layout() -> None:
    plan = ExecutionPlan.uniform(dp=3, pp=2, num_layers=5, num_microbatches=12)
    assert plan.pipelines[1].stages[1].worker == 1 * 3 + 1
    assert [st.layers for st in plan.pipelines[0].stages] == [range(0, 3), range(3, 5)]
    assert plan.microbatch_offsets() == (0, 4, 8)
    assert plan.holders(4) == (3, 4, 5)
    major = ExecutionPlan.uniform(dp=3, pp=2, num_layers=5, num_microbatches=12,
                                  placement="pipeline-major")
    assert major.pipelines[1].stages[0].worker == 2
    assert ExecutionPlan.from_dict(plan.to_dict()) == plan


def _plan(*pipelines: tuple[tuple[tuple[int, int, int], ...], int],
          reroutes: tuple[Reroute, ...] = ()) -> ExecutionPlan:
    return ExecutionPlan(
        num_layers=4,
        pipelines=tuple(Pipeline(tuple(Stage(*s) for s in stages), m) for stages, m in pipelines),
        reroutes=reroutes,
    )


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (_plan((((0, 0, 2), (1, 3, 4)), 2)), "starts at layer 3"),
        (_plan((((0, 0, 2), (1, 2, 3)), 2)), "covers layers 0..2"),
        (_plan((((0, 0, 2), (1, 2, 4)), 2), (((1, 0, 4),), 2)), "worker 1 is used twice"),
        (_plan((((0, 0, 4),), 0)), "at least one micro-batch"),
        (_plan((((0, 0, 2), (1, 2, 4)), 2), (((2, 0, 1), (3, 1, 4)), 2),
               reroutes=(Reroute(0, 1, ((3, 2),)),)), "holds layers [1, 4)"),
        (_plan((((0, 0, 2), (1, 2, 4)), 2), (((2, 0, 2), (3, 2, 4)), 2),
               reroutes=(Reroute(0, 1, ((3, 1),)),)), "shares sum to 1"),
        (_plan((((0, 0, 2), (1, 2, 4)), 2), (((2, 0, 2), (3, 2, 4)), 2),
               reroutes=(Reroute(0, 1, ((0, 2),)),)), "same pipeline"),
    ],
)
def test_validate_says_what_is_wrong(plan: ExecutionPlan, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        plan.validate()


def test_validate_checks_the_global_batch() -> None:
    plan = ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=8)
    plan.validate(num_microbatches=8)
    with pytest.raises(ValueError, match="needs 10"):
        plan.validate(num_microbatches=10)


def test_reroute_assignment_gives_each_peer_its_share() -> None:
    r = Reroute(0, 1, ((4, 3), (5, 1), (7, 2)))
    order = r.assignment()
    assert sorted(order) == [4, 4, 4, 5, 7, 7]
    assert order[0] != order[1]  # spread, not in bursts


def test_reroute_plan_spreads_and_fails_without_replica() -> None:
    plan = ExecutionPlan.uniform(dp=4, pp=2, num_layers=4, num_microbatches=16)
    rerouted = reroute_plan(plan, [5])  # stage 1 of pipeline 1
    (r,) = rerouted.reroutes
    assert (r.pipeline, r.stage) == (1, 1)
    assert sorted(n for _, n in r.shares) == [1, 1, 2]
    assert 5 not in rerouted.workers
    with pytest.raises(ValueError, match="no live replica"):
        reroute_plan(plan, [4, 5, 6, 7])


def _all_bounds(n: int, k: int) -> list[list[tuple[int, int]]]:
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        out.append(list(itertools.pairwise(edges)))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.integers(1, 8))
def test_balanced_bounds_is_optimal(costs: list[int], num_stages: int) -> None:
    if num_stages > len(costs):
        with pytest.raises(ValueError):
            balanced_bounds(costs, num_stages)
        return
    bounds = balanced_bounds(costs, num_stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(lo < hi for lo, hi in bounds)
    best = min(max(sum(costs[lo:hi]) for lo, hi in b) for b in _all_bounds(len(costs),
                                                                            num_stages))
    assert max(sum(costs[lo:hi]) for lo, hi in bounds) == best


def test_plan_is_a_value() -> None:
    plan = ExecutionPlan.uniform(dp=2, pp=2, num_layers=4, num_microbatches=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_layers = 5  # type: ignore[misc]
    assert hash(plan) == hash(ExecutionPlan.from_dict(plan.to_dict()))


def test_a_pipeline_put_on_workers_is_the_one_built_directly() -> None:
    """``Pipeline.on_workers`` (and ``with_microbatches``) fill the new pipeline's slots
    themselves (not through the dataclass's constructor): every field is set, and the
    pipeline equals, hashes and reads like one built stage by stage, frozen as well."""
    source = Pipeline((Stage(0, 0, 2), Stage(1, 2, 3), Stage(2, 3, 6)), 4)
    moved = source.on_workers([7, 5, 9], num_microbatches=3)
    built = Pipeline((Stage(7, 0, 2), Stage(5, 2, 3), Stage(9, 3, 6)), 3)
    assert {f.name for f in dataclasses.fields(Pipeline)} == {
        "stages", "num_microbatches", "_layout", "_hash", "_table"}
    assert moved == built and hash(moved) == hash(built) and repr(moved) == repr(built)
    assert (moved.workers, moved.layout, moved.layer_ranges) == (
        built.workers, built.layout, built.layer_ranges)
    assert source.on_workers([0, 1, 2]) == source
    assert source.with_microbatches(4) is source
    fewer = source.with_microbatches(2)
    assert fewer == Pipeline(source.stages, 2) and fewer.stages is source.stages
    assert hash(fewer) == hash(Pipeline(source.stages, 2)) and fewer.layout == source.layout
    with pytest.raises(dataclasses.FrozenInstanceError):
        moved.num_microbatches = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="workers: 2 given"):
        source.on_workers([1, 2])


def test_a_placed_pipeline_looks_its_stages_up_only_when_read() -> None:
    """A pipeline put on workers keeps its workers and ranges as a table and looks its
    stage objects up at the first read of ``stages`` (re-plans build hundreds of pipelines
    that are only read through their tables): until then equality, hashing, the tables and
    a change of micro-batches work without them; once read they are the shared stages, and
    the pipeline pickles, copies and ``replace``-s like one built directly."""
    import copy
    import pickle

    from chameleon_ft.plan.pipeline import shared_stage

    slot = vars(Pipeline)["stages"]  # the stored stages, unset until read
    source = Pipeline((Stage(0, 0, 2), Stage(1, 2, 3), Stage(2, 3, 6)), 4)
    moved = source.on_workers([7, 5, 9])
    fewer = moved.with_microbatches(2)
    built = Pipeline((Stage(7, 0, 2), Stage(5, 2, 3), Stage(9, 3, 6)), 2)
    assert fewer == built and hash(fewer) == hash(built) and fewer.table is moved.table
    assert (moved.workers, moved.layout, moved.num_stages) == ((7, 5, 9), source.layout, 3)
    for unread in (moved, fewer):
        with pytest.raises(AttributeError):
            slot.__get__(unread)
    assert moved.stages == built.stages and moved.stages[1] is shared_stage(5, 2, 3)
    assert slot.__get__(moved) is moved.stages  # kept once read
    for twin in (pickle.loads(pickle.dumps(fewer)), copy.deepcopy(fewer),
                 dataclasses.replace(fewer, num_microbatches=2)):
        assert twin == built and twin.stages == built.stages and repr(twin) == repr(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        moved.stages = built.stages  # type: ignore[misc]


def test_file_profile_through_the_config(tmp_path: Path) -> None:
    from chameleon_ft.profile import build_profile
    from chameleon_ft.spec import config_from_mapping

    uniform_profile(6, fwd_s=0.5, bwd_input_s=0.5, param_bytes=10).save(tmp_path / "p.json")
    doc = {
        "cluster": {"num_nodes": 1, "devices_per_node": 4},
        "job": {"pp": 2, "dp": 2, "global_batch": 8},
        "profile": {"kind": "file", "path": "p.json"},
    }
    config = config_from_mapping(doc, base_dir=str(tmp_path))
    assert build_profile(config).num_layers == 6
    doc["model"] = {"preset": "gpt3-1.3b"}
    with pytest.raises(ValueError, match=r"^profile\.path: .*26"):
        build_profile(config_from_mapping(doc, base_dir=str(tmp_path)))
    doc["profile"] = {"kind": "file"}
    with pytest.raises(ValueError, match=r"^profile\.path"):
        config_from_mapping(doc)


@pytest.mark.parametrize(("dtype", "per_param", "act_scale"),
                         [(None, 16, 1), ("bfloat16", 18, 1), ("float32", 16, 2),
                          ("float64", 32, 4)])
def test_analytic_profile_prices_the_runtimes_numerics(dtype: str | None, per_param: int,
                                                       act_scale: int) -> None:
    """The planner's mixed precision by default (bf16 weights and gradients, fp32 masters
    and moments); the runtime's bytes for its [train] dtype (bf16 compute copy beside fp32
    masters, gradients and moments; one dtype for everything otherwise)."""
    model, device = model_preset("gpt3-1.3b"), device_preset("a100-80g")
    base = analytic_profile(model, device, micro_batch=2)
    priced = analytic_profile(model, device, micro_batch=2, train_dtype=dtype)
    for mine, planner in zip(priced.layers, base.layers, strict=True):
        params = planner.param_bytes / 2
        assert mine.static_bytes == pytest.approx(per_param * params)
        assert mine.activation_bytes == pytest.approx(act_scale * planner.activation_bytes)
        assert mine.output_bytes == pytest.approx(act_scale * planner.output_bytes)
        assert mine.fwd_s == planner.fwd_s
    with pytest.raises(ValueError, match=r"train\.dtype"):
        analytic_profile(model, device, train_dtype="float16")


def test_a_uniform_layer_over_a_tp_group_is_its_share_plus_its_collectives() -> None:
    """A uniform profile's figures are a whole layer's: at tp 2 each device computes and
    holds half, and forward and input gradient each pay the layer's ring halves over the
    intra-node link ((k - 1) / k of the bytes plus k - 1 latencies apiece)."""
    from chameleon_ft.profile import UniformTP

    whole = dict(fwd_s=0.012, bwd_input_s=0.012, bwd_weight_s=0.012, param_bytes=1000.0,
                 optimizer_bytes=2000.0, activation_bytes=400.0, output_bytes=100.0,
                 optimizer_step_s=0.004)
    base = uniform_profile(8, **whole)
    assert uniform_profile(8, **whole, tp=UniformTP()) == base
    tp = UniformTP(degree=2, collectives=3, collective_bytes=4096.0, link=(1e-3, 2e9))
    half = uniform_profile(8, **whole, tp=tp)
    comm_s = 3 * (0.5 * 4096 / 2e9 + 1e-3)
    layer = half.layers[0]
    assert layer.fwd_s == pytest.approx(0.006 + comm_s)
    assert layer.bwd_input_s == pytest.approx(0.006 + comm_s)
    assert layer.bwd_weight_s == pytest.approx(0.006)
    assert (layer.param_bytes, layer.optimizer_bytes, layer.activation_bytes,
            layer.output_bytes) == (500.0, 1000.0, 200.0, 50.0)
    assert half.optimizer_step_s == pytest.approx(0.002)
    free = uniform_profile(8, **whole, tp=UniformTP(degree=2, collectives=3,
                                                    collective_bytes=4096.0))
    assert free.layers[0].fwd_s == pytest.approx(0.006)


def _testbed_doc() -> tuple[dict[str, Any], Path]:
    import tomllib

    root = Path(__file__).resolve().parents[2]
    return tomllib.loads((root / "examples" / "testbed8.toml").read_text()), root / "examples"


def test_the_testbed_at_tp2_prices_its_collectives_from_the_config() -> None:
    from chameleon_ft.profile import build_profile
    from chameleon_ft.spec.config import config_from_mapping

    doc, base_dir = _testbed_doc()
    tp1 = build_profile(config_from_mapping(doc, base_dir=str(base_dir)))
    doc["job"].update(tp=2, dp=1)
    doc["profile"].update(tp_collectives=1, tp_collective_bytes=4096.0)
    tp2 = build_profile(config_from_mapping(doc, base_dir=str(base_dir)))
    # the collectives' own latency a hop and the host time as the job file states them
    # (benchmarks/tp_layer_overhead.py measures them), over the 2.8 GB/s link
    stated = doc["profile"]
    hop_s = 0.5 * 4096 / 2.8e9 + stated["tp_collective_latency_s"]
    assert 0 < stated["tp_collective_latency_s"] < 1600e-6  # not the link's 1.6 ms
    assert tp2.layers[3].fwd_s == pytest.approx(tp1.layers[3].fwd_s / 2 + hop_s
                                                + stated["tp_host_fwd_s"])
    assert tp2.layers[3].bwd_input_s == pytest.approx(tp1.layers[3].bwd_input_s / 2 + hop_s
                                                      + stated["tp_host_bwd_s"])
    with pytest.raises(ValueError, match="tp_collectives"):
        doc["profile"]["tp_collectives"] = -1
        config_from_mapping(doc, base_dir=str(base_dir))


def test_a_sharded_layers_host_time_and_collective_latency_are_priced_at_tp2() -> None:
    """At tp 2 a uniform layer's forward is its device share, its ring halves at the
    collective's own latency a hop (not the link's) and the framework's host time; its
    input gradient the same with the backward's host time; its weight gradient its share
    alone."""
    from chameleon_ft.profile import build_profile
    from chameleon_ft.spec.config import config_from_mapping

    doc, base_dir = _testbed_doc()
    doc["job"].update(tp=2, dp=1)
    doc["profile"].update(tp_collectives=1, tp_collective_bytes=4096.0,
                          tp_collective_latency_s=3e-4, tp_host_fwd_s=2e-3,
                          tp_host_bwd_s=5e-3)
    layer = build_profile(config_from_mapping(doc, base_dir=str(base_dir))).layers[3]
    hop_s = 0.5 * 4096 / 2.8e9 + 3e-4  # the testbed's 2.8 GB/s intra-node link
    assert layer.fwd_s == pytest.approx(0.012 / 2 + hop_s + 2e-3)
    assert layer.bwd_input_s == pytest.approx(0.012 / 2 + hop_s + 5e-3)
    assert layer.bwd_weight_s == pytest.approx(0.012 / 2)
    # latency 0 is the link's (1.6 ms); the host time is paid on an ideal network too
    doc["profile"]["tp_collective_latency_s"] = 0.0
    link = build_profile(config_from_mapping(doc, base_dir=str(base_dir))).layers[3]
    assert link.fwd_s == pytest.approx(0.006 + 0.5 * 4096 / 2.8e9 + 1.6e-3 + 2e-3)
    doc["cluster"]["ideal_network"] = True
    ideal = build_profile(config_from_mapping(doc, base_dir=str(base_dir))).layers[3]
    assert (ideal.fwd_s, ideal.bwd_input_s) == pytest.approx((0.006 + 2e-3, 0.006 + 5e-3))


def test_the_tp_host_and_latency_fields_leave_tp1_unchanged() -> None:
    from chameleon_ft.profile import build_profile
    from chameleon_ft.spec.config import config_from_mapping

    doc, base_dir = _testbed_doc()
    plain = build_profile(config_from_mapping(doc, base_dir=str(base_dir)))
    doc["profile"].update(tp_collective_latency_s=3e-4, tp_host_fwd_s=2e-3,
                          tp_host_bwd_s=5e-3)
    with_fields = build_profile(config_from_mapping(doc, base_dir=str(base_dir)))
    assert with_fields.to_json() == plain.to_json()


@pytest.mark.parametrize("name", ["tp_host_fwd_s", "tp_host_bwd_s", "tp_collective_latency_s"])
@pytest.mark.parametrize("value", [-1e-3, float("nan"), float("inf"), "1ms"])
def test_bad_tp_host_and_latency_values_are_refused(name: str, value: Any) -> None:
    from chameleon_ft.profile import UniformTP
    from chameleon_ft.spec.config import config_from_mapping

    doc, base_dir = _testbed_doc()
    doc["profile"][name] = value
    with pytest.raises(ValueError, match=rf"^profile\.{name}: ") as err:
        config_from_mapping(doc, base_dir=str(base_dir))
    assert "\n" not in str(err.value)
    if not isinstance(value, str):
        with pytest.raises(ValueError, match=rf"^profile\.{name}: "):
            UniformTP(degree=2, **{name.removeprefix("tp_"): value})
