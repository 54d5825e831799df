"""Write the models of the examples: a randomly initialised tiny Hugging Face causal LM as
a ``save_pretrained`` directory (config.json + model.safetensors), built locally with no
download. Any directory of your own of a supported family works the same way.

- ``llama`` (``examples/llama_tiny_cpu.toml``): 4 decoder layers, hidden 64, 4 heads
  sharing 2 key/value heads, 512 ids (``make_tokens.py``'s bytes and byte pairs);
- ``qwen2`` (``examples/qwen_tiny_cpu.toml``): the same shape with Qwen2's biases on the
  query, key and value projections, and the 512 ids of ``make_tokenizer.py``'s tokenizer
  (end-of-sequence id 0).

``--tied`` ties the LM head to the embedding (Llama 3.2 1B/3B, Qwen2.5 0.5B-3B): the
runtime keeps a copy of the matrix in the first and the last stage.

    python examples/make_model.py --family llama|qwen2 [--out DIR] [--seed 0] [--tied]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from transformers import Qwen2Config

from chameleon_ft.runtime.workload.models.hf import llama_config, save_random_hf
from chameleon_ft.spec.model import ModelSpec

TINY_LLAMA = ModelSpec(name="llama-tiny", num_blocks=4, hidden_size=64, num_heads=4,
                       num_kv_heads=2, ffn_size=176, vocab_size=512, seq_len=64,
                       mlp="swiglu")
"""4 decoder layers, hidden 64, 4 heads sharing 2 key/value heads, 512 tokens."""


def tiny_config(family: str, tied: bool = False) -> Any:
    """The transformers configuration of the example model of ``family``."""
    if family == "llama":
        config = llama_config(TINY_LLAMA)
        config.tie_word_embeddings = tied
        return config
    return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=176,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, tie_word_embeddings=tied,
                       bos_token_id=None, eos_token_id=0, pad_token_id=None)


def main(argv: list[str] | None = None) -> Path:
    """Write the directory; returns its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("llama", "qwen2"), required=True)
    parser.add_argument("--out", type=Path, help="default: examples/data/<family>-tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    args = parser.parse_args(argv)
    family = "qwen" if args.family == "qwen2" else args.family
    out = args.out or Path(__file__).resolve().parent / "data" / f"{family}-tiny"
    config = tiny_config(args.family, args.tied)
    save_random_hf(config, out, seed=args.seed)
    print(f"wrote a {config.num_hidden_layers}-layer {args.family} model (hidden "
          f"{config.hidden_size}{', tied head' if args.tied else ''}) to {out}")
    return Path(out)


if __name__ == "__main__":
    main()
