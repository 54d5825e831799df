"""Device (accelerator) specifications with named presets.

A device prices each operation by a roofline (docs/design.md section 3.6): the larger of
its FLOPs at the achievable fraction of the peak and its bytes at the achievable fraction
of the memory bandwidth. Large matrix products therefore run near ``compute_efficiency``
of the peak, elementwise work at the memory bandwidth, and the efficiency of a whole
layer depends on its shape. ``mfu`` overrides the roofline with one flat rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_ft.spec._fields import check_positive, fail

GIB = 1 << 30


def _fraction(name: str, value: float) -> None:
    check_positive(name, value)
    if value > 1:
        fail(name, f"is a fraction and must be <= 1, got {value}")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator."""

    name: str = "custom"
    """A label for reports."""
    peak_flops: float
    """Peak dense bf16 FLOP/s."""
    memory_bytes: float
    """Device memory in bytes."""
    memory_gb_per_s: float = 2000.0
    """Memory bandwidth, GB/s (datasheet)."""
    compute_efficiency: float = 0.7
    """Fraction of ``peak_flops`` that large matrix products sustain: the roofline's flat
    roof (calibrated per preset on published runs, docs/design.md)."""
    memory_efficiency: float = 0.85
    """Fraction of ``memory_gb_per_s`` that streaming kernels sustain: the roofline's
    slope (measured copy bandwidth, docs/design.md)."""
    mfu: float | None = None
    """When set, every operation runs at ``peak_flops * mfu`` whatever its shape, and
    memory traffic is free (the flat model, for devices without a roofline)."""

    def __post_init__(self) -> None:
        check_positive("peak_flops", self.peak_flops)
        if self.mfu is not None:
            _fraction("mfu", self.mfu)
        _fraction("compute_efficiency", self.compute_efficiency)
        _fraction("memory_efficiency", self.memory_efficiency)
        check_positive("memory_bytes", self.memory_bytes)
        check_positive("memory_gb_per_s", self.memory_gb_per_s)

    @property
    def flops(self) -> float:
        """Sustained FLOP/s of large matrix products: ``peak * mfu`` when ``mfu`` is set,
        else ``peak * compute_efficiency``."""
        return self.peak_flops * (self.mfu if self.mfu is not None else self.compute_efficiency)

    @property
    def bytes_per_s(self) -> float:
        """Sustained memory bandwidth, bytes/s (infinite under the flat ``mfu`` model)."""
        if self.mfu is not None:
            return float("inf")
        return self.memory_gb_per_s * 1e9 * self.memory_efficiency

    def op_seconds(self, flops: float, num_bytes: float = 0.0) -> float:
        """Seconds of one operation by the roofline: ``max(flops / compute rate, bytes /
        memory rate)``.

        Args:
            flops: floating-point operations.
            num_bytes: bytes read and written in device memory.

        Returns:
            Seconds (0 for an empty operation).
        """
        return max(flops / self.flops, num_bytes / self.bytes_per_s)


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    # Peaks: vendor datasheets, dense bf16 without sparsity. memory_efficiency: measured
    # copy bandwidth (A100 80GB: 1.80 of 2.04 TB/s; H100 SXM: 2.8 of 3.35 TB/s).
    # compute_efficiency: calibrated on published runs (benchmarks/published.py; A100 on
    # Megatron-LM's, H100 on Llama 3's 8K-GPU run; docs/design.md, sources).
    "a100-80g": DeviceSpec(name="a100-80g", peak_flops=312e12, memory_bytes=80 * GIB,
                           memory_gb_per_s=2039, compute_efficiency=0.688,
                           memory_efficiency=0.88),
    "h100-80g": DeviceSpec(name="h100-80g", peak_flops=989e12, memory_bytes=80 * GIB,
                           memory_gb_per_s=3350, compute_efficiency=0.521,
                           memory_efficiency=0.84),
    # H200: the H100's compute with HBM3e; no published run calibrates it, so it takes
    # the H100's fractions.
    "h200": DeviceSpec(name="h200", peak_flops=989e12, memory_bytes=141 * GIB,
                       memory_gb_per_s=4800, compute_efficiency=0.521, memory_efficiency=0.84),
    # Ascend 910B: no published run with a layout to calibrate on; the flat model with the
    # 40% MFU this preset always had.
    "ascend-910b": DeviceSpec(name="ascend-910b", peak_flops=313e12, mfu=0.40,
                              memory_bytes=64 * GIB, memory_gb_per_s=1600),
    # A 2-core CPU running float32 PyTorch: order-of-magnitude only; measure with the
    # runtime's profiler for real numbers.
    "cpu": DeviceSpec(name="cpu", peak_flops=5e10, mfu=0.5, memory_bytes=16 * GIB,
                      memory_gb_per_s=20),
}


def device_preset(name: str) -> DeviceSpec:
    """Return the named device preset.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name not in DEVICE_PRESETS:
        fail("cluster.device", f"unknown device {name!r}; choose one of {', '.join(DEVICE_PRESETS)}")
    return DEVICE_PRESETS[name]
