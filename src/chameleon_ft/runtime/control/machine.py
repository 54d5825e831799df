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

from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import rules
from chameleon_ft.runtime.control.model import Control, Mode, Settings, mode

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
})
"""Every change of mode the step makes, labelled by what caused it (a step that keeps
the mode is not listed). docs/design.md 4.1 draws exactly these."""

_LABELS: dict[type, str] = {
    m.Tick: "tick", m.Exits: "exits", m.Beats: "death", m.Errors: "death",
    m.Registered: "registered", m.Reduced: "reduced", m.StopAsked: "stop",
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
        # the run is over; checkpoints that complete now still count (the final one is
        # written only when the last step has none)
        if isinstance(obs, m.CheckpointWritten | m.CheckpointDone | m.CheckpointFailed):
            return _guarded(c, obs, p)
        return c, []
    new, effects = _guarded(c, obs, p)
    edge = transition(before, obs, mode(new))
    if edge is not None and edge not in TRANSITIONS:
        effects.append(m.Log(f"internal: undeclared transition {edge} (please report)"))
    return new, effects


def _guarded(c: Control, obs: m.Observation, p: Settings) -> tuple[Control, list[m.Effect]]:
    """:func:`rules.apply`, whose exception (a defect: the property-based tests look for
    any) ends the run through the failure path instead of ending the coordinator."""
    try:
        return rules.apply(c, obs, p)
    except Exception as exc:
        what = f"internal error in the control plane ({type(exc).__name__}: {exc}); please report"
        if mode(c) in (Mode.FINISHED, Mode.FAILED):
            return c, [m.Log(what)]
        new, effects = rules.fail(c, what)
        return new, [m.Log(what), *effects]


def transition(before: Mode, obs: m.Observation, after: Mode) -> tuple[Mode, str, Mode] | None:
    """The labelled change of mode an observation made (None: the mode stayed)."""
    return None if after is before else (before, label(before, obs), after)
