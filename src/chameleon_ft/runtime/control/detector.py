"""Failure detection, pure: observations in, deaths and waits out.

What the coordinator sees of its workers, each poll: local process exits, heartbeat
counters, and the error reports of the running generation. From those this module decides
who is dead (an exit, a fatal report, a heartbeat silent for the hang deadline, or a peer
named by a failed transfer whose heartbeat stopped), and what to do about errors that no
death explains: wait for members still inside an older generation's group set-up, declare
absent members failed, or retry the generation (docs/design.md 4.3).

Nothing here reads a clock or a store: times are arguments, and the shell turns the
verdicts into effects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from chameleon_ft.runtime.protocol import ErrorReport

SETUP_WAIT_DEADLINES = 2
"""A member inside a superseded generation's group set-up is waited for this many of that
generation's collective deadlines. Gloo's set-up (torch 2.13) fails within one deadline
when a peer never came; when a peer died or stopped mid-handshake it can retry its
connections for five, and a member stuck that long is declared failed rather than
stalling the run: the wait covers the first case (and generations with a longer deadline
than the newest), and costs at most one deadline more in the others. Members stuck with a
peer that went silent are not waited for at all."""

SUSPECT_BEATS = 2.5
"""A peer named by a failed transfer is dead once its heartbeat is this many intervals old."""
UNEXPLAINED_BEATS = 4
"""Errors stay unexplained this many heartbeat intervals past the hang deadline before
the generation is given up (a death that explains them is seen by then)."""


Report = ErrorReport | str
"""One error report as the shell read it: a report, or ``MALFORMED`` (sealed by a member,
not a report)."""
MAX_MESSAGES = 8
"""First lines of a generation's error reports kept for its log line."""


@dataclass(frozen=True)
class Beat:
    """The last heartbeat count seen of one process, and since when it has not moved."""

    count: int
    since_s: float


@dataclass(frozen=True)
class Watch:
    """What detection remembers about the running generation (fresh for each one)."""

    gen: int
    errors_read: int = 0
    """The generation's error reports read so far (in the order the shell found them)."""
    suspects: frozenset[int] = frozenset()
    """Peers named by failed transfers: dead as soon as their heartbeat stalls briefly."""
    unexplained_since_s: float | None = None
    """The first error report no death has explained yet."""
    recheck_at_s: float = 0.0
    """While absent members are waited for: when to look again."""
    messages: tuple[str, ...] = ()
    """First lines of the generation's first error reports, in order (for the log; at
    most ``MAX_MESSAGES``)."""
    waits_logged: frozenset[int] = frozenset()
    """Absent members whose wait was announced already."""


@dataclass(frozen=True)
class Seen:
    """What one reading of the error reports found."""

    watch: Watch
    deaths: dict[int, str] = field(default_factory=dict)
    logs: tuple[str, ...] = ()
    corrupt: dict[int, str] = field(default_factory=dict)
    """Checkpoints (by committed steps) a worker found corrupt while loading, and why."""


def read_errors(watch: Watch, reports: tuple[Report, ...], *, alive: frozenset[int],
                now_s: float) -> Seen:
    """Read the generation's error reports from the ``watch.errors_read``-th on, in order
    (a malformed one is logged and ignored). A fatal report is its writer's death; a
    report naming a peer makes that peer a suspect.

    Args:
        watch: the generation's detection state.
        reports: the reports from the ``watch.errors_read``-th on, as read.
        alive: workers believed alive (reports of others are stale).
        now_s: the run clock.
    """
    deaths: dict[int, str] = {}
    corrupt: dict[int, str] = {}
    logs: list[str] = []
    w = replace(watch, errors_read=watch.errors_read + len(reports))
    for report in reports:
        if not isinstance(report, ErrorReport):
            logs.append(f"generation {w.gen}: ignored a malformed error report")
            continue
        first_line = report.message.splitlines()[0] if report.message else "?"
        if len(w.messages) < MAX_MESSAGES:
            w = replace(w, messages=(*w.messages, first_line))
        if report.worker not in alive:
            continue
        if report.corrupt_step is not None:
            corrupt.setdefault(report.corrupt_step, first_line)
            continue
        if report.fatal:
            deaths[report.worker] = "error: " + first_line
        elif report.peer is not None:
            w = replace(w, suspects=w.suspects | {report.peer})
        if w.unexplained_since_s is None:
            w = replace(w, unexplained_since_s=now_s)
    return Seen(w, deaths, tuple(logs), corrupt)


def check_beats(beats: Mapping[tuple[int, str], Beat], counts: Mapping[int, tuple[str, int]],
                *, suspects: frozenset[int], now_s: float, hang_s: float,
                heartbeat_s: float) -> tuple[dict[tuple[int, str], Beat], dict[int, str]]:
    """Heartbeats: a process whose counter has not moved for the hang deadline is hung.

    The last beat may be up to an interval older than when it was seen, so a process is
    declared hung at the deadline minus one interval: detection stays within the deadline.
    A suspect (named by a failed transfer) is dead after ``SUSPECT_BEATS`` silent intervals.

    Args:
        beats: the last count seen of each process, by ``(worker, incarnation)``.
        counts: each alive worker's incarnation and current counter.
        suspects: the generation's suspects.
        now_s: the run clock.
        hang_s: the hang deadline.
        heartbeat_s: the heartbeat interval.

    Returns:
        The updated counts and the hung workers with their cause.
    """
    new = dict(beats)
    deaths: dict[int, str] = {}
    for w, (incarnation, count) in sorted(counts.items()):
        last = beats.get((w, incarnation))
        if last is None or last.count != count:
            new[(w, incarnation)] = Beat(count, now_s)
            continue
        silent = now_s - last.since_s
        if silent > hang_s - heartbeat_s:
            deaths[w] = f"hang (no heartbeat for {silent:.2f} s)"
        elif w in suspects and silent > SUSPECT_BEATS * heartbeat_s:
            deaths[w] = "reported by peers, heartbeat stopped"
    return new, deaths


def exits(statuses: Mapping[int, int], alive: frozenset[int]) -> dict[int, str]:
    """Alive workers whose local process exited: dead at once."""
    return {w: f"exit (status {code})" for w, code in sorted(statuses.items()) if w in alive}


def unexplained_due(watch: Watch, *, now_s: float, hang_s: float, heartbeat_s: float) -> bool:
    """Whether errors have gone unexplained long enough to act on them."""
    since = watch.unexplained_since_s
    return (since is not None and now_s - since > hang_s + UNEXPLAINED_BEATS * heartbeat_s
            and now_s >= watch.recheck_at_s)


def members_in_older_setup(setup_gens: Mapping[int, int | None], gen: int,
                           generations: Mapping[int, tuple[float, float]], now_s: float, *,
                           slack_s: float) -> dict[int, float]:
    """Absent members that may still come out of an older generation's group set-up.

    Args:
        setup_gens: each absent member's last generation whose groups it began to build
            (None: it never began any).
        gen: the current generation.
        generations: ``(published at, collective deadline)`` of the generations whose
            set-up ends within its deadlines (those that lost no member to silence).
        now_s: the current time (the clock of ``published at``).
        slack_s: added to the longest set-up (the member must still read the next
            directive and reach that generation's rendezvous).

    Returns:
        Member -> the time until which it is waited for; members not in the result are
        stuck for good (or in this generation's own set-up) and may be declared failed.
    """
    waiting = {}
    for w, g in setup_gens.items():
        if g is None or g >= gen or g not in generations:
            continue
        published, deadline = generations[g]
        until = published + SETUP_WAIT_DEADLINES * deadline + slack_s
        if now_s < until:
            waiting[w] = until
    return waiting


@dataclass(frozen=True)
class WaitForSetup:
    """Absent members may still leave an older set-up: look again at ``recheck_at_s``."""

    until_s: dict[int, float]
    """Each waited-for member and until when."""


@dataclass(frozen=True)
class AbsentFailed:
    """Absent members will not come: they are failed."""

    workers: tuple[int, ...]


@dataclass(frozen=True)
class Retry:
    """Every member joined: the errors are the generation's own; redo it (bounded)."""


Judgement = WaitForSetup | AbsentFailed | Retry


def judge_unexplained(absent: Mapping[int, int | None], *, world: frozenset[int], gen: int,
                      generations: Mapping[int, tuple[float, float]], now_s: float,
                      slack_s: float) -> Judgement:
    """What unexplained errors mean, given who never joined the generation's groups.

    A member absent while the others gave up on it is alive (its heartbeat beats) but may
    be inside an older generation's set-up, which gloo cannot interrupt: it is waited for
    while that set-up can still end (:func:`members_in_older_setup`), else declared failed.
    With nobody (or everybody) absent, the errors are the generation's own: retry.

    Args:
        absent: members that never joined, with the generation whose set-up each began last.
        world: the generation's members.
        gen: the generation.
        generations: ``(published, deadline)`` of generations whose set-up ends in time.
        now_s: the run clock.
        slack_s: the hang deadline (to read the next directive).
    """
    if not absent or len(absent) >= len(world):
        return Retry()
    waiting = members_in_older_setup(absent, gen, generations, now_s, slack_s=slack_s)
    if waiting:
        return WaitForSetup(waiting)
    return AbsentFailed(tuple(sorted(absent)))
