"""The runtime's model, data, optimizer and fault plan, in process (no workers)."""

from __future__ import annotations

import pytest
import torch

from chameleon_ft.runtime.workload.corpus import ByteCorpus, corpus_digest
from chameleon_ft.runtime.workload.models.gpt_layers import (
    GPTShape,
    StageModel,
    build_layer,
    loss_sum,
)
from chameleon_ft.spec.train import Fault, check_faults, parse_fault

SHAPE = GPTShape(num_blocks=2, hidden_size=32, num_heads=2, vocab_size=256, seq_len=16,
                 ffn_size=128)


def _stage(layers: range, dtype: torch.dtype = torch.float64) -> StageModel:
    stage = StageModel()
    for i in layers:
        stage.layers[str(i)] = build_layer(SHAPE, i, seed=3, dtype=dtype)
    return stage


def test_parameter_names_and_values_do_not_depend_on_the_split() -> None:
    whole = dict(_stage(range(4)).named_parameters())
    split = {**dict(_stage(range(0, 1)).named_parameters()),
             **dict(_stage(range(1, 4)).named_parameters())}
    assert sorted(whole) == sorted(split)
    assert all(name.startswith("layers.") for name in whole)
    assert all(torch.equal(whole[k], split[k]) for k in whole)


def test_split_forward_equals_whole_forward() -> None:
    x, y = ByteCorpus(SHAPE.seq_len).microbatch(0, 0, 2)
    whole = _stage(range(4))(x)
    first, second = _stage(range(0, 2)), _stage(range(2, 4))
    assert whole.shape == (2, SHAPE.seq_len, SHAPE.vocab_size)
    assert torch.allclose(second(first(x)), whole, atol=1e-12)
    loss = float(loss_sum(whole, y, 2 * SHAPE.seq_len).detach())
    assert loss == pytest.approx(5.545, abs=0.05)  # ln 256: an untrained byte model


def test_samples_depend_only_on_step_and_global_index() -> None:
    corpus = ByteCorpus(SHAPE.seq_len, seed=0)
    x1, y1 = corpus.microbatch(4, 3, 2)
    x2, y2 = ByteCorpus(SHAPE.seq_len, seed=0).microbatch(4, 3, 2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next bytes
    assert not torch.equal(x1, corpus.microbatch(5, 3, 2)[0])
    assert x1.dtype == torch.int64 and int(x1.max()) < 256
    assert len(corpus_digest()) == 16


def test_fault_parsing_and_checks() -> None:
    assert parse_fault("rank=2,step=5,kind=hang,phase=backward") == Fault(
        rank=2, step=5, kind="hang", phase="backward")
    assert parse_fault("rank=1,step=0").kind == "kill"
    for bad in ("rank=1", "rank=x,step=1", "rank=1,step=1,kind=explode", "nonsense",
                "rank=1,step=1,colour=red"):
        with pytest.raises(ValueError, match="fault"):
            parse_fault(bad)
    with pytest.raises(ValueError, match="rank 4 does not exist"):
        check_faults((parse_fault("rank=4,step=1"),), num_workers=4, steps=10)
    with pytest.raises(ValueError, match="never runs"):
        check_faults((parse_fault("rank=0,step=10"),), num_workers=4, steps=10)


def test_calibration_from_run_times() -> None:
    from chameleon_ft.profile import uniform_profile
    from chameleon_ft.runtime.profiler import calibrate_from_run, control_overhead_s

    base = uniform_profile(4, fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0, param_bytes=10.0,
                           optimizer_step_s=1.0)
    op_times = [{"step": s, "gen": 0, "worker": w, "layers": layers, "f_s": [0.2, 0.2],
                 "b_s": [0.6, 0.6], "optimizer_s": 0.05, "commit_wait_s": 0.003 + w * 0.001}
                for s in range(6) for w, layers in ((0, [0, 2]), (1, [2, 4]))]
    profile = calibrate_from_run(base, op_times)
    assert [c.fwd_s for c in profile.layers] == pytest.approx([0.1] * 4)
    assert [c.bwd_input_s for c in profile.layers] == pytest.approx([0.15] * 4)
    assert profile.optimizer_step_s == pytest.approx(0.1)  # a half-model stage took 0.05 s
    assert control_overhead_s(op_times) == pytest.approx(0.003)


def test_layer_build_of_a_python_model_is_measured_per_layer() -> None:
    # the profiler times any layered model's layers (here the testbed's emulated-device
    # model: 8 layers, a small first and last one), as it times the built-in GPT's
    from pathlib import Path

    from chameleon_ft.runtime.profiler import measure_model_layer_build
    from chameleon_ft.spec.config import load_config

    config = load_config(Path(__file__).resolve().parents[2] / "examples" / "testbed8.toml")
    build = measure_model_layer_build(config, repeats=3)
    assert len(build["times_s"]) == 8 and all(t > 0 for t in build["times_s"])
    assert build["layer_build_s"] >= 0 and build["layer_build_gb_per_s"] > 0


@pytest.mark.parametrize(("tied", "dtype", "elem"), [(True, "float32", 4), (True, "float64", 8),
                                                     (False, "float32", 4)])
def test_the_declared_profile_of_a_tied_model_prices_the_copies_sum(
        tied: bool, dtype: str, elem: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with a declared [profile] (here a random Llama from the architecture keys)
    gets its tied weight's bytes from its tied pair, in the run's dtype; the measurements
    of the host are stubbed (they need processes)."""
    from chameleon_ft.profile import Profile
    from chameleon_ft.runtime import profiler
    from chameleon_ft.spec.config import config_from_mapping

    monkeypatch.setattr(profiler, "measure_p2p", lambda: {
        "latency_s": 1e-5, "bandwidth_bytes_s": 1e9, "times_s": {}})
    monkeypatch.setattr(profiler, "measure_groups", lambda: {
        "comm_init_s": 0.01, "comm_per_rank_s": 0.001, "times_s": {}})
    monkeypatch.setattr(profiler, "measure_model_layer_build", lambda config: {
        "layer_build_s": 0.0, "layer_build_gb_per_s": 1.0, "times_s": []})
    monkeypatch.setattr(profiler, "measure_control", lambda: 1e-4)
    config = config_from_mapping({
        "model": {"source": "hf", "num_blocks": 2, "hidden_size": 32, "num_heads": 4,
                  "num_kv_heads": 2, "ffn_size": 48, "vocab_size": 97, "seq_len": 12,
                  "tied_embeddings": tied},
        "cluster": {"num_nodes": 1, "devices_per_node": 2, "device": "cpu"},
        "job": {"pp": 2, "dp": 1, "global_batch": 4, "micro_batch": 1},
        "profile": {"kind": "uniform", "num_layers": 4, "fwd_s": 0.01, "param_bytes": 1e5},
        "train": {"dtype": dtype}})
    profile = profiler.declared_profile(config)
    assert profile.source == "measured"
    assert profile.tied_bytes == (97 * 32 * elem if tied else 0.0)
    assert Profile.from_json(profile.to_json()).tied_bytes == profile.tied_bytes
    # a calibration from a run keeps it
    assert profiler.calibrate_from_run(profile, []).tied_bytes == profile.tied_bytes
