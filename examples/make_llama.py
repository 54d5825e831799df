"""Write the model of ``examples/llama_tiny_cpu.toml``: a randomly initialised tiny Llama
as a Hugging Face ``save_pretrained`` directory (config.json + model.safetensors), built
locally with no download. Any Llama directory of your own works the same way.

    python examples/make_llama.py [--out examples/data/llama-tiny] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from chameleon_ft.runtime.workload.models.hf import save_random_llama
from chameleon_ft.spec.model import ModelSpec

TINY_LLAMA = ModelSpec(name="llama-tiny", num_blocks=4, hidden_size=64, num_heads=4,
                       num_kv_heads=2, ffn_size=176, vocab_size=512, seq_len=64,
                       mlp="swiglu")
"""4 decoder layers, hidden 64, 4 heads sharing 2 key/value heads, 512 tokens."""


def main(argv: list[str] | None = None) -> Path:
    """Write the directory; returns its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "data" / "llama-tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    save_random_llama(TINY_LLAMA, args.out, seed=args.seed)
    print(f"wrote a {TINY_LLAMA.num_blocks}-layer Llama (hidden {TINY_LLAMA.hidden_size}) "
          f"to {args.out}")
    return Path(args.out)


if __name__ == "__main__":
    main()
