"""Write the token file of ``examples/llama_tiny_cpu.toml``: deterministic, no download.

The text is the Python standard library's sources (the byte corpus every Python has);
tokens are its bytes (ids 0..255) plus its 256 most frequent byte pairs (ids 256..511),
encoded greedily left to right, written as a flat little-endian ``uint16`` file.

    python examples/make_tokens.py [--out examples/data/tokens.bin] [--max-bytes N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from chameleon_ft.runtime.workload.corpus import corpus_bytes

VOCAB_SIZE = 512


def encode(text: bytes) -> np.ndarray:
    """Bytes plus the 256 most frequent byte pairs (greedy, left to right) -> uint16 ids."""
    raw = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    counts = np.bincount(raw[:-1] * 256 + raw[1:], minlength=65536)
    # most frequent first, ties by pair value: a stable, deterministic table
    top = np.lexsort((np.arange(65536), -counts))[:VOCAB_SIZE - 256]
    pair_id = np.full(65536, -1, dtype=np.int64)
    pair_id[top] = 256 + np.arange(len(top))
    out: list[int] = []
    data, i, n = raw.tolist(), 0, len(raw)
    table = pair_id.tolist()
    while i < n:
        if i + 1 < n and table[data[i] * 256 + data[i + 1]] >= 0:
            out.append(table[data[i] * 256 + data[i + 1]])
            i += 2
        else:
            out.append(data[i])
            i += 1
    return np.asarray(out, dtype=np.uint16)


def main(argv: list[str] | None = None) -> Path:
    """Write the file; returns its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "data" / "tokens.bin")
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    args = parser.parse_args(argv)
    tokens = encode(corpus_bytes(args.max_bytes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokens.astype("<u2").tofile(args.out)
    print(f"wrote {len(tokens)} tokens (vocabulary {VOCAB_SIZE}) to {args.out}")
    return Path(args.out)


if __name__ == "__main__":
    main()
