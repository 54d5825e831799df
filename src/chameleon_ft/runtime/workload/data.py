"""Data sources: ``microbatch(step, first_sample, size) -> (inputs, targets)``.

A data source returns the samples at global positions ``g = step * global_batch + i`` for
``i`` in ``first_sample .. first_sample + size - 1``: every sample is fixed by its global
position, so a step trains on the same samples whatever the plan and whoever runs them.
``digest()`` is a cheap fingerprint that workers on other hosts compare with the
coordinator's before training.

Kinds (``[data] kind``):

- ``bytes`` (:class:`ByteData`): the Python standard library's sources as byte tokens
  (``chameleon_ft.runtime.workload.corpus.ByteCorpus``), the default;
- ``tokens`` (:class:`TokenData`): a flat binary file of token ids read through
  ``numpy.memmap``; the sample at ``g`` is the window starting at
  ``s = (g * seq_len) mod (n - seq_len)``; with ``shuffle`` the windows of each pass over
  the file are visited in a seeded random order (a keyed Feistel permutation: nothing the
  size of the file is ever materialised);
- ``python``: ``factory = "package.module:function"`` called with the job's ``Config``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from chameleon_ft.runtime.workload.corpus import ByteCorpus, corpus_digest
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.data import DataKind

_MASK64 = (1 << 64) - 1
_DIGEST_BLOCK_BYTES = 1 << 16
_DIGEST_BLOCKS = 8
_CHECK_CHUNK = 1 << 24
"""Token ids checked against the vocabulary per chunk (64 MiB of uint32 at most)."""
_FEISTEL_ROUNDS = 4


@runtime_checkable
class DataSource(Protocol):
    """Samples fixed by their global position."""

    def microbatch(self, step: int, first_sample: int,
                   size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of the samples ``first_sample .. first_sample + size - 1`` of
        step ``step`` (indices within the step's global batch), stacked on dim 0."""
        ...


def data_digest(source: Any) -> str:
    """The source's ``digest()``, or ``""`` for a source without one (not checked)."""
    fn = getattr(source, "digest", None)
    return str(fn()) if fn is not None else ""


def check_data(obj: Any, field: str = "data") -> DataSource:
    """Check that ``obj`` has a ``microbatch`` method.

    Raises:
        ValueError: naming ``field``.
    """
    if not callable(getattr(obj, "microbatch", None)):
        raise ValueError(f"{field}: {type(obj).__name__} has no microbatch(step, "
                         "first_sample, size) method")
    source: DataSource = obj
    return source


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def feistel_permute(index: int, size: int, key: int) -> int:
    """A keyed bijection of ``0 .. size-1`` evaluated at ``index`` in O(1) memory.

    A balanced Feistel network of four rounds (SplitMix64 round function) permutes the
    smallest power of four ``>= size``; values that land outside ``0 .. size-1`` are
    permuted again (cycle walking), which keeps it a bijection of the smaller range and
    takes fewer than four rounds trips on average.

    Args:
        index: in ``0 .. size-1``.
        size: the range's size, >= 1.
        key: the permutation's key (seed and pass).
    """
    if not 0 <= index < size:
        raise IndexError(f"index {index} outside 0..{size - 1}")
    half = ((size - 1).bit_length() + 1) // 2
    mask = (1 << half) - 1
    round_keys = [_mix((key * 0x9E3779B97F4A7C15 + r) & _MASK64) for r in range(_FEISTEL_ROUNDS)]
    x = index
    while True:
        left, right = x >> half, x & mask
        for rk in round_keys:
            left, right = right, left ^ (_mix(right ^ rk) & mask)
        x = (left << half) | right
        if x < size:
            return x


class ByteData:
    """``kind = "bytes"``: the standard library's sources as byte tokens."""

    def __init__(self, seq_len: int, *, seed: int = 0) -> None:
        """Args:
            seq_len: tokens per sample.
            seed: changes which windows each step draws.
        """
        self.corpus = ByteCorpus(seq_len, seed=seed)
        self.seq_len = seq_len
        self.seed = seed

    def microbatch(self, step: int, first_sample: int,
                   size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, both (size, seq_len) int64; targets are the next bytes."""
        return self.corpus.windows([self.corpus.offset(step, first_sample + i)
                                    for i in range(size)])

    def digest(self) -> str:
        """The corpus's hash and the sampling settings."""
        return hashlib.sha256(f"bytes:{corpus_digest()}:{self.seq_len}:{self.seed}"
                              .encode()).hexdigest()[:16]


class TokenData:
    """``kind = "tokens"``: windows of a flat binary file of token ids."""

    def __init__(self, path: Path, *, seq_len: int, global_batch: int,
                 dtype: str = "uint16", shuffle: bool = False, seed: int = 0,
                 vocab_size: int | None = None) -> None:
        """Open the file and check it.

        Args:
            path: the token file (native byte order, no header).
            seq_len: tokens per sample.
            global_batch: samples per step (the global position of sample ``i`` of step
                ``k`` is ``k * global_batch + i``).
            dtype: ``uint16`` or ``uint32``.
            shuffle: visit each pass's windows in a seeded random order.
            seed: the shuffle's seed.
            vocab_size: when given, every id must be below it (checked here, in chunks).

        Raises:
            ValueError: naming ``data.path`` for a missing or malformed file, a file
                shorter than one sample or an id outside the vocabulary.
        """
        self.path = Path(path)
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dtype = np.dtype(dtype)
        self.shuffle = shuffle
        self.seed = seed
        try:
            size_bytes = os.path.getsize(self.path)
        except OSError as exc:
            raise ValueError(f"data.path: cannot read {str(self.path)!r}: "
                             f"{exc.strerror}") from None
        if size_bytes % self.dtype.itemsize:
            raise ValueError(f"data.path: {str(self.path)!r} has {size_bytes} bytes, not a "
                             f"multiple of {self.dtype.itemsize} (data.dtype {dtype})")
        self.num_tokens = size_bytes // self.dtype.itemsize
        if self.num_tokens < seq_len + 1:
            raise ValueError(f"data.path: {str(self.path)!r} holds {self.num_tokens} tokens, "
                             f"shorter than one sample (seq_len + 1 = {seq_len + 1})")
        self.num_starts = self.num_tokens - seq_len
        """``n - seq_len``: window starts are taken modulo this."""
        self.windows_per_pass = -(-self.num_starts // seq_len)
        """Samples in one pass over the file (the shuffle's block)."""
        self._tokens: np.memmap[Any, np.dtype[Any]] | None = None
        if vocab_size is not None:
            self._check_vocab(vocab_size)

    @property
    def tokens(self) -> np.memmap[Any, np.dtype[Any]]:
        """The file, memory-mapped (opened on first use, also after unpickling)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        # A memmap would pickle as a full in-memory copy; the receiver maps the file again.
        state = dict(self.__dict__)
        state["_tokens"] = None
        return state

    def _check_vocab(self, vocab_size: int) -> None:
        tokens = self.tokens
        for start in range(0, self.num_tokens, _CHECK_CHUNK):
            chunk = tokens[start:start + _CHECK_CHUNK]
            top = int(chunk.max())
            if top >= vocab_size:
                where = start + int(np.argmax(chunk >= vocab_size))
                raise ValueError(f"data.path: token id {top} at position {where} of "
                                 f"{str(self.path)!r} is outside the model's vocabulary "
                                 f"(vocab_size {vocab_size})")

    def start(self, position: int) -> int:
        """First token of the sample at global position ``position``."""
        if self.shuffle:
            k = self.windows_per_pass
            epoch, j = divmod(position, k)
            key = (self.seed * 0xD1B54A32D192ED03 + epoch) & _MASK64
            position = epoch * k + feistel_permute(j, k, key)
        return (position * self.seq_len) % self.num_starts

    def microbatch(self, step: int, first_sample: int,
                   size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, both (size, seq_len) int64; targets are the next tokens."""
        base = step * self.global_batch + first_sample
        tokens = self.tokens
        windows = np.stack([tokens[s:s + self.seq_len + 1]
                            for s in (self.start(base + i) for i in range(size))])
        windows_t = torch.from_numpy(windows.astype(np.int64))  # (size, T + 1)
        return windows_t[:, :-1].contiguous(), windows_t[:, 1:].contiguous()

    def digest(self) -> str:
        """Size, dtype, sampling settings and SHA-256 of the first, last and a few evenly
        spaced 64 KiB blocks: cheap even for a huge file."""
        h = hashlib.sha256(f"tokens:{self.dtype}:{self.num_tokens}:{self.seq_len}:"
                           f"{self.global_batch}:{self.shuffle}:{self.seed}".encode())
        size_bytes = self.num_tokens * self.dtype.itemsize
        offsets = {0, max(0, size_bytes - _DIGEST_BLOCK_BYTES)}
        offsets.update(size_bytes * k // (_DIGEST_BLOCKS + 1)
                       for k in range(1, _DIGEST_BLOCKS + 1))
        with open(self.path, "rb") as f:
            for offset in sorted(offsets):
                f.seek(offset)
                h.update(f.read(_DIGEST_BLOCK_BYTES))
        return h.hexdigest()[:16]


def load_data(config: Config, *, vocab_size: int | None = None) -> DataSource:
    """The data source of ``[data]``.

    Args:
        config: the job; ``config.seq_len`` and ``config.job.global_batch`` fix the samples.
        vocab_size: ids must be below it (default: ``[model] vocab_size`` when known).

    Raises:
        ValueError: one line naming the ``[data]`` field at fault.
    """
    spec = config.data
    if vocab_size is None and config.model is not None:
        vocab_size = config.model.vocab_size
    seq_len = config.seq_len
    if spec.kind == DataKind.PYTHON:
        from chameleon_ft.runtime.workload.models.factory import call_factory

        return check_data(call_factory(spec.factory, "data.factory", config), "data.factory")
    if seq_len < 1:
        raise ValueError(f"model.seq_len: data kind {spec.kind!r} needs the training "
                         "sequence length")
    if spec.kind == DataKind.TOKENS:
        return TokenData(config.resolve(spec.path), seq_len=seq_len,
                         global_batch=config.job.global_batch, dtype=spec.dtype,
                         shuffle=spec.shuffle, seed=config.data_seed, vocab_size=vocab_size)
    if vocab_size is not None and vocab_size < 256:
        raise ValueError(f"data.kind: byte tokens need a vocabulary of 256, the model has "
                         f"{vocab_size}")
    return ByteData(seq_len, seed=config.data_seed)
