"""The failure-trace format, below both the simulator and the runtime.

A trace (:class:`Trace`) is a time-ordered tuple of events (:class:`TraceEvent`): worker,
node and switch failures, software faults, repairs, fail-slows (``slow`` and ``slow-end``
of a worker, with its factor), and its end. The simulator replays
traces against policies (``chameleon simulate``), the runtime replays them on real
workers (``chameleon train --trace``); both read the same CSV. Pure Python.
"""

from chameleon_ft.failures.csvio import (
    CSV_HEADER,
    SLOW_CSV_HEADER,
    trace_from_csv,
    trace_to_csv,
    validate_trace,
)
from chameleon_ft.failures.trace import FAILURE_KINDS, SLOW_KINDS, EventKind, Trace, TraceEvent

__all__ = ["CSV_HEADER", "FAILURE_KINDS", "SLOW_CSV_HEADER", "SLOW_KINDS", "EventKind", "Trace",
           "TraceEvent", "trace_from_csv", "trace_to_csv", "validate_trace"]
