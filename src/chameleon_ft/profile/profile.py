"""Per-layer cost profiles: the numbers every estimate is built from.

All figures are per micro-batch and per device of a worker: a worker of ``tp`` devices
runs in lock step, so its per-device memory is compared against one device's memory,
and its transfers use ``tp`` links in parallel, each moving the per-device bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1


def _check(field_name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field_name}: must be a number, got {value!r}")
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"{field_name}: must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """What one layer costs per micro-batch on one device of a worker."""

    name: str = ""
    """``embedding``, ``block3``, ``head``... for reports."""
    fwd_s: float = 0.0
    """Forward seconds."""
    bwd_input_s: float = 0.0
    """Input-gradient (B) seconds."""
    bwd_weight_s: float = 0.0
    """Weight-gradient (W) seconds."""
    param_bytes: float = 0.0
    """Parameter bytes; gradients take as many again."""
    optimizer_bytes: float = 0.0
    """Optimizer-state bytes (fp32 master copy and Adam moments)."""
    activation_bytes: float = 0.0
    """Activation bytes kept per in-flight micro-batch until its backward."""
    output_bytes: float = 0.0
    """Bytes of the output activation sent downstream (and of its gradient sent back)."""

    def __post_init__(self) -> None:
        for name in ("fwd_s", "bwd_input_s", "bwd_weight_s", "param_bytes", "optimizer_bytes",
                     "activation_bytes", "output_bytes"):
            _check(f"layer {self.name or '?'}.{name}", getattr(self, name))

    @property
    def bwd_s(self) -> float:
        """Fused backward seconds (B + W)."""
        return self.bwd_input_s + self.bwd_weight_s

    @property
    def state_bytes(self) -> float:
        """Bytes that move when this layer migrates: parameters plus optimizer state."""
        return self.param_bytes + self.optimizer_bytes

    @property
    def static_bytes(self) -> float:
        """Bytes resident whatever the schedule: parameters, gradients, optimizer state."""
        return 2 * self.param_bytes + self.optimizer_bytes


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Costs of every layer of the model, in pipeline order, plus the optimizer step."""

    layers: tuple[LayerCost, ...]
    """Embedding, blocks, head: one entry per planner layer."""
    optimizer_step_s: float = 0.0
    """Optimizer-step seconds for the whole model on one worker; a stage pays its share
    in proportion to the parameter bytes it holds."""
    control_s: float = 0.0
    """Per-step control-plane seconds between the gradient synchronisation and the optimizer:
    the step commit (every worker reports, one decision is published). Measured by the
    runtime; 0 for analytic profiles, where it is negligible next to a step."""
    tokens_per_sample: int = 0
    """Sequence length, for tokens/s; 0 when unknown."""
    micro_batch: int = 1
    """Samples per micro-batch the costs were taken at."""
    source: str = "uniform"
    """``analytic``, ``uniform`` or ``measured``."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """Free-form provenance: model, device, tp, machine, date."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("profile.layers: a profile needs at least one layer")
        _check("profile.optimizer_step_s", self.optimizer_step_s)
        _check("profile.control_s", self.control_s)
        if self.micro_batch < 1:
            raise ValueError(f"profile.micro_batch: must be >= 1, got {self.micro_batch}")

    @property
    def num_layers(self) -> int:
        """Number of planner layers."""
        return len(self.layers)

    @cached_property
    def total_param_bytes(self) -> float:
        """Parameter bytes of the whole model per device."""
        return sum(layer.param_bytes for layer in self.layers)

    def optimizer_s(self, layers: Iterable[int]) -> float:
        """Optimizer-step seconds of a worker holding ``layers``."""
        chosen = list(layers)
        total = self.total_param_bytes
        if total > 0:
            share = sum(self.layers[i].param_bytes for i in chosen) / total
        else:
            share = len(chosen) / self.num_layers
        return self.optimizer_step_s * share

    def to_json(self) -> str:
        """Serialise (the format ``file`` profiles and the runtime profiler use)."""
        doc = {
            "format": "chameleon-profile",
            "version": FORMAT_VERSION,
            "source": self.source,
            "micro_batch": self.micro_batch,
            "tokens_per_sample": self.tokens_per_sample,
            "optimizer_step_s": self.optimizer_step_s,
            "control_s": self.control_s,
            "meta": self.meta,
            "layers": [asdict(layer) for layer in self.layers],
        }
        return json.dumps(doc, indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: naming the field for a malformed document.
        """
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile: not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != "chameleon-profile":
            raise ValueError('profile.format: expected "chameleon-profile"')
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"profile.version: expected {FORMAT_VERSION}, got {doc.get('version')!r}")
        layers_doc = doc.get("layers")
        if not isinstance(layers_doc, list):
            raise ValueError("profile.layers: must be a list")
        known = set(LayerCost.__dataclass_fields__)
        layers = []
        for i, item in enumerate(layers_doc):
            if not isinstance(item, dict):
                raise ValueError(f"profile.layers[{i}]: must be an object")
            unknown = set(item) - known
            if unknown:
                raise ValueError(f"profile.layers[{i}].{sorted(unknown)[0]}: unknown key")
            layers.append(LayerCost(**item))
        return cls(
            layers=tuple(layers),
            optimizer_step_s=float(doc.get("optimizer_step_s", 0.0)),
            control_s=float(doc.get("control_s", 0.0)),
            tokens_per_sample=int(doc.get("tokens_per_sample", 0)),
            micro_batch=int(doc.get("micro_batch", 1)),
            source=str(doc.get("source", "measured")),
            meta=dict(doc.get("meta", {})),
        )

    def save(self, path: str | Path) -> None:
        """Write the JSON form to ``path`` (atomically)."""
        p = Path(path)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a JSON profile.

        Raises:
            ValueError: for a missing or malformed file.
        """
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"profile.path: cannot read {str(p)!r}: {exc.strerror}") from None
        return cls.from_json(text)


def uniform_profile(
    num_layers: int,
    *,
    fwd_s: float = 0.0,
    bwd_input_s: float = 0.0,
    bwd_weight_s: float = 0.0,
    param_bytes: float = 0.0,
    optimizer_bytes: float = 0.0,
    activation_bytes: float = 0.0,
    output_bytes: float = 0.0,
    optimizer_step_s: float = 0.0,
    tokens_per_sample: int = 0,
    control_s: float = 0.0,
) -> Profile:
    """``num_layers`` identical layers: for tests and for checking the closed forms."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"profile.num_layers: must be an integer >= 1, got {num_layers!r}")
    layer_args = dict(fwd_s=fwd_s, bwd_input_s=bwd_input_s, bwd_weight_s=bwd_weight_s,
                      param_bytes=param_bytes, optimizer_bytes=optimizer_bytes,
                      activation_bytes=activation_bytes, output_bytes=output_bytes)
    layers = tuple(LayerCost(name=f"layer{i}", **layer_args) for i in range(num_layers))
    return Profile(layers=layers, optimizer_step_s=optimizer_step_s, control_s=control_s,
                   tokens_per_sample=tokens_per_sample, source="uniform")


def stage_sums(profile: Profile, layers: Sequence[int]) -> LayerCost:
    """The costs of a stage holding ``layers``: sums, except ``output_bytes`` of the last."""
    chosen = [profile.layers[i] for i in layers]
    return LayerCost(
        name=f"layers{layers[0]}-{layers[-1]}" if chosen else "empty",
        fwd_s=sum(c.fwd_s for c in chosen),
        bwd_input_s=sum(c.bwd_input_s for c in chosen),
        bwd_weight_s=sum(c.bwd_weight_s for c in chosen),
        param_bytes=sum(c.param_bytes for c in chosen),
        optimizer_bytes=sum(c.optimizer_bytes for c in chosen),
        activation_bytes=sum(c.activation_bytes for c in chosen),
        output_bytes=chosen[-1].output_bytes if chosen else 0.0,
    )
