"""The checkpoint protocol's values, pure: which checkpoints are being written, by whom and
by when, and how far the final checkpoint has come.

Workers write their layers themselves and the shell reports which layer files arrived
(:class:`~chameleon_ft.runtime.control.messages.CheckpointLayers`); everything decided
around that lives here and in :mod:`~chameleon_ft.runtime.control.saving`: that a
checkpoint is due, each layer's writer, its deadline (its bytes over the storage's
bandwidth, a setting), when it is complete, when it failed (a worker's disk refused, a
writer died, the deadline passed), and the final checkpoint's attempts (docs/design.md
4.4).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from chameleon_ft.plan import ExecutionPlan

FINAL_ATTEMPTS = ("background", "folder", "fallback")
"""The final checkpoint's attempts, in order: the periodic checkpoint of the final step
being written when training ended; the final holders writing it into the checkpoint
folder; the final holders uploading it into the run folder (the checkpoint folder refused
it: full, read-only, failing)."""


def writer_of(holders: Iterable[int], layer: int) -> int:
    """Which of a layer's holders writes it into a checkpoint: replicas take turns by
    layer, so they share the writing."""
    ordered = sorted(set(holders))
    return ordered[layer % len(ordered)]


def writers(plan: ExecutionPlan) -> dict[int, int]:
    """Each layer's writer under ``plan`` (the plan whose workers hold the state)."""
    return {i: writer_of(plan.holders(i), i) for i in range(plan.num_layers)}


def due(step: int, every: int) -> bool:
    """Whether committing ``step`` (0-based) makes a periodic checkpoint due (one after
    every ``every`` committed steps; 0: none)."""
    return every > 0 and (step + 1) % every == 0


@dataclass(frozen=True)
class Expected:
    """A checkpoint being written."""

    deadline_s: float
    writers: Mapping[int, int]
    """Layer -> the worker writing it."""
    written: frozenset[int] = frozenset()
    """Layers whose file was reported."""
    fallback: bool = False
    """The final state uploaded into the run folder."""

    def missing(self, num_layers: int) -> list[int]:
        """Layers not written yet."""
        return [i for i in range(num_layers) if i not in self.written]


@dataclass(frozen=True)
class Final:
    """The final checkpoint being written (the run finished; its workers wait)."""

    step: int
    gen: int
    """The final generation: its stop directive names the holders."""
    holders: Mapping[int, tuple[int, ...]]
    """Per layer, the workers whose state is at the final step."""
    attempt: int
    """An index into :data:`FINAL_ATTEMPTS`."""
    key: tuple[int, int]
    """``(step, gen)`` of the attempt's checkpoint."""
    asked: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """Per worker, every layer asked of it in this attempt."""
    tried: Mapping[int, frozenset[int]] = field(default_factory=dict)
    """Per layer, the holders asked for it in this attempt."""


def primaries(holders: Mapping[int, tuple[int, ...]]) -> dict[int, int]:
    """Each layer's first writer among its final holders."""
    return {layer: writer_of(ws, layer) for layer, ws in holders.items() if ws}


def shares(layer_writers: Mapping[int, int]) -> dict[int, tuple[int, ...]]:
    """Per worker, the layers it writes."""
    out: dict[int, list[int]] = {}
    for layer, worker in sorted(layer_writers.items()):
        out.setdefault(worker, []).append(layer)
    return {w: tuple(layers) for w, layers in out.items()}
