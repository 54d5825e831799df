"""The Hugging Face Llama adapter against transformers itself: same forward, causal,
exported directories that transformers loads, one-line errors naming model.path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from chameleon_ft.profile.analytic import analytic_profile
from chameleon_ft.runtime.workload.models import (
    build_stage,
    initial_params,
    load_model,
    split_param_name,
)
from chameleon_ft.runtime.workload.models.hf_llama import HFLlama, llama_config, save_random_llama
from chameleon_ft.spec import config_from_mapping, device_preset
from chameleon_ft.spec.model import ModelSpec

SPEC = ModelSpec(num_blocks=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_size=48,
                 vocab_size=97, seq_len=12, mlp="swiglu")
CLUSTER = {"num_nodes": 1, "devices_per_node": 2, "device": "cpu"}
JOB = {"pp": 2, "dp": 1, "global_batch": 4, "micro_batch": 2}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_llama(SPEC, tmp_path_factory.mktemp("llama") / "tiny", seed=9,
                             dtype=torch.float64)


def _config(model: dict[str, object], base: Path) -> object:
    return config_from_mapping({"model": model, "cluster": CLUSTER, "job": JOB},
                               base_dir=str(base))


def test_layers_compute_what_llama_for_causal_lm_computes(llama_dir: Path) -> None:
    model = HFLlama.from_pretrained(llama_dir)
    assert model.dtype == torch.float64 and model.num_layers == SPEC.num_blocks + 2
    x = torch.randint(0, SPEC.vocab_size, (3, SPEC.seq_len),
                      generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = build_stage(model, range(model.num_layers))(x)
    for attention, atol in (("sdpa", 1e-12), ("eager", 1e-6)):  # eager: float32 softmax
        reference = LlamaForCausalLM.from_pretrained(
            str(llama_dir), local_files_only=True, attn_implementation=attention,
            dtype=torch.float64)
        with torch.no_grad():
            theirs = reference(input_ids=x).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)
    # the initial values are the directory's, tensor for tensor
    hf_state = reference.state_dict()
    for name, tensor in initial_params(model).items():
        index, inner = split_param_name(name)
        assert torch.equal(tensor, hf_state[model.hf_name(index, inner)])


def test_attention_is_causal() -> None:
    model = HFLlama(llama_config(SPEC), seed=1)
    stage = build_stage(model, range(model.num_layers), dtype=torch.float64)
    x = torch.randint(0, SPEC.vocab_size, (2, SPEC.seq_len),
                      generator=torch.Generator().manual_seed(1))
    changed = x.clone()
    changed[:, 7] = (changed[:, 7] + 1) % SPEC.vocab_size
    with torch.no_grad():
        a, b = stage(x), stage(changed)
    assert torch.equal(a[:, :7], b[:, :7]), "a later token changed an earlier output"
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_random_init_is_seeded_per_layer() -> None:
    a = initial_params(HFLlama(llama_config(SPEC), seed=1))
    b = initial_params(HFLlama(llama_config(SPEC), seed=2))
    assert a.keys() == b.keys()
    assert all(t.dtype == torch.float32 for t in a.values())
    assert torch.equal(a["layers.1.input_layernorm.weight"], torch.ones(SPEC.hidden_size))
    assert not torch.equal(a["layers.1.self_attn.q_proj.weight"],
                           b["layers.1.self_attn.q_proj.weight"])
    std = float(a["layers.0.embed_tokens.weight"].std())
    assert std == pytest.approx(0.02, rel=0.1)  # Hugging Face's initializer_range


def test_export_loads_with_auto_model(llama_dir: Path, tmp_path: Path) -> None:
    model = HFLlama.from_pretrained(llama_dir)
    (llama_dir / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    params = {k: v + 0.5 for k, v in initial_params(model).items()}  # "trained"
    model.export(params, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True,
                                                  dtype=torch.float64)
    state = loaded.state_dict()
    assert all(torch.equal(state[model.hf_name(*split_param_name(k))], v)
               for k, v in params.items())
    written = json.loads((tmp_path / "hf" / "config.json").read_text(encoding="utf-8"))
    assert written["num_hidden_layers"] == SPEC.num_blocks
    assert written["dtype"] == "float64"
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()


def test_sharded_directories_are_read_by_index(llama_dir: Path, tmp_path: Path) -> None:
    model = HFLlama.from_pretrained(llama_dir)
    sharded = tmp_path / "sharded"
    whole = LlamaForCausalLM.from_pretrained(str(llama_dir), local_files_only=True,
                                             dtype=torch.float64)
    whole.save_pretrained(str(sharded), max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    again = HFLlama.from_pretrained(sharded)
    a, b = initial_params(model), initial_params(again)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_config_json_gives_the_planner_the_same_architecture(llama_dir: Path) -> None:
    config = _config({"source": "hf", "path": "tiny", "seq_len": 12}, llama_dir.parent)
    spec = config.model  # type: ignore[attr-defined]
    assert spec.num_blocks == 2 and spec.kv_heads == 2 and spec.ffn == 48
    assert spec.mlp == "swiglu" and not spec.tied_embeddings
    model = load_model(config)  # type: ignore[arg-type]
    profile = analytic_profile(spec, device_preset("cpu"))
    assert profile.num_layers == model.num_layers
    for i, cost in enumerate(profile.layers):  # bf16 bytes per parameter
        count = sum(p.numel() for p in model.build_layer(i).parameters())
        assert cost.param_bytes == pytest.approx(2 * count)


def _mutate(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    data = json.loads((src / "config.json").read_text(encoding="utf-8"))
    data.update(changes)
    (dst / "config.json").write_text(json.dumps(data), encoding="utf-8")
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


@pytest.mark.parametrize(("changes", "needle"), [
    ({"model_type": "gpt2"}, "only Llama"),
    ({"tie_word_embeddings": True}, "tie"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_directories_are_rejected_naming_model_path(
        llama_dir: Path, tmp_path: Path, changes: dict[str, object], needle: str) -> None:
    _mutate(llama_dir, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=needle) as info:
        _config({"source": "hf", "path": "bad", "seq_len": 12}, tmp_path)
    assert str(info.value).startswith("model.path:") and "\n" not in str(info.value)


def test_missing_path_and_missing_tensors(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^model\.path: .* is not a directory"):
        _config({"source": "hf", "path": "nowhere", "seq_len": 12}, tmp_path)
    _mutate(llama_dir, tmp_path / "bigger", num_hidden_layers=3)
    config = _config({"source": "hf", "path": "bigger", "seq_len": 12}, tmp_path)
    model = load_model(config)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^model\.path: .* has no tensor 'model\.layers\.2\."):
        model.build_layer(3)
    wider = _mutate(llama_dir, tmp_path / "wider", intermediate_size=64)
    model = HFLlama.from_pretrained(wider)
    with pytest.raises(ValueError, match=r"^model\.path: layer 1 .* does not match"):
        model.build_layer(1)
