"""Helpers shared by the ``chameleon`` sub-commands: argument parsing and formatting."""

from __future__ import annotations

import math

from chameleon_ft.jsontext import dumps

__all__ = ["check_workers", "dumps", "human_bytes", "human_seconds", "parse_workers", "table"]


def parse_workers(text: str, field: str = "--fail") -> list[int]:
    """Parse ``"3,7,12"`` into worker ids.

    Raises:
        ValueError: naming ``field`` for anything but comma-separated non-negative integers.
    """
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"{field}: {part!r} is not a worker id; give comma-separated "
                             "integers such as 3,7")
        out.append(int(part))
    if not out:
        raise ValueError(f"{field}: give at least one worker id, such as 3")
    if len(set(out)) != len(out):
        raise ValueError(f"{field}: worker ids must be distinct, got {text!r}")
    return out


def check_workers(workers: list[int], num_workers: int, field: str = "--fail") -> None:
    """Reject worker ids outside ``0..num_workers-1``."""
    for w in workers:
        if w >= num_workers:
            raise ValueError(f"{field}: worker {w} does not exist; this job has workers "
                             f"0..{num_workers - 1}")


def human_bytes(num_bytes: float) -> str:
    """``1.5 GiB`` style."""
    if math.isinf(num_bytes):
        return "unlimited"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def human_seconds(seconds: float) -> str:
    """``12.3 ms``, ``4.56 s``, ``3.2 min``, ``1.5 h`` style."""
    if math.isinf(seconds):
        return "inf"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain aligned text table."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    return "\n".join(lines)
