"""Device (accelerator) specifications with named presets."""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_ft.spec._fields import check_positive, fail

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator."""

    name: str = "custom"
    """A label for reports."""
    peak_flops: float
    """Peak dense bf16 FLOP/s."""
    mfu: float = 0.4
    """Fraction of the peak that training kernels sustain (model FLOPs utilisation)."""
    memory_bytes: float
    """Device memory in bytes."""
    memory_gb_per_s: float = 2000.0
    """Memory bandwidth, GB/s; sets the optimizer step's time (a bandwidth-bound update)."""

    def __post_init__(self) -> None:
        check_positive("peak_flops", self.peak_flops)
        check_positive("mfu", self.mfu)
        if self.mfu > 1:
            fail("mfu", f"is a fraction of the peak and must be <= 1, got {self.mfu}")
        check_positive("memory_bytes", self.memory_bytes)
        check_positive("memory_gb_per_s", self.memory_gb_per_s)

    @property
    def flops(self) -> float:
        """Sustained FLOP/s: ``peak_flops * mfu``."""
        return self.peak_flops * self.mfu


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    # Vendor datasheets, dense bf16 without sparsity; MFU from published large runs
    # (Llama 3 reports 38-43% on H100; Megatron reports ~45-52% on A100).
    "a100-80g": DeviceSpec(name="a100-80g", peak_flops=312e12, mfu=0.45, memory_bytes=80 * GIB,
                           memory_gb_per_s=2039),
    "h100-80g": DeviceSpec(name="h100-80g", peak_flops=989e12, mfu=0.40, memory_bytes=80 * GIB,
                           memory_gb_per_s=3350),
    "h200": DeviceSpec(name="h200", peak_flops=989e12, mfu=0.40, memory_bytes=141 * GIB,
                       memory_gb_per_s=4800),
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
