"""The coordinator: owns the store, admits workers, watches them, commits steps, recovers.

It runs in the ``chameleon train`` process. The run's state is one value
(:class:`~chameleon_ft.runtime.control.state.RunState`) that each event replaces through a pure
transition; this module does the I/O around it. One loop polls, every couple of
milliseconds:

- local worker processes (exit = dead at once), heartbeats (silent for ``hang_timeout_s``
  = hung), error reports (a worker's own exception = dead; a peer named by a failed
  transfer whose heartbeat stopped = dead), join requests from other hosts;
- the "reduced" counter of the step in flight: when every worker of the plan has reduced
  step k it writes the verdict ``commit`` (``commit-end`` when the plan changes at this
  boundary); only then does any worker apply the optimizer;
- checkpoint assemblies that completed (bulk state arrives over ``runtime.blobs``, never
  through the store).

On a failure before the commit it writes ``abort`` for step k, asks the policy, and
publishes generation g + 1 starting again at step k. Whenever the generation number
changes, for whatever reason, the old generation's abort key is set: workers blocked in
its collectives are released within milliseconds. No committed step is lost or applied
twice; a failure during a recovery is simply a failure in the next generation.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from chameleon_ft.plan import ExecutionPlan, initial_plan
from chameleon_ft.profile import Profile, build_profile
from chameleon_ft.runtime import auth
from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.coordinator.resources import check_memory
from chameleon_ft.runtime.replay import TraceDriver
from chameleon_ft.runtime.storage.blobs import BlobError, BlobServer
from chameleon_ft.runtime.storage.checkpoint import (
    Assembly,
    CheckpointError,
    CheckpointStore,
    Manifest,
)
from chameleon_ft.runtime.storage.packing import PackError, unpack
from chameleon_ft.runtime.worker.main import JobInfo
from chameleon_ft.runtime.workload.bundle import Workload, seal_workload
from chameleon_ft.runtime.workload.models import (
    export_model,
    param_name,
    probe_outputs,
    targets_per_sample,
)
from chameleon_ft.runtime.workload.precision import torch_dtype
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.job import RUNTIME_SCHEDULES
from chameleon_ft.spec.recovery import POLICY_NAMES
from chameleon_ft.spec.train import Fault, check_faults

_POLL_S = 0.002
"""Coordinator poll interval: bounds the commit latency it adds to every step."""
COLLECTIVE_FLOOR_S = 3.0
"""Smallest collective deadline derived from a plan (gloo's first transfers on a loaded
machine take hundreds of milliseconds)."""
CHECKPOINT_LOG_S = 10.0
"""At most one "checkpoint written" line per this many seconds."""
MAX_FAILED_STARTS = 3
"""Replacements of one worker that may die before they are up; then repairs stop."""
RUNTIME_POLICIES = ("chameleon", "reroute", "dynamic", "restart", "shrink",
                    "reroute-then-dynamic")
"""Policies the runtime executes (``recycle`` needs split backwards, a simulator baseline)."""
COLLECTIVE_FACTOR = 10.0
"""Derived collective deadline: this many times the plan's estimated step + migration."""
SETUP_WAIT_DEADLINES = 2
"""A member inside a superseded generation's group set-up is waited for this many of that
generation's collective deadlines. Gloo's set-up (torch 2.13) fails within one deadline
when a peer never came; when a peer died or stopped mid-handshake it can retry its
connections for five, and a member stuck that long is declared failed rather than
stalling the run: the wait covers the first case (and generations with a longer deadline
than the newest), and costs at most one deadline more in the others. Members stuck with a
peer that went silent are not waited for at all."""


class DecisionLike(Protocol):
    """What the coordinator reads from a policy decision."""

    @property
    def strategy(self) -> Any: ...

    @property
    def plan(self) -> ExecutionPlan | None: ...

    @property
    def migration(self) -> Any: ...

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


class Hooks:
    """Callbacks a harness (tests, the chaos benchmark) uses to watch and steer a run.

    Each is called on the coordinator's thread; the default does nothing.
    """

    def before_publish(self, coord: Coordinator, directive: dict[str, Any]) -> None:
        """A generation is about to be published (faults injected here reach it)."""

    def on_commit(self, coord: Coordinator, step: int) -> None:
        """``step`` committed."""

    def on_failure(self, coord: Coordinator, event: Event) -> None:
        """A failure was detected (before the decision)."""


@dataclass
class StepRecord:
    """One committed step."""

    step: int
    loss: float
    step_s: float
    gen: int
    committed_at_s: float
    num_workers: int


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
    idle: bool = False
    """Only idle workers died: nothing was aborted or recovered."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dict(vars(self))


class WorkerFailure(RuntimeError):
    """Raised when the job cannot continue (every replica gone and no way to restart)."""


def forkserver_context() -> Any:
    """A forkserver context whose server preloads torch and the worker module."""
    # Waits in slices make c10d log a warning per timed-out slice; keep errors only.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = multiprocessing.get_context("forkserver")
    # Workers fork from a server that already imported torch: ~0.3 s per worker, not 5-10 s.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "chameleon_ft.runtime.worker.main"])
    return ctx


def default_run_dir(base: Path | None = None) -> Path:
    """``runs/train-YYYYmmdd-HHMMSS`` under ``base`` (default: the working directory)."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    root = (base or Path.cwd()) / "runs"
    path = root / f"train-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = root / f"train-{stamp}-{n}"
    return path


def config_digest(config: Config, workload: Workload | None = None) -> str:
    """What must not change between a run and its ``--resume``: the model, the data, the
    optimizer and the numerics (the API's objects by their type and ``repr``)."""
    model = config.model
    objects = [] if workload is None else [
        None if o is None else f"{type(o).__module__}.{type(o).__qualname__}"
        for o in (workload.model_obj, workload.data_obj, workload.optimizer_obj,
                  workload.lr_schedule_obj)]
    doc = {"model": None if model is None else vars(model),
           "source": vars(config.model_source), "data": vars(config.data),
           "optimizer": repr(config.optimizer), "dtype": config.train.dtype,
           "seed": config.train.seed, "global_batch": config.job.global_batch,
           "micro_batch": config.job.micro_batch, "lr": config.train.lr,
           "weight_decay": config.train.weight_decay, "objects": objects}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class _Proc:
    """A worker process launched (locally) or admitted (remotely) under an id."""

    worker: int
    incarnation: str
    process: Any = None
    """The local ``multiprocessing`` process; None for a remote worker."""
    registered: bool = False
    replacement: bool = False
    ready: bool = False
    """A replacement that registered and was admitted as an idle worker."""


class Coordinator:
    """Runs one training job: start workers, train, recover, report."""

    def __init__(self, config: Config, *, profile: Profile | None = None,
                 decide: Decide | None = None, policy: str | None = None,
                 faults: Sequence[Fault] = (), out_dir: str | Path | None = None,
                 num_local_workers: int | None = None, host: str = "127.0.0.1",
                 port: int = 0, log: Callable[[str], None] | None = None,
                 token: str | None = None, job_name: str | None = None,
                 resume: bool = False, check_resources: bool = True,
                 hooks: Hooks | None = None, model: Any = None, data: Any = None,
                 optimizer: Any = None, lr_schedule: Any = None,
                 log_every: int | None = None, trace: TraceDriver | None = None) -> None:
        """Prepare a job (nothing starts until :meth:`run`).

        Args:
            config: the job file; ``config.train`` holds steps, dtype and timeouts.
            profile: per-layer costs (default: the config's ``[profile]``).
            decide: the recovery decision function (default: the project's Planner).
            policy: policy name for the default Planner (default ``config.policy.name``).
            faults: injected faults.
            out_dir: the run directory: checkpoints, report, parameters (default: a new
                ``runs/train-<time>`` folder, announced in the log).
            num_local_workers: workers to launch here (default: all); the rest join with
                ``chameleon worker``.
            host: address the store listens on.
            port: store port (0: any free port).
            log: one-line progress messages.
            token: the job token remote workers must prove they know (default: one is
                generated, and printed when workers may join from other hosts).
            job_name: the job's name (workers may name the job they mean to join).
            resume: continue from the newest complete checkpoint in ``out_dir``.
            check_resources: refuse to launch a job whose workers cannot fit this host.
            hooks: callbacks for harnesses.
            model: a layered model object (default: ``[model]``).
            data: a data source object (default: ``[data]``).
            optimizer: an optimizer factory ``params -> torch.optim.Optimizer`` (default:
                ``[optimizer]``).
            lr_schedule: ``step -> learning rate`` (default: ``[optimizer]``'s schedule).
            log_every: a step line every this many steps (default: about 25 per run);
                failures, decisions and recoveries are always logged.
            trace: a failure trace to replay in wall-clock time (``runtime/replay.py``).

        Raises:
            ValueError: for faults naming missing workers, layouts that do not fit, a
                token on a non-loopback address that is too short, a resume without a
                checkpoint, workers that would not fit the host's memory, or a trace
                the run cannot replay.
        """
        self.config = config
        self.workload = Workload(config, model, data, optimizer, lr_schedule)
        self.model = self.workload.model()
        self.data = self.workload.data(self.model)
        self.workload.optimizer()  # a bad optimizer is refused before anything starts
        self.workload.lr_schedule()
        self.num_layers = self.model.num_layers
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
        self.faults: list[Fault] = list(faults)
        check_faults(tuple(self.faults), self.num_workers, self.train.steps)
        self.plan0 = initial_plan(config, self.profile)
        if self.profile.num_layers != self.num_layers:
            raise ValueError(f"profile: {self.profile.num_layers} layers, the model has "
                             f"{self.num_layers}; make them agree ([profile] or the model)")
        self.policy = policy or config.policy.name
        if decide is None and self.policy not in RUNTIME_POLICIES:
            what = "a simulator baseline" if self.policy in POLICY_NAMES else "an unknown policy"
            raise ValueError(f"--policy: {self.policy!r} is {what}; the runtime runs "
                             f"{', '.join(RUNTIME_POLICIES)}")
        if config.job.schedule not in RUNTIME_SCHEDULES:
            raise ValueError(f"job.schedule: the runtime executes "
                             f"{', '.join(sorted(RUNTIME_SCHEDULES))}; {config.job.schedule!r} "
                             "is priced by the estimator and the simulator only")
        self.notes: list[str] = []
        if config.recovery.decoupled_backward:
            # ReCycle's split backward is priced by the simulator; the runtime's planner
            # must not choose plans it cannot execute
            config = replace(config, recovery=replace(config.recovery,
                                                      decoupled_backward=False))
            self.config = config
            self.notes.append("note: recovery.decoupled_backward is a simulator setting; "
                              "the runtime runs fused backward passes and plans for them")
        self._decide = decide
        self.host, self.port = host, port
        self.log = log or (lambda _msg: None)
        self.hooks = hooks or Hooks()
        if log_every is not None and log_every < 1:
            raise ValueError(f"--log-every: must be >= 1, got {log_every}")
        self.log_every = log_every
        self.job_name = job_name or (config.model.name if config.model is not None
                                     else "") or "chameleon"
        remote_possible = self.num_local < self.num_workers or not auth.is_loopback(host)
        self.token_generated = token is None
        self.token = token or auth.new_token()
        if len(self.token) < auth.MIN_TOKEN_CHARS:
            raise ValueError(f"--token: at least {auth.MIN_TOKEN_CHARS} characters")
        self.announce_token = remote_possible and self.token_generated
        self.secret = auth.secret_of(self.token)
        self.job_id, self.nonce = auth.new_nonce(), auth.new_nonce()
        self.out_dir = Path(out_dir) if out_dir is not None else default_run_dir()
        self.out_dir_given = out_dir is not None
        self.ckpt = CheckpointStore(self.out_dir, self.train.keep_checkpoints)
        self.digest = config_digest(config, self.workload)
        self.start_step = 0
        self.resumed_from: Manifest | None = None
        if resume:
            self._prepare_resume()
        self.trace = trace
        if trace is not None:
            trace.check_job(num_nodes=config.cluster.num_nodes,
                            workers_per_node=config.workers_per_node,
                            num_workers=self.num_workers, num_local=self.num_local,
                            resume=resume)
        self.hang_s = self.train.hang_s
        self._check_collective_timeout()
        if check_resources:
            for line in check_memory(config, self.plan0, self.profile, self.num_local,
                                     build_layer=self.model.build_layer):
                self.log(line)
        # run-time fields
        self.procs: dict[int, _Proc] = {}
        """The current process of each worker id."""
        self.all_procs: list[Any] = []
        """Every local process launched here, replaced ones included (all reaped)."""
        self.events: list[Event] = []
        self.rejoins: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []
        self.op_times: list[dict[str, Any]] = []
        """Per committed step and worker: compute seconds of each op (for calibration)."""
        self.steps: dict[int, StepRecord] = {}
        self.commits: list[StepRecord] = []
        """Every commit in order, redone steps too (``steps`` keeps the last of each)."""
        self.checkpoint_times: dict[int, float] = {}
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        """Guards what the blob threads share with the loop (assemblies, finals)."""
        self.assemblies: dict[tuple[int, int], Assembly] = {}
        self.completed: queue.Queue[tuple[int, int]] = queue.Queue()
        self.finals: dict[int, bytes] = {}
        self.final_gen = -1
        self.state = st.start(self.plan0, range(self.num_workers), step=self.start_step,
                              load=st.Load("restore", self.start_step) if self.start_step
                              else st.INIT)
        self.stop_signal: int | None = None
        self.rejoin_asked: tuple[ExecutionPlan, frozenset[int]] | None = None
        self.gen_info: dict[int, dict[str, Any]] = {}
        """Per generation not yet retired: its groups and steps (for deleting its keys)."""
        self.ready_gens: set[int] = set()
        self.failed_starts: dict[int, int] = {}
        self.checkpoint_logged_s = -CHECKPOINT_LOG_S
        self.joins_seen = 0
        self.join_wait_since: float | None = None
        self.fault_times_used: set[int] = set()
        self.retracted: set[int] = set()
        self.state_started = False
        self.drain_started = 0.0
        self.drain_done = False
        self.final_holders: dict[int, list[int]] = {}
        self.killed_at: dict[int, float] = {}
        """Run clock when :meth:`kill_workers` signalled a worker (its fault time)."""
        self.trace_ended = False
        self.ready_s: float | None = None

    # ------------------------------------------------------------------ set-up checks
    def _prepare_resume(self) -> None:
        manifest = self.ckpt.latest()
        if manifest is None:
            raise ValueError(f"--resume: no complete checkpoint in {self.out_dir}/checkpoints; "
                             "run without --resume to start from step 0")
        if manifest.meta.get("config") != self.digest:
            raise ValueError(f"--resume: the checkpoint in {manifest.folder} was written by a "
                             "job with another model or numerics (model, dtype, seed, batch, "
                             "optimizer); use the config it was trained with")
        if manifest.num_layers != self.num_layers:
            raise ValueError(f"--resume: the checkpoint has {manifest.num_layers} layers, the "
                             f"model {self.num_layers}")
        if manifest.step >= self.train.steps:
            raise ValueError(f"--resume: the checkpoint already holds {manifest.step} steps; "
                             f"ask for more with --steps (now {self.train.steps})")
        self.start_step = manifest.step
        self.resumed_from = manifest

    def _estimate_s(self, plan: ExecutionPlan) -> float:
        from chameleon_ft.perf import Topology, estimate

        return float(estimate(plan, self.profile, Topology.from_config(self.config)).step_s)

    def _check_collective_timeout(self) -> None:
        floor = self.train.collective_floor_s
        if floor <= 0:
            return
        step_s = self._estimate_s(self.plan0)
        if floor < 2 * step_s:
            raise ValueError(f"train.collective_timeout_s: {floor:g} s is less than twice the "
                             f"plan's estimated step ({step_s:.3g} s): healthy workers would "
                             "time out waiting for each other; raise it or leave it at 0 "
                             "(derived from the plan)")

    def collective_timeout_s(self, plan: ExecutionPlan, migration: Any) -> float:
        """The collective deadline of a generation: at least ``COLLECTIVE_FACTOR`` times its
        estimated step plus migration, and at least the configured value."""
        est = self._estimate_s(plan) + (float(migration.time_s) if migration is not None
                                        and hasattr(migration, "time_s") else 0.0)
        derived = max(COLLECTIVE_FLOOR_S, COLLECTIVE_FACTOR * est)
        floor = self.train.collective_floor_s
        if floor <= 0:
            return derived
        if derived > floor:
            self.log(f"collective timeout raised from {floor:g} s to {derived:.3g} s for a "
                     f"plan estimated at {est:.3g} s per step (with migration)")
            return derived
        return floor

    # ------------------------------------------------------------------ helpers
    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.t0

    def _decide_fn(self) -> Decide:
        if self._decide is None:
            self._decide = PlannerDecide(self.config, self.profile, self.policy)
        return self._decide

    def _job_info(self, blob_port: int) -> JobInfo:
        job, train = self.config.job, self.train
        dtype = torch_dtype(train.dtype)
        x, y = self.data.microbatch(0, 0, job.micro_batch)
        boundaries = [[list(shape), str(out_dtype).removeprefix("torch.")]
                      for shape, out_dtype in probe_outputs(self.model, x, dtype)]
        return JobInfo(job_name=self.job_name, job_id=self.job_id, nonce=self.nonce,
                       num_workers=self.num_workers, num_layers=self.num_layers,
                       dtype=train.dtype, micro_batch=job.micro_batch,
                       global_batch=job.global_batch, heartbeat_s=train.heartbeat_s,
                       hang_timeout_s=self.hang_s, backend=train.backend,
                       data_digest=Workload.data_digest(self.data),
                       checkpoint_every=train.checkpoint_every,
                       control_timeout_s=max(train.join_timeout_s, 10 * self.hang_s),
                       blob_port=blob_port, boundaries=boundaries,
                       targets_per_sample=targets_per_sample(y),
                       workload=seal_workload(self.workload, self.secret))

    def _schedule(self, plan: ExecutionPlan) -> tuple[dict[str, Any], list[Any]]:
        from chameleon_ft.perf import Topology, build_schedule

        sched = build_schedule(plan, self.profile, Topology.from_config(self.config))
        ops = {str(w): [[str(op.kind), op.pipeline, op.stage, op.microbatch] for op in seq]
               for w, seq in sched.ops.items()}
        rounds = [[[list(b.workers), list(b.layers)] for b in rnd] for rnd in sched.sync_rounds]
        return ops, rounds

    def _store_has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> dict[str, Any]:
        """Train to the end (or to a drain on SIGINT/SIGTERM) and return the report.

        Raises:
            ValueError: when workers do not join in time.
            WorkerFailure: when the job cannot continue.
        """
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if not self.out_dir_given:
            self.log(f"run directory: {self.out_dir} (checkpoints, report, parameters)")
        self.store = dist.TCPStore(self.host, self.port, is_master=True,
                                   wait_for_workers=False,
                                   timeout=timedelta(seconds=self.train.join_timeout_s))
        self.port = self.store.port
        self.blobs = BlobServer(self.host, self.secret, self._on_blob,
                                timeout_s=max(self.train.join_timeout_s, 10 * self.hang_s))
        old_handlers = self._install_signal_handlers()
        try:
            self.store.set(proto.JOB_KEY, self._job_info(self.blobs.port).to_json())
            self._publish_faults()
            self.log(f"coordinator listening on {self.host}:{self.port}; job "
                     f"{self.job_name!r}, {self.num_local} local workers, "
                     f"{self.num_workers - self.num_local} to join")
            for note in self.notes:
                self.log(note)
            if self.announce_token:
                self.log(f"job token: {self.token}  (give it to remote workers: --token or "
                         f"{auth.TOKEN_ENV})")
            if self.resumed_from is not None:
                self.log(f"resuming from {self.resumed_from.folder} "
                         f"({self.resumed_from.step} steps)")
            self._launch(range(self.num_local))
            if self.num_local:
                pids = " ".join(str(self.procs[w].process.pid) for w in range(self.num_local))
                self.log(f"launched workers 0-{self.num_local - 1} (pids {pids})")
            self._wait_joined()
            self._publish()
            self._loop()
            return self._finish()
        finally:
            self._restore_signal_handlers(old_handlers)
            self._reap()
            with contextlib.suppress(Exception):
                self.blobs.close()
            with self.lock:  # checkpoints that will never complete
                for assembly in self.assemblies.values():
                    self.ckpt.discard(assembly)
                self.assemblies.clear()

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        old: dict[int, Any] = {}

        def handler(signum: int, _frame: Any) -> None:
            if self.stop_signal is not None:  # a second signal: stop waiting politely
                raise KeyboardInterrupt
            self.stop_signal = signum

        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, handler)
        return old

    @staticmethod
    def _restore_signal_handlers(old: dict[int, Any]) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    def _launch(self, ids: Sequence[int], *, replacement: bool = False) -> None:
        from chameleon_ft.runtime.worker.main import worker_main

        ctx = forkserver_context()
        address = auth.advertise_address(self.host, self.port)
        for w in ids:
            incarnation = auth.new_nonce()
            proc = ctx.Process(target=worker_main,
                               args=(w, self.host, self.port, address, incarnation,
                                     self.secret, replacement),
                               daemon=False, name=f"chameleon-worker-{w}")
            proc.start()
            self.procs[w] = _Proc(w, incarnation, proc, replacement=replacement)
            self.all_procs.append(proc)

    def _registered(self, p: _Proc) -> bool:
        if not p.registered and self._store_has(proto.worker_info_key(p.worker, p.incarnation)):
            p.registered = True
        return p.registered

    def _wait_joined(self) -> None:
        deadline = time.monotonic() + self.train.join_timeout_s
        while True:
            self._admit_joins()
            joined = sum(1 for p in self.procs.values() if self._registered(p))
            if joined >= self.num_workers:
                return
            for w, p in list(self.procs.items()):
                if p.process is None or p.process.exitcode is None or p.registered:
                    continue
                starts = self.failed_starts.get(w, 0) + 1
                self.failed_starts[w] = starts
                if starts >= MAX_FAILED_STARTS:
                    raise ValueError(f"worker {w} exited with status {p.process.exitcode} "
                                     f"while starting, {starts} times; see its output above")
                self.log(f"worker {w} exited with status {p.process.exitcode} while starting; "
                         "starting it again")
                self._launch([w])
            if self.stop_signal is not None:
                raise WorkerFailure("interrupted while workers were joining")
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

    # ------------------------------------------------------------------ joins
    def _admit_joins(self) -> None:
        """Answer join requests from other hosts (any time during the run)."""
        slots = self.store.add(proto.JOIN_SLOTS_KEY, 0)
        seen = self.joins_seen
        while seen < slots:
            key = proto.join_request_key(seen)
            if not self._store_has(key):
                # reserved by one worker, another's announced: skip it after the deadline
                now = time.monotonic()
                if self.join_wait_since is None:
                    self.join_wait_since = now
                if now - self.join_wait_since < self.hang_s:
                    break
            self.join_wait_since = None
            seen += 1
            if not self._store_has(key):
                continue
            raw = self.store.get(key)
            self.store.delete_key(key)
            try:
                request = auth.JoinRequest.from_json(raw)
            except ValueError:
                self.refused.append({"reason": "malformed join request", "at_s": self.now()})
                self.log("refused a join request: malformed")
                continue
            reply = self._join_reply(request)
            self.store.set(proto.join_reply_key(request.wnonce), reply.to_json())
            if not reply.ok:
                self.refused.append({"host": request.host, "reason": reply.reason,
                                     "at_s": self.now()})
                self.log(f"refused a worker from {request.host} ({request.address}): "
                         f"{reply.reason}")
            else:
                self.log(f"admitted worker {reply.worker} from {request.host} "
                         f"({request.address})" + (" as a replacement" if reply.replacement
                                                   else ""))
        self.joins_seen = seen

    def _join_reply(self, request: auth.JoinRequest) -> auth.JoinReply:
        why = auth.check_join(request, token=self.token, job_name=self.job_name,
                              job_id=self.job_id, nonce=self.nonce)
        if why is not None:
            return auth.JoinReply(ok=False, reason=why)
        free = [w for w in range(self.num_local, self.num_workers) if w not in self.procs]
        if free:
            w = free[0]
            p = _Proc(w, auth.new_nonce())
            self.procs[w] = p
            return auth.JoinReply(ok=True, worker=w, incarnation=p.incarnation)
        state = getattr(self, "state", None)
        dead = sorted(set(range(self.num_workers)) - set(state.alive)) if state else []
        dead = [w for w in dead if self.procs.get(w) is None or self.procs[w].process is None]
        if self.train.rejoin and dead and self.state_started:
            w = dead[0]
            p = _Proc(w, auth.new_nonce(), replacement=True)
            self.procs[w] = p
            return auth.JoinReply(ok=True, worker=w, incarnation=p.incarnation,
                                  replacement=True)
        return auth.JoinReply(ok=False, reason=f"the job already has its {self.num_workers} "
                              "workers")

    # ------------------------------------------------------------------ generations
    def _publish(self) -> None:
        """Publish the state's generation (ending the previous one first)."""
        s = self.state
        self.state_started = True
        if s.gen > 0:
            self.store.set(proto.abort_key(s.gen - 1), "1")
        migration = s.migration
        transfers: list[list[int]] = []
        rounds: list[list[int]] = []
        if migration is not None:
            transfers = [[t.layer, t.src, t.dst, t.part, t.num_parts]
                         for t in migration.transfers]
            rounds = [list(r) for r in migration.rounds]
        world = sorted(s.world)
        ops, sync_rounds = self._schedule(s.plan)
        directive = {
            "action": "train", "gen": s.gen, "plan": s.plan.to_dict(), "step": s.next_step,
            "steps": self.train.steps, "world": world, "ops": ops, "rounds": sync_rounds,
            "migration": {"transfers": transfers, "rounds": rounds} if transfers else None,
            "load": None if s.load is None else {"kind": s.load.kind, "step": s.load.step},
            "incarnations": {str(w): self.procs[w].incarnation for w in sorted(s.alive)},
            "collective_timeout_s": self.collective_timeout_s(s.plan, migration)}
        self.hooks.before_publish(self, directive)
        groups = [(f"gen{s.gen}/world/", len(world))]
        groups += [(f"gen{s.gen}/bucket/{'_'.join(map(str, m))}/", len(m))
                   for m in sorted({tuple(b[0]) for rnd in sync_rounds for b in rnd
                                    if len(b[0]) > 1})]
        self.gen_info[s.gen] = {"groups": groups, "first_step": s.next_step,
                                "last_step": s.next_step - 1, "world": world,
                                "collective_s": directive["collective_timeout_s"]}
        decide = self._decide_fn()
        precompute = getattr(decide, "precompute", None)
        if precompute is not None:
            precompute(s.plan)
        self.gen_started_s = self.gen_info[s.gen]["published_s"] = self.now()
        self.ready_s: float | None = None
        self.last_commit_s: float | None = None
        self.errors_seen = 0
        self.error_wait_since: float | None = None
        self.suspects: dict[int, float] = {}
        self.unexplained_since: float | None = None
        self.setup_waits_logged: set[int] = set()
        self.unexplained_recheck = 0.0
        """While members are waited for (``_on_unexplained``), look again at this time."""
        self.messages: list[str] = []
        self.store.set(proto.directive_key(s.gen), proto.dumps(directive))
        self.store.set(proto.CURRENT_GEN_KEY, str(s.gen))

    def _publish_stop(self) -> None:
        """The final generation: every worker uploads its layers' state and leaves."""
        s = self.state
        self.store.set(proto.abort_key(s.gen - 1), "1")
        final = {i: [w for w in s.state_plan.holders(i) if w in s.holding]
                 for i in range(self.num_layers)}
        self.final_gen = s.gen
        self.store.set(proto.directive_key(s.gen), proto.dumps(
            {"action": "stop", "gen": s.gen, "step": s.next_step, "final": final}))
        self.store.set(proto.CURRENT_GEN_KEY, str(s.gen))
        self.final_holders = final

    def _retire_generations(self, before: int) -> None:
        """Delete the store keys of generations older than ``before`` (all their workers
        moved on, or are dead)."""
        for g in sorted(k for k in self.gen_info if k < before):
            info = self.gen_info.pop(g)
            keys = [proto.directive_key(g), proto.abort_key(g), proto.ready_key(g),
                    proto.error_slot_key(g)]
            with contextlib.suppress(Exception):
                slots = self.store.add(proto.error_slot_key(g), 0)
                keys += [proto.error_key(g, i) for i in range(slots)]
            # the committed steps and the one in flight when the generation ended
            for step in range(info["first_step"], info["last_step"] + 2):
                keys += [proto.reduced_key(g, step), proto.verdict_key(g, step)]
                for w in info["world"]:
                    keys += [proto.loss_key(g, step, w), proto.timing_key(g, step, w)]
            keys += proto.rendezvous_keys(g, info["groups"])
            for key in keys:
                with contextlib.suppress(Exception):
                    self.store.delete_key(key)

    # ------------------------------------------------------------------ faults
    def _publish_faults(self) -> None:
        self.store.set(proto.FAULTS_KEY, json.dumps(
            [[f.rank, f.step, f.kind, f.phase] for f in self.faults]))
        self.store.add(proto.FAULTS_VERSION_KEY, 1)

    def inject(self, fault: Fault) -> int:
        """Arm one more fault while the run goes on (chaos harness); returns its index."""
        self.faults.append(fault)
        self._publish_faults()
        return len(self.faults) - 1

    def retract(self, index: int) -> bool:
        """Disarm fault ``index`` unless it fired already; returns whether it was disarmed
        (a fault whose worker left every plan would otherwise wait forever)."""
        if self.store.add(proto.fault_claim_key(index), 1) != 1:
            return False
        self.retracted.add(index)
        return True

    def _fault_time(self, failed: frozenset[int]) -> float | None:
        """When an injected fault fired on one of ``failed`` (worker wall clock -> run clock)."""
        times = []
        for index, fault in enumerate(self.faults):
            # a glitch does not take its worker out: it explains no death
            if fault.rank not in failed or index in self.fault_times_used or \
                    fault.kind == "glitch":
                continue
            key = proto.fault_fired_key(index)
            if self._store_has(key):
                doc = json.loads(self.store.get(key))
                times.append(self.now() - (time.time() - float(doc["time"])))
                self.fault_times_used.add(index)
        times += [self.killed_at.pop(w) for w in failed if w in self.killed_at]
        return min(times) if times else None

    def fault_report(self) -> list[dict[str, Any]]:
        """Every injected fault, whether and where it fired."""
        out = []
        for index, fault in enumerate(self.faults):
            key = proto.fault_fired_key(index)
            fired = json.loads(self.store.get(key)) if self._store_has(key) else None
            out.append({"fault": fault.to_text(), "fired": fired is not None,
                        "retracted": index in self.retracted,
                        **({"fired_step": fired["step"], "fired_gen": fired["gen"],
                            "fired_pid": fired["pid"]} if fired else {})})
        return out

    # ------------------------------------------------------------------ trace replay
    def kill_workers(self, workers: Sequence[int]) -> list[int]:
        """SIGKILL the local processes of ``workers`` now (a replayed hardware failure).

        The loop notices the exits as it notices any death; the kill time becomes the
        failure's fault time.

        Returns:
            The workers signalled (those with a running local process).
        """
        killed = []
        for w in workers:
            p = self.procs.get(w)
            proc = None if p is None else p.process
            if proc is None or proc.pid is None or proc.exitcode is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            self.killed_at.setdefault(w, self.now())
            killed.append(w)
        # a node's workers die together: wait (briefly) for every signalled process to
        # exit, so that the loop sees them in one pass and recovers once, not once per
        # worker with a plan that names the next one to go
        deadline = time.monotonic() + 1.0
        for w in killed:
            self.procs[w].process.join(max(0.0, deadline - time.monotonic()))
        if killed:
            self.log(f"trace: killed worker(s) {killed}")
        return killed

    def relaunch_workers(self, workers: Sequence[int]) -> list[int]:
        """Relaunch those of ``workers`` that are dead now (a replayed repair).

        A replacement comes up idle; the policy decides whether to fold it back in. A
        worker whose exit the loop has not processed yet is left for a later call.

        Returns:
            The workers relaunched.
        """
        dead = []
        for w in workers:
            p = self.procs.get(w)
            if w >= self.num_local or w in self.state.alive or p is None or \
                    p.process is None or p.process.exitcode is None:
                continue
            dead.append(w)
        if dead:
            self._launch(dead, replacement=True)
            self.log(f"trace: relaunched worker(s) {dead} (repair); idle until a plan uses "
                     "them")
        return dead

    def software_fault(self) -> bool:
        """A job-level software fault: abort the step in flight, every worker of the running
        plan reloads the last checkpoint (``state.software_restart``).

        Returns:
            Whether it happened (not while a death is still to be recovered from, nor once
            training stops).
        """
        s = self.state
        try:
            new = st.software_restart(s)
        except ValueError as exc:
            self.log(f"trace: software fault not applied: {exc}")
            return False
        self._abort_generation()
        now = self.now()
        event = Event(workers=[], cause="software fault (every worker reloads the "
                      "checkpoint)", gen=s.gen, step=s.next_step, fault_at_s=now,
                      detected_at_s=now, detected_after_s=0.0, strategy="restart",
                      reason="a job-level software fault: the running plan restarts from "
                             f"the checkpoint after {new.next_step} steps",
                      lost_steps=s.next_step - new.next_step)
        for step in range(new.next_step, s.next_step):
            self.steps.pop(step, None)
        self.events.append(event)
        self.log(f"FAILURE at step {s.next_step}: software fault; restarting the plan from "
                 f"the checkpoint after {new.next_step} steps")
        self.hooks.on_failure(self, event)
        self.state = new
        self._after_new_gen()
        return True

    def stop_at_boundary(self, reason: str) -> None:
        """Stop training at the next step boundary (a replayed trace's end): the step in
        flight commits, or is aborted after the drain deadline, then the state is
        checkpointed and the workers stop, as in a drain, but not reported as an
        interruption."""
        if self.state.phase is not st.Phase.TRAINING:
            return
        self.log(f"{reason}: stopping at the next step boundary")
        self.state = st.draining(self.state, reason)
        self.drain_started = time.monotonic()
        self.trace_ended = True

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        """Follow generations until every step committed, a drain ended, or failure."""
        hb_last: dict[tuple[int, str], tuple[int, float]] = {}
        hb_next = 0.0
        while self.state.phase in (st.Phase.TRAINING, st.Phase.DRAINING):
            if self.state.next_step >= self.train.steps:
                return
            now = time.monotonic()
            self._admit_joins()
            if self.trace is not None:
                self.trace.poll(self)
            dead: dict[int, str] = {}
            # 1. process exits: the fastest, surest signal for workers launched here
            for w in sorted(self.state.alive):
                proc = self.procs[w].process
                if proc is not None and proc.exitcode is not None:
                    dead[w] = f"exit (status {proc.exitcode})"
            # 2. error reports
            self._read_errors(dead, now)
            # 3. heartbeats
            if now >= hb_next:
                hb_next = now + self.train.heartbeat_s / 2
                self._check_heartbeats(dead, hb_last, now)
            if dead:
                self._on_deaths(dead)
                if self.drain_done:
                    return
                continue
            self._watch_replacements()
            if (self.unexplained_since is not None
                    and now - self.unexplained_since > self.hang_s + 4 * self.train.heartbeat_s
                    and now >= self.unexplained_recheck and self._on_unexplained()):
                continue
            if self.stop_signal is not None and self.state.phase is st.Phase.TRAINING:
                name = signal.Signals(self.stop_signal).name
                self.log(f"{name} received: finishing the step in flight, then writing a "
                         "checkpoint and stopping")
                self.state = st.draining(self.state, name)
                self.drain_started = now
            if self.state.phase is st.Phase.DRAINING and \
                    now - self.drain_started > max(self.hang_s, 2.0) and self._abort_drain():
                return
            # 4. readiness (end of the transition) and the current step's votes
            s = self.state
            if self.ready_s is None and \
                    self.store.add(proto.ready_key(s.gen), 0) >= len(s.world):
                self.ready_s = self.now()
                self.ready_gens.add(s.gen)
                self._retire_generations(s.gen)
            if self.store.add(proto.reduced_key(s.gen, s.next_step), 0) >= len(s.plan.workers):
                # a step that commits shows the generation works: earlier reports were stale
                self.unexplained_since = None
                self.suspects.clear()
                if self._commit():
                    return
                continue
            self._collect_checkpoints()
            self._sleep()

    def _read_errors(self, dead: dict[int, str], now: float) -> None:
        """Read the generation's error reports in slot order, never blocking: a slot that
        was reserved but not written (its writer died in between) is skipped after the
        hang deadline; a malformed report is logged and ignored."""
        gen = self.state.gen
        slots = self.store.add(proto.error_slot_key(gen), 0)
        while self.errors_seen < slots:
            key = proto.error_key(gen, self.errors_seen)
            if not self._store_has(key):
                if self.error_wait_since is None:
                    self.error_wait_since = now
                if now - self.error_wait_since < self.hang_s:
                    break
                self.log(f"generation {gen}: error report {self.errors_seen} was never "
                         "written (its writer died); skipped")
                self.errors_seen += 1
                self.error_wait_since = None
                continue
            self.error_wait_since = None
            raw = self.store.get(key)
            self.errors_seen += 1
            try:
                report = proto.ErrorReport.from_json(raw)
            except ValueError:
                self.log(f"generation {gen}: ignored a malformed error report")
                continue
            first_line = report.message.splitlines()[0] if report.message else "?"
            self.messages.append(first_line)
            if report.worker not in self.state.alive:
                continue
            if report.fatal:
                dead[report.worker] = "error: " + first_line
            elif report.peer is not None:
                self.suspects.setdefault(report.peer, now)
            if self.unexplained_since is None:
                self.unexplained_since = now

    def _check_heartbeats(self, dead: dict[int, str],
                          hb_last: dict[tuple[int, str], tuple[int, float]],
                          now: float) -> None:
        hb_s = self.train.heartbeat_s
        for w in sorted(self.state.alive):
            p = self.procs[w]
            key = proto.heartbeat_key(w, p.incarnation)
            count = self.store.add(key, 0)
            seen, since = hb_last.get((w, p.incarnation), (-1, now))
            if count != seen:
                hb_last[(w, p.incarnation)] = (count, now)
            elif now - since > self.hang_s - hb_s:
                # the last beat may be up to an interval older than when we saw it:
                # declaring at timeout - interval keeps detection within the deadline
                dead.setdefault(w, f"hang (no heartbeat for {now - since:.2f} s)")
            elif w in self.suspects and now - since > 2.5 * hb_s:
                dead.setdefault(w, "reported by peers, heartbeat stopped")

    def _sleep(self) -> None:
        sentinels = [p.process.sentinel for w, p in self.procs.items()
                     if w in self.state.alive and p.process is not None]
        if sentinels:
            multiprocessing.connection.wait(sentinels, timeout=_POLL_S)
        else:
            time.sleep(_POLL_S)

    # ------------------------------------------------------------------ commits
    def _commit(self) -> bool:
        """Every worker of the plan reduced the step in flight: commit it.

        Returns:
            True when the loop must end (a drain finished at this boundary).
        """
        s = self.state
        step, gen = s.next_step, s.gen
        draining = s.phase is st.Phase.DRAINING
        end = s.switch_due or draining
        self.store.set(proto.verdict_key(gen, step), proto.COMMIT_END if end else proto.COMMIT)
        committed = self.now()
        start = self.last_commit_s if self.last_commit_s is not None else (
            self.ready_s if self.ready_s is not None else self.gen_started_s)
        loss = self._collect_loss(gen, step)
        self._collect_timings(gen, step)
        record = StepRecord(step, loss, committed - start, gen, committed,
                            len(s.plan.workers))
        self.steps[step] = record
        self.commits.append(record)
        self.state = st.committed(s, step)
        info = self.gen_info.get(gen, {"first_step": step})
        info["last_step"] = step
        # every worker read the previous verdict before it reduced this step
        if step - 1 >= info["first_step"]:
            for key in (proto.verdict_key(gen, step - 1), proto.reduced_key(gen, step - 1)):
                with contextlib.suppress(Exception):
                    self.store.delete_key(key)
        self.last_commit_s = committed
        self._log_step(step, loss, committed - start, gen)
        for event in self.events:
            if event.resumed_at_s is None and not event.idle:
                event.resumed_at_s = committed
                origin = event.fault_at_s if event.fault_at_s is not None \
                    else event.detected_at_s
                self.log(f"recovered: first step after the failure committed "
                         f"{committed - origin:.3f} s after it ({event.strategy})")
        self.hooks.on_commit(self, step)
        if draining:
            return True
        if end:
            self._switch()
            return False
        self._maybe_rejoin()
        return False

    def _log_step(self, step: int, loss: float, step_s: float, gen: int) -> None:
        every = self.log_every or (max(1, self.train.steps // 25) if self.train.steps > 50
                                   else 1)
        recovered = bool(self.events) and self.events[-1].resumed_at_s is None and \
            not self.events[-1].idle
        if step % every == 0 or step == self.train.steps - 1 or step == self.start_step or \
                recovered:
            self.log(f"step {step:4d}  loss {loss:.4f}  step {step_s:.3f} s  gen {gen}")

    def _collect_timings(self, gen: int, step: int) -> None:
        for w in self.state.plan.workers:
            key = proto.timing_key(gen, step, w)
            if self._store_has(key):
                doc = json.loads(self.store.get(key))
                self.op_times.append({"step": step, "gen": gen, "worker": w, **doc})
                self.store.delete_key(key)

    def _collect_loss(self, gen: int, step: int) -> float:
        pieces: list[tuple[int, float]] = []
        for w in self.state.plan.workers:
            key = proto.loss_key(gen, step, w)
            if self._store_has(key):
                pieces.extend((int(m), float(v)) for m, v in json.loads(self.store.get(key)))
                self.store.delete_key(key)
        # sum in global micro-batch order: the same grouping whatever the plan
        return math.fsum(v for _, v in sorted(pieces))

    def _abort_drain(self) -> bool:
        """The step in flight did not commit in time after a stop was asked: abort it.

        Returns:
            True (the loop ends; the committed state is checkpointed by ``_finish``).
        """
        s = self.state
        self.store.set(proto.verdict_key(s.gen, s.next_step), proto.ABORT)
        self.log(f"the step in flight ({s.next_step}) did not finish in time: aborted")
        return True

    # ------------------------------------------------------------------ failures
    def _fence(self, workers: frozenset[int]) -> None:
        """A hung worker must never come back into this run: kill local ones."""
        for w in workers:
            proc = self.procs[w].process if w in self.procs else None
            if proc is not None and proc.exitcode is None and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            p = self.procs.get(w)
            if p is not None:
                with contextlib.suppress(Exception):
                    self.store.delete_key(proto.heartbeat_key(w, p.incarnation))

    def _on_deaths(self, dead: dict[int, str]) -> None:
        s = self.state
        failed = frozenset(dead) & s.alive
        for w in failed:
            if not dead[w].startswith(("exit", "error")):
                # silent (stopped, cut off) or stuck, not gone: its peers' group set-up
                # may retry for five deadlines; nobody waits for them (_on_unexplained)
                for info in self.gen_info.values():
                    if w in info["world"]:
                        info["silent_member"] = True
        detected = self.now()
        new, broken = st.workers_died(s, failed)
        self._fence(failed)
        fault_at = self._fault_time(failed)
        event = Event(workers=sorted(failed), cause="; ".join(
            f"w{w}: {dead[w]}" for w in sorted(failed)), gen=s.gen, step=s.next_step,
            fault_at_s=fault_at, detected_at_s=detected,
            detected_after_s=None if fault_at is None else detected - fault_at)
        self.events.append(event)
        if not broken:
            self.state = new
            event.idle, event.strategy = True, "none"
            event.reason = "only idle workers died; training went on"
            self.log(f"idle worker(s) {sorted(failed)} died ({event.cause}); training goes on")
            return
        self._abort_generation()
        detect_txt = "" if event.detected_after_s is None else \
            f" {event.detected_after_s:.3f} s after the fault"
        self.log(f"FAILURE at step {s.next_step}: {event.cause}; detected{detect_txt}")
        self.hooks.on_failure(self, event)
        self.state = new
        if new.phase is st.Phase.DRAINING:
            event.strategy, event.reason = "none", "stopping: the drain ends here"
            self.drain_done = True
            return
        if not new.alive:
            self._restart_everything(event)
            return
        self._recover(event)

    def _recover(self, event: Event) -> None:
        s = self.state
        decision, decide_s = self._decision()
        event.decide_s = decide_s
        event.strategy = str(decision.strategy)
        event.reason = decision.reason
        event.decision = decision.to_dict()
        if decision.plan is None:
            self._fail(f"no recovery possible: {decision.reason}")
            return
        self._log_decision(decision)
        rec = self._recovery_of(decision)
        if rec.strategy == "restart":
            assert rec.restored_step is not None
            event.lost_steps = s.next_step - rec.restored_step
            for step in range(rec.restored_step, s.next_step):
                self.steps.pop(step, None)
        try:
            self.state = st.recovered(s, rec)
        except ValueError as exc:
            self._fail(f"the policy's plan is unusable: {exc}")
            return
        self._after_new_gen()

    def _restart_everything(self, event: Event) -> None:
        """No worker is left: relaunch every worker launched here, wait for them (and for
        remote replacements) to be up, and reload the last checkpoint on the initial plan:
        the job's own restart, without leaving the coordinator.

        Raises:
            WorkerFailure: without ``[train] rejoin``, or when the workers of the initial
                plan are not all back within ``join_timeout_s``.
        """
        if not self.train.rejoin:
            raise WorkerFailure("every worker failed (with [train] rejoin the coordinator "
                                "would relaunch them and reload the last checkpoint)")
        self.log("every worker failed: relaunching them and reloading the last checkpoint")
        local = [w for w in range(self.num_local) if w not in self.state.alive]
        self._launch(local, replacement=True)
        needed = frozenset(self.plan0.workers)
        deadline = time.monotonic() + self.train.join_timeout_s
        while not needed <= self.state.alive:
            self._admit_joins()
            for w, proc in list(self.procs.items()):
                if w in self.state.alive or not proc.replacement or not self._registered(proc):
                    continue
                proc.ready = True
                self.state = st.rejoin_ready(self.state, [w])
                self.store.set(proto.start_gen_key(w, proc.incarnation),
                               str(self.state.gen + 1))
            if any(self.procs[w].process.exitcode is not None for w in local):
                raise WorkerFailure("every worker failed, and a relaunched one died while "
                                    "starting")
            if time.monotonic() > deadline:
                missing = sorted(needed - self.state.alive)
                raise WorkerFailure(f"every worker failed; workers {missing} were not back "
                                    f"within {self.train.join_timeout_s:g} s")
            time.sleep(0.01)
        restored = self.state.latest_checkpoint()
        event.strategy = "restart"
        event.reason = "every worker failed: all relaunched, the last checkpoint reloaded"
        event.lost_steps = self.state.next_step - restored
        for step in range(restored, self.state.next_step):
            self.steps.pop(step, None)
        self.state = st.recovered(self.state, st.Recovery("restart", self.plan0,
                                                          restored_step=restored))
        self._after_new_gen()

    def _recovery_of(self, decision: DecisionLike) -> st.Recovery:
        s = self.state
        strategy = str(decision.strategy)
        plan = decision.plan
        assert plan is not None
        if strategy == "restart":
            return st.Recovery("restart", plan, restored_step=s.latest_checkpoint())
        chosen = getattr(decision, "chosen", None)
        interim = getattr(chosen, "interim_plan", None)
        if strategy == "reroute-then-dynamic" and interim is not None:
            after = 1
            if chosen.interim_step_s and chosen.interim_s:
                after = max(1, math.ceil(chosen.interim_s / chosen.interim_step_s))
            return st.Recovery(strategy, plan, migration=decision.migration, interim=interim,
                               switch_after=after)
        return st.Recovery(strategy, plan, migration=decision.migration)

    def _abort_generation(self) -> None:
        """Abort the step in flight (its verdict) and the running generation (its abort key,
        which releases workers blocked in its collectives at once)."""
        s = self.state
        self.store.set(proto.verdict_key(s.gen, s.next_step), proto.ABORT)
        self.store.set(proto.abort_key(s.gen), "1")

    def _after_new_gen(self) -> None:
        """Drop checkpoint assemblies of abandoned timelines, then publish."""
        with self.lock:
            for key in [k for k in self.assemblies if k[1] < self.state.epoch]:
                self.ckpt.discard(self.assemblies.pop(key))
        self._publish()

    def _fail(self, reason: str) -> None:
        self.state = st.stopped(self.state, reason)
        raise WorkerFailure(reason)

    def _absent(self) -> list[int]:
        """Members of the generation that never joined its groups (no rendezvous key)."""
        info = self.gen_info.get(self.state.gen)
        if info is None:
            return []
        world = info["world"]
        return [w for rank, w in enumerate(world)
                if not self._store_has(f"gen{self.state.gen}/world//0/{rank}")]

    def _setup_gen(self, w: int) -> int | None:
        """The generation whose groups worker ``w`` last began to build (None: none yet)."""
        key = proto.setup_key(w, self.procs[w].incarnation)
        try:
            return int(self.store.get(key)) if self._store_has(key) else None
        except (RuntimeError, ValueError):
            return None

    def _on_unexplained(self) -> bool:
        """Errors that no death explains: redo the generation, boundedly.

        A member that never joined the generation's groups while the others gave up on it
        is alive (its heartbeat beats) but inside the group set-up of an older generation,
        which gloo cannot interrupt. When that generation lost members only to process
        exits, its set-up ends within a deadline: the member is waited for (it then joins
        the generation that replaces this one). Past that, or when a member of that
        generation went silent (gloo then retries for five deadlines), the member is stuck
        for this run and is declared failed.

        Returns:
            False when it only waits for such members (nothing was done).
        """
        absent = self._absent()
        if absent and len(absent) < len(self.state.world):
            waiting = members_in_older_setup(
                {w: self._setup_gen(w) for w in absent}, self.state.gen,
                {g: (i["published_s"], i["collective_s"]) for g, i in self.gen_info.items()
                 if not i.get("silent_member")},
                self.now(), slack_s=self.hang_s)
            if waiting:
                new = sorted(set(waiting) - self.setup_waits_logged)
                if new:
                    self.setup_waits_logged.update(new)
                    self.log(f"generation {self.state.gen}: worker(s) {new} still inside an "
                             "older generation's group set-up (gloo's set-up cannot be "
                             "interrupted); waiting for it to end, at most "
                             f"{max(waiting[w] for w in new) - self.now():.1f} s more")
                self.unexplained_recheck = time.monotonic() + self.train.heartbeat_s
                return False
            self._on_deaths({w: f"did not join generation {self.state.gen}'s groups within "
                                "the deadline" for w in absent})
            return True
        s = self.state
        gen = s.gen
        self._abort_generation()
        action = st.retry_action(s, self.train.max_retries)
        summary = "; ".join(dict.fromkeys(self.messages))[:300]
        if action is st.RetryAction.RETRY:
            self.log(f"generation {gen}: errors no death explains ({summary}); rebuilding the "
                     f"groups and redoing step {s.next_step} (retry {s.retries + 1} of "
                     f"{self.train.max_retries})")
            self.state = st.retried(s)
        elif action is st.RetryAction.RESTART:
            plan = s.state_plan if set(s.state_plan.workers) <= s.alive else s.plan
            restored = s.latest_checkpoint()
            self.log(f"generation {gen}: errors persist after {s.retries} retries ({summary}); "
                     f"restarting from the checkpoint after {restored} steps")
            for step in range(restored, s.next_step):
                self.steps.pop(step, None)
            self.state = st.escalated(s, plan, restored)
        else:
            self._fail(f"errors persist after {self.train.max_retries} retries and a restart: "
                       f"{summary}")
        self._after_new_gen()
        return True

    def _decision(self) -> tuple[DecisionLike, float]:
        """Ask the policy, starting from the placement the workers' state really has.

        Returns:
            The decision and the seconds it took.
        """
        s = self.state
        base, newly, usable = st.decision_inputs(s)
        t = time.monotonic()
        if not newly:
            # the placement is intact (only a migration source or the interim plan's
            # extra workers died): train on it again
            return ManualDecision("keep", base, reason="the state's placement is intact"), 0.0
        since_ckpt = self.now() - self.checkpoint_times.get(s.latest_checkpoint(), 0.0)
        decision = self._decide_fn()(base, newly, usable, self.now(), since_ckpt)
        if s.from_checkpoint and str(decision.strategy) != "restart":
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
        self.log(f"decision: {decision.strategy} ({decision.reason})")
        for c in doc.get("candidates") or []:
            if isinstance(c, dict):
                step, tr = c.get("step_s"), c.get("transition_s")
                ok = "" if c.get("feasible", True) else " (infeasible)"
                self.log(f"  candidate {c.get('strategy')}: step "
                         f"{step if step is None else round(step, 4)} s, transition "
                         f"{tr if tr is None else round(tr, 3)} s{ok}")
        if decision.plan is not None:
            for line in decision.plan.describe().splitlines():
                self.log(f"  {line}")

    # ------------------------------------------------------------------ switches, rejoins
    def _switch(self) -> None:
        """The pending plan change happens at this boundary: migrate, then train on it."""
        s = self.state
        assert s.pending is not None
        pending = s.pending
        self.state = st.switched(s)
        self.log(f"switching plans after step {s.next_step - 1} "
                 f"({len(pending.migration.transfers) if pending.migration else 0} transfers)")
        for line in pending.plan.describe().splitlines():
            self.log(f"  {line}")
        self._after_new_gen()

    def _watch_replacements(self) -> None:
        """Admit replacements that came up as idle workers; relaunch dead local workers
        (repair, ``[train] rejoin``) once training runs again."""
        for w, p in list(self.procs.items()):
            if not p.replacement or p.ready or w in self.state.alive:
                continue
            if p.process is not None and p.process.exitcode is not None:
                continue  # died while starting: relaunched below
            if self._registered(p):
                p.ready = True
                self.state = st.rejoin_ready(self.state, [w])
                self.store.set(proto.start_gen_key(w, p.incarnation), str(self.state.gen + 1))
                self.log(f"worker {w} (repaired) is up; idle until a plan uses it")
        if not self.train.rejoin or self.state.phase is not st.Phase.TRAINING:
            return
        if self.trace is not None:
            return  # a replayed trace brings workers back with its repair rows
        if any(e.resumed_at_s is None and not e.idle for e in self.events):
            return  # relaunch only once training runs again
        for w in range(self.num_local):
            p = self.procs[w]
            if w in self.state.alive or p.process is None or p.process.exitcode is None:
                continue
            failed_starts = self.failed_starts.get(w, 0)
            if p.replacement and not p.ready:
                failed_starts += 1
                self.failed_starts[w] = failed_starts
            if failed_starts >= MAX_FAILED_STARTS:
                if failed_starts == MAX_FAILED_STARTS:
                    self.failed_starts[w] += 1
                    self.log(f"worker {w}: {MAX_FAILED_STARTS} replacements died before they "
                             "were up; no more repairs of this worker")
                continue
            self._launch([w], replacement=True)
            self.log(f"relaunched worker {w} (repair); it rejoins when ready")

    def _maybe_rejoin(self) -> None:
        """Ask the policy whether idle workers should be folded in (once per state)."""
        s = self.state
        if s.pending is not None or not s.idle or s.phase is not st.Phase.TRAINING:
            return
        asked = (s.plan, s.idle)
        if self.rejoin_asked == asked:
            return  # the same question gets the same answer
        self.rejoin_asked = asked
        rejoin = getattr(self._decide_fn(), "rejoin", None)
        if rejoin is None:
            return
        try:
            decision = rejoin(s.plan, s.idle, s.alive, self.now())
        except ValueError as exc:
            self.log(f"rejoin of {sorted(s.idle)} not possible: {exc}")
            return
        uses = s.idle & frozenset(decision.plan.workers) if decision.plan is not None \
            else frozenset()
        strategy = str(decision.strategy)
        if strategy != "keep" and not uses:
            # a plan that leaves every idle worker idle is no re-join: switching to it
            # would only cost a generation
            strategy = "keep"
        record = {"workers": sorted(s.idle), "step": s.next_step, "strategy": strategy,
                  "reason": decision.reason}
        self.rejoins.append(record)
        self.log(f"idle worker(s) {sorted(s.idle)}: {strategy} ({decision.reason})")
        if strategy == "keep" or decision.plan is None:
            return
        try:
            self.state = st.rejoin_planned(s, decision.plan, decision.migration, s.idle)
        except ValueError as exc:
            self.log(f"rejoin plan unusable: {exc}")

    # ------------------------------------------------------------------ bulk state
    def _on_blob(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        """Answer a bulk request (on a server thread)."""
        try:
            op, kind = str(header["op"]), str(header["kind"])
            layer = int(header["layer"])
        except (KeyError, TypeError, ValueError):
            raise BlobError("malformed request") from None
        if not 0 <= layer < self.num_layers:
            raise BlobError(f"layer {layer} does not exist")
        if op == "put" and kind == "checkpoint":
            step, gen = int(header["step"]), int(header["gen"])
            if gen < self.state.epoch:
                raise BlobError(f"checkpoint upload from generation {gen}, before the last "
                                f"restart (generation {self.state.epoch}): refused")
            with self.lock:
                key = (step, gen)
                if key not in self.assemblies:
                    self.assemblies[key] = self.ckpt.begin(step, gen, self.num_layers)
                assembly = self.assemblies[key]
            if assembly.add(layer, payload):
                self.completed.put(key)
            return {}, b""
        if op == "put" and kind == "final":
            with self.lock:
                if int(header["gen"]) != self.final_gen:
                    raise BlobError("final upload for another generation")
                self.finals.setdefault(layer, payload)
            return {}, b""
        if op == "get" and kind == "restore":
            try:
                manifest = self.ckpt.manifest(int(header["step"]))
                return {}, manifest.read_layer(layer)
            except CheckpointError as exc:
                raise BlobError(str(exc)) from None
        raise BlobError(f"unknown request {op} {kind}")

    def _checkpoint_meta(self) -> dict[str, Any]:
        return {"config": self.digest, "job": self.job_name, "dtype": self.train.dtype,
                "num_layers": self.num_layers}

    def _collect_checkpoints(self) -> None:
        while True:
            try:
                step, gen = self.completed.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                assembly = self.assemblies.pop((step, gen), None)
            if assembly is None:
                continue
            self.state, accepted = st.checkpoint_complete(self.state, step, gen)
            if not accepted:
                self.ckpt.discard(assembly)
                continue
            manifest = self.ckpt.commit(assembly, plan=self.state.state_plan.to_dict(),
                                        meta=self._checkpoint_meta())
            self.checkpoint_times[step] = self.now()
            if self.now() - self.checkpoint_logged_s >= CHECKPOINT_LOG_S:
                self.checkpoint_logged_s = self.now()
                self.log(f"checkpoint after {step} steps written to {manifest.folder}")

    # ------------------------------------------------------------------ the end
    def _finish(self) -> dict[str, Any]:
        s = self.state
        interrupted = s.phase is st.Phase.DRAINING and not self.trace_ended
        self.state = st.finished(s)
        self._publish_stop()
        for event in self.events:  # an event whose recovery never committed a step
            if event.resumed_at_s is None and not event.idle and not event.strategy:
                event.strategy = "none"
        layers = self._gather_finals()
        step = self.state.next_step
        self._collect_checkpoints()
        if step not in self.ckpt.steps():
            assembly = self.ckpt.begin(step, self.state.gen, self.num_layers)
            for i, data in layers.items():
                assembly.add(i, data)
            manifest = self.ckpt.commit(assembly, plan=self.state.state_plan.to_dict(),
                                        meta=self._checkpoint_meta())
            self.log(f"checkpoint after {step} steps written to {manifest.folder}")
        params: dict[str, torch.Tensor] = {}
        for i, data in sorted(layers.items()):
            try:
                module_state = unpack(data)["module"]
            except (PackError, KeyError, TypeError) as exc:
                raise WorkerFailure(f"layer {i}: the final state does not decode: {exc}") from None
            for name, tensor in module_state.items():
                params[param_name(i, name)] = tensor
        self._wait_exits()
        self._finish_transitions()
        digest = param_hash(params)
        _save_atomic(params, self.out_dir / "params.pt")
        if export_model(self.model, params, self.out_dir):
            self.log(f"model exported in its own format under {self.out_dir}")
        steps = [self.steps[k] for k in sorted(self.steps)]
        report = {
            "steps": [{"step": r.step, "loss": r.loss, "step_s": r.step_s, "gen": r.gen}
                      for r in steps],
            "loss": [r.loss for r in steps],
            "step_s": [r.step_s for r in steps],
            "events": [e.to_dict() for e in self.events],
            "rejoins": self.rejoins,
            "refused": self.refused,
            "faults": self.fault_report(),
            "param_hash": digest,
            "initial_plan": self.plan0.to_dict(),
            "final_plan": self.state.plan.to_dict(),
            "dtype": self.train.dtype,
            "num_workers": self.num_workers,
            "total_s": self.now(),
            "run_dir": str(self.out_dir),
            "resumed_from_step": None if self.resumed_from is None else self.resumed_from.step,
            "committed_steps": step,
            "interrupted": None if not interrupted else self.state.reason,
            "checkpoints": self.ckpt.steps(),
        }
        if self.trace is not None:
            report.update(self.trace.report([r.committed_at_s for r in steps],
                                            self.config.job.global_batch))
        self.params = params
        _write_atomic_text(self.out_dir / "report.json", json.dumps(report, indent=2))
        # per-op compute times (calibration input for the profiler), kept apart: large
        _write_atomic_text(self.out_dir / "op_times.json", json.dumps(self.op_times))
        self._write_metrics(steps)
        try:
            from chameleon_ft.runtime.report.plots import write_report_png

            write_report_png(report, self.out_dir / "report.png")
        except Exception as exc:  # a plot must never lose a finished run
            self.log(f"report.png not written: {exc}")
        return report

    def _gather_finals(self) -> dict[int, bytes]:
        """Wait (bounded) for one holder of every layer to upload its state."""
        deadline = time.monotonic() + max(10.0, 5 * self.hang_s)
        while True:
            with self.lock:
                have = dict(self.finals)
            missing = [i for i in range(self.num_layers) if i not in have]
            if not missing:
                return have
            gone = [i for i in missing if all(
                self.procs[w].process is not None and self.procs[w].process.exitcode
                not in (None, 0) for w in self.final_holders[i])]
            if gone or time.monotonic() > deadline:
                raise WorkerFailure(f"layers {missing}: no holder uploaded its final state "
                                    f"(holders {[self.final_holders[i] for i in missing]})")
            time.sleep(_POLL_S)

    def _wait_exits(self) -> None:
        """Workers exit once they uploaded; a death after the last commit is reported."""
        leave_by = time.monotonic() + max(5.0, 2 * self.hang_s)
        for w in sorted(self.state.alive):
            proc = self.procs[w].process
            if proc is not None:
                proc.join(max(0.0, leave_by - time.monotonic()))
        for w in sorted(self.state.alive):
            proc = self.procs[w].process
            if proc is not None and proc.exitcode not in (None, 0):
                fault_at = self._fault_time(frozenset({w}))
                now = self.now()
                self.events.append(Event(
                    workers=[w], cause=f"w{w}: exit (status {proc.exitcode}) after the last "
                    "step committed", gen=self.state.gen, step=self.state.next_step,
                    fault_at_s=fault_at, detected_at_s=now,
                    detected_after_s=None if fault_at is None else now - fault_at,
                    strategy="none", reason="training had finished; its replicas supplied "
                    "the final parameters"))
                self.log(f"worker {w} died after the last step; its replicas supplied the "
                         "final parameters")

    def _finish_transitions(self) -> None:
        measure_transitions(self.events, self.commits)

    def _write_metrics(self, steps: list[StepRecord]) -> None:
        """``metrics.jsonl``: one line per committed step (appended across resumes)."""
        tokens = self.config.job.global_batch * max(1, self.config.seq_len)
        lines = [json.dumps({"step": r.step, "loss": r.loss, "step_s": r.step_s,
                             "tokens_per_s": tokens / r.step_s if r.step_s > 0 else None,
                             "gen": r.gen, "plan_workers": r.num_workers})
                 for r in steps]
        path = self.out_dir / "metrics.jsonl"
        old = path.read_text() if path.exists() and self.resumed_from is not None else ""
        keep = [ln for ln in old.splitlines()
                if ln and json.loads(ln)["step"] < self.start_step]
        _write_atomic_text(path, "".join(f"{ln}\n" for ln in keep + lines))


def members_in_older_setup(setup_gens: dict[int, int | None], gen: int,
                           generations: dict[int, tuple[float, float]], now: float, *,
                           slack_s: float) -> dict[int, float]:
    """Absent members that may still come out of an older generation's group set-up.

    Args:
        setup_gens: each absent member's last generation whose groups it began to build
            (None: it never began any).
        gen: the current generation.
        generations: ``(published at, collective deadline)`` of the generations whose
            set-up ends within its deadlines (those that lost no member to silence).
        now: the current time (the clock of ``published at``).
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
        if now < until:
            waiting[w] = until
    return waiting


def measure_transitions(events: list[Event], commits: list[StepRecord]) -> None:
    """Set each event's transition: fault to first commit after it, minus the new plan's step.

    ``commits`` is every commit in time order, steps that a later restart redid included:
    the first commit after an event ends its recovery even if a restart threw it away.
    """
    times = [r.committed_at_s for r in commits]
    for event in events:
        if event.idle:
            continue
        i = bisect.bisect_right(times, event.detected_at_s)
        if i == len(commits):
            continue
        first = commits[i]
        # generations follow one another in time: the first's later commits are the run
        # that follows it
        end = i + 1
        while end < len(commits) and commits[end].gen == first.gen:
            end += 1
        same_gen = commits[i + 1:end]
        own_s = statistics.median(r.step_s for r in same_gen) if same_gen else first.step_s
        event.resumed_at_s = first.committed_at_s
        start = event.fault_at_s if event.fault_at_s is not None else event.detected_at_s
        event.transition_s = first.committed_at_s - start - own_s


def _write_atomic_text(path: Path, text: str) -> None:
    from chameleon_ft.runtime.storage.checkpoint import write_atomic

    write_atomic(path, text.encode())


def _save_atomic(params: dict[str, torch.Tensor], path: Path) -> None:
    import io

    buf = io.BytesIO()
    torch.save(params, buf)
    _write_atomic_text_bytes(path, buf.getvalue())


def _write_atomic_text_bytes(path: Path, data: bytes) -> None:
    from chameleon_ft.runtime.storage.checkpoint import write_atomic

    write_atomic(path, data)


def param_hash(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the parameters' names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
