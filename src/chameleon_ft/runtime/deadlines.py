"""Deadlines for moving bytes: a latency plus the bytes over a bandwidth, with a floor.

Every wait on a transfer or a write of state is sized by what it moves (a fixed limit is
either too short for a large model or far too long for a small one): a checkpoint's
layers written to the checkpoint folder, a layer sent over the bulk channel, the final
checkpoint. The bandwidths come from ``[train] storage_gb_per_s`` and ``bulk_gb_per_s``
(configured, or measured by ``python -m chameleon_ft.runtime.profiler``).

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOOR_S = 10.0
"""No byte-sized deadline is shorter (process start-up, a loaded host, a first connection)."""


@dataclass(frozen=True)
class Deadline:
    """``max(floor_s, latency_s + bytes / (gb_per_s * 1e9))``."""

    latency_s: float
    gb_per_s: float
    floor_s: float = FLOOR_S

    def for_bytes(self, num_bytes: float) -> float:
        """Seconds allowed to move ``num_bytes``."""
        return max(self.floor_s, self.latency_s + max(0.0, num_bytes) / (self.gb_per_s * 1e9))
