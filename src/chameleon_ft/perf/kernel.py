"""The compiled list scheduler (``_listsched``, built by setup.py where a C compiler is
found): whether it runs, and the one helper the graph builder takes from it.

Python is the reference (:mod:`chameleon_ft.perf.list_scheduler`); the kernel gives the
same timelines, bit for bit.
"""

from __future__ import annotations

import os

try:  # the compiled list scheduler (setup.py; optional: Python is the reference)
    from chameleon_ft.perf import _listsched
except ImportError:  # pragma: no cover - built wherever a C compiler was found
    _listsched = None  # type: ignore[assignment]

COMPILED = _listsched is not None and os.environ.get("CHAMELEON_SCHEDULER") != "python"
"""Whether :func:`simulate` and :func:`best_timeline` run the compiled list scheduler:
where it is built, unless ``CHAMELEON_SCHEDULER=python`` asks for the Python reference
(bit-identical timelines, about 30 times slower on large graphs)."""


def _shifted_python(ids: list[int], lo: int, hi: int, delta: int) -> list[int]:
    """``[i + delta for i in ids[lo:hi]]`` (``_listsched.shifted`` where it is built)."""
    return list(map(delta.__add__, ids[lo:hi]))


_shifted = getattr(_listsched, "shifted", _shifted_python)


__all__ = ["COMPILED", "_listsched", "_shifted", "_shifted_python"]
