"""Worker processes as the control plane sees them: launched or admitted, registered, up,
proven, gone; the limit on relaunching one worker id, and who may join (pure).

A *member* is the process that currently holds a worker id, named by its incarnation
nonce. Local members are launched by the coordinator; remote ones are admitted through the
join protocol (``runtime.auth``). Nothing here touches a process: the shell launches and
kills, and reports what it saw.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

MAX_FAILED_STARTS = 3
"""Replacements of one worker id that may die before a plan using them commits a step;
then that id is repaired no more."""


@dataclass(frozen=True)
class Member:
    """The process holding one worker id."""

    worker: int
    incarnation: str
    local: bool
    """Launched by this coordinator (it sees the process exit)."""
    replacement: bool = False
    """Started (or admitted) in a dead worker's place while the run goes on."""
    registered: bool = False
    """It connected and announced itself."""
    ready: bool = False
    """A replacement that registered and was admitted as an idle worker."""
    proven: bool = False
    """A plan using this process committed a step (a repair that worked)."""
    gone: bool = False
    """Its process exited, or it was declared dead."""
    handed_at_s: float = 0.0
    """When the id was handed to it (remote joiners: an unanswered id is handed again
    after the join deadline)."""


@dataclass(frozen=True)
class Members:
    """Every worker id's current member and the repair bookkeeping."""

    by_worker: Mapping[int, Member]
    failed_starts: Mapping[int, int]
    """Per worker id: replacements that died before they were proven."""
    given_up: frozenset[int] = frozenset()
    """Worker ids no longer repaired (too many failed replacements)."""

    def incarnation(self, worker: int) -> str:
        """The incarnation of the member holding ``worker``."""
        return self.by_worker[worker].incarnation


def empty() -> Members:
    """No member yet."""
    return Members(by_worker={}, failed_starts={})


def launched(members: Members, incarnations: Mapping[int, str], *, local: bool,
             replacement: bool = False, now_s: float = 0.0) -> Members:
    """New processes hold ``incarnations``' worker ids (launched here or admitted). An id
    whose member is up (registered and not gone) keeps it: no launch or admission hands
    out such an id, so a report of one is stale."""
    by = dict(members.by_worker)
    for w, inc in incarnations.items():
        held = by.get(w)
        if held is not None and held.registered and not held.gone:
            continue
        by[w] = Member(w, inc, local=local, replacement=replacement, handed_at_s=now_s)
    return replace(members, by_worker=by)


def registered(members: Members, workers: Iterable[int]) -> Members:
    """These members connected and announced themselves (a member already gone stays
    gone: its announcement came too late)."""
    by = dict(members.by_worker)
    for w in workers:
        if w in by and not by[w].gone:
            by[w] = replace(by[w], registered=True)
    return replace(members, by_worker=by)


def made_ready(members: Members, workers: Iterable[int]) -> Members:
    """These replacements are up and idle."""
    by = dict(members.by_worker)
    for w in workers:
        by[w] = replace(by[w], ready=True)
    return replace(members, by_worker=by)


def proven(members: Members, workers: Iterable[int]) -> Members:
    """A plan using these members committed a step: their repairs worked."""
    by = dict(members.by_worker)
    starts = dict(members.failed_starts)
    for w in workers:
        if w in by and not by[w].proven:
            by[w] = replace(by[w], proven=True)
            starts.pop(w, None)
    return replace(members, by_worker=by, failed_starts=starts)


def died(members: Members, workers: Iterable[int], *,
         starting: bool = False) -> tuple[Members, list[str]]:
    """These members' processes are gone (exit seen, or declared dead).

    A replacement that dies before a plan using it committed a step counts as a failed
    start, whether it died while starting, idle, or in its first generation: otherwise a
    worker id whose repairs keep dying is relaunched for ever, each cycle costing a failure
    and a recovery. After ``MAX_FAILED_STARTS`` the id is given up. With ``starting`` (the
    first workers, before anything was published) every death is a failed start.

    Returns:
        The members and a log line for each id given up.
    """
    by = dict(members.by_worker)
    starts = dict(members.failed_starts)
    given_up = set(members.given_up)
    logs = []
    for w in workers:
        m = by.get(w)
        if m is None or m.gone:
            continue
        by[w] = replace(m, gone=True)
        if starting or (m.replacement and not m.proven):
            starts[w] = starts.get(w, 0) + 1
            if starts[w] >= MAX_FAILED_STARTS and w not in given_up:
                given_up.add(w)
                logs.append(f"worker {w}: {MAX_FAILED_STARTS} replacements died before a "
                            "plan using them committed a step; no more repairs of this worker")
    return replace(members, by_worker=by, failed_starts=starts,
                   given_up=frozenset(given_up)), logs


def start_failed(members: Members, workers: Iterable[int]) -> tuple[Members, list[str]]:
    """Processes for these worker ids could not be started: each counts as a failed start
    (given up after ``MAX_FAILED_STARTS``, so a launch that keeps failing is not retried
    for ever).

    Returns:
        The members and a log line for each id given up.
    """
    starts = dict(members.failed_starts)
    given_up = set(members.given_up)
    logs = []
    for w in workers:
        starts[w] = starts.get(w, 0) + 1
        if starts[w] >= MAX_FAILED_STARTS and w not in given_up:
            given_up.add(w)
            logs.append(f"worker {w}: could not be started {MAX_FAILED_STARTS} times; no more "
                        "repairs of this worker")
    return replace(members, failed_starts=starts, given_up=frozenset(given_up)), logs


def to_relaunch(members: Members, alive: frozenset[int], num_local: int) -> list[int]:
    """Local worker ids whose process is gone and that may be repaired."""
    return [w for w in range(num_local)
            if w not in alive and w in members.by_worker and members.by_worker[w].gone
            and w not in members.given_up]


@dataclass(frozen=True)
class Admission:
    """The answer to one join request."""

    worker: int | None
    """The worker id handed out (None: refused)."""
    replacement: bool = False
    reason: str = ""


def admit(members: Members, *, alive: frozenset[int], num_local: int, num_workers: int,
          rejoin: bool, started: bool, now_s: float, join_timeout_s: float) -> Admission:
    """Which worker id a remote joiner gets.

    Ids the job never had a member for come first (the initial remote workers). While the
    run goes on with ``[train] rejoin``, a dead remote id is handed to a replacement; an id
    handed already waits for its joiner (``join_timeout_s``) before it is handed again, so
    two joiners never get the same id.
    """
    free = [w for w in range(num_local, num_workers) if w not in members.by_worker]
    if free:
        return Admission(free[0])
    if rejoin and started:
        for w in range(num_local, num_workers):
            m = members.by_worker[w]
            if w in alive or w in members.given_up:
                continue
            abandoned = not m.registered and now_s - m.handed_at_s >= join_timeout_s
            if m.gone or abandoned:
                return Admission(w, replacement=True)
    return Admission(None, reason=f"the job already has its {num_workers} workers")
