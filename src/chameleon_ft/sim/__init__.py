"""Discrete-event cluster simulator: failure traces replayed against every policy.

- ``events``: the engine's internal events (commits, switches); the trace rows it replays
  are :mod:`chameleon_ft.failures`, the format shared with the runtime.
- ``traces``: generate a trace from failure rates.
- ``policies``: the policy interface, the planner-backed policies, the oracle and Bamboo.
- ``engine``: ``simulate(trace, policy, ...) -> RunResult``, the heapq loop.
- ``scenarios`` / ``runner``: named scenarios and ``run_scenario`` (every policy on the
  same traces, over seeds and sweep cells).
- ``report``: JSON, Markdown and PNG reports (the only module that writes files).
"""

from chameleon_ft.failures import (
           EventKind,
           Trace,
           TraceEvent,
           trace_from_csv,
           trace_to_csv,
           validate_trace,
)
from chameleon_ft.sim.engine import RunResult, simulate
from chameleon_ft.sim.runner import ScenarioRun, run_scenario
from chameleon_ft.sim.scenarios import PRESETS, Scenario, preset_scenario, scenario_from_config
from chameleon_ft.sim.traces import generate_trace

__all__ = ["PRESETS", "EventKind", "RunResult", "Scenario", "ScenarioRun", "Trace",
           "TraceEvent", "generate_trace", "preset_scenario", "run_scenario",
           "scenario_from_config", "simulate", "trace_from_csv", "trace_to_csv",
           "validate_trace"]
