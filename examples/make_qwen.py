"""Write the model of ``examples/qwen_tiny_cpu.toml``: a randomly initialised tiny Qwen2 (the
Qwen2 / Qwen2.5 architecture: biases on the query, key and value projections, grouped-query
attention) as a Hugging Face ``save_pretrained`` directory, built locally with no download.
Its 512 ids are those of ``examples/make_tokenizer.py``'s tokenizer (end-of-sequence id 0).

    python examples/make_qwen.py [--out examples/data/qwen-tiny] [--seed 0] [--tied]

``--tied`` ties the LM head to the embedding, as Qwen2.5 0.5B-3B do; the runtime keeps a copy
of the matrix in the first and the last stage and sums their gradients every step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import Qwen2Config

from chameleon_ft.runtime.workload.models.hf import save_random_hf


def tiny_qwen(tied: bool = False) -> Qwen2Config:
    """4 decoder layers, hidden 64, 4 heads sharing 2 key/value heads, 512 ids."""
    return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=176,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, tie_word_embeddings=tied,
                       bos_token_id=None, eos_token_id=0, pad_token_id=None)


def main(argv: list[str] | None = None) -> Path:
    """Write the directory; returns its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "data" / "qwen-tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    args = parser.parse_args(argv)
    config = tiny_qwen(args.tied)
    save_random_hf(config, args.out, seed=args.seed)
    print(f"wrote a {config.num_hidden_layers}-layer Qwen2 (hidden {config.hidden_size}"
          f"{', tied head' if args.tied else ''}) to {args.out}")
    return Path(args.out)


if __name__ == "__main__":
    main()
