"""Data sources: samples fixed by their global position, token files read in windows,
a shuffle that is a permutation, and one-line errors naming the [data] field."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.runtime.workload.corpus import ByteCorpus
from chameleon_ft.runtime.workload.data import (
    ByteData,
    TokenData,
    data_digest,
    feistel_permute,
    load_data,
)
from chameleon_ft.spec import config_from_mapping

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _config(base: Path, data: dict[str, Any], vocab: int = 512, seq_len: int = 8,
            **model: Any) -> Any:
    return config_from_mapping({
        "model": {"num_blocks": 2, "hidden_size": 16, "num_heads": 2, "vocab_size": vocab,
                  "seq_len": seq_len, **model},
        "cluster": {"num_nodes": 1, "devices_per_node": 2, "device": "cpu"},
        "job": {"pp": 2, "dp": 1, "global_batch": 6, "micro_batch": 2},
        "data": data}, base_dir=str(base))


def _tokens(path: Path, n: int, dtype: str = "uint16", top: int = 500) -> np.ndarray:
    values = (np.arange(n, dtype=np.int64) * 7919 % top).astype(dtype)
    values.tofile(path)
    return values


def test_bytes_wrap_the_corpus_by_global_position() -> None:
    data, corpus = ByteData(16, seed=3), ByteCorpus(16, seed=3)
    x, y = data.microbatch(2, 4, 2)
    cx, cy = corpus.microbatch(2, 2, 2)  # micro-batch 2 of size 2 = samples 4, 5
    assert torch.equal(x, cx) and torch.equal(y, cy)
    whole = data.microbatch(2, 0, 6)[0]
    assert torch.equal(whole[4:6], x), "a sample does not depend on its micro-batch"
    assert data.digest() == ByteData(16, seed=3).digest() != ByteData(16, seed=4).digest()


def test_token_windows_follow_the_formula(tmp_path: Path) -> None:
    n, seq_len, batch = 100, 8, 6
    values = _tokens(tmp_path / "t.bin", n)
    data = TokenData(tmp_path / "t.bin", seq_len=seq_len, global_batch=batch)
    for step in (0, 1, 5, 40):
        x, y = data.microbatch(step, 1, 4)
        assert x.shape == y.shape == (4, seq_len) and x.dtype == torch.int64
        for i in range(4):
            g = step * batch + 1 + i
            s = (g * seq_len) % (n - seq_len)
            assert x[i].tolist() == values[s:s + seq_len].tolist()
            assert y[i].tolist() == values[s + 1:s + seq_len + 1].tolist()
    whole = data.microbatch(3, 0, batch)[0]
    assert torch.equal(whole[1:5], data.microbatch(3, 1, 4)[0])


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_load_from_config_with_both_dtypes(tmp_path: Path, dtype: str) -> None:
    values = _tokens(tmp_path / "t.bin", 200, dtype, top=70_000 if dtype == "uint32" else 500)
    config = _config(tmp_path, {"kind": "tokens", "path": "t.bin", "dtype": dtype},
                     vocab=70_000)
    data = load_data(config)
    x, _ = data.microbatch(0, 0, 2)
    assert x[1].tolist() == values[8:16].tolist()
    assert len(data_digest(data)) == 16


def test_shuffle_permutes_each_pass(tmp_path: Path) -> None:
    n, seq_len = 331, 8
    _tokens(tmp_path / "t.bin", n)
    plain = TokenData(tmp_path / "t.bin", seq_len=seq_len, global_batch=1)
    mixed = TokenData(tmp_path / "t.bin", seq_len=seq_len, global_batch=1, shuffle=True,
                      seed=7)
    k = plain.windows_per_pass
    assert k == -(-(n - seq_len) // seq_len)
    for epoch in range(3):
        ours = [mixed.start(epoch * k + j) for j in range(k)]
        theirs = [plain.start(epoch * k + j) for j in range(k)]
        assert sorted(ours) == sorted(theirs), "a pass visits the same windows"
        assert ours != theirs
    again = TokenData(tmp_path / "t.bin", seq_len=seq_len, global_batch=1, shuffle=True,
                      seed=7)
    assert [again.start(g) for g in range(50)] == [mixed.start(g) for g in range(50)]
    other = TokenData(tmp_path / "t.bin", seq_len=seq_len, global_batch=1, shuffle=True,
                      seed=8)
    assert [other.start(g) for g in range(50)] != [mixed.start(g) for g in range(50)]
    assert mixed.digest() != plain.digest()


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 600), key=st.integers(0, 2**64 - 1))
def test_feistel_is_a_bijection(size: int, key: int) -> None:
    image = [feistel_permute(i, size, key) for i in range(size)]
    assert sorted(image) == list(range(size))


def test_feistel_needs_no_table_for_a_huge_range() -> None:
    size = 10**12 + 39
    values = {feistel_permute(i, size, 5) for i in range(1000)}
    assert len(values) == 1000 and all(0 <= v < size for v in values)


def test_token_data_pickles_without_the_file_contents(tmp_path: Path) -> None:
    _tokens(tmp_path / "t.bin", 50_000)
    data = TokenData(tmp_path / "t.bin", seq_len=8, global_batch=2)
    data.microbatch(0, 0, 2)  # maps the file
    blob = pickle.dumps(data)
    assert len(blob) < 5_000
    assert torch.equal(pickle.loads(blob).microbatch(3, 0, 2)[0], data.microbatch(3, 0, 2)[0])


@pytest.mark.parametrize(("make", "data", "needle"), [
    (lambda d: _tokens(d / "t.bin", 8), {"kind": "tokens", "path": "t.bin"},
     "shorter than one sample"),
    (lambda d: _tokens(d / "t.bin", 100, top=600), {"kind": "tokens", "path": "t.bin"},
     "outside the model's vocabulary"),
    (lambda d: (d / "t.bin").write_bytes(b"abc"), {"kind": "tokens", "path": "t.bin"},
     "not a multiple of 2"),
    (lambda d: None, {"kind": "tokens", "path": "missing.bin"}, "cannot read"),
])
def test_bad_token_files_name_data_path(tmp_path: Path, make: Any, data: dict[str, Any],
                                        needle: str) -> None:
    make(tmp_path)
    with pytest.raises(ValueError, match=needle) as info:
        load_data(_config(tmp_path, data))
    assert str(info.value).startswith("data.path:") and "\n" not in str(info.value)


def test_vocabulary_check_finds_the_first_offender(tmp_path: Path) -> None:
    values = np.zeros(50, dtype=np.uint16)
    values[37] = 900
    values.tofile(tmp_path / "t.bin")
    with pytest.raises(ValueError, match="token id 900 at position 37"):
        TokenData(tmp_path / "t.bin", seq_len=8, global_batch=2, vocab_size=512)


@pytest.mark.parametrize(("data", "field"), [
    ({"kind": "words"}, "data.kind"),
    ({"kind": "tokens"}, "data.path"),
    ({"kind": "tokens", "path": "t.bin", "dtype": "int8"}, "data.dtype"),
    ({"kind": "bytes", "path": "t.bin"}, "data.path"),
    ({"kind": "python"}, "data.factory"),
    ({"kind": "python", "factory": "no colon"}, "data.factory"),
    ({"shuffle": True}, "data.shuffle"),
    ({"kind": "bytes", "colour": 1}, "data.colour"),
])
def test_bad_data_tables_are_rejected_at_load(tmp_path: Path, data: dict[str, Any],
                                              field: str) -> None:
    with pytest.raises(ValueError) as info:
        _config(tmp_path, data)
    assert str(info.value).startswith(field), str(info.value)


def test_python_factories(tmp_path: Path) -> None:
    config = _config(EXAMPLES, {"kind": "python", "factory": "mlp_regression:build_data"})
    data = load_data(config)
    x, y = data.microbatch(1, 2, 3)
    assert x.shape == (3, 8) and y.shape == (3, 1)
    assert torch.equal(load_data(config).microbatch(1, 3, 1)[0], x[1:2])
    for factory, needle in (("no_such_module_here:f", "cannot import 'no_such_module_here'"),
                            ("mlp_regression:nothing", "has no callable 'nothing'"),
                            ("mlp_regression:build_model", "has no microbatch")):
        bad = _config(EXAMPLES, {"kind": "python", "factory": factory})
        with pytest.raises(ValueError, match=needle) as info:
            load_data(bad)
        assert str(info.value).startswith("data.factory:") and "\n" not in str(info.value)


def test_bytes_need_a_byte_vocabulary(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.kind: byte tokens"):
        load_data(_config(tmp_path, {}, vocab=100))
