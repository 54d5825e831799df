"""The coordinator: owns the store, admits workers, watches them, commits steps, recovers.

It runs in the ``chameleon train`` process. One loop polls, every couple of milliseconds:
local worker processes (exit = dead at once), heartbeats (silent for ``timeout_s`` = hung),
error reports (a worker's own exception = dead; a peer named by a failed transfer whose
heartbeat stopped = dead), and the "reduced" counter of the current step. When every live
worker of the plan has reduced step k, it writes the verdict ``commit``; only then does any
worker apply the optimizer. On a failure before that it writes ``abort`` for step k and
the generation's abort key (workers break their connections), asks the policy, and
publishes generation g + 1 starting again at step k. No committed step is lost or applied
twice; a failure during a recovery is simply a failure in the next generation.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from chameleon_ft.plan import ExecutionPlan, initial_plan
from chameleon_ft.profile import Profile, build_profile
from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.data import corpus_digest
from chameleon_ft.runtime.model import GPTShape
from chameleon_ft.runtime.worker import JobInfo
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.train import Fault, check_faults

_POLL_S = 0.002
"""Coordinator poll interval: bounds the commit latency it adds to every step."""


class MigrationLike(Protocol):
    """The restorer's migration: transfers and rounds (see ``recovery.types.Migration``)."""

    @property
    def transfers(self) -> Sequence[Any]: ...

    @property
    def rounds(self) -> Sequence[Sequence[int]]: ...


class DecisionLike(Protocol):
    """What the coordinator reads from a policy decision."""

    @property
    def strategy(self) -> Any: ...

    @property
    def plan(self) -> ExecutionPlan | None: ...

    @property
    def migration(self) -> MigrationLike | None: ...

    @property
    def reason(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


Decide = Callable[[ExecutionPlan, frozenset[int], frozenset[int], float, float | None],
                  DecisionLike]
"""``(current plan, newly failed, alive, now_s, since_checkpoint_s) -> decision``."""


@dataclass(frozen=True)
class ManualDecision:
    """A decision made by hand (tests) or by the runtime itself (restart fallback)."""

    strategy: str
    plan: ExecutionPlan
    migration: Any = None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"strategy": self.strategy, "reason": self.reason, "candidates": [],
                "plan": self.plan.to_dict()}


class PlannerDecide:
    """The project's policy (``chameleon_ft.policy.Planner``) as a :data:`Decide`.

    :meth:`precompute` prepares the candidates of likely failures of a plan on a background
    thread while training is healthy, so a decision at failure time is a cache look-up.
    """

    def __init__(self, config: Config, profile: Profile, policy: str) -> None:
        from chameleon_ft.policy import Planner  # pure core: imported only when training

        self.planner = Planner(config, profile=profile, policy=policy)
        self.lock = threading.Lock()

    def __call__(self, plan: ExecutionPlan, failed: frozenset[int], alive: frozenset[int],
                 now_s: float, since_checkpoint_s: float | None) -> DecisionLike:
        with self.lock:
            decision: DecisionLike = self.planner.decide(
                plan, sorted(failed), alive=sorted(alive), now_s=now_s,
                since_checkpoint_s=since_checkpoint_s)
            return decision

    def rejoin(self, plan: ExecutionPlan, returned: frozenset[int], alive: frozenset[int],
               now_s: float) -> DecisionLike:
        """The policy's answer to repaired workers coming back."""
        with self.lock:
            decision: DecisionLike = self.planner.decide_rejoin(
                plan, sorted(returned), alive=sorted(alive), now_s=now_s)
            return decision

    def precompute(self, plan: ExecutionPlan) -> None:
        """Start filling the planner's cache for ``plan`` in the background."""

        def work() -> None:
            with self.lock, contextlib.suppress(Exception):
                self.planner.precompute(plan)

        threading.Thread(target=work, daemon=True, name="chameleon-precompute").start()


@dataclass(frozen=True)
class PendingSwitch:
    """A plan to switch to at a step boundary, with the migration that prepares it."""

    plan: ExecutionPlan
    migration: Any
    at_step: int
    """Switch when this step commits."""
    rejoin: tuple[int, ...] = ()
    """Repaired workers the new plan folds back in."""


@dataclass
class StepRecord:
    """One committed step."""

    step: int
    loss: float
    step_s: float
    gen: int
    committed_at_s: float


@dataclass
class Event:
    """One failure and the recovery from it."""

    workers: list[int]
    cause: str
    """``exit``, ``heartbeat``, ``error`` or ``reported`` (named by peers)."""
    gen: int
    """The generation that failed."""
    step: int
    """The step that was in flight (discarded and redone)."""
    fault_at_s: float | None
    detected_at_s: float
    detected_after_s: float | None
    strategy: str = ""
    reason: str = ""
    decision: dict[str, Any] = field(default_factory=dict)
    decide_s: float = 0.0
    resumed_at_s: float | None = None
    """When the first step after the recovery committed."""
    transition_s: float | None = None
    """Kill to first committed step after recovery, minus the new plan's step time."""
    lost_steps: int = 0
    """Committed steps thrown away by a checkpoint restart."""
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {k: v for k, v in vars(self).items()}


class WorkerFailure(RuntimeError):
    """Raised when the job cannot continue (every replica gone and no way to restart)."""


def forkserver_context() -> Any:
    """A forkserver context whose server preloads torch and the worker module."""
    ctx = multiprocessing.get_context("forkserver")
    # Workers fork from a server that already imported torch: ~0.3 s per worker, not 5-10 s.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "chameleon_ft.runtime.worker"])
    return ctx


class Coordinator:
    """Runs one training job: start workers, train, recover, report."""

    def __init__(self, config: Config, *, profile: Profile | None = None,
                 decide: Decide | None = None, policy: str | None = None,
                 faults: Sequence[Fault] = (), out_dir: str | Path | None = None,
                 num_local_workers: int | None = None, host: str = "127.0.0.1",
                 port: int = 0, log: Callable[[str], None] | None = None) -> None:
        """Prepare a job (nothing starts until :meth:`run`).

        Args:
            config: the job file; ``config.train`` holds steps, dtype and timeouts.
            profile: per-layer costs (default: the config's ``[profile]``).
            decide: the recovery decision function (default: the project's Planner).
            policy: policy name for the default Planner (default ``config.policy.name``).
            faults: injected faults.
            out_dir: where checkpoints and the final parameters go (default: a temp dir).
            num_local_workers: workers to launch here (default: all); the rest join with
                ``chameleon worker``.
            host: address the store listens on.
            port: store port (0: any free port).
            log: one-line progress messages.

        Raises:
            ValueError: for faults naming missing workers or layouts that do not fit.
        """
        if config.model is None:
            raise ValueError("model: the runtime needs a [model] table (the GPT to train)")
        self.config = config
        self.train = config.train
        self.profile = profile if profile is not None else build_profile(config)
        self.num_workers = config.num_workers
        if config.job.tp != 1:
            raise ValueError(f"job.tp: the runtime runs one process per worker without tensor "
                             f"parallelism; set tp = 1 (got {config.job.tp})")
        self.num_local = self.num_workers if num_local_workers is None else num_local_workers
        if not 0 <= self.num_local <= self.num_workers:
            raise ValueError(f"workers: {self.num_local} local workers for a layout of "
                             f"{self.num_workers}")
        self.faults = tuple(faults)
        check_faults(self.faults, self.num_workers, self.train.steps)
        self.plan = initial_plan(config, self.profile)
        if self.profile.num_layers != config.model.num_layers:
            raise ValueError(f"profile: {self.profile.num_layers} layers, the model has "
                             f"{config.model.num_layers}")
        self.policy = policy or config.policy.name
        self._decide = decide if decide is not None else PlannerDecide(config, self.profile,
                                                                       self.policy)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.host, self.port = host, port
        self.log = log or (lambda _msg: None)
        self.shape = GPTShape.from_spec(config.model)
        self.procs: dict[int, Any] = {}
        """The current process of each worker launched here."""
        self.all_procs: list[Any] = []
        """Every process launched here, replaced ones included (all reaped at the end)."""
        self.replaced: set[int] = set()
        self.rejoining: set[int] = set()
        self.rejoins: list[dict[str, Any]] = []
        self.events: list[Event] = []
        self.op_times: list[dict[str, Any]] = []
        """Per committed step and worker: compute seconds of each op (for calibration)."""
        self.steps: dict[int, StepRecord] = {}
        self.checkpoints: dict[int, float] = {0: 0.0}
        """Committed-step counts with a checkpoint on disk -> when (0 = the initial state)."""
        self.gen = 0
        self.t0 = time.monotonic()
        self.initial_plan = self.plan
        self.state_plan = self.plan
        """The plan whose layer placement the workers' state matches: the plan of the last
        generation that committed a step (a generation that fails before its first commit
        leaves the workers' state as it was)."""
        self.pending: PendingSwitch | None = None
        """The second phase of a ``reroute-then-dynamic`` recovery, waiting for its turn."""
        self.from_checkpoint = True
        """No step committed since the state was (re)loaded from a checkpoint or the
        initial parameters: only another restart is consistent with it."""

    # ------------------------------------------------------------------ helpers
    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.t0

    def _job_info(self) -> JobInfo:
        job, train = self.config.job, self.train
        return JobInfo(shape=self.shape, dtype=train.dtype, lr=train.lr,
                       weight_decay=train.weight_decay, seed=train.seed,
                       micro_batch=job.micro_batch, global_batch=job.global_batch,
                       timeout_s=train.timeout_s, heartbeat_s=train.heartbeat_s,
                       backend=train.backend,
                       faults=tuple((f.rank, f.step, f.kind, f.phase) for f in self.faults),
                       corpus_digest=corpus_digest(),
                       checkpoint_every=train.checkpoint_every,
                       control_timeout_s=train.join_timeout_s)

    def _schedule(self, plan: ExecutionPlan) -> tuple[dict[str, Any], list[Any]]:
        from chameleon_ft.perf import Topology, build_schedule

        sched = build_schedule(plan, self.profile, Topology.from_config(self.config))
        ops = {str(w): [[str(op.kind), op.pipeline, op.stage, op.microbatch] for op in seq]
               for w, seq in sched.ops.items()}
        rounds = [[[list(b.workers), list(b.layers)] for b in rnd] for rnd in sched.sync_rounds]
        return ops, rounds

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> dict[str, Any]:
        """Train to the end and return the report.

        Raises:
            ValueError: when workers do not join in time.
            WorkerFailure: when the job cannot continue.
        """
        self.store = dist.TCPStore(self.host, self.port, is_master=True,
                                   wait_for_workers=False,
                                   timeout=timedelta(seconds=self.train.join_timeout_s))
        self.port = self.store.port
        try:
            self.store.set(proto.JOB_KEY, self._job_info().to_json())
            self.store.add(proto.NEXT_ID_KEY, self.num_local)
            self.log(f"coordinator listening on {self.host}:{self.port}; "
                     f"{self.num_local} local workers, "
                     f"{self.num_workers - self.num_local} to join")
            self._launch(range(self.num_local))
            self._wait_joined()
            self.alive = set(range(self.num_workers))
            self._publish(self.plan, 0, load={"kind": "init"})
            next_step = 0
            while next_step < self.train.steps:
                outcome = self._watch(next_step)
                next_step = outcome.next_step
                if outcome.dead or outcome.retry:
                    next_step = self._recover(outcome, next_step)
                elif outcome.switch:
                    self._switch(next_step)
            self._finish_transitions()
            return self._finish()
        finally:
            self._reap()

    def _launch(self, ids: Sequence[int], *, replacement: bool = False) -> None:
        from chameleon_ft.runtime.worker import worker_main

        ctx = forkserver_context()
        for w in ids:
            proc = ctx.Process(target=worker_main,
                               args=(w, self.host, self.port, None, replacement),
                               daemon=False, name=f"chameleon-worker-{w}")
            proc.start()
            self.procs[w] = proc
            self.all_procs.append(proc)

    def _wait_joined(self) -> None:
        deadline = time.monotonic() + self.train.join_timeout_s
        while True:
            joined = self.store.add(proto.REGISTERED_KEY, 0)
            if joined >= self.num_workers:
                return
            for w, proc in self.procs.items():
                if proc.exitcode is not None:
                    raise ValueError(f"worker {w} exited with status {proc.exitcode} while "
                                     "starting; see its output above")
            if time.monotonic() > deadline:
                raise ValueError(f"workers: only {joined} of the {self.num_workers} workers "
                                 f"the layout needs joined within {self.train.join_timeout_s:g} "
                                 f"s; start the rest with `chameleon worker --coordinator "
                                 f"{self.host}:{self.port}`")
            time.sleep(0.01)

    def _reap(self) -> None:
        """Leave no process behind: wait briefly, then SIGKILL by pid and join."""
        deadline = time.monotonic() + 5.0
        for proc in self.all_procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.all_procs:
            if proc.exitcode is None and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join(5.0)
        with contextlib.suppress(Exception):
            del self.store

    # ------------------------------------------------------------------ generations
    def _publish(self, plan: ExecutionPlan, step: int, *, load: dict[str, Any] | None = None,
                 migration: Any = None, dead: Sequence[int] = ()) -> None:
        transfers: list[list[int]] = []
        rounds: list[list[int]] = []
        if migration is not None:
            transfers = [[t.layer, t.src, t.dst, t.part, t.num_parts]
                         for t in migration.transfers]
            rounds = [list(r) for r in migration.rounds]
        world = sorted(set(plan.workers) | {t[1] for t in transfers} | {t[2] for t in transfers})
        ops, sync_rounds = self._schedule(plan)
        directive = {"action": "train", "gen": self.gen, "plan": plan.to_dict(), "step": step,
                     "steps": self.train.steps, "dead": sorted(set(range(self.num_workers))
                                                                - self.alive),
                     "world": world, "ops": ops, "rounds": sync_rounds,
                     "migration": {"transfers": transfers, "rounds": rounds} if transfers else None,
                     "load": load}
        self.plan = plan
        self.world = world
        precompute = getattr(self._decide_fn(), "precompute", None)
        if precompute is not None:
            precompute(plan)
        self.gen_started_s = self.now()
        self.ready_s: float | None = None
        self.store.set(proto.directive_key(self.gen), proto.dumps(directive))

    @dataclass
    class _Outcome:
        next_step: int
        dead: dict[int, str] = field(default_factory=dict)
        retry: bool = False
        switch: bool = False
        """The generation ended at a step boundary for a planned plan change."""
        messages: list[str] = field(default_factory=list)

    def _watch(self, next_step: int) -> Coordinator._Outcome:
        """Follow one generation until training ends or a worker fails."""
        gen = self.gen
        out = Coordinator._Outcome(next_step)
        hb_last: dict[int, tuple[int, float]] = {w: (-1, time.monotonic()) for w in self.alive}
        hb_next = 0.0
        errors_seen = 0
        suspects: dict[int, float] = {}
        unexplained_since: float | None = None
        last_commit_s: float | None = None
        timeout_s, hb_s = self.train.timeout_s, self.train.heartbeat_s
        members = set(self.world)
        while out.next_step < self.train.steps:
            now = time.monotonic()
            # 1. process exits: the fastest, surest signal for workers launched here
            for w in sorted(self.alive):
                proc = self.procs.get(w)
                if proc is not None and proc.exitcode is not None:
                    out.dead[w] = f"exit (status {proc.exitcode})"
            # 2. error reports
            num_errors = self.store.add(proto.num_errors_key(gen), 0)
            while errors_seen < num_errors:
                report = proto.ErrorReport.from_json(
                    self.store.get(proto.error_key(gen, errors_seen)))
                errors_seen += 1
                out.messages.append(report.message.splitlines()[0])
                if report.fatal:
                    out.dead[report.worker] = "error: " + report.message.splitlines()[0]
                elif report.peer is not None:
                    suspects.setdefault(report.peer, now)
                if unexplained_since is None:
                    unexplained_since = now
            # 3. heartbeats
            if now >= hb_next:
                hb_next = now + hb_s / 2
                for w in sorted(self.alive):
                    count = self.store.add(proto.heartbeat_key(w), 0)
                    seen, since = hb_last.get(w, (-1, now))
                    if count != seen:
                        hb_last[w] = (count, now)
                    elif now - since > timeout_s - hb_s:
                        # the last beat may be up to an interval older than when we saw
                        # it: declaring at timeout - interval keeps detection within timeout
                        out.dead.setdefault(w, f"hang (no heartbeat for {now - since:.2f} s)")
                    elif w in suspects and now - since > 2.5 * hb_s:
                        out.dead.setdefault(w, "reported by peers, heartbeat stopped")
            if out.dead:
                break
            if unexplained_since is not None and now - unexplained_since > timeout_s + 4 * hb_s:
                out.retry = True  # errors nobody's death explains: rebuild and redo the step
                break
            # 4. readiness (end of the transition) and the current step's votes
            if self.ready_s is None and self.store.add(proto.ready_key(gen), 0) >= len(members):
                self.ready_s = self.now()
            step = out.next_step
            if self.store.add(proto.reduced_key(gen, step), 0) >= len(self.plan.workers):
                end = self.pending is not None and step >= self.pending.at_step
                self.store.set(proto.verdict_key(gen, step),
                               proto.COMMIT_END if end else proto.COMMIT)
                committed = self.now()
                start = last_commit_s if last_commit_s is not None else (
                    self.ready_s if self.ready_s is not None else self.gen_started_s)
                loss = self._collect_loss(gen, step)
                self._collect_timings(gen, step)
                self.steps[step] = StepRecord(step, loss, committed - start, gen, committed)
                self.state_plan, self.from_checkpoint = self.plan, False
                last_commit_s = committed
                self.log(f"step {step:4d}  loss {loss:.4f}  step {committed - start:.3f} s  "
                         f"gen {gen}")
                for event in self.events:
                    if event.resumed_at_s is None:
                        event.resumed_at_s = committed
                        origin = event.fault_at_s if event.fault_at_s is not None \
                            else event.detected_at_s
                        # The transition itself (minus the new plan's median step) is
                        # computed at the end, once later steps of this plan are known.
                        self.log(f"recovered: first step after the failure committed "
                                 f"{committed - origin:.3f} s after it ({event.strategy})")
                out.next_step = step + 1
                if not end:
                    self._maybe_rejoin(out.next_step)
                if end:
                    out.switch = True
                    break
                continue
            self._collect_checkpoints()
            self._sleep()
        return out

    def _sleep(self) -> None:
        sentinels = [p.sentinel for w, p in self.procs.items() if w in self.alive]
        if sentinels:
            multiprocessing.connection.wait(sentinels, timeout=_POLL_S)
        else:
            time.sleep(_POLL_S)

    def _collect_timings(self, gen: int, step: int) -> None:
        for w in self.plan.workers:
            key = proto.timing_key(gen, step, w)
            if self.store.check([key]):
                doc = json.loads(self.store.get(key))
                self.op_times.append({"step": step, "gen": gen, "worker": w, **doc})

    def _collect_loss(self, gen: int, step: int) -> float:
        pieces: list[tuple[int, float]] = []
        for w in self.plan.workers:
            key = proto.loss_key(gen, step, w)
            if self.store.check([key]):
                pieces.extend((int(m), float(v)) for m, v in json.loads(self.store.get(key)))
        # sum in global micro-batch order: the same grouping whatever the plan
        return math.fsum(v for _, v in sorted(pieces))

    # ------------------------------------------------------------------ checkpoints
    def _collect_checkpoints(self) -> None:
        every = self.train.checkpoint_every
        if every <= 0 or self.out_dir is None:
            return
        last = max(self.steps, default=-1) + 1
        for num_steps in range(every, last + 1, every):
            if num_steps in self.checkpoints:
                continue
            key = proto.checkpoint_count_key(num_steps)
            if not self.store.check([key]) or self.store.add(key, 0) < self.shape.num_layers:
                continue
            folder = self.out_dir / "checkpoints" / f"step{num_steps}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(self.shape.num_layers):
                key_i = proto.checkpoint_layer_key(num_steps, i)
                (folder / f"layer{i}.pt").write_bytes(self.store.get(key_i))
                self.store.delete_key(key_i)
            (folder / "COMPLETE").write_text(str(num_steps))
            self.checkpoints[num_steps] = self.now()
            self.log(f"checkpoint after {num_steps} steps written to {folder}")

    def _restore(self, committed: int) -> tuple[int, dict[str, Any]]:
        """Publish the newest complete checkpoint at or before ``committed`` steps."""
        best = max(s for s in self.checkpoints if s <= committed)
        if best == 0:
            return 0, {"kind": "init"}
        assert self.out_dir is not None
        folder = self.out_dir / "checkpoints" / f"step{best}"
        for i in range(self.shape.num_layers):
            self.store.set(proto.restore_layer_key(self.gen, i),
                           (folder / f"layer{i}.pt").read_bytes())
        return best, {"kind": "restore", "step": best}

    # ------------------------------------------------------------------ recovery
    def _decide_fn(self) -> Decide:
        if self._decide is None:
            self._decide = PlannerDecide(self.config, self.profile, self.policy)
        return self._decide

    def _recover(self, outcome: Coordinator._Outcome, next_step: int) -> int:
        gen = self.gen
        detected = self.now()
        self.store.set(proto.verdict_key(gen, next_step), proto.ABORT)
        self.store.set(proto.abort_key(gen), "1")
        failed = frozenset(outcome.dead)
        for w in failed:  # fence: a hung worker must never come back into this run
            proc = self.procs.get(w)
            if proc is not None and proc.exitcode is None and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        self.alive -= failed
        if not failed:
            self.log(f"generation {gen}: unexplained errors ({'; '.join(outcome.messages)}); "
                     "rebuilding the groups and redoing the step")
            self.gen += 1
            if self.from_checkpoint:
                restored, load = self._restore(len(self.steps))
                self._publish(self.plan, restored, load=load)
                return restored
            self._publish(self.state_plan, next_step)
            return next_step
        fault_at = self._fault_time(failed)
        event = Event(workers=sorted(failed), cause="; ".join(
            f"w{w}: {outcome.dead[w]}" for w in sorted(failed)), gen=gen, step=next_step,
            fault_at_s=fault_at, detected_at_s=detected,
            detected_after_s=None if fault_at is None else detected - fault_at)
        self.events.append(event)
        detect_txt = "" if event.detected_after_s is None else \
            f" {event.detected_after_s:.3f} s after the fault"
        self.log(f"FAILURE at step {next_step}: {event.cause}; detected{detect_txt}")
        if not self.alive:
            raise WorkerFailure("every worker failed")
        decision = self._decision(failed)
        event.decide_s = decision[1]
        decision_value = decision[0]
        event.strategy = str(decision_value.strategy)
        event.reason = decision_value.reason
        event.decision = decision_value.to_dict()
        if decision_value.plan is None:
            raise WorkerFailure(f"no recovery possible: {decision_value.reason}")
        self._log_decision(decision_value)
        new_plan = decision_value.plan
        unknown = set(new_plan.workers) - self.alive
        if unknown:
            raise WorkerFailure(f"the policy's plan uses workers {sorted(unknown)} that are not "
                                "alive")
        self.gen += 1
        if event.strategy == "restart":
            restored, load = self._restore(len(self.steps))
            event.lost_steps = next_step - restored
            for s in range(restored, next_step):
                self.steps.pop(s, None)
            self.from_checkpoint = True
            self._publish(new_plan, restored, load=load)
            return restored
        self.pending = None
        interim = getattr(getattr(decision_value, "chosen", None), "interim_plan", None)
        if event.strategy == "reroute-then-dynamic" and interim is not None:
            # Phase 1 now: train rerouted (no state moves). Phase 2 at a step boundary once
            # the planned background window has passed: migrate and switch. The migration
            # runs between two steps here, not overlapped with training.
            chosen = decision_value.chosen  # type: ignore[attr-defined]
            after = 1
            if chosen.interim_step_s and chosen.interim_s:
                after = max(1, math.ceil(chosen.interim_s / chosen.interim_step_s))
            self.pending = PendingSwitch(new_plan, decision_value.migration,
                                         next_step + after - 1)
            self._publish(interim, next_step)
            return next_step
        self._publish(new_plan, next_step, migration=decision_value.migration)
        return next_step

    def _maybe_rejoin(self, next_step: int) -> None:
        """Relaunch dead local workers once training runs again; fold them back in when
        they are up and the policy says it pays (the switch happens at the next commit)."""
        if not self.train.rejoin or self.pending is not None:
            return
        if any(e.resumed_at_s is None for e in self.events):
            return
        dead_local = [w for w in self.procs if w not in self.alive and w not in self.replaced]
        if dead_local:
            self.replaced.update(dead_local)
            self.rejoining.update(dead_local)
            self._launch(dead_local, replacement=True)
            self.log(f"relaunched worker(s) {dead_local} (repair); they rejoin when ready")
            return
        ready = sorted(w for w in self.rejoining
                       if self.store.check([proto.rejoin_ready_key(w)]))
        rejoin = getattr(self._decide_fn(), "rejoin", None)
        if not ready or rejoin is None:
            return
        self.rejoining.difference_update(ready)
        decision = rejoin(self.plan, frozenset(ready), frozenset(self.alive | set(ready)),
                          self.now())
        record = {"workers": ready, "step": next_step, "strategy": str(decision.strategy),
                  "reason": decision.reason}
        self.rejoins.append(record)
        self.log(f"rejoin of worker(s) {ready}: {decision.strategy} ({decision.reason})")
        if str(decision.strategy) == "keep" or decision.plan is None:
            return  # not worth it: the repaired workers stay idle
        self.pending = PendingSwitch(decision.plan, decision.migration, next_step,
                                     rejoin=tuple(ready))

    def _switch(self, next_step: int) -> None:
        """Switch plans at a step boundary (second phase of a two-phase recovery, or a
        rejoin): migrate, then train on the new plan."""
        assert self.pending is not None
        pending, self.pending = self.pending, None
        self.gen += 1
        for w in pending.rejoin:
            self.alive.add(w)
            self.store.set(proto.rejoin_gen_key(w), str(self.gen))
        self.log(f"switching to the dynamic plan after step {next_step - 1} "
                 f"({len(pending.migration.transfers) if pending.migration else 0} transfers)")
        for line in pending.plan.describe().splitlines():
            self.log(f"  {line}")
        self._publish(pending.plan, next_step, migration=pending.migration)

    def _decision(self, failed: frozenset[int]) -> tuple[DecisionLike, float]:
        """Ask the policy, starting from the placement the workers' state really has.

        Returns:
            The decision and the seconds it took.
        """
        base = self.state_plan
        newly = frozenset(w for w in base.workers if w not in self.alive)
        t = time.monotonic()
        if not newly:  # only workers idle in that placement died: keep it
            return ManualDecision("keep", base, reason="the failed workers held no state"), 0.0
        since_ckpt = self.now() - self.checkpoints[max(self.checkpoints)]
        decision = self._decide_fn()(base, newly, frozenset(self.alive), self.now(), since_ckpt)
        if self.from_checkpoint and str(decision.strategy) != "restart":
            # the state was just reloaded and nothing committed since: only a restart
            # (reload again, on the survivors) is consistent with it
            restart = [c for c in getattr(decision, "candidates", ())
                       if str(c.strategy) == "restart" and c.feasible and c.plan is not None]
            if not restart:
                raise WorkerFailure("a failure before the first step after a restart, and no "
                                    "restart plan for the survivors")
            decision = ManualDecision("restart", restart[0].plan,
                                      reason="failure before the first commit after loading "
                                             "the state: restart again")
        return decision, time.monotonic() - t

    def _log_decision(self, decision: DecisionLike) -> None:
        doc = decision.to_dict()
        cands = doc.get("candidates") or []
        parts = []
        for c in cands:
            if isinstance(c, dict):
                step = c.get("step_s")
                tr = c.get("transition_s")
                ok = "" if c.get("feasible", True) else " (infeasible)"
                parts.append(f"{c.get('strategy')}: step {step if step is None else round(step, 4)}"
                             f" s, transition {tr if tr is None else round(tr, 3)} s{ok}")
        self.log(f"decision: {decision.strategy} ({decision.reason})")
        for p in parts:
            self.log(f"  candidate {p}")
        if decision.plan is not None:
            for line in decision.plan.describe().splitlines():
                self.log(f"  {line}")

    def _fault_time(self, failed: frozenset[int]) -> float | None:
        """When the injected fault fired (worker wall clock -> run clock), if it was one."""
        times = []
        for w in failed:
            key = proto.fault_time_key(w)
            if self.store.check([key]):
                wall = float(self.store.get(key).decode())
                times.append(self.now() - (time.time() - wall))
                self.store.delete_key(key)
        return min(times) if times else None

    def _finish_transitions(self) -> None:
        """Transition = fault to first commit after recovery, minus the new plan's step."""
        records = sorted(self.steps.values(), key=lambda r: r.committed_at_s)
        for event in self.events:
            later = [r for r in records if r.committed_at_s > event.detected_at_s]
            if not later:
                continue
            first = later[0]
            same_gen = [r.step_s for r in later[1:] if r.gen == first.gen]
            own_s = statistics.median(same_gen) if same_gen else first.step_s
            event.resumed_at_s = first.committed_at_s
            start = event.fault_at_s if event.fault_at_s is not None else event.detected_at_s
            event.transition_s = first.committed_at_s - start - own_s

    # ------------------------------------------------------------------ the end
    def _finish(self) -> dict[str, Any]:
        self.store.set(proto.abort_key(self.gen), "1")
        # Every live holder uploads each of its layers; take the first holder's copy that
        # arrives. A worker may die after the last commit (in its last optimizer step):
        # its replicas hold the same state.
        final = {i: [w for w in self.plan.holders(i) if w in self.alive]
                 for i in range(self.shape.num_layers)}
        self.gen += 1
        self.store.set(proto.directive_key(self.gen), proto.dumps(
            {"action": "stop", "gen": self.gen, "dead": [], "final": final}))
        for w in self.replaced - self.alive:  # repaired but never used: let them exit
            self.store.set(proto.rejoin_gen_key(w), str(self.gen))
        params: dict[str, torch.Tensor] = {}
        deadline = time.monotonic() + max(10.0, 5 * self.train.timeout_s)
        for i, holders in final.items():
            blob = None
            while blob is None:
                for w in holders:
                    if self.store.check([proto.final_layer_key(i, w)]):
                        blob = self.store.get(proto.final_layer_key(i, w))
                        break
                else:
                    gone = all(w in self.procs and self.procs[w].exitcode not in (None, 0)
                               for w in holders)
                    if gone or time.monotonic() > deadline:
                        raise WorkerFailure(f"layer {i}: no holder uploaded its final "
                                            f"parameters (holders {holders})")
                    time.sleep(_POLL_S)
            named = torch.load(io.BytesIO(blob), weights_only=True)
            for name, tensor in named.items():
                params[f"layers.{i}.{name}"] = tensor
        # the workers exit once they uploaded; wait for them so that a death after the
        # last commit is seen and reported
        leave_by = time.monotonic() + max(5.0, 2 * self.train.timeout_s)
        for w in sorted(self.alive):
            if w in self.procs:
                self.procs[w].join(max(0.0, leave_by - time.monotonic()))
        for w in sorted(self.alive):
            proc = self.procs.get(w)
            if proc is not None and proc.exitcode not in (None, 0):
                fault_at = self._fault_time(frozenset({w}))
                now = self.now()
                self.events.append(Event(
                    workers=[w], cause=f"w{w}: exit (status {proc.exitcode}) after the last "
                    "step committed", gen=self.gen, step=len(self.steps), fault_at_s=fault_at,
                    detected_at_s=now, detected_after_s=None if fault_at is None
                    else now - fault_at, strategy="none",
                    reason="training had finished; its replicas supplied the final parameters"))
                self.log(f"worker {w} died after the last step; its replicas supplied the "
                         "final parameters")
        digest = param_hash(params)
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save(params, self.out_dir / "params.pt")
        steps = [self.steps[s] for s in sorted(self.steps)]
        report = {
            "steps": [{"step": r.step, "loss": r.loss, "step_s": r.step_s, "gen": r.gen}
                      for r in steps],
            "loss": [r.loss for r in steps],
            "step_s": [r.step_s for r in steps],
            "events": [e.to_dict() for e in self.events],
            "rejoins": self.rejoins,
            "param_hash": digest,
            "initial_plan": self.initial_plan.to_dict(),
            "final_plan": self.plan.to_dict(),
            "dtype": self.train.dtype,
            "num_workers": self.num_workers,
            "total_s": self.now(),
        }
        self.params = params
        if self.out_dir is not None:
            (self.out_dir / "report.json").write_text(json.dumps(report, indent=2))
            # per-op compute times (calibration input for the profiler), kept apart: large
            (self.out_dir / "op_times.json").write_text(json.dumps(self.op_times))
        return report


def param_hash(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the parameters' names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
