"""``chameleon prepare-data``: text and JSONL through the model's own tokenizer into the
token file the trainer reads; one-line errors with exit status 2 for bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from chameleon_ft.cli import main
from chameleon_ft.runtime.workload.prepare import token_dtype
from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec import config_from_mapping

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DOCS = ["def add(a, b):\n    return a + b\n", "Ünïcödé text, with a second line.\nAnd more.",
        "", "x = [i * i for i in range(10)]  # squares"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE built here (examples/make_tokenizer.py), EOS but no BOS (Qwen's
    way)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import make_tokenizer
    finally:
        sys.path.remove(str(EXAMPLES))
    text = make_tokenizer.stdlib_documents(60_000)
    return Path(make_tokenizer.build_tokenizer(text, tmp_path_factory.mktemp("tok") / "bpe"))


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same BPE with a BOS prepended to every document by its post-processor (Llama's
    way) and its EOS a different id."""
    bpe = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bpe.add_special_tokens(["<s>", "</s>"])
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    out = tmp_path_factory.mktemp("tok") / "bos"
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>") \
        .save_pretrained(str(out))
    return out


def _inputs(root: Path) -> list[Path]:
    text = root / "one.txt"
    text.write_text(DOCS[0], encoding="utf-8")
    jsonl = root / "many.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS[1:]))
                     + "\n\n", encoding="utf-8")
    return [text, jsonl]


def _prepare(tokenizer: Path, inputs: list[Path], out: Path,
             capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["prepare-data", "--tokenizer", str(tokenizer), "--input",
                 *map(str, inputs), "--out", str(out)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("which", ["eos-only", "bos-and-eos"])
def test_ids_are_the_tokenizers_own(which: str, tokenizer_dir: Path, bos_tokenizer_dir: Path,
                                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tokenizer_dir if which == "eos-only" else bos_tokenizer_dir
    out = tmp_path / "tokens.bin"
    code, stdout, _ = _prepare(directory, _inputs(tmp_path), out, capsys)
    assert code == 0
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    expected: list[int] = []
    for doc in DOCS:  # the text file's one document, then the JSONL's lines
        expected += tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]
    ids = np.fromfile(out, dtype="uint16")
    assert ids.tolist() == expected
    assert (ids[0] == tokenizer.bos_token_id) == (which == "bos-and-eos")
    summary = stdout.splitlines()[0]
    assert summary.startswith(f"prepare-data: 4 documents, {len(expected):,} tokens (uint16, "
                              f"vocabulary {len(tokenizer)}, end-of-sequence id "
                              f"{tokenizer.eos_token_id}) in ")
    assert 'dtype = "uint16"' in stdout
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp


def test_a_vocabulary_beyond_16_bits_writes_uint32(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "[EOS]": 70_001}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="[EOS]", unk_token="[UNK]") \
        .save_pretrained(str(tmp_path / "big"))
    (tmp_path / "doc.txt").write_text("w69999 w5 w65536", encoding="utf-8")
    code, stdout, _ = _prepare(tmp_path / "big", [tmp_path / "doc.txt"], tmp_path / "t.bin",
                               capsys)
    assert code == 0 and "uint32" in stdout
    assert np.fromfile(tmp_path / "t.bin", dtype="uint32").tolist() == [69999, 5, 65536, 70001]
    assert (token_dtype(65536), token_dtype(65537)) == ("uint16", "uint32")


def _one_line_error(tokenizer: Path, inputs: list[Path], out: Path, flag: str,
                    needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = _prepare(tokenizer, inputs, out, capsys)
    assert code == 2, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"chameleon prepare-data: error: {flag}: ") and needle in lines[0]
    assert not out.exists()


def test_bad_inputs_are_one_line_with_status_2(tokenizer_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tokens.bin"
    good = _inputs(tmp_path)
    _one_line_error(tmp_path / "no-such-tokenizer", good, out, "--tokenizer",
                    "is not a directory", capsys)
    (tmp_path / "not-a-tokenizer").mkdir()
    _one_line_error(tmp_path / "not-a-tokenizer", good, out, "--tokenizer",
                    "cannot load a tokenizer", capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    _one_line_error(tokenizer_dir, [*good, empty], out, "--input", "is empty", capsys)
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    _one_line_error(tokenizer_dir, [binary], out, "--input", "is not text (not UTF-8 at byte",
                    capsys)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9".encode("latin-1"))
    _one_line_error(tokenizer_dir, [latin], out, "--input", "not UTF-8 at byte 3", capsys)
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"text": "fine"}\n{"body": "no text"}\n', encoding="utf-8")
    _one_line_error(tokenizer_dir, [bad_line], out, "--input", 'line 2 has no string field',
                    capsys)
    _one_line_error(tokenizer_dir, [tmp_path / "missing.txt"], out, "--input", "cannot read",
                    capsys)
    _one_line_error(tokenizer_dir, good, tmp_path / "no" / "dir" / "t.bin", "--out",
                    "does not exist", capsys)


def test_the_file_trains(tokenizer_dir: Path, tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    """prepare-data, then a short single-process training run reading the file."""
    from hf_families import family_config

    from chameleon_ft.runtime.workload.models.hf import save_random_hf

    sys.path.insert(0, str(EXAMPLES))
    try:
        import make_tokenizer
    finally:
        sys.path.remove(str(EXAMPLES))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n"
                              for d in make_tokenizer.stdlib_documents(30_000)), encoding="utf-8")
    code, stdout, _ = _prepare(tokenizer_dir, [corpus], tmp_path / "tokens.bin", capsys)
    assert code == 0, stdout
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True))
    config: Any = family_config("qwen2")
    config.vocab_size = vocab
    save_random_hf(config, tmp_path / "qwen2", seed=1)
    job = config_from_mapping({
        "model": {"source": "hf", "path": "qwen2", "seq_len": 12},
        "data": {"kind": "tokens", "path": "tokens.bin", "dtype": "uint16"},
        "cluster": {"num_nodes": 1, "devices_per_node": 2, "device": "cpu"},
        "job": {"pp": 2, "dp": 1, "global_batch": 4, "micro_batch": 2},
        "optimizer": {"lr": 1e-2}, "train": {"steps": 6}}, base_dir=str(tmp_path))
    losses = train_reference(job).losses
    assert losses[0] == pytest.approx(np.log(vocab), abs=0.2)
    assert losses[-1] < losses[0]
