"""A job prepared for the coordinator: everything checked and built before any process
starts (bad input fails here, in one line naming the field)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from chameleon_ft.plan import ExecutionPlan, initial_plan
from chameleon_ft.profile import Profile, build_profile
from chameleon_ft.runtime import auth
from chameleon_ft.runtime.coordinator import record
from chameleon_ft.runtime.coordinator.resources import check_memory
from chameleon_ft.runtime.deadlines import Deadline
from chameleon_ft.runtime.replay import TraceDriver
from chameleon_ft.runtime.storage.checkpoint import CheckpointStore, Manifest
from chameleon_ft.runtime.workload.bundle import Workload
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.job import RUNTIME_SCHEDULES
from chameleon_ft.spec.recovery import POLICY_NAMES
from chameleon_ft.spec.train import Fault, TrainSpec, check_faults

RUNTIME_POLICIES = ("chameleon", "reroute", "dynamic", "restart", "shrink",
                    "reroute-then-dynamic", "swap")
"""Policies the runtime executes (``recycle`` needs split backwards, a simulator baseline)."""
COLLECTIVE_FLOOR_S = 3.0
"""Smallest collective deadline derived from a plan (gloo's first transfers on a loaded
machine take hundreds of milliseconds)."""
COLLECTIVE_FACTOR = 10.0
"""Derived collective deadline: this many times the plan's estimated step + migration."""


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
class Job:
    """What the coordinator runs: the checked config and everything built from it."""

    config: Config
    workload: Workload
    model: Any
    data: Any
    profile: Profile
    plan0: ExecutionPlan
    policy: str
    faults: list[Fault]
    num_local: int
    host: str
    port: int
    token: str
    token_generated: bool
    announce_token: bool
    secret: bytes
    job_name: str
    job_id: str
    nonce: str
    out_dir: Path
    out_dir_given: bool
    ckpt: CheckpointStore
    digest: str
    trace: TraceDriver | None
    log_every: int | None
    start_step: int = 0
    resumed_from: Manifest | None = None
    notes: list[str] = field(default_factory=list)
    term: int = 0
    """This coordinator's term: one more than the run's previous coordinator's."""
    takeover: bool = False
    """The run did not end: its workers may be alive, waiting for a coordinator; they are
    re-attached (``control.reattach``) before anything is launched."""
    boundaries: list[list[Any]] | None = None
    """The layers' output shapes and dtypes, as the run's record keeps them (None: to
    learn)."""

    @property
    def num_workers(self) -> int:
        """Every worker the run launches or admits: the layout's, then the spare nodes'
        (``[cluster] spare_nodes``, idle until a decision uses them)."""
        return self.config.total_workers

    @property
    def num_layers(self) -> int:
        """Layers of the model."""
        return int(self.model.num_layers)

    @property
    def hang_s(self) -> float:
        """The hang deadline."""
        return self.config.train.hang_s

    @property
    def state_bytes(self) -> float:
        """Bytes of the model's state: every layer's parameters and optimizer state (what a
        checkpoint holds, one copy per layer)."""
        return float(sum(layer.param_bytes + layer.optimizer_bytes
                         for layer in self.profile.layers))

    @property
    def storage(self) -> Deadline:
        """Deadlines of writing and reading checkpoints."""
        return Deadline(self.hang_s, self.config.train.storage_gb_per_s)

    def checkpoint_deadline_s(self) -> float:
        """How long a checkpoint (every layer, written in parallel by the workers) may take."""
        return self.storage.for_bytes(self.state_bytes)

    def drain_grace_s(self) -> float:
        """How long a drain lets the step in flight finish: the scheduler's grace less the
        time the final checkpoint needs (0: abort it at once)."""
        return max(0.0, self.config.train.drain_timeout_s - self.checkpoint_deadline_s())

    def estimate_s(self, plan: ExecutionPlan) -> float:
        """The plan's estimated step."""
        from chameleon_ft.perf import Topology, estimate

        return float(estimate(plan, self.profile, Topology.from_config(self.config)).step_s)

    def collective_deadline(self, plan: ExecutionPlan, migration: Any) -> tuple[float, str | None]:
        """A generation's collective deadline: at least ``COLLECTIVE_FACTOR`` times its
        estimated step plus migration, and at least the configured value; with the log line
        saying so when the plan raised a configured value."""
        est = self.estimate_s(plan) + (float(migration.time_s) if migration is not None
                                       and hasattr(migration, "time_s") else 0.0)
        derived = max(COLLECTIVE_FLOOR_S, COLLECTIVE_FACTOR * est)
        floor = self.config.train.collective_floor_s
        if floor <= 0:
            return derived, None
        if derived > floor:
            return derived, (f"collective timeout raised from {floor:g} s to {derived:.3g} s "
                             f"for a plan estimated at {est:.3g} s per step (with migration)")
        return floor, None


def _checked_config(config: Config, num_local: int | None, policy: str | None,
                    custom_decide: bool) -> tuple[Config, int, str, list[str]]:
    fleet = config.total_workers
    local = fleet if num_local is None else num_local
    if not 0 <= local <= fleet:
        raise ValueError(f"workers: {local} local workers for a fleet of {fleet} "
                         f"({config.num_workers} in the layout, {config.num_spare_workers} "
                         "spares)")
    name = policy or config.policy.name
    if not custom_decide and name not in RUNTIME_POLICIES:
        what = "a simulator baseline" if name in POLICY_NAMES else "an unknown policy"
        raise ValueError(f"--policy: {name!r} is {what}; the runtime runs "
                         f"{', '.join(RUNTIME_POLICIES)}")
    if config.job.schedule not in RUNTIME_SCHEDULES:
        raise ValueError(f"job.schedule: the runtime executes "
                         f"{', '.join(sorted(RUNTIME_SCHEDULES))}; {config.job.schedule!r} "
                         "is priced by the estimator and the simulator only")
    notes = []
    if config.recovery.decoupled_backward:
        # ReCycle's split backward is priced by the simulator; the runtime's planner must
        # not choose plans it cannot execute
        config = replace(config, recovery=replace(config.recovery, decoupled_backward=False))
        notes.append("note: recovery.decoupled_backward is a simulator setting; the runtime "
                     "runs fused backward passes and plans for them")
    config, note = _memory_checkpoints(config)
    notes.extend([note] if note else [])
    if config.job.tp > 1 and config.recovery.memory_checkpoint:
        # copies per shard, each plane's to its own peer, are not built (design 4.11)
        config = replace(config, recovery=replace(config.recovery, memory_checkpoint=False))
        notes.append("note: recovery.memory_checkpoint is off for this run: checkpoints "
                     "in memory are not kept per tensor-parallel shard yet (job.tp > 1)")
    return config, local, name, notes


def _memory_checkpoints(config: Config) -> tuple[Config, str | None]:
    """The runtime copies each checkpoint into peers' memory (``worker/memcopies.py``), at
    the checkpoints' cadence: its planner prices that cadence, or no memory copies at all
    when there are no periodic checkpoints or a single node (no other node to hold them)."""
    rec, every = config.recovery, config.train.checkpoint_every
    if not rec.memory_checkpoint:
        return config, None
    if every <= 0 or config.cluster.total_nodes < 2:
        why = "no periodic checkpoints ([train] checkpoint_every = 0)" if every <= 0 else \
            "a single node (the copies live on another node)"
        return replace(config, recovery=replace(rec, memory_checkpoint=False)), (
            f"note: recovery.memory_checkpoint is off for this run: {why}")
    if rec.memory_checkpoint_every != every:
        return replace(config, recovery=replace(rec, memory_checkpoint_every=every)), (
            f"note: the runtime copies checkpoints into memory as it writes them, every "
            f"{every} steps ([train] checkpoint_every), and plans for that "
            f"(recovery.memory_checkpoint_every {rec.memory_checkpoint_every} is the "
            "simulator's)")
    return config, None


def prepare(config: Config, *, profile: Profile | None = None, custom_decide: bool = False,
            policy: str | None = None, faults: Sequence[Fault] = (),
            out_dir: str | Path | None = None, num_local_workers: int | None = None,
            host: str = "127.0.0.1", port: int = 0, token: str | None = None,
            job_name: str | None = None, resume: bool = False, check_resources: bool = True,
            model: Any = None, data: Any = None, optimizer: Any = None,
            lr_schedule: Any = None, log_every: int | None = None,
            trace: TraceDriver | None = None,
            log: Callable[[str], None] = lambda _line: None) -> Job:
    """Check a job and build what it needs (see :class:`~.shell.Coordinator` for the
    arguments).

    Raises:
        ValueError: for faults naming missing workers, layouts that do not fit, a token
            that is too short or not the resumed run's, a resume without a checkpoint or
            live workers, workers that would not fit the host, a trace it cannot replay.
    """
    workload = Workload(config, model, data, optimizer, lr_schedule)
    built_data = workload.data(built_model := workload.model())
    workload.optimizer()  # a bad optimizer is refused before anything starts
    workload.lr_schedule()
    _check_tensor_parallel(config, built_model)
    config, num_local, policy_name, notes = _checked_config(config, num_local_workers,
                                                            policy, custom_decide)
    prof = profile if profile is not None else build_profile(config, runtime=True)
    check_faults(tuple(faults), config.total_workers, config.train.steps)
    plan0 = initial_plan(config, prof)
    if prof.num_layers != built_model.num_layers:
        raise ValueError(f"profile: {prof.num_layers} layers, the model has "
                         f"{built_model.num_layers}; make them agree ([profile] or the model)")
    if log_every is not None and log_every < 1:
        raise ValueError(f"--log-every: must be >= 1, got {log_every}")
    remote_possible = num_local < config.total_workers or not auth.is_loopback(host)
    run_dir = Path(out_dir) if out_dir is not None else default_run_dir()
    earlier, token, port = _earlier_run(run_dir, digest := config_digest(config, workload),
                                        host, port, token, config.train if resume else None)
    secret_token = _token(token)
    job = Job(config=config, workload=workload, model=built_model, data=built_data,
              profile=prof, plan0=plan0, policy=policy_name, faults=list(faults),
              num_local=num_local, host=host, port=port, token=secret_token,
              token_generated=token is None,
              announce_token=remote_possible and token is None,
              secret=auth.secret_of(secret_token),
              job_name=job_name or (config.model.name if config.model is not None
                                    else "") or "chameleon",
              job_id=auth.new_nonce(), nonce=auth.new_nonce(), out_dir=run_dir,
              out_dir_given=out_dir is not None,
              ckpt=CheckpointStore(run_dir, config.train.keep_checkpoints),
              digest=digest, trace=trace, log_every=log_every, notes=notes)
    _continue(job, earlier)
    _prepare_checkpoints(job, resume)
    if trace is not None:
        trace.check_job(num_nodes=config.cluster.total_nodes,
                        workers_per_node=config.workers_per_node,
                        num_workers=config.total_workers, num_local=num_local, resume=resume)
    _check_collective_timeout(job)
    for line in check_memory(config, plan0, prof, num_local, build_layer=built_model.build_layer
                             ) if check_resources else ():
        log(line)
    return job


def _check_tensor_parallel(config: Config, model: Any) -> None:
    """A worker of ``[job] tp = k`` is k processes that shard its layers (design 4.11):
    the model must have a tensor-parallel plan that ``k`` divides.

    Raises:
        ValueError: one line naming ``job.tp``.
    """
    if config.job.tp == 1:
        return
    from chameleon_ft.runtime.workload.tp_check import check_tensor_parallel

    check_tensor_parallel(model, config.job.tp, config.seq_len)


def _token(token: str | None) -> str:
    out = token or auth.new_token()
    if len(out) < auth.MIN_TOKEN_CHARS:
        raise ValueError(f"--token: at least {auth.MIN_TOKEN_CHARS} characters")
    return out


def _prepare_checkpoints(job: Job, resume: bool) -> None:
    """Resume from the newest checkpoint, or start from step 0 with an earlier run's
    checkpoints moved out of the way (design 4.4)."""
    if resume:
        _prepare_resume(job)
        return
    earlier = job.ckpt.set_aside_earlier()
    if earlier is not None:
        job.notes.append(f"note: {job.out_dir}/checkpoints held an earlier run's checkpoints; "
                         f"moved to {earlier} (this run starts from step 0; --resume "
                         "continues a run instead)")


def _continue(job: Job, earlier: record.RunRecord | None) -> None:
    """The same run, one more coordinator: its job id, the next term; its workers are
    taken over unless the run ended (or they leave with their coordinator: no grace)."""
    if earlier is None:
        return
    job.job_id, job.term, job.boundaries = earlier.job_id, earlier.term + 1, earlier.boundaries
    job.takeover = not earlier.ended and job.config.train.coordinator_grace_s > 0


def _earlier_run(run_dir: Path, digest: str, host: str, port: int, token: str | None,
                 resume: TrainSpec | None) -> tuple[record.RunRecord | None, str | None, int]:
    """The record of the run being resumed (None: none; ``resume``: the job's ``[train]``
    when resuming), checked against what this coordinator was given (its workers, when
    they may still wait, look for the next coordinator at the run's address, and prove
    they know its token), with the token and port to use.

    Raises:
        ValueError: for another token, address or model than the run's.
    """
    earlier = record.read(run_dir) if resume else None
    if earlier is None or resume is None:
        return None, token, port
    waiting = not earlier.ended and resume.coordinator_grace_s > 0
    if earlier.digest != digest:
        raise ValueError(f"--resume: the run in {run_dir} trains another model or numerics "
                         "(model, dtype, seed, batch, optimizer); use the config it was "
                         "started with")
    if token is not None and token != earlier.token:
        raise ValueError(f"--token: the run in {run_dir} was started with another token; "
                         f"give the same one, or none (its folder keeps it)")
    if waiting and host != earlier.host:
        raise ValueError(f"--host: the run in {run_dir} listens on {earlier.host}, where its "
                         f"workers look for the next coordinator; give --host {earlier.host}")
    if waiting and port not in (0, earlier.port):
        raise ValueError(f"--port: the run in {run_dir} listens on port {earlier.port}, where "
                         f"its workers look for the next coordinator; give --port "
                         f"{earlier.port} or leave it out")
    return earlier, earlier.token, earlier.port if waiting else port


def _prepare_resume(job: Job) -> None:
    manifest = job.ckpt.latest()
    if manifest is None and job.takeover:
        job.notes.append(f"note: {job.out_dir}/checkpoints holds no complete checkpoint: "
                         "the run goes on only if its workers are still alive")
        return
    if manifest is None:
        raise ValueError(f"--resume: no complete checkpoint in {job.out_dir}/checkpoints; "
                         "run without --resume to start from step 0")
    if manifest.meta.get("config") != job.digest:
        raise ValueError(f"--resume: the checkpoint in {manifest.folder} was written by a "
                         "job with another model or numerics (model, dtype, seed, batch, "
                         "optimizer); use the config it was trained with")
    if manifest.num_layers != job.num_layers:
        raise ValueError(f"--resume: the checkpoint has {manifest.num_layers} layers, the "
                         f"model {job.num_layers}")
    if manifest.step >= job.config.train.steps and not job.takeover:
        raise ValueError(f"--resume: the checkpoint already holds {manifest.step} steps; "
                         f"ask for more with --steps (now {job.config.train.steps})")
    job.start_step = manifest.step
    job.resumed_from = manifest


def _check_collective_timeout(job: Job) -> None:
    floor = job.config.train.collective_floor_s
    if floor <= 0:
        return
    step_s = job.estimate_s(job.plan0)
    if floor < 2 * step_s:
        raise ValueError(f"train.collective_timeout_s: {floor:g} s is less than twice the "
                         f"plan's estimated step ({step_s:.3g} s): healthy workers would "
                         "time out waiting for each other; raise it or leave it at 0 "
                         "(derived from the plan)")
