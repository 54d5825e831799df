"""Token files from text (``chameleon prepare-data``): what ``[data] kind = "tokens"`` reads.

Local text files and JSONL files (one document per line, in its ``text`` field) are
tokenized with the model's own tokenizer, loaded from a local directory (never
downloaded), each document as the tokenizer encodes it (its own special tokens, such as a
leading BOS) followed by the end-of-sequence id unless the tokenizer already ends it with
one. The ids are written as a flat file of ``uint16`` when the vocabulary fits in 16 bits,
else ``uint32`` (native byte order, no header: :class:`~chameleon_ft.runtime.workload.data.
TokenData`), first to a temporary file beside the target, then renamed, so a reader never
sees half a file. A text file is one document; a ``.jsonl`` file holds one per line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BATCH_DOCUMENTS = 256
"""Documents tokenized per call (a fast tokenizer encodes a batch in parallel)."""
UINT16_VOCAB = 1 << 16


@dataclass(frozen=True)
class PrepareSummary:
    """What :func:`prepare_tokens` wrote."""

    documents: int
    tokens: int
    dtype: str
    """``uint16`` or ``uint32``: ``[data] dtype`` for the file."""
    vocab_size: int
    eos_id: int
    seconds: float
    out: Path


def load_tokenizer(directory: Path) -> Any:
    """The tokenizer saved in ``directory`` (``save_pretrained`` layout), local files only.

    Raises:
        ValueError: naming ``--tokenizer`` for a missing directory, one transformers cannot
            load, or a tokenizer without an end-of-sequence token.
    """
    if not directory.is_dir():
        raise ValueError(f"--tokenizer: {str(directory)!r} is not a directory (a local "
                         "tokenizer folder, as save_pretrained writes it)")
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - the hf extra is part of `make test`
        raise ValueError("--tokenizer: needs Hugging Face transformers; install the extra "
                         "from the checkout: pip install -e '.[hf]'") from None
    hf_logging.set_verbosity_error()  # no "sequence longer than the model" notes per document
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--tokenizer: cannot load a tokenizer from {str(directory)!r}: "
                         f"{first}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--tokenizer: {str(directory)!r} has no end-of-sequence token "
                         "(eos_token), which separates the documents")
    return tokenizer


def _read(path: Path) -> bytes:
    """The file's bytes, checked to be text.

    Raises:
        ValueError: naming ``--input`` for a missing, binary (a NUL byte, not UTF-8) or
            empty file.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"--input: cannot read {str(path)!r}: {exc.strerror}") from None
    bad = raw.find(b"\0")
    if bad < 0:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = exc.start
    if bad >= 0:
        raise ValueError(f"--input: {str(path)!r} is not text (not UTF-8 at byte {bad}); "
                         "give plain text or JSONL files")
    if not raw.strip():
        raise ValueError(f"--input: {str(path)!r} is empty")
    return raw


def documents(path: Path) -> Iterator[tuple[str, int]]:
    """The documents of one input, each with the input bytes it took: the whole text of a
    text file, the ``text`` field of every line of a ``.jsonl`` file (blank lines
    skipped).

    Raises:
        ValueError: naming ``--input`` (and the line) for a file that is not text, is
            empty, or holds a line that is not a JSON object with a string ``text``.
    """
    raw = _read(path)
    if path.suffix.lower() != ".jsonl":
        yield raw.decode("utf-8"), len(raw)
        return
    for number, line in enumerate(raw.splitlines(keepends=True), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--input: {str(path)!r} line {number} is not JSON: "
                             f"{exc.msg}") from None
        value = record.get("text") if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise ValueError(f"--input: {str(path)!r} line {number} has no string field "
                             '"text"')
        yield value, len(line)


def encode_documents(tokenizer: Any, docs: Sequence[str]) -> list[list[int]]:
    """Each document as the tokenizer encodes it, ended by the end-of-sequence id."""
    eos = int(tokenizer.eos_token_id)
    encoded = tokenizer(list(docs), add_special_tokens=True)["input_ids"]
    return [list(ids) if ids and ids[-1] == eos else [*ids, eos] for ids in encoded]


def token_dtype(vocab_size: int) -> str:
    """``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


def prepare_tokens(tokenizer_dir: Path, inputs: Sequence[Path], out: Path, *,
                   progress: Callable[[int], None] | None = None) -> PrepareSummary:
    """Tokenize ``inputs`` into the token file ``out``.

    Args:
        tokenizer_dir: a local tokenizer directory.
        inputs: text or ``.jsonl`` files.
        out: the token file (replaced atomically: nothing is written on an error).
        progress: called with the input bytes tokenized since its last call.

    Raises:
        ValueError: one line naming ``--tokenizer``, ``--input`` or ``--out``.
    """
    start = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_dir)
    if not inputs:
        raise ValueError("--input: give at least one text or JSONL file")
    vocab_size = len(tokenizer)
    dtype = token_dtype(vocab_size)
    if not out.parent.is_dir():
        raise ValueError(f"--out: the folder {str(out.parent)!r} does not exist")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    counts = [0, 0]  # documents, tokens

    def write(f: Any, batch: list[str], nbytes: int) -> None:
        for ids in encode_documents(tokenizer, batch) if batch else []:
            np.asarray(ids, dtype=dtype).tofile(f)
            counts[1] += len(ids)
        counts[0] += len(batch)
        if progress is not None:
            progress(nbytes)

    try:
        with open(tmp, "wb") as f:
            for path in inputs:
                batch: list[str] = []
                nbytes = 0
                for doc, size in documents(path):
                    batch.append(doc)
                    nbytes += size
                    if len(batch) == BATCH_DOCUMENTS:
                        write(f, batch, nbytes)
                        batch, nbytes = [], 0
                write(f, batch, nbytes)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as exc:
        raise ValueError(f"--out: cannot write {str(out)!r}: {exc.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return PrepareSummary(documents=counts[0], tokens=counts[1], dtype=dtype,
                          vocab_size=vocab_size, eos_id=int(tokenizer.eos_token_id),
                          seconds=time.perf_counter() - start, out=out)
