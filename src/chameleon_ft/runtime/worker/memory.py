"""A worker's memory as the kernel counts it: resident now and at its peak (Linux
``/proc/self/status``; ``None`` elsewhere). Reported with each step's timings so a run
shows what each worker really needed (``op_times.jsonl``), next to the planner's
estimate: the worker resets its peak once it is set up (``/proc/self/clear_refs``), so
the peak less the resident memory at that moment is what training added (layers,
optimizer state, activations, every transient)."""

from __future__ import annotations


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes() -> int | None:
    """Resident memory of this process now (``VmRSS``)."""
    return _status_bytes("VmRSS")


def peak_resident_bytes() -> int | None:
    """The largest resident memory this process has had (``VmHWM``)."""
    return _status_bytes("VmHWM")


def reset_peak() -> bool:
    """Set the peak to the resident memory now (Linux 4.0+: ``5`` into
    ``/proc/self/clear_refs``); whether it was done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
