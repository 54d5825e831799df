"""Write the tokenizer and the text of ``examples/qwen_tiny_cpu.toml``: deterministic, no
download.

The text is the Python standard library's sources (the corpus every Python has), one
JSONL document per module (``{"text": ...}``). The tokenizer is a byte-level BPE of 512
ids trained on that text with Hugging Face ``tokenizers``, its end-of-sequence token
``<|endoftext|>`` (id 0) and no BOS, as Qwen's tokenizers have, saved with
``save_pretrained``. ``chameleon prepare-data`` then turns the text into a token file:

    python examples/make_tokenizer.py [--out examples/data/tokenizer]
                                      [--corpus examples/data/corpus.jsonl] [--max-bytes N]
    chameleon prepare-data --tokenizer examples/data/tokenizer \\
        --input examples/data/corpus.jsonl --out examples/data/qwen-tokens.bin
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 512
EOS = "<|endoftext|>"


def stdlib_documents(max_bytes: int) -> list[str]:
    """The standard library's modules in name order, whole, until ``max_bytes``."""
    docs, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if size >= max_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        size += len(text)
    return docs


def build_tokenizer(docs: list[str], out: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train a byte-level BPE on ``docs`` and save it as a transformers tokenizer."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)
    tokenizer.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> Path:
    """Write the corpus and the tokenizer; returns the tokenizer's directory."""
    here = Path(__file__).resolve().parent / "data"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=here / "tokenizer")
    parser.add_argument("--corpus", type=Path, default=here / "corpus.jsonl")
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    args = parser.parse_args(argv)
    docs = stdlib_documents(args.max_bytes)
    args.corpus.parent.mkdir(parents=True, exist_ok=True)
    with open(args.corpus, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    build_tokenizer(docs, args.out)
    print(f"wrote {len(docs)} documents to {args.corpus} and a {VOCAB_SIZE}-id byte-level "
          f"BPE tokenizer to {args.out}")
    return Path(args.out)


if __name__ == "__main__":
    main()
