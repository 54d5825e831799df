"""The examples build their data and model locally and train in process."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from chameleon_ft.runtime.workload.data import load_data
from chameleon_ft.runtime.workload.models import load_model
from chameleon_ft.runtime.workload.optim import optimizer_from_config, schedule_from_config
from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def example_scripts() -> object:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import make_llama
        import make_tokens

        yield make_tokens, make_llama
    finally:
        sys.path.remove(str(EXAMPLES))


def test_qwen_example_builds_prepares_and_trains(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """make examples' steps for examples/qwen_tiny_cpu.toml, in a temporary folder."""
    from chameleon_ft.cli import main

    sys.path.insert(0, str(EXAMPLES))
    try:
        import make_model
        import make_tokenizer
    finally:
        sys.path.remove(str(EXAMPLES))
    shutil.copy(EXAMPLES / "qwen_tiny_cpu.toml", tmp_path)
    data = tmp_path / "data"
    tokenizer = make_tokenizer.main(["--out", str(data / "tokenizer"), "--corpus",
                                     str(data / "corpus.jsonl"), "--max-bytes", "120000"])
    assert main(["prepare-data", "--tokenizer", str(tokenizer), "--input",
                 str(data / "corpus.jsonl"), "--out", str(data / "qwen-tokens.bin")]) == 0
    make_model.main(["--family", "qwen2", "--out", str(data / "qwen-tiny")])
    capsys.readouterr()
    config = load_config(tmp_path / "qwen_tiny_cpu.toml")
    assert config.model is not None and config.model.attention_bias == "qkv"
    model = load_model(config)
    assert model.num_layers == 6 and model.describe().startswith("Qwen2 from ")  # type: ignore[attr-defined]
    losses = train_reference(config, steps=8).losses
    assert losses[0] == pytest.approx(np.log(512), abs=0.1)
    assert losses[-1] < losses[0]
    assert load_config(tmp_path / "qwen_tiny_cpu.toml").data.dtype == "uint16"
    tied = make_model.main(["--family", "qwen2", "--out", str(data / "qwen-tied"), "--tied"])
    assert load_model(replace(config, model_source=replace(
        config.model_source, path=str(tied)))).tied_parameters()  # type: ignore[attr-defined]


def test_llama_example_builds_and_trains(tmp_path: Path, example_scripts: object) -> None:
    make_tokens, make_llama = example_scripts  # type: ignore[misc]
    shutil.copy(EXAMPLES / "llama_tiny_cpu.toml", tmp_path)
    tokens = make_tokens.main(["--out", str(tmp_path / "data" / "tokens.bin"),
                               "--max-bytes", "60000"])
    make_llama.main(["--out", str(tmp_path / "data" / "llama-tiny")])
    ids = np.fromfile(tokens, dtype="<u2")
    assert ids.max() < 512 and (ids >= 256).mean() > 0.2, "pairs are used"
    assert np.array_equal(make_tokens.encode(b"abab"), make_tokens.encode(b"abab"))
    config = load_config(tmp_path / "llama_tiny_cpu.toml")
    assert config.model is not None and config.model.num_layers == 6
    model = load_model(config)
    assert model.num_layers == 6
    optimizer_from_config(config)
    schedule = schedule_from_config(config)
    assert schedule is not None and schedule(0) < schedule(10)
    losses = train_reference(config, steps=8).losses
    assert losses[0] == pytest.approx(np.log(512), abs=0.1)
    assert losses[-1] < losses[0]
    assert len(load_data(config).digest()) == 16  # type: ignore[attr-defined]


def test_mlp_example_loads_and_trains() -> None:
    config = load_config(EXAMPLES / "mlp_cpu.toml")
    assert config.model is None and config.num_layers == 4
    losses = train_reference(config, steps=20).losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
