"""A worker's memory as the kernel counts it: resident now and at its peak (Linux
``/proc/self/status``; ``None`` elsewhere). Reported with each step's timings so a run
shows what each worker really needed (``op_times.jsonl``), next to the planner's
estimate."""

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
