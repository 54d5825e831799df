"""``chameleon train`` with the user's own model, data and optimizer: a python factory
model end to end, and one-line errors for every kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import LAYOUT, cmd, env

from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"




@pytest.mark.slow
@pytest.mark.timeout(180)
def test_python_factories_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(cmd("train", "--config", str(EXAMPLES / "mlp_cpu.toml"), "--steps",
                               "8", "--dtype", "float64", "--out", str(out), "--policy",
                               "dynamic", "--fault", "rank=1,step=3,kind=kill,phase=backward"),
                          capture_output=True, text=True, timeout=150, env=env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert [e["workers"] for e in report["events"]] == [[1]]
    reference = train_reference(load_config(EXAMPLES / "mlp_cpu.toml"), steps=8,
                                dtype=torch.float64)
    got = torch.load(out / "params.pt")
    assert sorted(got) == sorted(reference.params)
    assert max(float((got[k] - reference.params[k]).abs().max()) for k in got) < 1e-9
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(8))


LLAMA = """
[model]
source = "hf"
path = "{path}"
seq_len = 16

[data]
kind = "tokens"
path = "{tokens}"

[optimizer]
name = "{optimizer}"
{optimizer_args}

""" + LAYOUT + """
[train]
steps = 3
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import make_llama
    finally:
        sys.path.remove(str(EXAMPLES))
    return Path(make_llama.main(["--out", str(tmp_path_factory.mktemp("m") / "llama")]))


def _job(tmp_path: Path, llama: Path, *, path: str | None = None, tokens: np.ndarray | None = None,
         optimizer: str = "AdamW", optimizer_args: str = "lr = 0.001") -> Path:
    ids = tokens if tokens is not None else np.arange(4000) % 500
    token_file = tmp_path / "tokens.bin"
    ids.astype("<u2").tofile(token_file)
    job = tmp_path / "job.toml"
    job.write_text(LLAMA.format(path=path or llama, tokens=token_file, optimizer=optimizer,
                                optimizer_args=optimizer_args))
    return job


def _one_line_error(job: Path, field: str) -> None:
    proc = subprocess.run(cmd("train", "--config", str(job)), capture_output=True, text=True,
                          timeout=120, env=env())
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-1000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"error: {field}" in lines[0], proc.stderr
    assert "launched" not in proc.stdout


def test_missing_model_directory(tmp_path: Path, llama: Path) -> None:
    _one_line_error(_job(tmp_path, llama, path=str(tmp_path / "nowhere")), "model.path")


def test_non_llama_directory(tmp_path: Path, llama: Path) -> None:
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    _one_line_error(_job(tmp_path, llama, path=str(other)), "model.path")


def test_token_file_shorter_than_a_sample(tmp_path: Path, llama: Path) -> None:
    _one_line_error(_job(tmp_path, llama, tokens=np.arange(10)), "data.path")


def test_token_id_above_the_vocabulary(tmp_path: Path, llama: Path) -> None:
    ids = np.arange(4000) % 500
    ids[1234] = 9999
    _one_line_error(_job(tmp_path, llama, tokens=ids), "data.path")


def test_factory_that_does_not_import(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    text = (EXAMPLES / "mlp_cpu.toml").read_text().replace(
        "mlp_regression:build_model", "no_such_module_here:build_model")
    job.write_text(text)
    _one_line_error(job, "model.factory")


def test_unknown_optimizer(tmp_path: Path, llama: Path) -> None:
    _one_line_error(_job(tmp_path, llama, optimizer="AdamWW"), "optimizer.name")


def test_unknown_optimizer_argument(tmp_path: Path, llama: Path) -> None:
    _one_line_error(_job(tmp_path, llama, optimizer="SGD",
                         optimizer_args="lr = 0.1\nmomentm = 0.9"), "optimizer.momentm")


@pytest.mark.timeout(180)
def test_prepare_data_through_the_cli(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import make_tokenizer
    finally:
        sys.path.remove(str(EXAMPLES))
    tokenizer = make_tokenizer.main(["--out", str(tmp_path / "tok"), "--corpus",
                                     str(tmp_path / "corpus.jsonl"), "--max-bytes", "40000"])
    (tmp_path / "notes.txt").write_text("A text file is one document.\n", encoding="utf-8")
    out = tmp_path / "tokens.bin"
    proc = subprocess.run(cmd("prepare-data", "--tokenizer", str(tokenizer), "--input",
                              str(tmp_path / "corpus.jsonl"), str(tmp_path / "notes.txt"),
                              "--out", str(out)),
                          capture_output=True, text=True, timeout=150, env=env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    documents = len((tmp_path / "corpus.jsonl").read_text().splitlines()) + 1
    assert proc.stdout.startswith(f"prepare-data: {documents} documents, ")
    assert proc.stderr == ""  # no progress bar off a terminal
    ids = np.fromfile(out, dtype="uint16")
    assert (ids == 0).sum() == documents  # one end-of-sequence id per document
    assert ids[-1] == 0 and ids.max() < 512
