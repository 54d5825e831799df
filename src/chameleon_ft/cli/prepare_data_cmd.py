"""``chameleon prepare-data``: local text or JSONL files -> a token file for ``[data] kind =
"tokens"``, tokenized with the model's own tokenizer from a local directory (never
downloaded). A progress bar on a terminal, then one summary line. transformers is
imported only inside :func:`run`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chameleon prepare-data``."""
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="a local tokenizer directory (save_pretrained layout: "
                             "tokenizer.json, tokenizer_config.json...), e.g. the model's own")
    parser.add_argument("--input", required=True, nargs="+", metavar="FILE",
                        help="text files (each one document) or .jsonl files (one document "
                             "per line, in its \"text\" field)")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="the token file to write: the documents' ids, each document "
                             "ended by the end-of-sequence id, uint16 when the vocabulary "
                             "fits in 16 bits, else uint32")


def run(args: argparse.Namespace) -> int:
    """Tokenize, write atomically, print the summary.

    Raises:
        ValueError: one line naming the flag at fault (exit status 2).
    """
    from tqdm import tqdm

    from chameleon_ft.runtime.workload.prepare import prepare_tokens

    inputs = [Path(p) for p in args.input]
    total = sum(p.stat().st_size for p in inputs if p.is_file())
    # tqdm draws only on a terminal (disable=None); logs get the summary line alone
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr,
              disable=None, leave=False) as bar:
        summary = prepare_tokens(Path(args.tokenizer), inputs, Path(args.out),
                                 progress=bar.update)
    print(f"prepare-data: {summary.documents:,} documents, {summary.tokens:,} tokens "
          f"({summary.dtype}, vocabulary {summary.vocab_size:,}, end-of-sequence id "
          f"{summary.eos_id}) in {summary.seconds:.2f} s -> {summary.out}")
    print(f'  train on it with [data] kind = "tokens", path = "{summary.out}", '
          f'dtype = "{summary.dtype}"')
    return 0
