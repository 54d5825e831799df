"""Per-layer cost profiles: the numbers every estimate is built from.

All figures are per micro-batch and per device of a worker: a worker of ``tp`` devices
runs in lock step, so its per-device memory is compared against one device's memory,
and its transfers use ``tp`` links in parallel, each moving the per-device bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
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
    grad_bytes: float | None = None
    """Gradient bytes kept on the device; ``None``: as many as ``param_bytes`` (fewer when
    the gradients are sharded over the data-parallel replicas)."""
    workspace_bytes: float = 0.0
    """Bytes the layer's backward holds for one micro-batch beyond ``activation_bytes``,
    at one moment only: with full recomputation, the activations its forward makes again
    (a worker needs the largest of its layers' once, not per micro-batch in flight)."""

    def __post_init__(self) -> None:
        for name in ("fwd_s", "bwd_input_s", "bwd_weight_s", "param_bytes", "optimizer_bytes",
                     "activation_bytes", "output_bytes", "workspace_bytes"):
            _check(f"layer {self.name or '?'}.{name}", getattr(self, name))
        if self.grad_bytes is not None:
            _check(f"layer {self.name or '?'}.grad_bytes", self.grad_bytes)

    @property
    def bwd_s(self) -> float:
        """Fused backward seconds (B + W)."""
        return self.bwd_input_s + self.bwd_weight_s

    @property
    def state_bytes(self) -> float:
        """Bytes that move when this layer migrates: parameters plus optimizer state."""
        return self.param_bytes + self.optimizer_bytes

    @property
    def gradient_bytes(self) -> float:
        """Gradient bytes kept on the device."""
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes

    @property
    def static_bytes(self) -> float:
        """Bytes resident whatever the schedule: parameters, gradients, optimizer state."""
        return self.param_bytes + self.gradient_bytes + self.optimizer_bytes


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
    rounds: tuple[tuple[LayerCost, ...], ...] = ()
    """For an interleaved job (:func:`fold_profile`): the model's layers cut into
    ``virtual_stages`` consecutive *rounds* (model chunks of a pipeline pass). ``layers``
    then holds the *columns*: column ``c`` is the ``c``-th layer of every round, summed.
    Empty for a plain profile (one round: ``layers`` itself)."""
    tied_bytes: float = 0.0
    """For a model whose head is tied to its embedding (``[model] tied_embeddings``), the
    bytes per device of the shared weight, counted as the all-reduce buckets count a
    layer's gradient (its parameter bytes); 0 when untied. Both layers keep their own copy
    (their ``LayerCost`` bytes include it) and every step sums the copies' gradients: one
    all-reduce of these bytes over the holders of either layer (:attr:`tied_layers`)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("profile.layers: a profile needs at least one layer")
        if self.rounds and any(len(r) > len(self.layers) or not r for r in self.rounds):
            raise ValueError("profile.rounds: every round needs 1..len(layers) layers")
        _check("profile.optimizer_step_s", self.optimizer_step_s)
        _check("profile.control_s", self.control_s)
        _check("profile.tied_bytes", self.tied_bytes)
        if self.micro_batch < 1:
            raise ValueError(f"profile.micro_batch: must be >= 1, got {self.micro_batch}")

    @property
    def num_layers(self) -> int:
        """Number of planner layers (columns of an interleaved profile)."""
        return len(self.layers)

    @property
    def virtual_stages(self) -> int:
        """Model chunks per stage: the rounds of an interleaved profile, else 1."""
        return max(1, len(self.rounds))

    @property
    def tied_layers(self) -> tuple[int, int]:
        """The planner layers (columns) holding the embedding and the head, whose copies
        of a tied weight are summed: the first and the last, or for a folded profile the
        column of the last round's last layer (rounds are cut longer first, so it need not
        be the last column)."""
        last = len(self.rounds[-1]) - 1 if self.rounds else self.num_layers - 1
        return 0, last

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
            "tied_bytes": self.tied_bytes,
            "meta": self.meta,
            "layers": [asdict(layer) for layer in self.layers],
        }
        if self.rounds:
            doc["rounds"] = [[asdict(layer) for layer in r] for r in self.rounds]
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
        layers = _layers_from_doc(layers_doc, "profile.layers")
        rounds_doc = doc.get("rounds", [])
        if not isinstance(rounds_doc, list):
            raise ValueError("profile.rounds: must be a list")
        rounds = tuple(_layers_from_doc(r, f"profile.rounds[{i}]")
                       for i, r in enumerate(rounds_doc))
        return cls(
            layers=layers,
            rounds=rounds,
            optimizer_step_s=float(doc.get("optimizer_step_s", 0.0)),
            control_s=float(doc.get("control_s", 0.0)),
            # absent from files written before ties were priced: untied
            tied_bytes=doc.get("tied_bytes", 0.0),
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


def _layers_from_doc(items: Any, where: str) -> tuple[LayerCost, ...]:
    if not isinstance(items, list):
        raise ValueError(f"{where}: must be a list")
    known = set(LayerCost.__dataclass_fields__)
    layers = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"{where}[{i}]: must be an object")
        unknown = set(item) - known
        if unknown:
            raise ValueError(f"{where}[{i}].{sorted(unknown)[0]}: unknown key")
        layers.append(LayerCost(**item))
    return tuple(layers)


def ring_half_s(num_bytes: float, ranks: int, latency_s: float, bw_bytes_s: float) -> float:
    """Seconds of one ring all-gather or reduce-scatter of a ``num_bytes`` tensor over
    ``ranks`` devices (each link moves ``(ranks - 1) / ranks`` of it, one latency a hop):
    half a ring all-reduce, which runs one of each."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * num_bytes / bw_bytes_s + (ranks - 1) * latency_s


@dataclass(frozen=True)
class UniformTP:
    """A uniform profile's layers sharded over a worker of ``degree`` devices."""

    degree: int = 1
    """``[job] tp``."""
    collectives: int = 0
    """Ring halves each layer runs in its group per micro-batch and direction: an
    all-gather or a reduce-scatter counts 1, an all-reduce 2."""
    collective_bytes: float = 0.0
    """Bytes of the whole tensor each of them gathers or reduces."""
    link: tuple[float, float] | None = None
    """``(latency_s, bandwidth_bytes_s)`` of a device's intra-node link; None: free."""
    collective_latency_s: float = 0.0
    """Latency of one hop of a collective inside the group when it differs from the
    link's (the runtime's pipeline sends, which set the link's, carry per-message work a
    collective does not); 0: the link's. Unused on a free link."""
    host_fwd_s: float = 0.0
    """Host seconds a sharded layer adds to its forward per micro-batch (the
    tensor-parallel framework's dispatch), beyond its device share and its collectives."""
    host_bwd_s: float = 0.0
    """The same for its input gradient."""

    def __post_init__(self) -> None:
        # the [profile] fields these come from are tp_<name>
        for name in ("collective_latency_s", "host_fwd_s", "host_bwd_s"):
            _check(f"profile.tp_{name}", getattr(self, name))

    def comm_s(self) -> float:
        """A layer's collectives, per micro-batch and direction."""
        if self.link is None:
            return 0.0
        latency_s, bandwidth_bytes_s = self.link
        if self.collective_latency_s > 0:
            latency_s = self.collective_latency_s
        return self.collectives * ring_half_s(self.collective_bytes, self.degree, latency_s,
                                              bandwidth_bytes_s)


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
    tp: UniformTP | None = None,
) -> Profile:
    """``num_layers`` identical layers: for tests, for checking the closed forms, and for
    models whose layers cost the same (the emulated-device testbed).

    The figures are a whole layer's on one device. With ``tp`` (a worker of ``k``
    devices) each device's share is priced as the analytic profile prices a block: the
    compute, parameters, optimizer state, activations and boundary bytes divided by
    ``k`` (column- and row-parallel layers, sequence- or feature-split activations), the
    optimizer step too, and the layer's collectives inside the group and the framework's
    host time per sharded layer (``tp.host_fwd_s``, ``tp.host_bwd_s``) added to its
    forward and to its input gradient (the weight gradient needs neither).
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"profile.num_layers: must be an integer >= 1, got {num_layers!r}")
    t = tp.degree if tp is not None else 1
    comm_s = tp.comm_s() if tp is not None else 0.0
    host_fwd_s = tp.host_fwd_s if tp is not None else 0.0
    host_bwd_s = tp.host_bwd_s if tp is not None else 0.0
    layer_args = dict(fwd_s=fwd_s / t + comm_s + host_fwd_s,
                      bwd_input_s=bwd_input_s / t + comm_s + host_bwd_s,
                      bwd_weight_s=bwd_weight_s / t, param_bytes=param_bytes / t,
                      optimizer_bytes=optimizer_bytes / t,
                      activation_bytes=activation_bytes / t, output_bytes=output_bytes / t)
    layers = tuple(LayerCost(name=f"layer{i}", **layer_args) for i in range(num_layers))
    return Profile(layers=layers, optimizer_step_s=optimizer_step_s / t, control_s=control_s,
                   tokens_per_sample=tokens_per_sample, source="uniform")


def stage_sums(profile: Profile, layers: Sequence[int]) -> LayerCost:
    """The costs of a stage holding ``layers``: sums, except ``output_bytes`` of the last."""
    chosen = [profile.layers[i] for i in layers]
    return _sum_costs(chosen, f"layers{layers[0]}-{layers[-1]}" if chosen else "empty")


def fold_profile(profile: Profile, virtual_stages: int, *, attach_ends: bool = False) -> Profile:
    """The profile an interleaved job plans with: ``virtual_stages`` rounds folded into
    columns.

    The model's layers are cut into ``virtual_stages`` consecutive rounds as evenly as
    possible (longer rounds first); column ``c`` is the ``c``-th layer of every round that
    has one, its costs and bytes summed. A stage holding columns ``[a, b)`` holds layers
    ``[a, b)`` of every round: ``virtual_stages`` non-contiguous chunks, the interleaved
    layout of Narayanan et al. (2021) with the same split in every round. Everything that
    plans by layer (templates, reroutes, migrations, all-reduce buckets) then works on
    columns unchanged; the estimator reads the rounds to time each chunk. A tie keeps its
    bytes: the embedding is in column 0 and the head in the last round's last column
    (:attr:`Profile.tied_layers`).

    With ``attach_ends`` the first layer (the embedding) joins the second and the last
    (the head) joins the one before it before the rounds are cut, as Megatron places them
    in the first and last chunks: then ``L - 2`` blocks split into equal rounds (it is
    used only when they divide evenly).

    Args:
        profile: a plain (unfolded) profile.
        virtual_stages: chunks per stage, at least 1 and at most the number of layers.
        attach_ends: fold the first and last layers into their neighbours first.

    Returns:
        ``profile`` itself for 1, else the folded profile.

    Raises:
        ValueError: naming ``job.virtual_stages`` when it does not fit the model.
    """
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or (
            virtual_stages < 1):
        raise ValueError(f"job.virtual_stages: must be an integer >= 1, got {virtual_stages!r}")
    if profile.rounds:
        raise ValueError("profile.rounds: the profile is already folded")
    if virtual_stages == 1:
        return profile
    n = profile.num_layers
    if virtual_stages > n:
        raise ValueError(f"job.virtual_stages: {virtual_stages} chunks per stage need at least "
                         f"as many layers, the model has {n}")
    rounds = _rounds(profile.layers, virtual_stages, attach_ends and n >= 4)
    columns = []
    for c in range(len(rounds[0])):
        members = [r[c] for r in rounds if c < len(r)]
        summed = _sum_costs(members, f"column{c}")
        # Every member's output goes to the next chunk; blocks share one size, so the
        # first round's (never the head's) stands for the column.
        columns.append(replace(summed, output_bytes=members[0].output_bytes))
    return replace(profile, layers=tuple(columns), rounds=tuple(rounds),
                   meta={**profile.meta, "virtual_stages": virtual_stages,
                         "attach_ends": attach_ends and n >= 4})


def _rounds(slots: tuple[LayerCost, ...], virtual_stages: int,
            attach_ends: bool) -> list[tuple[LayerCost, ...]]:
    """The layers cut into ``virtual_stages`` consecutive rounds, longer rounds first (the
    first and last layers joined to their neighbours first with ``attach_ends``).

    Raises:
        ValueError: when ``attach_ends`` leaves fewer blocks than rounds.
    """
    if attach_ends:
        first = _sum_costs(slots[:2], f"{slots[0].name}+{slots[1].name}")
        last = _sum_costs(slots[-2:], f"{slots[-2].name}+{slots[-1].name}")
        slots = (first, *slots[2:-2], last)
        if len(slots) < virtual_stages:
            raise ValueError(f"job.virtual_stages: {virtual_stages} chunks per stage need at "
                             f"least as many blocks, the model has {len(slots)}")
    base, extra = divmod(len(slots), virtual_stages)
    rounds: list[tuple[LayerCost, ...]] = []
    lo = 0
    for r in range(virtual_stages):
        hi = lo + base + (1 if r < extra else 0)
        rounds.append(slots[lo:hi])
        lo = hi
    return rounds


def unfold_profile(profile: Profile) -> Profile:
    """The model's layers of a folded profile, in model order (its rounds one after the
    other): the same model planned without interleaving. A plain profile is returned as is.

    With ``attach_ends`` folding, the embedding and the head stay joined to their
    neighbouring blocks, as they ran.
    """
    if not profile.rounds:
        return profile
    meta = {k: v for k, v in profile.meta.items() if k not in ("virtual_stages", "attach_ends")}
    return replace(profile, layers=tuple(layer for r in profile.rounds for layer in r),
                   rounds=(), meta=meta)


def _sum_costs(chosen: Sequence[LayerCost], name: str) -> LayerCost:
    sharded = any(c.grad_bytes is not None for c in chosen)
    return LayerCost(
        name=name,
        grad_bytes=sum(c.gradient_bytes for c in chosen) if sharded else None,
        fwd_s=sum(c.fwd_s for c in chosen),
        bwd_input_s=sum(c.bwd_input_s for c in chosen),
        bwd_weight_s=sum(c.bwd_weight_s for c in chosen),
        param_bytes=sum(c.param_bytes for c in chosen),
        optimizer_bytes=sum(c.optimizer_bytes for c in chosen),
        activation_bytes=sum(c.activation_bytes for c in chosen),
        output_bytes=chosen[-1].output_bytes if chosen else 0.0,
        workspace_bytes=max((c.workspace_bytes for c in chosen), default=0.0),
    )


def chunk_sums(profile: Profile, first: int, end: int) -> tuple[LayerCost, ...]:
    """The costs of each model chunk of a stage holding layers (columns) ``[first, end)``.

    One chunk for a plain profile (:func:`stage_sums`); for a folded one, one per round:
    that round's layers at those positions. A round too short to reach ``first`` gives an
    empty chunk that only passes its input on.
    """
    if not profile.rounds:
        return (stage_sums(profile, range(first, end)),)
    out = []
    for r, layers in enumerate(profile.rounds):
        chosen = layers[first:end]
        if chosen:
            out.append(_sum_costs(chosen, f"round{r}:{first}-{end - 1}"))
        else:
            out.append(LayerCost(name=f"round{r}:empty", output_bytes=layers[-1].output_bytes))
    return tuple(out)
