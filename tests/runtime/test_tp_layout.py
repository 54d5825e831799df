"""A tensor-parallel layer's state split into shards and joined again, in one process (no
group): exact both ways, at any degree, fused tensors part by part, re-sharding from one
degree to another, the shard header's JSON; and what tensor parallelism refuses, in one
line naming ``job.tp``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_families import family_config
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.runtime.storage.packing import pack, unpack
from chameleon_ft.runtime.workload.models.gpt import GPTModel
from chameleon_ft.runtime.workload.models.gpt_layers import GPTShape
from chameleon_ft.runtime.workload.models.hf import HFCausalLM
from chameleon_ft.runtime.workload.optim import LayerTrainState, TorchOptimizer
from chameleon_ft.runtime.workload.tensor_parallel import (
    boundary_shape,
    check_tensor_parallel,
    shard_layer,
)
from chameleon_ft.runtime.workload.tp_layout import (
    LayerLayout,
    TensorLayout,
    chunk_bounds,
    join_state_trees,
    join_tensor,
    reshard_state_trees,
    shard_header,
    split_state_tree,
    split_tensor,
)

GPT = GPTModel(GPTShape(num_blocks=2, hidden_size=32, num_heads=4, vocab_size=97,
                        seq_len=16, ffn_size=64), seed=1)
H = 32
BLOCK = LayerLayout(tensors={"qkv.weight": TensorLayout(dim=0, parts=(H, H, H)),
                             "proj.weight": TensorLayout(dim=1),
                             "fc.weight": TensorLayout(dim=0), "fc.bias": TensorLayout(dim=0),
                             "out.weight": TensorLayout(dim=1)},
                    params=tuple(n for n, _ in GPT.build_layer(1).named_parameters()))
"""The GPT block's layout, as ``shard_layer`` reads it from the placements."""


def _trained_block() -> dict[str, Any]:
    """A GPT block's state after one AdamW step: moments, a step count."""
    state = LayerTrainState.create(GPT.build_layer(1), TorchOptimizer("AdamW", (("lr", 0.1),)))
    out = state.module(torch.randn(2, 16, H, dtype=torch.float64))
    out.square().sum().backward()
    state.step(0)
    return state.state_tree()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 11), cols=st.integers(1, 5), degree=st.integers(1, 5),
       dim=st.integers(0, 1))
def test_a_split_is_torch_chunk_and_joins_back(rows: int, cols: int, degree: int,
                                               dim: int) -> None:
    full = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)
    spec = TensorLayout(dim=dim)
    shards = [split_tensor(full, spec, degree, r) for r in range(degree)]
    chunks = list(full.chunk(degree, dim=dim)) if full.shape[dim] else []
    for r, shard in enumerate(shards):  # DTensor's Shard holds torch.chunk's pieces
        want = chunks[r] if r < len(chunks) else full.narrow(dim, 0, 0)
        assert torch.equal(shard, want)
        assert chunk_bounds(full.shape[dim], degree, r)[1] - \
            chunk_bounds(full.shape[dim], degree, r)[0] == shard.shape[dim]
    assert torch.equal(join_tensor(shards, spec), full)


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(st.integers(1, 3), min_size=1, max_size=3), degree=st.integers(1, 4))
def test_fused_parts_split_each_on_its_own(parts: list[int], degree: int) -> None:
    sizes = tuple(p * degree for p in parts)
    full = torch.arange(sum(sizes) * 2, dtype=torch.float64).reshape(sum(sizes), 2)
    spec = TensorLayout(dim=0, parts=sizes)
    shards = [split_tensor(full, spec, degree, r) for r in range(degree)]
    for r, shard in enumerate(shards):  # [q_r; k_r; v_r]
        want = torch.cat([part.chunk(degree)[r] for part in full.split(list(sizes))])
        assert torch.equal(shard, want)
    assert torch.equal(join_tensor(shards, spec), full)


def test_a_fused_part_the_degree_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="fused parts"):
        split_tensor(torch.zeros(9, 2), TensorLayout(dim=0, parts=(3, 6)), 2, 0)


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_a_layer_state_splits_and_joins_exactly(degree: int) -> None:
    whole = _trained_block()
    shards = [split_state_tree(whole, BLOCK, degree, r) for r in range(degree)]
    assert shard_header(shards[1 % degree]) == (1 % degree, degree, BLOCK)
    assert shards[0]["module"]["qkv.weight"].shape == (3 * H // degree, H)
    assert shards[0]["module"]["ln1.weight"].shape == (H,)  # replicated
    moments = shards[0]["optimizer"]["state"]
    assert moments[BLOCK.params.index("proj.weight")]["exp_avg"].shape == (H, H // degree)
    # through the packed bytes, in any order
    again = join_state_trees([unpack(pack(s)) for s in reversed(shards)])
    assert _equal(again, whole)


def test_a_checkpoint_at_one_degree_loads_at_another() -> None:
    whole = _trained_block()
    at_two = [split_state_tree(whole, BLOCK, 2, r) for r in range(2)]
    for r in range(4):
        assert _equal(reshard_state_trees(at_two, 4, r), split_state_tree(whole, BLOCK, 4, r))
    assert _equal(reshard_state_trees(at_two, 1, 0)["module"], whole["module"])


def test_shards_that_are_not_one_whole_set_are_refused() -> None:
    whole = _trained_block()
    shards = [split_state_tree(whole, BLOCK, 2, r) for r in range(2)]
    with pytest.raises(ValueError, match="do not make ranks"):
        join_state_trees([shards[0], shards[0]])
    with pytest.raises(ValueError, match="mixed with shards"):
        join_state_trees([shards[0], whole])
    other = split_state_tree(whole, BLOCK, 4, 1)
    with pytest.raises(ValueError, match="do not make ranks"):
        join_state_trees([shards[0], other])


def test_an_optimizer_whose_state_is_not_element_wise_is_refused() -> None:
    layer = GPT.build_layer(1).float()
    state = LayerTrainState.create(layer, TorchOptimizer("Adafactor", (("lr", 0.01),)))
    layer(torch.randn(1, 16, H)).sum().backward()
    state.step(0)
    with pytest.raises(ValueError, match="element-wise optimizer"):
        split_state_tree(state.state_tree(), BLOCK, 2, 0)


def test_the_layout_survives_json() -> None:
    assert LayerLayout.from_json(BLOCK.to_json()) == BLOCK
    with pytest.raises(ValueError, match="not a tensor layout"):
        TensorLayout.from_json({"dim": -1})


def test_a_boundary_is_each_rank_s_tokens() -> None:
    assert boundary_shape((2, 16, 32), 4) == (2, 4, 32)
    assert boundary_shape((2, 16, 32), 1) == (2, 16, 32)


@pytest.mark.parametrize(("model", "degree", "seq_len", "match"), [
    (HFCausalLM(family_config("qwen2")), 4, 12, "2 key/value heads"),
    (HFCausalLM(family_config("mistral")), 8, 16, "4 attention heads"),
    (GPT, 3, 15, "4 attention heads"),
    (GPT, 2, 15, "15 tokens per sample"),
    (object(), 2, 16, "has no tensor-parallel plan"),
])
def test_what_cannot_be_sharded_is_refused_in_one_line(model: Any, degree: int, seq_len: int,
                                                       match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        check_tensor_parallel(model, degree, seq_len)
    assert str(info.value).startswith("job.tp: ") and "\n" not in str(info.value)


def test_a_user_model_brings_its_own_plan_and_its_own_check() -> None:
    """The emulated-device testbed's model (examples/): accepted at a degree that splits
    its 256 features (no sequence to split), refused in its own words otherwise."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        import emulated_device
    finally:
        sys.path.pop(0)
    model = emulated_device.EmulatedDeviceModel(8)
    check_tensor_parallel(model, 2, 0)
    check_tensor_parallel(model, 4, 0)
    with pytest.raises(ValueError, match=r"^job.tp: 3 does not divide the emulated model's 256"):
        check_tensor_parallel(model, 3, 0)


class _Mesh:
    """What ``shard_layer`` asks of a mesh before it refuses."""

    def size(self) -> int:
        return 2


@pytest.mark.parametrize(("family", "where"), [("llama", "self_attn"), ("phi3", "")])
def test_a_decoder_module_without_a_rule_is_refused_before_anything_changes(
        family: str, where: str) -> None:
    model = HFCausalLM(family_config(family))
    layer = model.build_layer(1)
    owner = layer.get_submodule(where)
    owner.extra = torch.nn.Linear(32, 32)  # a family's module we do not know
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    name = f"{where}.extra" if where else "extra"
    with pytest.raises(ValueError, match=rf"^job.tp: no tensor-parallel rule for Linear "
                                         rf"'{name}'"):
        shard_layer(model, 1, layer, _Mesh())  # type: ignore[arg-type]
    after = layer.state_dict()  # Phi-3's fused rows not reordered
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_tp_one_needs_nothing() -> None:
    check_tensor_parallel(object(), 1, 7)
