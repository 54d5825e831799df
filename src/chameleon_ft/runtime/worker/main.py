"""A training worker: runs its stage of the plan, generation after generation.

The worker loop (docs/design.md section 4):

1. read the directive of generation ``g`` (plan, schedule, migration, what to load, the
   generation's collective deadline, the incarnation of every member);
2. build the generation's process groups (``worker.groups``): two over every member for
   point-to-point sends (one per direction), one per gradient bucket;
3. receive migrated layers (``worker.migration``) or reload a checkpoint;
4. run steps (``worker.executor``): the step program (``runtime.traffic``: the schedule's
   forward/backward actions with their receives and sends, built once), the gradient
   all-reduce rounds, then report "reduced" and wait for the coordinator's verdict; apply
   the optimizer only on ``commit``;
5. on any communication error: report it, break every connection of the generation (so
   peers blocked on this worker fail at once instead of waiting for the timeout), and go
   to step 1 with the next generation. The old generation's groups are destroyed.

Beside training, ``worker.liveness`` runs the heartbeat, the watchdog of the coordinator
and the watcher of abort keys. Every value read from or written to the store goes through
the job's seal (``worker.channel``). At ``[job] tp = k`` (design 4.11) this loop runs in
each of the worker's k processes on its plane, with its shards (``worker.layers``); rank 0
alone speaks for the worker to the coordinator.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.control.checkpoints import writer_of
from chameleon_ft.runtime.deadlines import Deadline
from chameleon_ft.runtime.placement import Place
from chameleon_ft.runtime.step_sync import extra_groups
from chameleon_ft.runtime.storage.blobs import BlobClient
from chameleon_ft.runtime.traffic import Instruction, actions_of, peers_of, step_program
from chameleon_ft.runtime.worker import groups, reattach
from chameleon_ft.runtime.worker.channel import Channel, GenerationOver, Shared, read_job
from chameleon_ft.runtime.worker.checkpoints import (
    CheckpointIO,
    CorruptCheckpoint,
    shared_folder,
    wait_final,
)
from chameleon_ft.runtime.worker.comm import Comm, CommError, comm_failure
from chameleon_ft.runtime.worker.device import DeviceWatch, StepTimer
from chameleon_ft.runtime.worker.device import memory as device_memory
from chameleon_ft.runtime.worker.executor import StepResult, StepRun
from chameleon_ft.runtime.worker.faults import Faults
from chameleon_ft.runtime.worker.gradients import Reduced, reduce_step
from chameleon_ft.runtime.worker.layers import Layers
from chameleon_ft.runtime.worker.link import Link
from chameleon_ft.runtime.worker.liveness import (
    EXIT_FENCED,
    Liveness,
    client,
    exit_now,
)
from chameleon_ft.runtime.worker.memcopies import MemoryCopies, peer_of
from chameleon_ft.runtime.worker.memory import peak_resident_bytes, reset_peak, resident_bytes
from chameleon_ft.runtime.worker.migration import Migration
from chameleon_ft.runtime.worker.slowdown import Probe, Slowdown, between, probe_inputs, prober
from chameleon_ft.runtime.worker.unit import UnitWatch
from chameleon_ft.runtime.workload.bundle import Workload, open_workload
from chameleon_ft.runtime.workload.models import StageModel, tied_copies
from chameleon_ft.runtime.workload.optim import LayerTrainState
from chameleon_ft.runtime.workload.precision import Precision
from chameleon_ft.spec.train import ActivationCheckpointing

# kept importable from here (harnesses and the profiler build groups the same way)
make_group = groups.make_group
break_connections = groups.break_connections
__all__ = ["GenerationOver", "Worker", "break_connections", "make_group"]

_log = logging.getLogger(__name__)


class Worker:
    """One training process: its layers, optimizer state and the generation loop."""

    def __init__(self, worker_id: int, host: str, port: int, *, address: str,
                 incarnation: str, secret: bytes, connect_timeout_s: float = 30.0,
                 replacement: bool = False, place: Place | None = None,
                 tp_rank: int = 0, unit: UnitWatch | None = None) -> None:
        """Connect to the coordinator's store and read the job.

        Args:
            worker_id: this worker's id (its place in every plan).
            host: the coordinator's store host.
            port: the store port.
            address: the address other workers reach this one at.
            incarnation: the nonce the coordinator gave this process with its id.
            secret: the job secret that authenticates bulk transfers.
            connect_timeout_s: deadline of connecting and reading the job.
            replacement: a repaired worker rejoining a running job under a dead one's id.
            place: where this worker sits on its host, which picks its GPU
                (default: the first worker of a task running one).
            tp_rank: this process's rank in its worker (``[job] tp > 1``, design 4.11):
                rank 0 is the worker in the control plane.
            unit: the watch over the worker's other processes (``tp > 1``).
        """
        self.rss_base_bytes = resident_bytes()
        """Resident memory once this worker is set up (before it builds its stage), the
        peak counted from there; where the peak cannot be reset, when it started."""
        self.id, self.incarnation, self.replacement = worker_id, incarnation, replacement
        self.host, self.port, self.address, self.secret = host, port, address, secret
        self.tp_rank, self.unit = tp_rank, unit
        self._connect(secret, connect_timeout_s, place or Place(0))
        self._open_workload()
        self.micro_batch = self.job.micro_batch
        self.loss_count = self.job.global_batch * self.job.targets_per_sample
        """The loss normaliser: target elements in the whole step."""
        self._nothing_held()
        self.stage = StageModel(checkpointing=self.checkpointing)
        self.runner: torch.nn.Module = self.stage
        """What a step computes: the stage, behind ``TensorParallelStage`` at tp > 1."""
        # injected faults fire in the worker's control-plane process (rank 0) only
        self.faults = Faults(self.chan, self.id, incarnation, stall=self.watch.stall,
                             active=tp_rank == 0)
        self.slowdown = Slowdown(self.faults)
        """An injected fail-slow, if one runs (``worker.slowdown``)."""
        self.current: groups.Generation | None = None
        self.gen_changed = threading.Condition()
        self._warm_up_kernels()
        self.probe = Probe(functools.partial(probe_inputs, self), self.device)
        """What this worker times while a slow worker out of the plan."""
        if reset_peak():  # what training adds is measured from here
            self.rss_base_bytes = resident_bytes()

    def _nothing_held(self) -> None:
        """What this worker holds and has read: nothing yet."""
        self.layers: dict[int, LayerTrainState] = {}
        """The layers of this worker's current stage (trained and updated)."""
        self.held: dict[int, LayerTrainState] = {}
        """Every layer whose state this worker holds, valid after ``held_steps`` committed
        steps: the stage's layers plus, until the next commit, the previous stage's (a
        generation that fails before committing leaves the older placement intact, and the
        coordinator plans the next recovery from it)."""
        self.held_steps = 0
        self.held_gen, self.held_plan = -1, None
        """The generation whose commit or load made ``held``, and its plan (a dict)."""
        self.voted: tuple[int, int] | None = None
        """``(gen, step)`` reduced and voted for, its verdict not read yet (its gradients
        are kept: a coordinator that takes the run over may say it committed)."""
        self.directive_gen, self.members, self.plan_doc = -1, {}, None
        """The newest directive read: its generation, incarnations and plan."""
        self.again: Any = None
        """Called before each slice of the wait for a directive (a re-attach report)."""
        self.reserved_gen: int | None = None
        """The generation whose checkpoint memory was reserved (at its first commit)."""
        self.pending_optimizer_s: list[float] = []
        """Seconds of the last optimizer step, once read off the device (reported with
        the next step's timings)."""
        self.last_commit_wait_s: float | None = None
        """Seconds from reporting "reduced" to reading the verdict, last step."""

    def _open_workload(self) -> None:
        """The model, data, optimizer and numerics of the job (the data checked against
        the coordinator's)."""
        self.precision = Precision.of(self.job.dtype)
        self.dtype, self.loss_dtype = self.precision.compute, self.precision.master
        self.checkpointing = (self.work.config.train.activation_checkpointing
                              == ActivationCheckpointing.FULL)
        self.model, self.data = self.work.model(), self.work.data()
        self.copies = set(tied_copies(self.model))
        """Runtime names of the tied copies (their originals count in the norm)."""
        self.opt_factory, self.lr_schedule = self.work.optimizer(), self.work.lr_schedule()
        self.tp = self.job.tp
        self.make = Layers(self.model, self.precision, self.device, self.opt_factory,
                           self.lr_schedule, (self.tp_rank, self.tp) if self.tp > 1 else None)
        """How this process builds, loads and packs its layers (its shards at tp > 1)."""
        digest = self.work.data_digest(self.data)
        if digest != self.job.data_digest:
            raise ValueError(f"data: this host's data ({digest}) differs from the "
                             f"coordinator's ({self.job.data_digest}); give every host the "
                             "same files")

    def _connect(self, secret: bytes, connect_timeout_s: float, place: Place) -> None:
        """The store, the job, the bulk channel, the device and the checkpoint folder."""
        self.store = dist.TCPStore(self.host, self.port, is_master=False,
                                   timeout=timedelta(seconds=connect_timeout_s))
        self.job, signer = read_job(self.store, secret)
        shard = self.tp_rank if self.job.tp > 1 else None
        self.shared = Shared(signer, self.id, self.incarnation, _log.warning,
                             member=self.tp_rank == 0, shard=shard)
        self.chan = Channel(self.store, self.shared)
        self.hang_s = self.job.hang_timeout_s
        # rank 0 waits out the grace; its siblings wait as long as it lives (its unit slot
        # ends them once it gives up: design 4.11)
        grace_s = self.job.coordinator_grace_s if self.tp_rank == 0 else math.inf
        self.link = Link(self.host, self.port, hang_s=self.hang_s, grace_s=grace_s,
                         term=self.job.term)
        # the watchdog decides whether the coordinator is gone; the training thread's
        # requests may take longer on a loaded host without that meaning anything
        self.store.set_timeout(timedelta(seconds=max(5.0, 2 * self.hang_s)))
        self.rendezvous = self.chan.rendezvous(max(5.0, 2 * self.hang_s))
        """The store this process's groups meet in (kept: torch calls it)."""
        self.kept: list[Any] = []
        """Earlier coordinators' rendezvous stores (groups being closed may call them)."""
        self.blobs = BlobClient(self.host, self.job.blob_port, secret,
                                timeout_s=self.job.control_timeout_s,
                                deadline=Deadline(self.hang_s, self.job.bulk_gb_per_s))
        self.work: Workload = open_workload(self.job.workload, secret)
        self.backend = groups.resolve_backend(self.job.backend, self.job.device)
        self.device = groups.worker_device(self.job.device, place, self.backend)
        if self.device.type == "cuda":  # pragma: no cover - needs GPUs
            torch.cuda.set_device(self.device)
        self.watch = DeviceWatch(self.device)
        """The compute this worker gives its device (the heartbeat watches it)."""
        self.optimizer_timer = StepTimer(self.device)
        """Times the optimizer step (read with the next step's timings)."""
        self.storage = Deadline(self.hang_s, self.job.storage_gb_per_s)
        connect = functools.partial(client, self.host, self.port, max(5.0, self.hang_s))

        def own_store() -> Channel:
            return self.chan.on(connect())

        self.memory = MemoryCopies(self.id, self.address, secret, own_store,
                                   Deadline(self.hang_s, self.job.bulk_gb_per_s),
                                   self.job.control_timeout_s) if self.job.memory_copies else None
        if self.memory is not None:
            self.memory.start()
        self.ckpt = CheckpointIO(self.id, shared_folder(self.job.checkpoint_dir,
                                                        self.job.job_id), self.blobs,
                                 own_store, self.memory, self.device,
                                 shard=None if shard is None else (shard, self.job.tp))
        if self.job.checkpoint_every > 0 and self.ckpt.folder is not None and \
                self.ckpt.disk is not None:
            self.ckpt.disk.start()

    # ------------------------------------------------------------------ the stage
    def microbatch(self, step: int, first_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples from global position ``first_sample`` of ``step``."""
        x, y = self.data.microbatch(step, first_sample, self.micro_batch)
        return x, y

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's summed loss (in the master dtype under mixed precision)."""
        out: torch.Tensor = self.model.loss(self.precision.for_loss(output), targets)
        return out

    def boundary_buffer(self, layer: int, whole: bool = False) -> torch.Tensor:
        """An empty buffer for the input of ``layer`` (the output of ``layer - 1``; at
        ``tp > 1`` this rank's sequence shard of it, unless ``whole``)."""
        shape, dtype = self.job.boundaries[layer - 1]
        local = tuple(shape)
        if self.tp > 1 and not whole:  # DTensor's modules only where they are used
            from chameleon_ft.runtime.workload.tensor_parallel import boundary_shape

            local = boundary_shape(local, self.tp)
        return torch.empty(local, dtype=getattr(torch, dtype), device=self.device)

    def module(self, index: int) -> torch.nn.Module:
        """Layer ``index`` with its initial parameters, in the run's master dtype, on the
        device (whole)."""
        return self.make.module(index)

    def layer_from(self, index: int, blobs: list[bytes]) -> LayerTrainState:
        """Layer ``index`` with the state in ``blobs`` (``Layers.from_trees``)."""
        try:
            return self.make.from_trees(index, blobs)
        except ValueError as exc:
            raise RuntimeError(f"worker {self.id}: the state received for layer {index} "
                               f"does not load: {exc}") from None

    def _set_layers(self, layers: dict[int, LayerTrainState]) -> None:
        self.layers = layers
        self.stage = StageModel(checkpointing=self.checkpointing)
        for i in sorted(layers):
            self.stage.layers[str(i)] = layers[i].module
        self.runner = self.make.runner(self.stage)

    def _warm_up_kernels(self) -> None:
        """One throw-away forward and backward through every layer kind, before joining.

        CPU matmul kernels are prepared per shape on first use (a float64 stage's first
        backward costs ~0.6 s); running the real micro-batch shapes once at start keeps
        that out of step 0 and out of the first step after a recovery that hands this
        worker a new kind of layer.
        """
        last = self.job.num_layers - 1
        x, y = self.microbatch(0, 0)
        x, y = self.precision.inputs(x, self.device), self.precision.targets(y, self.device)
        hidden = self.module(0).to(self.dtype)(x)
        # The first backward from a non-scalar output with a given gradient (what every
        # stage but the last runs) is slow once per process, whatever the shapes.
        if hidden.requires_grad:
            hidden.backward(torch.ones_like(hidden))
        if last > 1:  # a middle layer: a floating-point input that needs its gradient
            inp = self.boundary_buffer(1, whole=True).zero_()
            inp.requires_grad_(inp.is_floating_point())
            out = self.module(1).to(self.dtype)(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
        if last > 0:
            inp = self.boundary_buffer(last, whole=True).zero_()
            inp.requires_grad_(inp.is_floating_point())
            self.loss(self.module(last).to(self.dtype)(inp), y).backward()

    # ------------------------------------------------------------------ the coordinator
    def _report(self, fatal: bool, peer: int | None, message: str, gen: int,
                corrupt_step: int | None = None) -> None:
        """Tell the coordinator what went wrong (a report key of this worker's own)."""
        report = proto.ErrorReport(worker=self.id, fatal=fatal, peer=peer, message=message,
                                   corrupt_step=corrupt_step)
        try:
            self.chan.report(gen, report)
        except Exception as exc:  # the coordinator is gone or slow: the watchdog decides
            _log.debug("error report not written: %s", exc)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Register, then follow the coordinator's generations until told to stop."""
        self.chan.register({"host": socket.gethostname(), "pid": os.getpid(),
                            "address": self.address})
        Liveness(self.id, self.incarnation, self.link,
                 heartbeat_s=self.job.heartbeat_s, hang_s=self.hang_s,
                 current=lambda: self.current, changed=self.gen_changed, link=self.chan.on,
                 watch=self.watch, device=self.device, member=self.tp_rank == 0,
                 unit=self.unit, start_s=self.job.control_timeout_s).start()
        gen = 0
        if self.replacement:
            # a repaired worker: the coordinator says from which generation on it follows
            gen = self.chan.start_gen()
        previous: groups.Generation | None = None
        probing = False
        while True:
            try:
                gen, directive = self.chan.directive(gen, between(
                    self.again, prober(self) if probing else None))
                self.again = None
                probing = self.id in directive.get("probe", ())
                if not probing:
                    self.probe.release()
                if self._follow(gen, directive, previous):
                    return
                previous = self._run_generation(gen, directive, previous)
            except GenerationOver:
                previous = self.current
            except dist.DistError as exc:  # its store failed: the coordinator went away
                reattach.recover(self, exc, previous)
                previous, gen = None, self.directive_gen
            except Exception as exc:  # injected, or a bug: the worker is going away
                self._report(True, None, f"{type(exc).__name__}: {exc}\n"
                             f"{traceback.format_exc()}", gen)
                raise
            gen += 1

    def _follow(self, gen: int, directive: dict[str, Any],
                previous: groups.Generation | None) -> bool:
        """A directive read: stop (returns True once the final checkpoint is over), or
        check this process is still the one it names; a step it committed while this
        worker was away is applied first."""
        _log.debug("read directive %d (%s, world %s)", gen, directive["action"],
                   directive.get("world"))
        reattach.apply(self, directive.get("apply"))
        self.directive_gen = gen
        if directive["action"] == "stop":
            if previous is not None:
                previous.close()
            self._stop(directive)
            return True
        if directive["incarnations"].get(str(self.id)) != self.incarnation:
            exit_now(EXIT_FENCED, f"chameleon worker {self.id}: fenced by the "
                     "coordinator (declared dead or replaced); exiting")
        self.members, self.plan_doc = dict(directive["incarnations"]), directive["plan"]
        self.faults.refresh()
        return False

    def _enter(self, generation: groups.Generation | None) -> None:
        with self.gen_changed:
            self.current = generation
            self.gen_changed.notify_all()

    def _run_generation(self, gen: int, d: dict[str, Any],
                        previous: groups.Generation | None) -> groups.Generation | None:
        """Take part in generation ``gen`` until it ends; returns its groups (to close once
        the next generation is up), or None when this worker was idle in it."""
        plan = ExecutionPlan.from_dict(d["plan"])
        world: list[int] = d["world"]
        if self.id not in world:
            self._set_layers({})  # idle: ``held`` stays valid until a step commits without us
            if previous is not None:
                groups.close_later(previous)
            return None
        generation = groups.Generation(gen, abort_s=float(d["collective_timeout_s"]),
                                       device=self.device)
        self._enter(generation)
        try:
            self.chan.began(gen)
            actions = actions_of(d["ops"])
            transfers = (d.get("migration") or {}).get("transfers", [])
            comm = groups.build(self.rendezvous, generation, self.id, world, d["rounds"],
                                extra=extra_groups(d), backend=self.backend,
                                timeout_s=float(d["collective_timeout_s"]),
                                address=self.address, device=self.device,
                                nccl_like=self.job.nccl_semantics,
                                peers=peers_of(plan, actions, transfers, self.id),
                                tag=self.chan.rendezvous_tag(gen, d),
                                plane=groups.Plane(self.tp_rank, self.tp)
                                if self.tp > 1 else None)
            self._new_mesh(gen, comm)
            self.faults.maybe_fire(d["step"], "recovery", gen)
            self._load_state(gen, d, plan, comm)
            self.chan.ready(gen)
            if previous is not None:  # the old groups are no longer needed: free them
                groups.close_later(previous)
                previous = None
            if self.id not in plan.workers:
                return generation  # only a migration source: idle in the new plan
            program = step_program(plan, actions, self.id, self.job.boundaries)
            for step in range(d["step"], d["steps"]):
                if not self._run_step(gen, step, plan, d, comm, program):
                    break
        except CommError as exc:
            _log.debug("generation %d: %s", gen, exc)
            self._report(False, exc.peer, str(exc), gen)
            generation.break_all()
        except CorruptCheckpoint as exc:
            self._report(False, None, str(exc), gen, corrupt_step=exc.step)
            generation.break_all()
        finally:
            if previous is not None:
                groups.close_later(previous)
        return generation

    # ------------------------------------------------------------------ state
    def _new_mesh(self, gen: int, comm: Comm) -> None:
        """Make the generation's tensor-parallel mesh current (named for it: design
        4.11); layers are built on it, and kept ones moved onto it, from now on."""
        if comm.tp is not None:
            from chameleon_ft.runtime.workload.tensor_parallel import tensor_parallel_mesh

            self.make.mesh = tensor_parallel_mesh(comm.tp, self.device.type, gen)

    def _restore(self, gen: int, step: int, wanted: list[int]) -> dict[int, LayerTrainState]:
        """This worker's layers of the checkpoint after ``step`` steps (verified)."""
        fetched = self.memory.fetched if self.memory is not None else 0
        layers = self.ckpt.restore(step, wanted, gen, self.layer_from)
        if self.memory is not None and self.memory.fetched > fetched:
            self.chan.fetched(gen, self.memory.fetched - fetched)
        return layers

    def _load_state(self, gen: int, d: dict[str, Any], plan: ExecutionPlan,
                    comm: Comm) -> None:
        """Fill the layers of this worker's new stage: keep, receive, restore or create."""
        wanted = list(plan.layers_by_worker.get(self.id, range(0)))
        load = d.get("load")
        layers = dict(self.held) if self.held_steps == d["step"] else {}
        if load is not None and load["kind"] == "init":
            layers = {i: self.make.new(i) for i in wanted}
        elif load is not None and load["kind"] == "restore":
            layers = self._restore(gen, load["step"], wanted)
        migration = d.get("migration")
        if migration:
            Migration(comm, self.device, layers, lambda i, data: self.layer_from(i, [data]),
                      lambda: self.faults.maybe_fire(d["step"], "migration", gen),
                      pack=self.make.to_bytes).run(migration["transfers"], migration["rounds"])
        missing = [i for i in wanted if i not in layers]
        if missing:
            raise RuntimeError(f"worker {self.id}: no state for layers {missing} in "
                               f"generation {gen}")
        # kept layers move onto the generation's mesh (tp > 1; no communication)
        layers.update(self.make.rebind(self.make.mesh, {i: layers[i] for i in wanted}))
        self.held, self.held_steps = layers, d["step"]
        self.held_gen, self.held_plan = gen, d["plan"]
        self._set_layers({i: layers[i] for i in wanted})

    # ------------------------------------------------------------------ one step
    def _run_step(self, gen: int, step: int, plan: ExecutionPlan, d: dict[str, Any],
                  comm: Comm, program: tuple[Instruction, ...]) -> bool:
        """Forward/backward per the step program, all-reduce, vote, and apply on commit.

        Returns:
            False when the generation ends at this step (aborted, or a planned switch).

        Raises:
            CommError: when a transfer or all-reduce of this worker failed.
        """
        self.faults.refresh()
        stretch = self.slowdown.at_step(step, gen)
        for state in self.layers.values():
            state.zero_grad()
        try:
            result = StepRun(self, comm, plan, step,
                             lambda phase: self.faults.maybe_fire(step, phase, gen),
                             stretch).run(program)
            self.faults.maybe_fire(step, "reduce", gen)
            reduced = reduce_step(comm, d, plan, self.layers, self.copies, self.device,
                                  self.tp_rank)
        except RuntimeError as exc:  # DTensor's collectives fail inside autograd's ops
            failure = comm_failure(exc, self.current is not None and self.current.broken) \
                if comm.tp is not None else None
            if failure is None:
                raise
            raise failure from None
        self._report_step(gen, step, result, reduced)
        t_reduced = time.perf_counter()
        self.voted = (gen, step)  # before the vote: a vote written as its store failed
        self.chan.reduced(gen, step)  # may still commit the step (its gradients are kept)
        verdict = self.chan.await_value(proto.verdict_key(gen, step), gen).decode()
        self.voted = None
        self.last_commit_wait_s = time.perf_counter() - t_reduced
        if verdict not in (proto.COMMIT, proto.COMMIT_END):
            return False
        self.faults.maybe_fire(step, "optimizer", gen)
        if not self.ckpt.snapshot_taken(self.storage.for_bytes(self.ckpt.pending_bytes)):
            raise RuntimeError(f"worker {self.id}: the checkpoint's copy of its layers did "
                               "not finish")
        optimizer_s: list[float] = []
        with self.optimizer_timer.time(optimizer_s, stretch), self.watch.computing():
            for state in self.layers.values():
                state.step(step)
        self.pending_optimizer_s = optimizer_s
        self.held, self.held_steps = dict(self.layers), step + 1  # other layers are now stale
        self.held_gen, self.held_plan = gen, d["plan"]
        self._maybe_checkpoint(step + 1, plan, gen)
        return verdict == proto.COMMIT

    def _writes(self, plan: ExecutionPlan) -> dict[int, LayerTrainState]:
        """The layers of this worker's stage it writes into checkpoints."""
        return {i: state for i, state in self.layers.items()
                if writer_of(plan.holders(i), i) == self.id}

    def _report_step(self, gen: int, step: int, result: StepResult, reduced: Reduced) -> None:
        """The step's losses, and its timings, memory, norm share and learning rate."""
        held = self.stage.indices()
        self.optimizer_timer.resolve()
        optimizer_s = self.pending_optimizer_s[0] if self.pending_optimizer_s else None
        self.chan.step_report(gen, step, result.losses, {
            "layers": [held[0], held[-1] + 1] if held else [], "f_s": result.forward_s,
            "b_s": result.backward_s, "optimizer_s": optimizer_s,
            "commit_wait_s": self.last_commit_wait_s, "rss_base_bytes": self.rss_base_bytes,
            "rss_peak_bytes": peak_resident_bytes(), **device_memory(self.device),
            "grad_norm_sq": reduced.norm_squared,
            **({"rss_peak_bytes_ranks": reduced.rank_peaks} if reduced.rank_peaks else {}),
            "lr": self.layers[held[0]].lr(step) if held else None})

    # ------------------------------------------------------------------ checkpoints
    def _maybe_checkpoint(self, num_steps: int, plan: ExecutionPlan, gen: int) -> None:
        """At a checkpoint: snapshot the layers this worker writes and write them in the
        background (training goes on at once). At a generation's first commit (its layers'
        state complete) their snapshot memory is allocated ahead, in the background."""
        every = self.job.checkpoint_every
        if every <= 0:
            return
        if num_steps % every:
            if self.reserved_gen != gen:  # the generation's first commit: state complete
                self.reserved_gen = gen
                self.ckpt.reserve_async(self.make.stored(self._writes(plan)))
            return
        mine = self.make.stored(self._writes(plan))
        inject = self.faults.maybe_fire(num_steps - 1, "checkpoint", gen)
        peer = None if self.memory is None else \
            peer_of(self.id, plan.workers, self.job.workers_per_node)
        if mine or inject is not None:
            self.ckpt.write_async(num_steps, gen, mine, inject, self.storage, peer)

    def _stop(self, directive: dict[str, Any]) -> None:
        """The run ended: finish the checkpoint being written, write this worker's share of
        the final checkpoint (its primary layers, and more if their first writer is gone),
        then leave when the coordinator says the final checkpoint is complete."""
        self.ckpt.finish(self.storage)
        self.chan.flush_refusals()
        final = directive.get("final") or {}
        if directive.get("failed") or self.held_steps != directive["step"]:
            return  # nothing to write (a failed run, or this worker missed a commit)
        gen, step = int(directive["gen"]), int(directive["step"])

        def write(layers: list[int], upload: bool = False) -> None:
            states = {i: self.make.tree(i, self.held[i]) for i in layers if i in self.held}
            # an injected disk fault fails the final checkpoint's write into the folder too
            inject = None if upload or not states else \
                self.faults.maybe_fire(step - 1, "checkpoint", gen)
            self.ckpt.write(step, gen, states, inject=inject, upload=upload)

        if directive.get("write"):
            write([int(i) for i, ws in final.items() if ws and writer_of(ws, int(i)) == self.id])
        wait_final(self.chan, gen, write, float(directive["final_timeout_s"]))

