"""Published training runs as estimator fixtures (``examples/published/``).

Each job file describes a run as its publication states it, plus a ``[published]`` table:
where the figure comes from, the measured throughput (TFLOPs per GPU, or a step time), the
publication's own FLOP formula, and whether the run calibrates its device preset. The
estimator's step time is turned into TFLOPs per GPU with that same formula, so the two
figures are comparable whatever each paper counts (recomputation, causal attention).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from chameleon_ft.perf.estimator import Estimator
from chameleon_ft.perf.network import Topology
from chameleon_ft.plan import initial_plan
from chameleon_ft.profile import build_profile
from chameleon_ft.spec.config import Config, load_config
from chameleon_ft.spec.device import DeviceSpec


class FlopFormula(StrEnum):
    """FLOPs per step as each publication counts them."""

    MEGATRON_2021 = "megatron-2021"
    """Narayanan et al. 2021, Eq. 3: ``96 B s l h^2 (1 + s/6h + V/16lh)`` (counts the
    recomputed forward)."""
    KORTHIKANTI_2022 = "korthikanti-2022"
    """Korthikanti et al. 2022, Eq. 7: ``72 B L s h^2 (1 + s/6h + v/12hL)`` (model FLOPs)."""
    PALM = "palm"
    """Chowdhery et al. 2022, appendix B: ``6 N + 12 L H Q T`` per token (model FLOPs), with
    the publication's parameter count N."""


@dataclass(frozen=True, kw_only=True)
class Published:
    """The ``[published]`` table of a fixture."""

    source: str
    """Publication, section and table."""
    flop_formula: str
    """A :class:`FlopFormula` value."""
    tflops_per_gpu: float | None = None
    """Published TFLOPs per GPU (by ``flop_formula``)."""
    step_s: float | None = None
    """Published seconds per step (when the publication gives a time)."""
    mfu: float | None = None
    """Published model FLOPs utilisation, for reference."""
    parameters: float | None = None
    """N of the PaLM formula, as the publication states it."""
    calibration: bool = False
    """Whether this run calibrates its device preset's compute efficiency."""

    @classmethod
    def from_mapping(cls, doc: Mapping[str, Any], where: str) -> Published:
        """Validate a raw ``[published]`` table.

        Raises:
            ValueError: naming the field.
        """
        known = set(cls.__dataclass_fields__)
        for key in doc:
            if key not in known:
                raise ValueError(f"{where}.published.{key}: unknown key")
        if "source" not in doc or "flop_formula" not in doc:
            raise ValueError(f"{where}.published: needs source and flop_formula")
        formula = str(doc["flop_formula"])
        if formula not in {f.value for f in FlopFormula}:
            raise ValueError(f"{where}.published.flop_formula: unknown formula {formula!r}")
        if doc.get("tflops_per_gpu") is None and doc.get("step_s") is None:
            raise ValueError(f"{where}.published: give tflops_per_gpu or step_s")
        if formula == FlopFormula.PALM and not doc.get("parameters"):
            raise ValueError(f"{where}.published.parameters: the PaLM formula needs N")

        def number(key: str) -> float | None:
            value = doc.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"{where}.published.{key}: must be a positive number, "
                                 f"got {value!r}")
            return float(value)

        return cls(source=str(doc["source"]), flop_formula=formula,
                   tflops_per_gpu=number("tflops_per_gpu"), step_s=number("step_s"),
                   mfu=number("mfu"), parameters=number("parameters"),
                   calibration=bool(doc.get("calibration", False)))


def flops_per_step(config: Config, published: Published) -> float:
    """FLOPs of one step of ``config`` by the publication's formula.

    Raises:
        ValueError: when the job has no model.
    """
    model = config.model
    if model is None:
        raise ValueError("model: the published-run formulas need a [model] table")
    batch = config.job.global_batch
    s, h, layers, v = model.seq_len, model.hidden_size, model.num_blocks, model.vocab_size
    if published.flop_formula == FlopFormula.MEGATRON_2021:
        return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    if published.flop_formula == FlopFormula.KORTHIKANTI_2022:
        return 72 * batch * layers * s * h * h * (1 + s / (6 * h) + v / (12 * h * layers))
    assert published.parameters is not None  # checked by from_mapping
    head_dim = h // model.num_heads
    per_token = 6 * published.parameters + 12 * layers * model.num_heads * head_dim * s
    return per_token * batch * s


@dataclass(frozen=True)
class Row:
    """One published run next to its estimate."""

    name: str
    device: str
    num_devices: int
    layout: str
    published_step_s: float
    estimated_step_s: float
    published_tflops: float
    estimated_tflops: float
    memory_fits: bool
    calibration: bool
    source: str

    @property
    def error(self) -> float:
        """Relative error of the estimated throughput (estimated / published - 1)."""
        return self.estimated_tflops / self.published_tflops - 1


def load(path: str | Path) -> tuple[Config, Published]:
    """A fixture's job and its ``[published]`` table.

    Raises:
        ValueError: for a bad file or a missing table.
    """
    config = load_config(path)
    doc = config.extra.get("published")
    if doc is None:
        raise ValueError(f"{Path(path).name}: no [published] table")
    return config, Published.from_mapping(doc, Path(path).stem)


def evaluate(path: str | Path, device: DeviceSpec | None = None) -> Row:
    """Estimate one fixture (optionally on another device spec, for calibration).

    Raises:
        ValueError: for a bad fixture.
    """
    config, published = load(path)
    if device is not None:
        from dataclasses import replace

        config = replace(config, cluster=replace(config.cluster, device=device))
    profile = build_profile(config)
    topology = Topology.from_config(config)
    plan = initial_plan(config, profile)
    est = Estimator(profile, topology).estimate(plan)
    n = config.cluster.num_devices
    flops = flops_per_step(config, published)
    if published.tflops_per_gpu is not None:
        pub_tflops = published.tflops_per_gpu
        pub_step = flops / (pub_tflops * 1e12 * n)
    else:
        assert published.step_s is not None
        pub_step = published.step_s
        pub_tflops = flops / (pub_step * n) / 1e12
    job = config.job
    schedule = job.schedule + (f" v{job.virtual_stages}" if job.virtual_stages > 1 else "")
    return Row(
        name=Path(path).stem,
        device=config.cluster.device.name if config.cluster.device else "?",
        num_devices=n,
        layout=f"tp{job.tp} pp{job.pp} dp{job.dp} {schedule}",
        published_step_s=pub_step,
        estimated_step_s=est.step_s,
        published_tflops=pub_tflops,
        estimated_tflops=flops / (est.step_s * n) / 1e12,
        memory_fits=est.memory_fits,
        calibration=published.calibration,
        source=published.source,
    )


def fixtures(folder: str | Path) -> list[Path]:
    """The fixture files of ``folder``, sorted."""
    return sorted(Path(folder).glob("*.toml"))
