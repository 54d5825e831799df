"""Write the model of ``examples/llama_tiny_cpu.toml``: ``make_model.py --family llama``.

    python examples/make_llama.py [--out examples/data/llama-tiny] [--seed 0] [--tied]
"""

from __future__ import annotations

import sys
from pathlib import Path

import make_model


def main(argv: list[str] | None = None) -> Path:
    """Write the directory; returns its path."""
    return make_model.main(["--family", "llama", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
