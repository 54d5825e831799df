"""[model] source/path/factory, [data] and [optimizer]: parsing and the errors a user sees
(pure: a Hugging Face directory's config.json is read as JSON, no torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chameleon_ft.profile.analytic import analytic_profile
from chameleon_ft.spec import config_from_mapping, device_preset, load_config

CLUSTER = {"num_nodes": 1, "devices_per_node": 2, "device": "cpu"}
JOB = {"pp": 2, "dp": 1, "global_batch": 4, "micro_batch": 2}
LLAMA_JSON = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
              "max_position_embeddings": 128, "tie_word_embeddings": False,
              "hidden_act": "silu"}


def _doc(model: dict[str, Any], **tables: Any) -> dict[str, Any]:
    return {"model": model, "cluster": CLUSTER, "job": JOB, **tables}


def _llama_dir(root: Path, **changes: Any) -> Path:
    d = root / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**LLAMA_JSON, **changes}), encoding="utf-8")
    (d / "model.safetensors").write_bytes(b"")
    return d


def test_existing_configs_keep_the_gpt_and_the_byte_corpus() -> None:
    config = load_config(Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.toml")
    assert config.model_source.source == "gpt" and config.data.kind == "bytes"
    assert config.optimizer.name == "AdamW" and not config.optimizer.args
    assert config.seq_len == 64 and config.data_seed == config.train.seed


def test_hf_directory_gives_the_architecture(tmp_path: Path) -> None:
    _llama_dir(tmp_path)
    config = config_from_mapping(_doc({"source": "hf", "path": "llama", "seq_len": 64}),
                                 base_dir=str(tmp_path))
    spec = config.model
    assert spec is not None
    assert (spec.num_blocks, spec.hidden_size, spec.num_heads, spec.kv_heads, spec.ffn,
            spec.vocab_size, spec.seq_len, spec.mlp) == (4, 64, 4, 2, 128, 512, 64, "swiglu")
    assert spec.name == "llama" and config.model_source.path == "llama"
    assert config.resolve(config.model_source.path) == tmp_path / "llama"
    profile = analytic_profile(spec, device_preset("cpu"))
    assert profile.num_layers == 6
    # q, o: h*h; k, v: h*h/2; gate, up, down: h*f; two norms
    assert profile.layers[1].param_bytes == 2 * (3 * 64 * 64 + 3 * 64 * 128 + 2 * 64)


def test_hf_without_a_path_is_a_llama_from_the_keys() -> None:
    config = config_from_mapping(_doc({"source": "hf", "num_blocks": 2, "hidden_size": 32,
                                       "num_heads": 4, "num_kv_heads": 2, "ffn_size": 48,
                                       "vocab_size": 97, "seq_len": 16}))
    assert config.model is not None and config.model.mlp == "swiglu"
    preset = config_from_mapping(_doc({"source": "hf", "preset": "llama3-8b"}))
    assert preset.model is not None and preset.model.kv_heads == 8


def test_python_model_without_architecture(tmp_path: Path) -> None:
    config = config_from_mapping(_doc({"source": "python", "factory": "pkg.mod:make",
                                       "seq_len": 10},
                                      profile={"kind": "uniform", "num_layers": 3}))
    assert config.model is None and config.seq_len == 10
    assert config.model_source.factory == "pkg.mod:make"


def _spec_of(tmp_path: Path, **changes: Any) -> Any:
    _llama_dir(tmp_path, **changes)
    config = config_from_mapping(_doc({"source": "hf", "path": "llama", "seq_len": 64}),
                                 base_dir=str(tmp_path))
    return config.model


def test_dropout_flags_and_zero_rates_are_accepted(tmp_path: Path) -> None:
    spec = _spec_of(tmp_path, model_type="phi3", resid_pdrop=0.0, embd_pdrop=0,
                    attention_dropout=0.0, use_dropout=True)
    assert spec.num_blocks == 4


def test_each_family_gives_its_own_shape(tmp_path: Path) -> None:
    h, f, v = 64, 128, 512
    cases: list[tuple[dict[str, Any], dict[str, Any], int]] = [
        # (config.json changes, expected spec fields, parameters of one block)
        ({"model_type": "mistral", "sliding_window": 32},
         {"attention_bias": "none", "mlp": "swiglu", "tied_embeddings": False},
         3 * h * h + 3 * h * f + 2 * h),
        ({"model_type": "qwen2", "tie_word_embeddings": True},  # biases on q, k and v
         {"attention_bias": "qkv", "tied_embeddings": True},
         3 * h * h + h + h // 2 + h // 2 + 3 * h * f + 2 * h),
        ({"model_type": "qwen3", "head_dim": 32},  # q/k norms over a head of 32, not 16
         {"qk_norm": True, "head_dim": 32, "attention_bias": "none"},
         h * 128 + 2 * h * 64 + 128 * h + 3 * h * f + 2 * 32 + 2 * h),
        ({"model_type": "llama", "attention_bias": True, "mlp_bias": True},
         {"attention_bias": "all", "mlp_bias": True},
         3 * h * h + 2 * h + h + 3 * h * f + 2 * f + h + 2 * h),
        ({"model_type": "gemma", "hidden_act": "gelu_pytorch_tanh",
          "tie_word_embeddings": None},  # Gemma ties when config.json does not say
         {"mlp": "geglu", "tied_embeddings": True}, 3 * h * h + 3 * h * f + 2 * h),
        ({"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh"},  # four norms
         {"mlp": "geglu", "block_norms": 4, "tied_embeddings": False},
         3 * h * h + 3 * h * f + 4 * h),
    ]
    for i, (changes, fields, block) in enumerate(cases):
        root = tmp_path / str(i)
        root.mkdir()
        spec = _spec_of(root, **changes)
        assert {k: getattr(spec, k) for k in fields} == fields, changes
        assert spec.block_params() == block, changes
        profile = analytic_profile(spec, device_preset("cpu"))
        assert profile.layers[1].param_bytes == 2 * block
        # the head keeps its own copy of a tied embedding on the last stage
        assert profile.layers[-1].param_bytes == 2 * (v * h + h)


@pytest.mark.parametrize(("changes", "needle"), [
    ({"model_type": "gpt2"}, "'gpt2' model; supported model_type values: gemma, gemma2, "
                             "llama, mistral, phi3, qwen2, qwen3"),
    ({"model_type": None}, "None model; supported"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"head_dim": 0}, "head_dim must be a positive integer"),
    ({"num_attention_heads": 3}, "not divisible by num_attention_heads 3"),
    ({"vocab_size": "many"}, "vocab_size"),
    ({"attention_dropout": 0.1}, "attention_dropout = 0.1: dropout is not supported"),
])
def test_unsupported_hf_directories_name_model_path(tmp_path: Path, changes: dict[str, Any],
                                                    needle: str) -> None:
    _llama_dir(tmp_path, **changes)
    with pytest.raises(ValueError, match=needle) as info:
        config_from_mapping(_doc({"source": "hf", "path": "llama", "seq_len": 64}),
                            base_dir=str(tmp_path))
    assert str(info.value).startswith("model.path:") and "\n" not in str(info.value)


def test_hf_directory_problems(tmp_path: Path) -> None:
    def load(model: dict[str, Any]) -> None:
        config_from_mapping(_doc(model), base_dir=str(tmp_path))

    with pytest.raises(ValueError, match=r"^model\.path: .*not a directory"):
        load({"source": "hf", "path": "missing", "seq_len": 64})
    d = _llama_dir(tmp_path)
    with pytest.raises(ValueError, match=r"^model\.seq_len: is required"):
        load({"source": "hf", "path": "llama"})
    with pytest.raises(ValueError, match=r"^model\.seq_len: 256 exceeds"):
        load({"source": "hf", "path": "llama", "seq_len": 256})
    with pytest.raises(ValueError, match=r"^model\.hidden_size: is read from model\.path"):
        load({"source": "hf", "path": "llama", "seq_len": 64, "hidden_size": 8})
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"^model\.path: .*has no model\.safetensors"):
        load({"source": "hf", "path": "llama", "seq_len": 64})
    (d / "config.json").write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^model\.path: .*not valid JSON"):
        load({"source": "hf", "path": "llama", "seq_len": 64})


@pytest.mark.parametrize(("model", "field"), [
    ({"source": "jax", "preset": "llama2-7b"}, "model.source"),
    ({"source": "python", "seq_len": 8}, "model.factory"),
    ({"source": "python", "factory": "nomodule"}, "model.factory"),
    ({"preset": "llama2-7b", "factory": "a.b:c"}, "model.factory"),
    ({"preset": "llama2-7b", "path": "x"}, "model.path"),
    ({"source": "hf", "preset": "gpt3-1.3b"}, "model.mlp"),
    ({"source": "hf", "num_blocks": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 97,
      "seq_len": 16, "mlp": "gelu"}, "model.mlp"),
    ({"source": "hf", "preset": "llama2-7b", "qk_norm": True}, "model.qk_norm"),
    ({"source": "hf", "preset": "llama2-7b", "attention_bias": "qkv"}, "model.attention_bias"),
    ({"preset": "llama2-7b", "attention_bias": "some"}, "model.attention_bias"),
    ({"preset": "llama2-7b", "mlp": "relu"}, "model.mlp"),
    ({"source": 3}, "model.source"),
])
def test_bad_model_sources_name_the_field(model: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        config_from_mapping(_doc(model, profile={"kind": "uniform", "num_layers": 4}))
    assert str(info.value).startswith(field), str(info.value)


def test_optimizer_table_keeps_its_arguments() -> None:
    config = config_from_mapping(_doc({"preset": "llama2-7b"}, optimizer={
        "name": "SGD", "lr": 0.1, "momentum": 0.9, "nesterov": True,
        "schedule": "cosine", "warmup_steps": 10, "min_lr": 0}))
    opt = config.optimizer
    assert opt.name == "SGD" and opt.schedule == "cosine" and opt.min_lr == 0.0
    assert dict(opt.args) == {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    betas = config_from_mapping(_doc({"preset": "llama2-7b"},
                                     optimizer={"betas": [0.9, 0.95]}))
    assert betas.optimizer.args["betas"] == (0.9, 0.95)


def test_clip_grad_norm_is_the_optimizers_own_key() -> None:
    config = config_from_mapping(_doc({"preset": "llama2-7b"},
                                      optimizer={"clip_grad_norm": 1, "lr": 0.1}))
    assert config.optimizer.clip_grad_norm == 1.0
    assert dict(config.optimizer.args) == {"lr": 0.1}  # not an argument of the class
    assert config_from_mapping(_doc({"preset": "llama2-7b"})).optimizer.clip_grad_norm == 0.0
    for bad, needle in ((-1.0, "must be >= 0"), ("1", "must be a float"),
                        (float("inf"), "must be finite")):
        with pytest.raises(ValueError, match=rf"^optimizer\.clip_grad_norm: {needle}"):
            config_from_mapping(_doc({"preset": "llama2-7b"},
                                     optimizer={"clip_grad_norm": bad}))


def test_activation_checkpointing_and_recompute_are_one_switch() -> None:
    def load(**tables: Any) -> Any:
        return config_from_mapping(_doc({"preset": "llama2-7b"}, **tables))

    default = load()
    assert (default.train.activation_checkpointing, default.profile.recompute) == (
        "none", "selective")
    for value in ("none", "full"):  # [train] decides the planner's pricing
        config = load(train={"activation_checkpointing": value})
        assert config.profile.recompute == value
    for recompute, runtime in (("full", "full"), ("selective", "none"), ("none", "none")):
        config = load(profile={"recompute": recompute})  # and the other way round
        assert config.train.activation_checkpointing == runtime
    both = load(train={"activation_checkpointing": "full"}, profile={"recompute": "full"})
    assert both.profile.recompute == "full"
    profile = analytic_profile(both.model, device_preset("cpu"), recompute="full")
    assert profile.layers[1].activation_bytes < analytic_profile(
        both.model, device_preset("cpu"), recompute="none").layers[1].activation_bytes
    for train, recompute in (("full", "selective"), ("none", "full")):
        with pytest.raises(ValueError, match=r"^train\.activation_checkpointing: .*conflicts "
                                             r"with profile\.recompute .*one switch"):
            load(train={"activation_checkpointing": train}, profile={"recompute": recompute})
    with pytest.raises(ValueError, match=r"^train\.activation_checkpointing: unknown value "
                                         r"'selective'; choose one of full, none"):
        load(train={"activation_checkpointing": "selective"})
