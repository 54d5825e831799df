"""The Hugging Face adapter against transformers itself, one contract per supported
family: the layers compute what the family's ``AutoModelForCausalLM`` computes (float64),
exported directories reload as the same class with equal weights, the planner counts what
the layers hold, and one-line errors name model.path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_families import FAMILIES, SEQ_LEN, VOCAB, family_config, save_family
from transformers import AutoModelForCausalLM

from chameleon_ft.profile.analytic import analytic_profile
from chameleon_ft.runtime.workload.models import (
    build_stage,
    check_tied_parameters,
    drop_tied_copies,
    initial_params,
    load_model,
    split_param_name,
    tied_end_elements,
    with_tied_copies,
)
from chameleon_ft.runtime.workload.models.hf import HFCausalLM, llama_config
from chameleon_ft.spec import config_from_mapping, device_preset
from chameleon_ft.spec.model import ModelSpec
from chameleon_ft.spec.model_source import HF_FAMILIES

SPEC = ModelSpec(num_blocks=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_size=48,
                 vocab_size=97, seq_len=12, mlp="swiglu")
CLUSTER = {"num_nodes": 1, "devices_per_node": 2, "device": "cpu"}
JOB = {"pp": 2, "dp": 1, "global_batch": 4, "micro_batch": 2}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: save_family(name, root / name, seed=9) for name in FAMILIES}


def _config(model: dict[str, object], base: Path) -> object:
    return config_from_mapping({"model": model, "cluster": CLUSTER, "job": JOB},
                               base_dir=str(base))


def _ids(seed: int, batch: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def test_every_supported_family_has_a_fixture() -> None:
    assert sorted(FAMILIES) == sorted(HF_FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_contract(family: str, family_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = family_dirs[family]
    model = HFCausalLM.from_pretrained(path)
    assert model.dtype == torch.float64 and model.num_layers == 3 + 2
    reference = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, attn_implementation=model.attention,
        dtype=torch.float64)
    assert model.tied == reference.config.tie_word_embeddings
    # split forward == the whole AutoModelForCausalLM forward, at every cut
    x = _ids(0)
    with torch.no_grad():
        theirs = reference(input_ids=x).logits
        whole = build_stage(model, range(model.num_layers))(x)
        torch.testing.assert_close(whole, theirs, rtol=0, atol=1e-12)
        for cut in range(1, model.num_layers):
            first = build_stage(model, range(cut))
            second = build_stage(model, range(cut, model.num_layers))
            torch.testing.assert_close(second(first(x)), theirs, rtol=0, atol=1e-12)
    # the initial values are the directory's, tensor for tensor (names, split
    # independence and determinism: test_model_contract.py runs over every family too)
    hf_state = reference.state_dict()
    initial = initial_params(model)
    for name, tensor in initial.items():
        index, inner = split_param_name(name)
        assert torch.equal(tensor, hf_state[model.hf_name(index, inner)]), name
    check_tied_parameters(model)
    dropped = drop_tied_copies(model, initial)  # what params.pt holds
    assert len(initial) - len(dropped) == len(model.tied_parameters()) == int(model.tied)
    again = with_tied_copies(model, dropped)
    assert again.keys() == initial.keys()
    assert all(torch.equal(again[k], initial[k]) for k in initial)
    # export: reloads as the same class with equal weights, one tensor for a tied pair
    trained = {k: v + 0.25 * (i + 1) for i, (k, v) in enumerate(initial.items())}
    for copy_name, original in {f"layers.{j}.{b}": f"layers.{i}.{a}"
                                for (i, a), (j, b) in model.tied_parameters()}.items():
        trained[copy_name] = trained[original]
    model.export(trained, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True,
                                                  dtype=torch.float64)
    assert type(loaded) is type(reference)
    state = loaded.state_dict()
    for name, value in trained.items():
        assert torch.equal(state[model.hf_name(*split_param_name(name))], value), name
    written = json.loads((tmp_path / "hf" / "config.json").read_text(encoding="utf-8"))
    assert written["model_type"] == family and written["dtype"] == "float64"
    if model.tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_planner_counts_what_the_layers_hold(family: str,
                                                 family_dirs: dict[str, Path]) -> None:
    config = _config({"source": "hf", "path": family, "seq_len": SEQ_LEN},
                     family_dirs[family].parent)
    spec = config.model  # type: ignore[attr-defined]
    model = load_model(config)  # type: ignore[arg-type]
    assert spec.tied_embeddings == model.tied  # type: ignore[attr-defined]
    profile = analytic_profile(spec, device_preset("cpu"))
    assert profile.num_layers == model.num_layers
    for i, cost in enumerate(profile.layers):  # bf16 bytes per parameter, the copy counted
        count = sum(p.numel() for p in model.build_layer(i).parameters())
        assert cost.param_bytes == pytest.approx(2 * count), (family, i)
    # the copies' sum the estimator prices is the tied pair the workers reduce
    shared = tied_end_elements(model)
    assert shared == (VOCAB * 32 if model.tied else 0)  # type: ignore[attr-defined]
    assert profile.tied_bytes == 2 * shared


def test_sliding_windows_limit_what_a_position_sees(family_dirs: dict[str, Path]) -> None:
    # three layers each seeing 4 positions (itself and 3 back) reach 9 back at most
    x = _ids(1, batch=1)
    changed = x.clone()
    changed[0, 0] = (changed[0, 0] + 1) % VOCAB
    for family, slides in (("mistral", True), ("llama", False)):
        model = HFCausalLM.from_pretrained(family_dirs[family])
        stage = build_stage(model, range(model.num_layers))
        with torch.no_grad():
            a, b = stage(x), stage(changed)
        assert not torch.allclose(a[:, 9], b[:, 9])
        assert torch.equal(a[:, 10:], b[:, 10:]) == slides, family


def test_attention_is_causal() -> None:
    model = HFCausalLM(llama_config(SPEC), seed=1)
    stage = build_stage(model, range(model.num_layers), dtype=torch.float64)
    x = _ids(1, batch=2)
    changed = x.clone()
    changed[:, 7] = (changed[:, 7] + 1) % SPEC.vocab_size
    with torch.no_grad():
        a, b = stage(x), stage(changed)
    assert torch.equal(a[:, :7], b[:, :7]), "a later token changed an earlier output"
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_random_init_is_seeded_per_layer() -> None:
    a = initial_params(HFCausalLM(llama_config(SPEC), seed=1))
    b = initial_params(HFCausalLM(llama_config(SPEC), seed=2))
    assert a.keys() == b.keys()
    assert all(t.dtype == torch.float32 for t in a.values())
    assert torch.equal(a["layers.1.input_layernorm.weight"], torch.ones(SPEC.hidden_size))
    assert not torch.equal(a["layers.1.self_attn.q_proj.weight"],
                           b["layers.1.self_attn.q_proj.weight"])
    std = float(a["layers.0.embed_tokens.weight"].std())
    assert std == pytest.approx(0.02, rel=0.1)  # Hugging Face's initializer_range


def test_random_init_follows_the_family() -> None:
    gemma = initial_params(HFCausalLM(family_config("gemma"), seed=1))
    assert torch.equal(gemma["layers.1.input_layernorm.weight"], torch.zeros(32))  # 1 + w
    assert torch.equal(gemma["layers.0.embed_tokens.weight"][0], torch.zeros(32))  # padding
    assert torch.equal(gemma["layers.4.lm_head.weight"], gemma["layers.0.embed_tokens.weight"])
    qwen2 = initial_params(HFCausalLM(family_config("qwen2"), seed=1))
    assert torch.equal(qwen2["layers.1.self_attn.q_proj.bias"], torch.zeros(64))
    qwen3 = initial_params(HFCausalLM(family_config("qwen3"), seed=1))
    assert torch.equal(qwen3["layers.2.self_attn.k_norm.weight"], torch.ones(16))


def test_tied_random_llama_from_the_architecture_keys() -> None:
    config = _config({"source": "hf", "num_blocks": 2, "hidden_size": 32, "num_heads": 4,
                      "num_kv_heads": 2, "ffn_size": 48, "vocab_size": 97, "seq_len": 12,
                      "tied_embeddings": True}, Path("."))
    model = load_model(config)  # type: ignore[arg-type]
    assert model.tied_parameters() == [((0, "embed_tokens.weight"),  # type: ignore[attr-defined]
                                        (3, "lm_head.weight"))]
    check_tied_parameters(model)


def test_sharded_directories_are_read_by_index(family_dirs: dict[str, Path],
                                               tmp_path: Path) -> None:
    path = family_dirs["qwen2"]
    model = HFCausalLM.from_pretrained(path)
    sharded = tmp_path / "sharded"
    whole = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                 dtype=torch.float64)
    whole.save_pretrained(str(sharded), max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    again = HFCausalLM.from_pretrained(sharded)
    a, b = initial_params(model), initial_params(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _mutate(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    data = json.loads((src / "config.json").read_text(encoding="utf-8"))
    data.update(changes)
    (dst / "config.json").write_text(json.dumps(data), encoding="utf-8")
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


@pytest.mark.parametrize(("changes", "needle"), [
    ({"model_type": "gpt2"}, "holds a 'gpt2' model; supported model_type values: gemma, "
                             "gemma2, llama, mistral, phi3, qwen2, qwen3"),
    ({"model_type": "qwen3_moe"}, "holds a 'qwen3_moe' model; supported"),
    ({"hidden_act": "relu"}, "hidden_act"),
])
def test_unsupported_directories_are_rejected_naming_model_path(
        family_dirs: dict[str, Path], tmp_path: Path, changes: dict[str, object],
        needle: str) -> None:
    _mutate(family_dirs["llama"], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=needle) as info:
        _config({"source": "hf", "path": "bad", "seq_len": 12}, tmp_path)
    assert str(info.value).startswith("model.path:") and "\n" not in str(info.value)


def test_missing_path_and_missing_tensors(family_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^model\.path: .* is not a directory"):
        _config({"source": "hf", "path": "nowhere", "seq_len": 12}, tmp_path)
    _mutate(family_dirs["qwen3"], tmp_path / "bigger", num_hidden_layers=4,
            layer_types=["full_attention"] * 4)
    config = _config({"source": "hf", "path": "bigger", "seq_len": 12}, tmp_path)
    model = load_model(config)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^model\.path: .* has no tensor 'model\.layers\.3\."):
        model.build_layer(4)
    wider = _mutate(family_dirs["qwen3"], tmp_path / "wider", intermediate_size=64)
    model = HFCausalLM.from_pretrained(wider)
    with pytest.raises(ValueError, match=r"^model\.path: layer 1 .* does not match"):
        model.build_layer(1)


def test_a_forkserver_started_early_preloads_what_the_launcher_asks(
        family_dirs: dict[str, Path]) -> None:
    """``chameleon train`` starts the workers' server before it builds the model (design
    4.1): the modules it names from ``[model] source`` are the ones the launcher names
    from the built model, since the server keeps the first list it is given."""
    from chameleon_ft.runtime.coordinator.forkserver import adapter_modules, source_modules
    from chameleon_ft.spec import load_config
    from chameleon_ft.spec.model_source import ModelSourceKind

    hf = _config({"source": "hf", "path": "llama", "seq_len": SEQ_LEN},
                 family_dirs["llama"].parent)
    gpt = load_config(Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.toml")
    for config in (hf, gpt):
        source = config.model_source.source  # type: ignore[attr-defined]
        model = load_model(config)  # type: ignore[arg-type]
        assert source_modules(source) == adapter_modules(model), source
    assert source_modules(ModelSourceKind.PYTHON) is None  # known only once built
