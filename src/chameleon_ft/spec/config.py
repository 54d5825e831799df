"""The job configuration file: TOML with ``[model]``, ``[cluster]``, ``[job]`` and more.

A minimal file::

    [model]
    preset = "llama2-7b"

    [cluster]
    num_nodes = 4
    devices_per_node = 8
    device = "a100-80g"

    [job]
    pp = 4
    dp = 8
    global_batch = 256

Unknown tables and keys are errors; every error names the field.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from chameleon_ft.spec._fields import fail, from_mapping, prefixed
from chameleon_ft.spec.cluster import ClusterSpec
from chameleon_ft.spec.data import DataSpec
from chameleon_ft.spec.device import DeviceSpec, device_preset
from chameleon_ft.spec.job import JobSpec
from chameleon_ft.spec.model import ModelSpec, model_preset
from chameleon_ft.spec.model_source import (
    HF_ARCHITECTURE_KEYS,
    ModelSource,
    ModelSourceKind,
    hf_model_spec,
    read_hf_config,
)
from chameleon_ft.spec.optimizer import OptimizerSpec, optimizer_from_mapping
from chameleon_ft.spec.profile_source import ProfileKind, ProfileSource, Recompute
from chameleon_ft.spec.recovery import PolicySpec, RecoverySpec
from chameleon_ft.spec.train import ActivationCheckpointing, TrainSpec

EXTRA_SECTIONS = ("simulation", "failures", "published")
"""Tables that belong to other commands (the simulator; the published-runs benchmark);
kept raw and validated there."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole job: what is trained, on what, how, and how failures are handled."""

    model: ModelSpec | None
    """The model's architecture as the planner sees it; ``None`` when the profile is
    ``uniform`` or ``file`` and no architecture is given (e.g. a ``python`` model)."""
    cluster: ClusterSpec
    job: JobSpec
    profile: ProfileSource = field(default_factory=ProfileSource)
    recovery: RecoverySpec = field(default_factory=RecoverySpec)
    policy: PolicySpec = field(default_factory=PolicySpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    model_source: ModelSource = field(default_factory=ModelSource)
    """Which implementation the runtime trains (``[model] source``, ``path``, ``factory``)."""
    data: DataSpec = field(default_factory=DataSpec)
    """Where the runtime's samples come from (``[data]``)."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """The runtime's optimizer and learning-rate schedule (``[optimizer]``)."""
    extra: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Raw tables listed in ``EXTRA_SECTIONS``."""
    base_dir: str = "."
    """Folder of the config file; relative paths inside it resolve from here."""

    def __post_init__(self) -> None:
        job, cluster = self.job, self.cluster
        if job.tp > cluster.devices_per_node or cluster.devices_per_node % job.tp:
            fail("job.tp", f"{job.tp} must divide cluster.devices_per_node "
                 f"{cluster.devices_per_node}: a worker lives inside one node")
        if job.dp * job.pp * job.tp != cluster.num_devices:
            fail("job.dp", f"dp x pp x tp = {job.dp} x {job.pp} x {job.tp} = "
                 f"{job.dp * job.pp * job.tp} does not match the cluster's "
                 f"{cluster.num_nodes} x {cluster.devices_per_node} = {cluster.num_devices} devices")
        if self.profile.kind == ProfileKind.ANALYTIC:
            if self.model is None:
                fail("model", 'is required for the analytic profile; add a [model] table or '
                     'set [profile] kind = "uniform" or "file"')
            if cluster.device is None:
                fail("cluster.device", "is required for the analytic profile; name a preset "
                     "such as \"h100-80g\" or give a [cluster.device] table")
        num_layers = self.num_layers
        if num_layers is not None and job.pp > num_layers:
            what = ("layers, the model has" if job.virtual_stages == 1 else
                    f"columns, {job.virtual_stages} chunks per stage leave")
            fail("job.pp", f"{job.pp} stages need at least as many {what} {num_layers}")

    @property
    def workers_per_node(self) -> int:
        """Workers (tensor-parallel groups) per node."""
        return self.cluster.devices_per_node // self.job.tp

    @property
    def num_workers(self) -> int:
        """Workers of the job's layout (``dp x pp``): the most any plan uses."""
        return self.cluster.num_nodes * self.workers_per_node

    @property
    def num_spare_workers(self) -> int:
        """Workers of the spare nodes (``[cluster] spare_nodes``), idle at the start; they
        are numbered ``num_workers .. total_workers - 1``."""
        return self.cluster.spare_nodes * self.workers_per_node

    @property
    def total_workers(self) -> int:
        """Every worker of the fleet: the job's and the spares'."""
        return self.num_workers + self.num_spare_workers

    @property
    def num_layers(self) -> int | None:
        """Planner layers, when known without building the profile: the model's layers, or
        for an interleaved job the columns they fold into (``profile.fold_profile``)."""
        layers = None
        if self.profile.kind == ProfileKind.UNIFORM:
            layers = self.profile.num_layers
        elif self.model is not None:
            layers = self.model.num_layers
        if layers is None:
            return None
        v = self.job.virtual_stages
        if (v > 1 and self.profile.kind != ProfileKind.UNIFORM and (layers - 2) % v == 0
                and layers >= 4):
            return (layers - 2) // v  # embedding and head ride with the end blocks
        return -(-layers // v)

    @property
    def seq_len(self) -> int:
        """The training sequence length: the architecture's, else ``[model] seq_len`` of a
        ``python`` model (0 when neither is given)."""
        if self.model is not None:
            return self.model.seq_len
        return self.model_source.seq_len

    @property
    def data_seed(self) -> int:
        """Seed of the sample order: ``[data] seed``, else ``[train] seed``."""
        return self.train.seed if self.data.seed is None else self.data.seed

    def resolve(self, path: str) -> Path:
        """Resolve a path written in the config file."""
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p


def _string(field_name: str, value: Any) -> str:
    if not isinstance(value, str):
        fail(field_name, f"must be a string, got {value!r}")
    return value


def _model_table(data: Mapping[str, Any], base_dir: str) -> tuple[ModelSpec | None, ModelSource]:
    """Split ``[model]`` into the architecture (for the planner) and the source (for the
    runtime); a Hugging Face directory's config.json supplies the architecture."""
    if not isinstance(data, Mapping):
        fail("model", f"must be a table, got {data!r}")
    data = dict(data)
    explicit = "source" in data
    source = _string("model.source", data.pop("source", ModelSourceKind.GPT.value))
    path = _string("model.path", data.pop("path", ""))
    factory = _string("model.factory", data.pop("factory", ""))
    if source == ModelSourceKind.PYTHON and not set(data) - {"name", "seq_len"}:
        # A python model without architecture keys: the profile must be uniform or a file.
        seq_len = data.get("seq_len", 0)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int):
            fail("model.seq_len", f"must be an integer, got {seq_len!r}")
        if "name" in data:
            _string("model.name", data["name"])
        return None, _source(source=source, factory=factory, seq_len=seq_len)
    if source == ModelSourceKind.HF and path:
        for key in ("preset", *HF_ARCHITECTURE_KEYS):
            if key in data:
                fail(f"model.{key}", "is read from model.path's config.json; remove it")
        unknown = set(data) - {"name", "seq_len"}
        if unknown:
            fail(f"model.{sorted(unknown)[0]}", "unknown key; with model.path the keys are: "
                 "source, path, name, seq_len")
        if "seq_len" not in data:
            fail("model.seq_len", "is required: the training sequence length")
        seq_len = data["seq_len"]
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            fail("model.seq_len", f"must be a positive integer, got {seq_len!r}")
        model_source = _source(source=source, path=path, factory=factory)
        resolved = Path(path) if Path(path).is_absolute() else Path(base_dir) / path
        hf = read_hf_config(resolved)
        name = _string("model.name", data.get("name", resolved.name or "hf"))
        return hf_model_spec(hf, seq_len=seq_len, name=name), model_source
    if source == ModelSourceKind.HF and "preset" not in data:
        data.setdefault("mlp", "swiglu")  # Llama blocks
    try:
        spec = _model(data)
    except ValueError as exc:
        raise prefixed("model", exc) from None
    if not (explicit or path or factory) and spec.mlp == "swiglu":
        # without a source, a SwiGLU architecture (the Llama presets) trains as Llama
        source = ModelSourceKind.HF.value
    if source == ModelSourceKind.HF:
        # without a directory, the architecture keys build a Llama with random weights
        for key, llama in (("mlp", "swiglu"), ("qk_norm", False), ("block_norms", 2)):
            if getattr(spec, key) != llama:
                fail(f"model.{key}", f'source = "hf" without model.path builds Llama blocks '
                     f"({key} = {llama!r}), got {getattr(spec, key)!r}; give model.path "
                     "for other families")
        if spec.attention_bias == "qkv":
            fail("model.attention_bias", 'source = "hf" without model.path builds Llama '
                 'blocks (attention_bias "none" or "all"); give model.path for Qwen2')
    return spec, _source(source=source, path=path, factory=factory)


def _source(**kwargs: Any) -> ModelSource:
    try:
        return ModelSource(**kwargs)
    except ValueError as exc:
        raise prefixed("model", exc) from None


def _model(data: Mapping[str, Any]) -> ModelSpec:
    data = dict(data)
    preset = data.pop("preset", None)
    if preset is None:
        return from_mapping(ModelSpec, data, "model")
    if not isinstance(preset, str):
        fail("model.preset", f"must be a string, got {preset!r}")
    base = model_preset(preset)
    if not data:
        return base
    overrides = from_mapping(_ModelOverrides, data, "model")
    try:
        return replace(base, **{k: v for k, v in vars(overrides).items() if v is not None})
    except ValueError as exc:
        raise prefixed("model", exc) from None


@dataclass(frozen=True, kw_only=True)
class _ModelOverrides:
    """Keys that may follow ``preset`` in ``[model]`` to adjust it."""

    name: str | None = None
    num_blocks: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    ffn_size: int | None = None
    vocab_size: int | None = None
    seq_len: int | None = None
    mlp: str | None = None
    tied_embeddings: bool | None = None
    head_dim: int | None = None
    attention_bias: str | None = None
    mlp_bias: bool | None = None
    qk_norm: bool | None = None
    block_norms: int | None = None


def _cluster(data: Mapping[str, Any]) -> ClusterSpec:
    if not isinstance(data, Mapping):
        fail("cluster", "must be a table")
    data = dict(data)
    device_value = data.pop("device", None)
    device: DeviceSpec | None
    if device_value is None:
        device = None
    elif isinstance(device_value, str):
        device = device_preset(device_value)
    elif isinstance(device_value, Mapping):
        device_data = dict(device_value)
        base_name = device_data.pop("preset", None)
        if base_name is not None:
            base = device_preset(str(base_name))
            merged = {"name": base.name, "peak_flops": base.peak_flops, "mfu": base.mfu,
                      "memory_bytes": base.memory_bytes,
                      "memory_gb_per_s": base.memory_gb_per_s,
                      "compute_efficiency": base.compute_efficiency,
                      "memory_efficiency": base.memory_efficiency}
            merged.update(device_data)
            device_data = merged
        try:
            device = from_mapping(DeviceSpec, device_data, "cluster.device")
        except ValueError as exc:
            raise prefixed("cluster.device", exc) from None
    else:
        fail("cluster.device", f"must be a preset name or a table, got {device_value!r}")
    try:
        spec = from_mapping(ClusterSpec, data, "cluster")
    except ValueError as exc:
        raise prefixed("cluster", exc) from None
    return replace(spec, device=device)


def _section(cls: type[Any], data: Any, name: str) -> Any:
    try:
        return from_mapping(cls, data, name)
    except ValueError as exc:
        raise prefixed(name, exc) from None


def config_from_mapping(data: Mapping[str, Any], base_dir: str = ".") -> Config:
    """Build a :class:`Config` from parsed TOML.

    Raises:
        ValueError: naming the field for unknown tables or keys and invalid values.
    """
    known = {"model", "cluster", "job", "profile", "recovery", "policy", "train", "data",
             "optimizer", *EXTRA_SECTIONS}
    for key in data:
        if key not in known:
            fail(key, f"unknown table; known tables are: {', '.join(sorted(known))}")
    for required in ("cluster", "job"):
        if required not in data:
            fail(required, f"the [{required}] table is required")
    profile = _section(ProfileSource, data.get("profile", {}), "profile")
    model: ModelSpec | None = None
    model_source = ModelSource()
    if "model" in data:
        try:
            model, model_source = _model_table(data["model"], base_dir)
        except ValueError as exc:
            raise prefixed("model", exc) from None
    train_table = data.get("train", {})
    optimizer = optimizer_from_mapping(data.get("optimizer", {}),
                                       train_table if isinstance(train_table, Mapping) else {})
    extra = {k: data[k] for k in EXTRA_SECTIONS if k in data}
    train = _section(TrainSpec, train_table, "train")
    profile, train = _one_recompute_switch(profile, train, data.get("profile", {}), train_table)
    try:
        return Config(
            model=model,
            cluster=_cluster(data["cluster"]),
            job=_section(JobSpec, data["job"], "job"),
            profile=profile,
            recovery=_section(RecoverySpec, data.get("recovery", {}), "recovery"),
            policy=_section(PolicySpec, data.get("policy", {}), "policy"),
            train=train,
            model_source=model_source,
            data=_section(DataSpec, data.get("data", {}), "data"),
            optimizer=optimizer,
            extra=extra,
            base_dir=base_dir,
        )
    except TypeError as exc:  # pragma: no cover - guarded by from_mapping
        raise ValueError(str(exc)) from None


def _one_recompute_switch(profile: ProfileSource, train: TrainSpec, profile_table: Any,
                          train_table: Any) -> tuple[ProfileSource, TrainSpec]:
    """``[train] activation_checkpointing`` and ``[profile] recompute`` are one switch: the
    one written decides the other (``full`` with ``full``, ``none`` with ``none``); both
    written must agree on ``full``; neither: the runtime keeps every activation and the
    planner prices its default (``selective``).

    Raises:
        ValueError: naming ``train.activation_checkpointing`` when the two disagree.
    """
    key = "activation_checkpointing"
    wrote_train = isinstance(train_table, Mapping) and key in train_table
    wrote_profile = isinstance(profile_table, Mapping) and "recompute" in profile_table
    full = ActivationCheckpointing.FULL.value
    if wrote_train and wrote_profile:
        if (train.activation_checkpointing == full) != (profile.recompute == Recompute.FULL):
            fail(f"train.{key}", f"{train.activation_checkpointing!r} conflicts with "
                 f"profile.recompute {profile.recompute!r}; they are one switch: set one "
                 "and the other follows")
        return profile, train
    if wrote_train:
        return replace(profile, recompute=train.activation_checkpointing), train
    if wrote_profile:
        value = full if profile.recompute == Recompute.FULL else ActivationCheckpointing.NONE
        return profile, replace(train, activation_checkpointing=str(value))
    return profile, train


def load_config(path: str | Path) -> Config:
    """Read and validate a TOML job file.

    Raises:
        ValueError: for a missing file, invalid TOML, or any invalid field.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"config: cannot read {str(p)!r}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config: {p.name} is not valid TOML: {exc}") from None
    return config_from_mapping(data, base_dir=str(p.parent))
