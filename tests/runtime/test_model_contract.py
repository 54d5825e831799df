"""One contract over every model adapter (gpt, hf random, hf from a directory of every
supported family, a python factory): names independent of the split, split forward ==
whole forward, deterministic build, loss summed over the micro-batch, tied pairs built
equal."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from chameleon_ft.runtime.workload.models import (
    LayeredModel,
    build_stage,
    check_model,
    check_tied_parameters,
    load_model,
    probe_outputs,
    tied_parameters,
    to_run,
)
from chameleon_ft.spec import config_from_mapping
from chameleon_ft.spec.model_source import HF_FAMILIES

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLUSTER = {"num_nodes": 1, "devices_per_node": 2, "device": "cpu"}
JOB = {"pp": 2, "dp": 1, "global_batch": 4, "micro_batch": 2}
LLAMA = {"num_blocks": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
         "ffn_size": 48, "vocab_size": 97, "seq_len": 12}


def _gpt() -> tuple[LayeredModel, torch.Tensor, torch.Tensor]:
    config = config_from_mapping({
        "model": {"num_blocks": 2, "hidden_size": 32, "num_heads": 2, "vocab_size": 256,
                  "seq_len": 12}, "cluster": CLUSTER, "job": JOB})
    x = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
    return load_model(config), x, torch.roll(x, -1, 1)


def _hf_random() -> tuple[LayeredModel, torch.Tensor, torch.Tensor]:
    config = config_from_mapping({"model": {"source": "hf", **LLAMA}, "cluster": CLUSTER,
                                  "job": JOB})
    x = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(2))
    return load_model(config), x, torch.roll(x, -1, 1)


def _hf_dir(family: str) -> Callable[[Path], tuple[LayeredModel, torch.Tensor, torch.Tensor]]:
    def make(tmp: Path) -> tuple[LayeredModel, torch.Tensor, torch.Tensor]:
        from hf_families import SEQ_LEN, VOCAB, save_family

        save_family(family, tmp / family, seed=5)
        config = config_from_mapping({"model": {"source": "hf", "path": family,
                                                "seq_len": SEQ_LEN},
                                      "cluster": CLUSTER, "job": JOB}, base_dir=str(tmp))
        x = torch.randint(0, VOCAB, (4, SEQ_LEN), generator=torch.Generator().manual_seed(3))
        return load_model(config), x, torch.roll(x, -1, 1)

    return make


def _python() -> tuple[LayeredModel, torch.Tensor, torch.Tensor]:
    config = config_from_mapping({
        "model": {"source": "python", "factory": "mlp_regression:build_model"},
        "cluster": CLUSTER, "job": JOB,
        "profile": {"kind": "uniform", "num_layers": 4, "fwd_s": 1e-4}},
        base_dir=str(EXAMPLES))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    return load_model(config), x, torch.randn(4, 1, generator=torch.Generator().manual_seed(5))


ADAPTERS: dict[str, Callable[[Path], tuple[LayeredModel, torch.Tensor, torch.Tensor]]] = {
    "gpt": lambda _tmp: _gpt(),
    "hf-random": lambda _tmp: _hf_random(),
    **{f"hf-{family}": _hf_dir(family) for family in HF_FAMILIES},
    "python": lambda _tmp: _python(),
}


@pytest.fixture(params=sorted(ADAPTERS))
def adapter(request: pytest.FixtureRequest,
            tmp_path: Path) -> tuple[LayeredModel, torch.Tensor, torch.Tensor]:
    model, x, y = ADAPTERS[request.param](tmp_path)
    return check_model(model), to_run(x, torch.float64, "cpu"), to_run(y, torch.float64, "cpu")


def test_names_and_values_do_not_depend_on_the_split(adapter: tuple[LayeredModel, torch.Tensor, torch.Tensor]) -> None:
    model, _, _ = adapter
    n = model.num_layers
    whole = dict(build_stage(model, range(n)).named_parameters())
    for cut in range(1, n):
        split = {**dict(build_stage(model, range(cut)).named_parameters()),
                 **dict(build_stage(model, range(cut, n)).named_parameters())}
        assert sorted(split) == sorted(whole)
        assert all(torch.equal(split[k], whole[k]) for k in whole)
    assert all(k.split(".")[0] == "layers" and k.split(".")[1].isdigit() for k in whole)
    assert {int(k.split(".")[1]) for k in whole} == set(range(n)), "every layer has parameters"


def test_build_is_deterministic_on_cpu(adapter: tuple[LayeredModel, torch.Tensor, torch.Tensor]) -> None:
    model, _, _ = adapter
    for i in range(model.num_layers):
        a, b = model.build_layer(i), model.build_layer(i)
        assert a is not b
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert pa.keys() == pb.keys()
        for k in pa:
            assert pa[k].device.type == "cpu"
            assert torch.equal(pa[k], pb[k])
            assert pa[k].data_ptr() != pb[k].data_ptr(), "layers must not share storage"


def test_split_forward_equals_whole_forward(adapter: tuple[LayeredModel, torch.Tensor, torch.Tensor]) -> None:
    model, x, _ = adapter
    n = model.num_layers
    whole = build_stage(model, range(n), dtype=torch.float64)(x)
    for cut in range(1, n):
        first = build_stage(model, range(cut), dtype=torch.float64)
        second = build_stage(model, range(cut, n), dtype=torch.float64)
        torch.testing.assert_close(second(first(x)), whole, rtol=0, atol=1e-12)
    shapes = probe_outputs(model, x, torch.float64)
    assert len(shapes) == n and shapes[-1][0] == tuple(whole.shape)
    assert all(dtype == torch.float64 for _, dtype in shapes)


def test_loss_is_a_sum_over_the_micro_batch(adapter: tuple[LayeredModel, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = adapter
    stage = build_stage(model, range(model.num_layers), dtype=torch.float64)
    with torch.no_grad():
        out = stage(x)
    total = model.loss(out, y)
    halves = model.loss(out[:2], y[:2]) + model.loss(out[2:], y[2:])
    assert total.dim() == 0
    assert float(total) == pytest.approx(float(halves), rel=1e-12)
    assert float(model.loss(out[:1], y[:1])) < float(total)


def test_tied_pairs_are_built_equal(adapter: tuple[LayeredModel, torch.Tensor, torch.Tensor]) -> None:
    model, _, _ = adapter
    check_tied_parameters(model)  # raises for a pair that is not built equal
    for (i, a), (j, b) in tied_parameters(model):
        assert i != j and b in dict(model.build_layer(j).named_parameters())
        assert a in dict(model.build_layer(i).named_parameters())


class _Declares:
    """A model whose only point is its tied_parameters() declaration."""

    num_layers = 3

    def __init__(self, pairs: object) -> None:
        self.pairs = pairs

    def build_layer(self, index: int) -> torch.nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(index)
            return torch.nn.Linear(4, 4, bias=index == 1)

    def tied_parameters(self) -> object:
        return self.pairs


@pytest.mark.parametrize(("pairs", "needle"), [
    ([(0, "weight")], r"gave \(0, 'weight'\); expected \(\(layer, name\), \(layer, name\)\)"),
    ([((0, "weight"), (3, "weight"))], r"names \(3, 'weight'\); expected a layer in 0\.\.2"),
    ([((0, "weight"), (2, "weight")), ((1, "weight"), (2, "weight"))],
     r"ties layers\.2\.weight twice"),
    ([((0, "weight"), (2, "bias"))], r"tied parameter layers\.2\.bias does not exist"),
    ([((0, "weight"), (2, "weight"))], r"are not built equal"),  # seeds 0 and 2 differ
])
def test_bad_tied_declarations_are_one_line(pairs: object, needle: str) -> None:
    with pytest.raises(ValueError, match=rf"^model: .*{needle}") as info:
        check_tied_parameters(_Declares(pairs))
    assert "\n" not in str(info.value)
