"""The control plane's step: ``step(control, observation) -> (control, effects)``, pure.

The shell (``runtime.coordinator``) feeds observations in and performs the effects that
come out, in order; it keeps no field that a decision reads. A defect is one more row of a
table-driven test (tests/unit/test_runtime_control.py), not a multi-process race.

The run moves through the modes of :class:`~chameleon_ft.runtime.control.model.Mode`;
:data:`TRANSITIONS` lists every move the step may make (drawn in docs/design.md 4.1,
where a test checks the drawing against this table), and the step asserts it never makes
another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chameleon_ft.runtime.control import joining, rules, saving
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control.model import Control, Mode, Settings, mode

Out = tuple[Control, list[m.Effect]]

J, T, D, R = Mode.JOINING, Mode.TRAINING, Mode.DECIDING, Mode.RECOVERING
RL, DR, FN, FL = Mode.RELAUNCHING, Mode.DRAINING, Mode.FINISHED, Mode.FAILED
TRANSITIONS: frozenset[tuple[Mode, str, Mode]] = frozenset({
    (J, "registered", T), (J, "exits", FL), (J, "tick", FL),
    (J, "stop", FL),
    (T, "reduced", FN), (T, "death", D), (T, "death", R), (T, "death", RL), (T, "death", FL),
    (T, "unexplained", D), (T, "unexplained", R), (T, "unexplained", FL),
    (T, "software", R), (T, "stop", DR),
    (T, "trace-end", DR),
    (D, "decision", R), (D, "decision", FL),
    (R, "reduced", T), (R, "reduced", FN), (R, "death", D), (R, "death", RL),
    (R, "death", FL), (R, "unexplained", D), (R, "unexplained", FL),
    (R, "stop", DR), (R, "trace-end", DR),
    (RL, "registered", R), (RL, "exits", FL), (RL, "death", FL), (RL, "tick", FL),
    (RL, "stop", FL),
    (DR, "reduced", FN), (DR, "tick", FN), (DR, "death", FN), (DR, "unexplained", FN),
    (DR, "unexplained", FL),
    *((k, "crash", FL) for k in (J, T, D, R, RL, DR)),
})
"""Every change of mode the step makes, labelled by what caused it (a step that keeps
the mode is not listed). docs/design.md 4.1 draws exactly these."""

HANDLERS: dict[type, Callable[[Control, Any, Settings], Out]] = {
    m.Tick: rules.on_tick, m.Exits: rules.on_exits, m.Beats: rules.on_beats,
    m.Errors: rules.on_errors, m.Ready: rules.on_ready, m.Reduced: rules.on_reduced,
    m.StopAsked: rules.on_stop, m.TraceEnd: rules.on_trace_end,
    m.SoftwareFault: rules.on_software, m.Decision: rules.on_decision,
    m.RejoinDecision: rules.on_rejoin_decision, m.Absent: rules.on_absent,
    m.ShellFailed: rules.on_shell_failed,
    m.Launched: joining.on_launched, m.LaunchFailed: joining.on_launch_failed,
    m.Registered: joining.on_registered, m.JoinSlots: joining.on_join_slots,
    m.JoinRequests: joining.on_joins,
    m.Relaunch: joining.on_relaunch,
    m.CheckpointLayers: saving.on_layers, m.CheckpointDone: saving.on_done,
    m.CheckpointFailed: saving.on_failed}
"""The handler of each observation while the run goes on."""

AFTER_THE_END: dict[type, Callable[[Control, Any, Settings], Out]] = {
    m.CheckpointLayers: saving.on_layers, m.CheckpointDone: saving.on_done,
    m.CheckpointFailed: saving.on_failed, m.Exits: saving.on_exits,
    m.Tick: lambda c, obs, p: saving.expire(c, obs.now_s, p),
    m.ShellFailed: lambda c, obs, p: saving.abandon_final(c, obs.reason)}
"""What still matters once the run finished: the final checkpoint's progress."""

_LABELS: dict[type, str] = {
    m.Tick: "tick", m.Exits: "exits", m.Beats: "death", m.Errors: "death",
    m.Registered: "registered", m.Reduced: "reduced", m.StopAsked: "stop",
    m.LaunchFailed: "exits", m.ShellFailed: "crash",
    m.SoftwareFault: "software", m.TraceEnd: "trace-end", m.Decision: "decision",
    m.Absent: "unexplained"}


def label(before: Mode, obs: m.Observation) -> str:
    """The transition label of an observation (exits of alive workers are deaths)."""
    if isinstance(obs, m.Exits) and before not in (Mode.JOINING, Mode.RELAUNCHING):
        return "death"
    return _LABELS.get(type(obs), type(obs).__name__)


def step(c: Control, obs: m.Observation, p: Settings) -> tuple[Control, list[m.Effect]]:
    """Apply one observation: the new control value and the effects to perform, in order.

    Observations about a generation that is no longer the running one are ignored, so the
    shell may gather a whole poll's observations before applying them. A change of mode
    that :data:`TRANSITIONS` does not declare is a defect of this module: it is said in
    the log (the run goes on) and the table-driven tests fail on it.
    """
    before = mode(c)
    if before in (Mode.FINISHED, Mode.FAILED):
        # the run is over; the final checkpoint's progress still counts until it is done
        if c.closed or type(obs) not in AFTER_THE_END:
            return c, []
        return _guarded(AFTER_THE_END, c, obs, p)
    new, effects = _guarded(HANDLERS, c, obs, p)
    edge = transition(before, obs, mode(new))
    if edge is not None and edge not in TRANSITIONS:
        effects.append(m.Log(f"internal: undeclared transition {edge} (please report)"))
    return new, effects


def _guarded(handlers: dict[type, Callable[[Control, Any, Settings], Out]], c: Control,
             obs: m.Observation, p: Settings) -> Out:
    """The observation's handler, whose exception (a defect: the property-based tests look
    for any) ends the run through the failure path instead of ending the coordinator."""
    try:
        return handlers[type(obs)](c, obs, p)
    except Exception as exc:
        what = f"internal error in the control plane ({type(exc).__name__}: {exc}); please report"
        if mode(c) in (Mode.FINISHED, Mode.FAILED):
            new, effects = saving.abandon_final(c, what)
            return new, [m.Log(what), *effects]
        new, effects = rules.fail(c, what)
        return new, [m.Log(what), *effects]


def transition(before: Mode, obs: m.Observation, after: Mode) -> tuple[Mode, str, Mode] | None:
    """The labelled change of mode an observation made (None: the mode stayed)."""
    return None if after is before else (before, label(before, obs), after)
