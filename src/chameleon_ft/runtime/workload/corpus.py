"""Deterministic byte-level training data from the Python standard library's sources.

Every machine with Python has the corpus, no download needed. The files are the top-level
``*.py`` modules of the standard library, sorted by name and concatenated, cut at
``max_bytes``. Sample ``i`` of step ``k`` starts at an offset hashed from ``(seed, k, i)``,
so a step's global batch is the same set of samples under every plan: pipeline ``p`` reads
global micro-batches ``offsets[p] ..`` of the plan and gets the same tokens whoever runs it.
"""

from __future__ import annotations

import hashlib
import sysconfig
from functools import lru_cache
from pathlib import Path

import torch

_MASK64 = (1 << 64) - 1
DEFAULT_CORPUS_BYTES = 4_000_000
"""Enough text that a short run never repeats a window; small enough to read in ~10 ms."""


@lru_cache(maxsize=4)
def corpus_bytes(max_bytes: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """The concatenated standard-library sources, at most ``max_bytes`` long.

    Raises:
        ValueError: when the standard library's sources cannot be found.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise ValueError(f"data: no Python sources under {root}; the corpus needs them")
    chunks, size = [], 0
    for f in files:
        text = f.read_bytes()
        chunks.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def corpus_digest(max_bytes: int = DEFAULT_CORPUS_BYTES) -> str:
    """SHA-256 of the corpus: workers on other hosts check they train on the same text."""
    return hashlib.sha256(corpus_bytes(max_bytes)).hexdigest()[:16]


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit hash of ``x``."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class ByteCorpus:
    """Samples of ``seq_len`` byte tokens and their next-byte targets."""

    def __init__(self, seq_len: int, seed: int = 0,
                 max_bytes: int = DEFAULT_CORPUS_BYTES) -> None:
        """Load the corpus.

        Args:
            seq_len: tokens per sample.
            seed: changes which windows each step draws.
            max_bytes: corpus size.
        """
        raw = corpus_bytes(max_bytes)
        if len(raw) <= seq_len + 1:
            raise ValueError(f"data: the corpus ({len(raw)} bytes) is shorter than one sample")
        # one byte per token (eight as int64 would be 40 MB in every process, the
        # coordinator's included); samples are widened when they are cut
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = len(raw) - seq_len - 1

    def offset(self, step: int, sample: int) -> int:
        """Start of sample ``sample`` (global index within the step) of step ``step``."""
        key = (self.seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + sample) & _MASK64
        return _mix(key) % self.num_windows

    def microbatch(self, step: int, global_microbatch: int,
                   micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of one micro-batch.

        Args:
            step: 0-based step.
            global_microbatch: index of the micro-batch in the step's global list.
            micro_batch: samples per micro-batch.

        Returns:
            ``(inputs, targets)``, both (micro_batch, seq_len) int64.
        """
        starts = [self.offset(step, global_microbatch * micro_batch + i)
                  for i in range(micro_batch)]
        return self.windows(starts)

    def windows(self, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of the samples starting at ``starts``: (len, seq_len)
        int64 each, the targets one byte later."""
        x = torch.stack([self.tokens[s:s + self.seq_len] for s in starts])  # (b, T)
        y = torch.stack([self.tokens[s + 1:s + 1 + self.seq_len] for s in starts])  # (b, T)
        return x.to(torch.int64), y.to(torch.int64)
