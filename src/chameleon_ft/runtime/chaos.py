"""Chaos runs: many random faults in one training run, checked against a failure-free run.

A :class:`ChaosHooks` watches a :class:`~chameleon_ft.runtime.coordinator.shell.Coordinator`
and, from a seeded generator, injects one *episode* at a time once the previous one has
settled (its recovery committed a step and every fault it armed has fired):

- ``single``: a kill, hang, error or glitch in the forward, backward or optimizer phase
  of a random worker of the running plan, or a slowdown (a fail-slow: 1.3 to 3 times
  slower for 5 to 25 steps; it keeps training, and its answer changes the plan at a step
  boundary);
- ``double``: two workers of the plan stopped or killed by signals at the same instant,
  in the middle of a step (this often leaves a layer without replicas: a restart);
- ``cascade``: a single fault, then a second one while the recovery from it runs (in the
  ``recovery`` phase of a worker of the next generation);
- ``migration``: a fault on a sender or receiver while state migrates (the next
  generation that moves state);
- ``repaired``: a fault on a worker that was relaunched and folded back in.

The oracle (docs/design.md section 4): the run's final parameters equal a failure-free
run's, every step committed exactly once, no process outlives the run, every injected
fault fired.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.runtime.coordinator.shell import Coordinator, Event, Hooks
from chameleon_ft.runtime.report.records import SLOW_CAUSES
from chameleon_ft.spec.train import Fault

KINDS = ("kill", "hang", "error", "glitch", "slow")
SLOW_FACTORS = (1.3, 3.0)
"""The range a ``slow`` fault's factor is drawn from (Falcon's, docs/design.md 6)."""
SLOW_STEPS = (5, 25)
"""The range of a ``slow`` fault's length in steps."""
PHASES = ("forward", "backward", "optimizer")
EPISODES = ("single", "double", "cascade", "migration", "repaired")


@dataclass
class Injected:
    """One fault the harness caused."""

    episode: str
    description: str
    index: int | None = None
    """Index in the coordinator's fault list (None for a signal sent by the harness)."""
    at_step: int = 0
    at_commit: int = 0
    """The harness's commit count when the fault was armed (patience is counted in
    commits: a restart rewinds step numbers)."""
    rank: int = -1
    retracted: bool = False
    """Disarmed before it fired: its worker left the plan (not counted as injected)."""
    lost: bool = False
    """Claimed by a worker that died before recording it fired (counted as not fired)."""
    sent_at_s: float | None = None
    """Run clock when the harness sent its signal (signals only)."""


@dataclass
class ChaosHooks(Hooks):
    """Injects random fault episodes into a running job."""

    seed: int
    budget: int
    """Faults to inject in the run."""
    last_step: int
    """No episode starts at or after this step (the run must have time to recover)."""
    settle_steps: int = 4
    """Steps committed after a recovery before the next episode."""
    patience_steps: int = 15
    """Steps to wait for an armed fault to fire (then it is retracted), or for a pending
    episode's moment."""
    injected: list[Injected] = field(default_factory=list)
    pending: str | None = None
    """An episode waiting for its moment (``cascade``, ``migration``, ``repaired``)."""
    original: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.quiet_since_step = 0
        self.pending_since = 0
        self.commits = 0
        self.lock = threading.Lock()

    # ---------------------------------------------------------------- bookkeeping
    def _remaining(self) -> int:
        return self.budget - sum(1 for x in self.injected if not x.retracted)

    def _waiting(self, coord: Coordinator) -> list[Injected]:
        """Armed faults not fired yet; those past their patience are retracted (their
        worker left every plan) or given up (claimed, never recorded: their worker died
        in between). Looked at every commit, also once the budget is spent: the last
        episode's faults must be accounted for too."""
        fired = {i for i, f in enumerate(coord.fault_report()) if f["fired"]}
        waiting = [x for x in self.injected if x.index is not None and not x.retracted
                   and not x.lost and x.index not in fired]
        for x in waiting:
            assert x.index is not None
            age = self.commits - x.at_commit
            if age > self.patience_steps and coord.retract(x.index):
                x.retracted = True
            elif age > 2 * self.patience_steps:
                x.lost = True
        return [x for x in waiting if not (x.retracted or x.lost)]

    def _settled(self, coord: Coordinator, step: int) -> bool:
        waiting = self._waiting(coord)
        if self.pending is not None or self._remaining() <= 0 or step >= self.last_step:
            return False
        if any(e.resumed_at_s is None and not e.idle and not e.slow for e in coord.events):
            return False
        if waiting:
            return False
        return step - self.quiet_since_step >= self.settle_steps

    def _phase_fault(self, coord: Coordinator, episode: str, rank: int, step: int,
                     phase: str | None = None, kinds: tuple[str, ...] = KINDS) -> None:
        kind = self.rng.choice(kinds)
        if kind == "slow":  # from the start of the step's compute
            fault = Fault(rank=rank, step=step, kind=kind,
                          factor=round(self.rng.uniform(*SLOW_FACTORS), 2),
                          steps=self.rng.randint(*SLOW_STEPS))
        else:
            if phase is None:
                phases = PHASES if kind != "glitch" else PHASES[:2]
                phase = self.rng.choice(phases)
            fault = Fault(rank=rank, step=step, kind=kind, phase=phase)
        index = coord.inject(fault)
        self.injected.append(Injected(episode, fault.to_text(), index, step,
                                      at_commit=self.commits, rank=rank))

    # ---------------------------------------------------------------- hooks
    def on_commit(self, coord: Coordinator, step: int) -> None:
        self.commits += 1
        if not self.original:
            self.original = {w: p.incarnation for w, p in coord.procs.items()}
        if self.pending is not None and self.commits - self.pending_since > self.patience_steps:
            self.pending = None  # its moment never came (no migration, no re-join)
        if not self._settled(coord, step):
            return
        plan_workers = sorted(coord.state.plan.workers)
        if not plan_workers:
            return
        choices = list(EPISODES)
        if self._remaining() < 2:
            choices = ["single", "migration", "repaired"]
        episode = self.rng.choice(choices)
        if episode == "single":
            self._phase_fault(coord, "single", self.rng.choice(plan_workers), step + 1)
        elif episode == "double" and len(plan_workers) >= 2:
            self._double(coord, self.rng.sample(plan_workers, 2))
        elif episode == "cascade":
            self._phase_fault(coord, "cascade", self.rng.choice(plan_workers), step + 1,
                              kinds=("kill", "hang", "error"))
            # the second fault waits for the recovery from the first (on_failure)
            self.pending, self.pending_since = "cascade-armed", self.commits
        elif episode in ("migration", "repaired"):
            self.pending, self.pending_since = episode, self.commits
            # nothing happens until a generation moves state or folds a repaired worker
            # back in; provoke one with a kill, which is an injected fault of its own
            self._phase_fault(coord, episode, self.rng.choice(plan_workers), step + 1,
                              kinds=("kill",))
        else:
            self._phase_fault(coord, "single", self.rng.choice(plan_workers), step + 1)

    def _double(self, coord: Coordinator, victims: list[int]) -> None:
        """Signal two workers at the same instant, a little into the next step."""
        sig = self.rng.choice((signal.SIGKILL, signal.SIGSTOP))
        pids = [coord.procs[w].process.pid for w in victims
                if coord.procs[w].process is not None]
        steps = [r.step_s for r in list(coord.steps.values())[-5:]]
        delay = self.rng.uniform(0.1, 0.6) * (statistics.median(steps) if steps else 0.05)
        name = "kill" if sig == signal.SIGKILL else "hang"

        records = [Injected("double", f"rank={w},kind={name} (signal, together with rank "
                            f"{next(v for v in victims if v != w)})", None,
                            coord.state.next_step, rank=w) for w in victims]

        def fire() -> None:
            time.sleep(delay)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            for record in records:
                record.sent_at_s = coord.now()

        self.injected.extend(records)
        threading.Thread(target=fire, daemon=True).start()

    def before_publish(self, coord: Coordinator, directive: dict[str, Any]) -> None:
        if self.pending is None or self._remaining() <= 0:
            return
        step = int(directive["step"])
        world = [int(w) for w in directive["world"]]
        armed = {x.rank for x in self.injected if x.index is not None and not x.retracted
                 and not x.lost and not coord.fault_report()[x.index]["fired"]}
        if self.pending == "cascade" and world:
            self.pending = None
            others = [w for w in world if w not in armed] or world
            self._phase_fault(coord, "cascade", self.rng.choice(others), step,
                              phase="recovery", kinds=("kill", "hang", "error", "glitch"))
        elif self.pending == "migration" and directive.get("migration"):
            ends = sorted({w for t in directive["migration"]["transfers"] for w in t[1:3]
                           if w not in armed})
            if ends:
                self.pending = None
                self._phase_fault(coord, "migration", self.rng.choice(ends), step,
                                  phase="migration")
        elif self.pending == "repaired":
            repaired = [w for w in world if directive["incarnations"].get(str(w))
                        != self.original.get(w) and w in directive["incarnations"]
                        and w not in armed]
            if repaired:
                self.pending = None
                rank = self.rng.choice(repaired)
                in_plan = rank in {s[0] for p in directive["plan"]["pipelines"]
                                   for s in p["stages"]}
                self._phase_fault(coord, "repaired", rank, step,
                                  phase=None if in_plan else "migration")

    def on_failure(self, coord: Coordinator, event: Event) -> None:
        self.quiet_since_step = event.step
        if self.pending == "cascade-armed":
            self.pending = "cascade"  # the recovery from the first fault comes next


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals and percentiles over chaos runs (see :func:`check_run`)."""
    detect = sorted(x for r in runs for x in r["detect_s"])
    recover = sorted(x for r in runs for x in r["recover_s"])

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]

    return {
        "runs": len(runs),
        "faults_injected": sum(r["injected"] for r in runs),
        "faults_fired": sum(r["fired"] for r in runs),
        "faults_retracted": sum(r.get("retracted", 0) for r in runs),
        "runs_exact": sum(1 for r in runs if r["exact"]),
        "max_param_diff": max((r["max_diff"] for r in runs), default=0.0),
        "steps_lost_outside_restarts": sum(r["lost_outside_restarts"] for r in runs),
        "steps_redone_by_restarts": sum(r["lost_by_restarts"] for r in runs),
        "stray_processes": sum(r["stray"] for r in runs),
        "detect_median_s": pct(detect, 0.5), "detect_p99_s": pct(detect, 0.99),
        "recover_median_s": pct(recover, 0.5), "recover_p99_s": pct(recover, 0.99),
        "events": sum(r["events"] for r in runs),
        "slow_injected": sum(r.get("slow_injected", 0) for r in runs),
        "slow_declared": sum(r.get("slow_declared", 0) for r in runs),
        "slow_cleared": sum(r.get("slow_cleared", 0) for r in runs),
        "strategies": {s: sum(r["strategies"].get(s, 0) for r in runs)
                       for s in sorted({k for r in runs for k in r["strategies"]})},
    }


def check_run(report: dict[str, Any], params: dict[str, Any], reference: dict[str, Any],
              hooks: ChaosHooks, pids: list[int], steps: int) -> dict[str, Any]:
    """Hold one chaos run against the oracle; returns its figures."""
    max_diff = max(float((params[k] - reference[k]).abs().max()) for k in reference)
    fired_phase = sum(1 for f in report["faults"] if f["fired"])
    signalled = sum(1 for x in hooks.injected if x.index is None)
    retracted = sum(1 for x in hooks.injected if x.retracted)
    slow = [e for e in report["events"] if e["cause"] in SLOW_CAUSES]
    events = [e for e in report["events"] if not e.get("idle") and e["cause"] not in SLOW_CAUSES]
    committed = [s["step"] for s in report["steps"]]
    lost_by_restarts = sum(e["lost_steps"] for e in events if e["strategy"] == "restart")
    lost_outside = sum(e["lost_steps"] for e in events if e["strategy"] != "restart")
    strategies: dict[str, int] = {}
    for e in events:
        strategies[e["strategy"]] = strategies.get(e["strategy"], 0) + 1
    stray = 0
    for pid in pids:
        if alive(pid):
            stray += 1
    # a signal's detection and recovery are timed from when the harness sent it
    sent = {x.rank: x.sent_at_s for x in hooks.injected if x.sent_at_s is not None}
    detect, recover = [], []
    for e in events:
        start = e["fault_at_s"]
        if start is None:
            start = min((sent[w] for w in e["workers"] if w in sent), default=None)
            for w in e["workers"]:
                sent.pop(w, None)
        if start is None:
            continue
        detect.append(e["detected_at_s"] - start)
        if e["transition_s"] is not None:
            # the coordinator times a transition from the fault when it knows it, from
            # the detection otherwise
            origin = e["fault_at_s"] if e["fault_at_s"] is not None else e["detected_at_s"]
            recover.append(e["transition_s"] + origin - start)
    return {
        "injected": len(hooks.injected) - retracted, "fired": fired_phase + signalled,
        "retracted": retracted,
        "phase_faults": len(report["faults"]), "exact": max_diff < 1e-9,
        "max_diff": max_diff, "steps_ok": committed == list(range(steps)),
        "events": len(events), "strategies": strategies,
        "lost_by_restarts": lost_by_restarts, "lost_outside_restarts": lost_outside,
        "stray": stray,
        "detect_s": detect, "recover_s": recover,
        "episodes": [x.episode for x in hooks.injected],
        "faults": [x.description for x in hooks.injected if not x.retracted],
        "slow_injected": sum(1 for x in hooks.injected
                             if "kind=slow" in x.description and not x.retracted),
        "slow_declared": sum(1 for e in slow if e["cause"] == "slow"),
        "slow_cleared": sum(1 for e in slow if e["cause"] == "slow-end"),
    }


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a reaped child counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
