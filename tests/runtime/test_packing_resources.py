"""Packed layer state (migration, checkpoints) and the memory check before launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from chameleon_ft.plan import initial_plan
from chameleon_ft.profile import build_profile
from chameleon_ft.runtime.coordinator.resources import check_memory, layer_parameters, worker_bytes
from chameleon_ft.runtime.storage.packing import PackError, pack, unpack
from chameleon_ft.spec import load_config
from chameleon_ft.spec.config import config_from_mapping

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_optimizer_state_round_trips_through_packing() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
    for opt_cls, kwargs in ((torch.optim.AdamW, {"betas": (0.9, 0.95)}),
                            (torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adam, {})):
        opt = opt_cls(model.parameters(), lr=0.01, **kwargs)
        model(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        tree = {"module": model.state_dict(), "optimizer": opt.state_dict()}
        data = pack(tree)
        assert data == pack({"module": model.state_dict(), "optimizer": opt.state_dict()})
        back = unpack(data)
        fresh = opt_cls(model.parameters(), lr=0.5)
        fresh.load_state_dict(back["optimizer"])
        assert fresh.state_dict()["param_groups"][0]["lr"] == 0.01
        for k, v in back["module"].items():
            assert torch.equal(v, model.state_dict()[k])


@pytest.mark.parametrize("data", [b"", b"CHL1", b"XXXX" + bytes(20),
                                  b"CHL1" + (10**6).to_bytes(8, "big") + b"{}"])
def test_garbage_does_not_unpack(data: bytes) -> None:
    with pytest.raises(PackError):
        unpack(data)


def test_truncated_tensor_bytes_do_not_unpack() -> None:
    data = pack({"x": torch.arange(10, dtype=torch.float64)})
    with pytest.raises(PackError, match="truncated"):
        unpack(data[:-8])


def test_unpackable_values_are_refused() -> None:
    with pytest.raises(PackError):
        pack({"f": object()})
    with pytest.raises(PackError):
        pack({(1, 2): 3})


def test_paper32_does_not_fit_this_host_one_line() -> None:
    config = load_config(EXAMPLES / "paper32.toml")
    plan = initial_plan(config, build_profile(config))
    with pytest.raises(ValueError) as info:
        check_memory(config, plan, build_profile(config), config.num_workers, backend="gloo",
                     available=24 * 2**30)
    message = str(info.value)
    assert message.startswith("memory: 32 local workers need") and "\n" not in message
    assert "24.0 GiB available" in message and "--remote-workers" in message
    assert "cluster.device is 'a100-80g'" in message


def test_tiny_fits_and_the_device_mismatch_is_noted() -> None:
    config = load_config(EXAMPLES / "tiny_cpu.toml")
    plan = initial_plan(config, build_profile(config))
    profile = build_profile(config)
    need = worker_bytes(config, plan, profile, layer_parameters(config, profile))
    assert sorted(need) == [0, 1, 2, 3] and all(n > 300 * 2**20 for n in need.values())
    assert check_memory(config, plan, build_profile(config), 4, backend="gloo",
                        available=8 * 2**30) == []
    tiny_on_a100 = config_from_mapping({
        "model": {"num_blocks": 2, "hidden_size": 32, "num_heads": 2, "vocab_size": 256,
                  "seq_len": 32},
        "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "a100-80g"},
        "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2}})
    plan = initial_plan(tiny_on_a100, build_profile(tiny_on_a100))
    (note,) = check_memory(tiny_on_a100, plan, build_profile(tiny_on_a100), 4,
                           backend="gloo", available=8 * 2**30)
    assert "'a100-80g'" in note and "CPU" in note
    with pytest.raises(ValueError, match="memory"):
        check_memory(config, plan, build_profile(config), 4, backend="gloo", available=2**20)


def test_a_spare_workers_memory_is_the_largest_workers() -> None:
    """A spare node's worker may take any stage's place: the check charges it the
    largest worker's need, so 4 workers and 2 spares need 6 times the largest at most
    and more than the 4 alone."""
    config = config_from_mapping({
        "model": {"num_blocks": 2, "hidden_size": 32, "num_heads": 2, "vocab_size": 256,
                  "seq_len": 32},
        "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu", "spare_nodes": 1},
        "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2}})
    assert (config.num_workers, config.total_workers) == (4, 6)
    profile = build_profile(config)
    plan = initial_plan(config, profile)

    def needed(local: int) -> int:  # the smallest memory the check accepts, by bisection
        lo, hi = 0, 2**40
        while hi - lo > 1:
            mid = (lo + hi) // 2
            try:
                check_memory(config, plan, profile, local, backend="gloo", available=mid)
                hi = mid
            except ValueError:
                lo = mid
        return hi

    four, six = needed(4), needed(6)
    assert six > four and (six - four) == pytest.approx(2 * max(
        needed(n) - needed(n - 1) for n in range(1, 5)), abs=2)


def _llama_job(**train: object) -> object:
    return config_from_mapping({
        "model": {"preset": "llama2-7b", "num_blocks": 4, "seq_len": 256},
        "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
        "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
        "train": dict(train)})


def test_the_memory_check_counts_the_runs_numerics() -> None:
    """bf16 holds a bf16 copy beside fp32 masters, gradients and moments (18 bytes a
    parameter against float32's 16) and bf16 activations; activation checkpointing keeps
    each layer's input only, plus one layer's recompute. The parameters are the model's
    whatever the dtype (the runtime's profile prices the dtype's bytes: they are not
    divided back as bf16 ones)."""
    from chameleon_ft.profile.analytic import layer_parameters as model_parameters
    from chameleon_ft.runtime.coordinator.resources import PROCESS_BYTES, state_bytes_per_param

    assert [state_bytes_per_param(d) for d in ("float32", "float64", "bfloat16")] == \
        [16, 32, 18]
    activations = {}
    for dtype in ("float32", "bfloat16", "float64"):
        for ckpt in ("none", "full"):
            config: Any = _llama_job(dtype=dtype, activation_checkpointing=ckpt)
            profile = build_profile(config, runtime=True)
            plan = initial_plan(config, profile)
            params = layer_parameters(config, profile)
            assert params == model_parameters(config.model), dtype
            state = sum(params[i] for i in plan.pipelines[0].stages[0].layers) * \
                state_bytes_per_param(dtype)
            activations[dtype, ckpt] = worker_bytes(config, plan, profile, params)[0] - \
                state - PROCESS_BYTES
    for dtype in ("float32", "bfloat16"):
        assert 0 < activations[dtype, "full"] < activations[dtype, "none"]
    for ckpt in ("none", "full"):  # 2, 4 and 8 bytes an element
        assert activations["bfloat16", ckpt] == pytest.approx(activations["float32", ckpt] / 2)
        assert activations["float64", ckpt] == pytest.approx(activations["float32", ckpt] * 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_holder_of_a_tied_pair_is_charged_its_own_copy(dtype: str) -> None:
    """A head tied to the embedding: the worker holding the embedding and the one holding
    the head each keep the V x h matrix with its gradient and optimizer state, as untied."""
    needs = {}
    for tied in (True, False):
        config: Any = config_from_mapping({
            "model": {"preset": "llama2-7b", "num_blocks": 4, "seq_len": 256,
                      "tied_embeddings": tied},
            "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
            "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
            "train": {"dtype": dtype}})
        profile = build_profile(config, runtime=True)
        plan = initial_plan(config, profile)
        params = layer_parameters(config, profile)
        v, h = config.model.vocab_size, config.model.hidden_size
        assert params[0] == v * h and params[-1] == v * h + h
        needs[tied] = worker_bytes(config, plan, profile, params)
    assert needs[True] == needs[False]


def test_the_memory_check_counts_the_checkpoint_copies() -> None:
    """A worker keeps a host copy of the master weights and optimizer state of the layers
    it writes into checkpoints; replicas share the layers, so with dp 2 each writes half."""
    from chameleon_ft.runtime.coordinator.resources import checkpoint_copy_bytes

    config: Any = _llama_job(checkpoint_every=0)
    profile = build_profile(config, runtime=True)
    plan = initial_plan(config, profile)
    params = layer_parameters(config, profile)
    assert checkpoint_copy_bytes(config, plan, params) == {}
    config = _llama_job(checkpoint_every=10)
    copies = checkpoint_copy_bytes(config, plan, params)
    assert sorted(copies) == [0, 1, 2, 3]
    assert sum(copies.values()) == sum(params) * 12  # fp32 weights and two moments
    # the copies can be what does not fit: the job without them fits in exactly its need
    need = sum(worker_bytes(config, plan, profile, params).values())
    assert check_memory(_llama_job(checkpoint_every=0), plan, profile, 4, backend="gloo",
                        available=int(need) + 1) == []
    with pytest.raises(ValueError, match="checkpoint's copy"):
        check_memory(config, plan, profile, 4, backend="gloo", available=int(need) + 1)


def test_a_tensor_parallel_worker_is_counted_per_process() -> None:
    """At tp 2 each of a worker's two processes holds half of the sharded tensors, the
    replicated ones whole (norms, row-parallel biases, the GPT's position table), half the
    activations and its own process: each rank a little over half the tp-1 worker's state,
    the worker's two processes together one more process."""
    from chameleon_ft.runtime.coordinator.resources import (
        PROCESS_BYTES,
        replicated_parameters,
    )

    needs, configs = {}, {}
    for tp in (1, 2):
        config: Any = config_from_mapping({
            "model": {"name": "g", "num_blocks": 2, "hidden_size": 256, "num_heads": 4,
                      "vocab_size": 4096, "seq_len": 128},
            "cluster": {"num_nodes": 2, "devices_per_node": 2 * tp, "device": "cpu"},
            "job": {"pp": 2, "dp": 2, "tp": tp, "global_batch": 8, "micro_batch": 2}})
        profile = build_profile(config, runtime=True)
        plan = initial_plan(config, profile)
        needs[tp] = worker_bytes(config, plan, profile, layer_parameters(config, profile))
        configs[tp] = config
    replicated = replicated_parameters(configs[2], 4)
    assert replicated[0] == 128 * 256 and all(r > 0 for r in replicated)
    assert replicated_parameters(configs[1], 4) == [0, 0, 0, 0]
    for w in range(4):
        whole, rank = needs[1][w] - PROCESS_BYTES, needs[2][w] - PROCESS_BYTES
        assert whole / 2 < rank < 0.6 * whole
    assert check_memory(configs[2], initial_plan(configs[2], build_profile(configs[2])),
                        build_profile(configs[2]), 4, backend="gloo",
                        available=8 * 2**30) == []
    with pytest.raises(ValueError, match="4 local workers need"):  # 8 processes of 300 MiB
        check_memory(configs[2], initial_plan(configs[2], build_profile(configs[2])),
                     build_profile(configs[2]), 4, backend="gloo", available=2 * 2**30)
