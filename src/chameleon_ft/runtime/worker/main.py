"""A training worker: runs its stage of the plan, generation after generation.

The worker loop (docs/design.md section 4):

1. read the directive of generation ``g`` (plan, schedule, migration, what to load, the
   generation's collective deadline, the incarnation of every member);
2. build the generation's process groups from ``PrefixStore(gen{g}/...)``: one group over
   every participating worker for point-to-point sends, one per gradient bucket;
3. receive migrated layers (parameters and optimizer state) or reload a checkpoint;
4. run steps: the schedule's forward/backward operations with sends and receives, the
   gradient all-reduce rounds, then report "reduced" and wait for the coordinator's
   verdict; apply the optimizer only on ``commit``;
5. on any communication error: report it, break every connection of the generation (so
   peers blocked on this worker fail at once instead of waiting for the timeout), and go
   to step 1 with the next generation. The old generation's groups are destroyed.

Two helper threads, each with its own store connection: a heartbeat that is also the
watchdog of the coordinator (if the store stops answering for half the hang deadline the
process exits: no worker outlives its coordinator), and a watcher that breaks a
generation's connections as soon as the coordinator sets its abort key. The watcher
follows the current generation by itself, so it never stays parked on an old one.

Gloo note: ``ProcessGroupGloo.abort()`` does not wake operations already waiting, but a
receive that times out closes its pair, and the peer's pending operations on that pair
then fail at once. :func:`break_connections` uses that to tear a generation down.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.storage.blobs import BlobClient, BlobError
from chameleon_ft.runtime.workload.bundle import Workload, open_workload
from chameleon_ft.runtime.workload.models import StageModel, to_run
from chameleon_ft.runtime.workload.optim import LayerTrainState
from chameleon_ft.runtime.workload.precision import torch_dtype

_BREAK_TAG = 2_000_000_000
"""Tag of the throw-away receive that closes a pair (never sent by anyone)."""
_MIGRATION_TAG = 1_000_000_000
_WARMUP_TAG = 1_500_000_000
_WAIT_SLICE_S = 0.5
"""Granularity of the worker's waits on the coordinator: each slice it checks that the
coordinator still answers and that its generation is still current."""

EXIT_OK, EXIT_ERROR, EXIT_COORDINATOR_GONE, EXIT_FENCED = 0, 1, 3, 4


class InjectedError(RuntimeError):
    """The ``error`` kind of injected fault."""


class CommError(RuntimeError):
    """A send, receive or all-reduce of the current generation failed."""

    def __init__(self, message: str, peer: int | None) -> None:
        super().__init__(message)
        self.peer = peer


class GenerationOver(RuntimeError):
    """The coordinator moved on past the generation this worker waits in."""


@dataclass(frozen=True)
class JobInfo:
    """What the coordinator tells every worker about the job (the ``job`` store key).

    Public: it holds nothing secret (the token never travels).
    """

    job_name: str
    job_id: str
    """Random per run: join proofs are bound to it."""
    nonce: str
    """The coordinator's join nonce."""
    num_workers: int
    num_layers: int
    dtype: str
    micro_batch: int
    global_batch: int
    heartbeat_s: float
    hang_timeout_s: float
    backend: str
    data_digest: str
    """The data source's digest (a worker on another host checks it has the same data)."""
    checkpoint_every: int
    control_timeout_s: float
    """Deadline of connecting and of one bulk transfer."""
    blob_port: int
    """The coordinator's bulk-state server (same host as the store)."""
    boundaries: list[list[Any]]
    """``[shape, dtype]`` of every layer's output for one micro-batch (a stage receives
    its first layer's input, the previous layer's output, into a buffer of that shape)."""
    targets_per_sample: int
    """Target elements of one sample: the loss is summed, then divided by this times the
    global batch."""
    workload: str
    """The model, data and optimizer to train (``runtime.workload``), sealed with the
    job's secret: a worker without the token cannot open it, and a forged one is refused."""

    def to_json(self) -> str:
        """Serialise."""
        return json.dumps(dict(vars(self)))

    @classmethod
    def from_json(cls, text: str | bytes) -> JobInfo:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: for text that is not a job description of this version.
        """
        try:
            return cls(**json.loads(text))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError("the store does not hold a chameleon job of this version") from None


def resolve_backend(name: str) -> str:
    """``auto`` -> ``nccl`` when CUDA is present, else ``gloo``."""
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return name


def make_group(store: dist.Store, prefix: str, rank: int, size: int, *, backend: str,
               timeout_s: float, address: str) -> dist.ProcessGroup:
    """A process group built directly from the store under ``prefix`` (eager connection).

    Args:
        store: the coordinator's store (a client connection).
        prefix: unique per generation and group, so old and new groups never meet.
        rank: this worker's rank inside the group.
        size: members.
        backend: ``gloo`` or ``nccl``.
        timeout_s: deadline of every operation of the group.
        address: the interface gloo listens on (workers reach each other over TCP only).
    """
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":  # pragma: no cover - needs GPUs
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)


def break_connections(group: dist.ProcessGroup, rank: int, size: int) -> None:
    """Close every pair of ``group`` so that peers blocked on this worker fail now.

    A receive that times out makes gloo close the pair; the peer sees "connection closed"
    on whatever it is waiting for over that pair.
    """
    if group.name() == "nccl":  # pragma: no cover - needs GPUs; NCCL's abort wakes waiters
        with contextlib.suppress(Exception):
            group.abort()
        return
    for r in range(size):
        if r == rank:
            continue
        with contextlib.suppress(Exception):
            group.recv([torch.zeros(1)], r, _BREAK_TAG).wait(timedelta(milliseconds=1))


class _Generation:
    """The process groups of one generation, and a flag saying it was torn down."""

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.groups: list[tuple[dist.ProcessGroup, int, int]] = []
        self.broken = False
        self.lock = threading.Lock()

    def add(self, group: dist.ProcessGroup, rank: int, size: int) -> None:
        with self.lock:
            self.groups.append((group, rank, size))
            broken = self.broken
        if broken:
            break_connections(group, rank, size)

    def break_all(self) -> None:
        with self.lock:
            if self.broken:
                return
            self.broken = True
            groups = list(self.groups)
        for group, rank, size in groups:
            break_connections(group, rank, size)

    def close(self) -> None:
        """Tear the groups down and drop them: their sockets and threads go away."""
        self.break_all()
        with self.lock:
            groups, self.groups = self.groups, []
        for group, _, _ in groups:
            with contextlib.suppress(Exception):
                group.shutdown()
        del groups


def _refused(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port`` any more (a definite answer, unlike a
    timeout)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _close_later(generation: _Generation) -> None:
    """Close an old generation's groups off the training thread (breaking a pair waits
    a millisecond per peer)."""
    threading.Thread(target=generation.close, daemon=True, name=f"close-gen{generation.gen}"
                     ).start()


def _exit_now(code: int, message: str) -> None:
    """Leave at once (no destructors: abandoned groups could block), saying why."""
    with contextlib.suppress(Exception):
        os.write(2, f"{message}\n".encode())
    os._exit(code)


class Worker:
    """One training process: its layers, optimizer state and the generation loop."""

    def __init__(self, worker_id: int, host: str, port: int, *, address: str,
                 incarnation: str, secret: bytes, connect_timeout_s: float = 30.0,
                 replacement: bool = False) -> None:
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
        """
        self.id = worker_id
        self.incarnation = incarnation
        self.replacement = replacement
        self.host, self.port, self.address = host, port, address
        self.store = dist.TCPStore(host, port, is_master=False,
                                   timeout=timedelta(seconds=connect_timeout_s))
        self.job = JobInfo.from_json(self.store.get(proto.JOB_KEY))
        self.hang_s = self.job.hang_timeout_s
        # the heartbeat thread decides whether the coordinator is gone; the training
        # thread's requests may take longer on a loaded host without that meaning anything
        self.store.set_timeout(timedelta(seconds=max(5.0, 2 * self.hang_s)))
        self.blobs = BlobClient(host, self.job.blob_port, secret,
                                timeout_s=self.job.control_timeout_s)
        self.dtype = torch_dtype(self.job.dtype)
        self.work: Workload = open_workload(self.job.workload, secret)
        self.backend = resolve_backend(self.job.backend)
        if self.backend == "nccl":  # pragma: no cover - needs GPUs
            self.device = torch.device("cuda", worker_id % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.model, self.data = self.work.model(), self.work.data()
        self.opt_factory, self.lr_schedule = self.work.optimizer(), self.work.lr_schedule()
        digest = self.work.data_digest(self.data)
        if digest != self.job.data_digest:
            raise ValueError(f"data: this host's data ({digest}) differs from the "
                             f"coordinator's ({self.job.data_digest}); give every host the "
                             "same files")
        self.layers: dict[int, LayerTrainState] = {}
        """The layers of this worker's current stage (trained and updated)."""
        self.held: dict[int, LayerTrainState] = {}
        """Every layer whose state this worker holds, valid after ``held_steps`` committed
        steps: the stage's layers plus, until the next commit, the previous stage's (a
        generation that fails before committing leaves the older placement intact, and the
        coordinator plans the next recovery from it)."""
        self.held_steps = 0
        self.last_optimizer_s: float | None = None
        """Seconds of the last optimizer step (reported with the next step's timings)."""
        self.last_commit_wait_s: float | None = None
        """Seconds from reporting "reduced" to reading the verdict, last step."""
        self.stage = StageModel()
        self.faults: list[tuple[int, int, str, str]] = []
        """Armed faults of this rank: ``(index, step, kind, phase)``."""
        self.faults_version = -1
        self.current: _Generation | None = None
        self.gen_changed = threading.Condition()
        self.loss_count = self.job.global_batch * self.job.targets_per_sample
        """The loss normaliser: target elements in the whole step."""
        self._warm_up_kernels()

    def _warm_up_kernels(self) -> None:
        """One throw-away forward and backward through every layer kind, before joining.

        CPU matmul kernels are prepared per shape on first use (a float64 stage's first
        backward costs ~0.6 s); running the real micro-batch shapes once at start keeps
        that out of step 0 and out of the first step after a recovery that hands this
        worker a new kind of layer.
        """
        last = self.job.num_layers - 1
        x, y = self.data.microbatch(0, 0, self.job.micro_batch)
        x, y = to_run(x, self.dtype, self.device), to_run(y, self.dtype, self.device)
        first = self._module(0)
        hidden = first(x)
        # The first backward from a non-scalar output with a given gradient (what every
        # stage but the last runs) is slow once per process, whatever the shapes.
        if hidden.requires_grad:
            hidden.backward(torch.ones_like(hidden))
        if last > 1:  # a middle layer: a floating-point input that needs its gradient
            inp = self._boundary_buffer(1).zero_()
            inp.requires_grad_(inp.is_floating_point())
            out = self._module(1)(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
        if last > 0:
            inp = self._boundary_buffer(last).zero_()
            inp.requires_grad_(inp.is_floating_point())
            self.model.loss(self._module(last)(inp), y).backward()

    # ------------------------------------------------------------------ plumbing
    def _client(self, timeout_s: float) -> dist.TCPStore:
        """A store connection of the helper threads: connecting may take long on a loaded
        host (it is no sign of a dead coordinator), each request then ``timeout_s``."""
        store = dist.TCPStore(self.host, self.port, is_master=False,
                              timeout=timedelta(seconds=max(timeout_s, 10.0)))
        store.set_timeout(timedelta(seconds=timeout_s))
        return store

    def _heartbeat(self) -> None:
        """Beat every ``heartbeat_s``; exit when the coordinator is gone.

        A coordinator that died leaves nothing listening on its port (the connection is
        refused: exit at once); one that is stopped or cut off stops answering (exit once
        ``hang_timeout_s`` passed since the last beat it took). A worker that was itself
        stopped and continued finds out at its next beat. A slow answer under load is not
        a death: a beat may time out, only a silence of the whole deadline counts.
        """
        gone = (f"chameleon worker {self.id}: the coordinator at {self.host}:{self.port} "
                "stopped answering; exiting")
        try:
            store = self._client(max(self.hang_s / 2, 0.2))
        except Exception:
            _exit_now(EXIT_COORDINATOR_GONE, gone)
        key = proto.heartbeat_key(self.id, self.incarnation)
        last_ok = time.monotonic()
        while True:
            try:
                store.add(key, 1)  # the answer is not used: a late one read later is harmless
                last_ok = time.monotonic()
            except Exception:
                if _refused(self.host, self.port) or \
                        time.monotonic() - last_ok > self.hang_s:
                    _exit_now(EXIT_COORDINATOR_GONE, gone)
            time.sleep(self.job.heartbeat_s)

    def _watch(self) -> None:
        """Break a generation's connections as soon as the coordinator aborts it.

        Waits on the abort key of the current generation in short slices and re-reads
        which generation is current after each, so it follows the worker from generation
        to generation whatever way the previous one ended.
        """
        store = self._client(max(self.hang_s / 2, 0.2))
        while True:
            with self.gen_changed:
                self.gen_changed.wait_for(
                    lambda: self.current is not None and not self.current.broken,
                    timeout=_WAIT_SLICE_S)
                gen = self.current
            if gen is None or gen.broken:
                continue
            try:
                store.wait([proto.abort_key(gen.gen)], timedelta(seconds=_WAIT_SLICE_S))
            except dist.DistStoreError:
                continue  # not aborted yet (or the store is slow): look again
            except Exception:
                time.sleep(_WAIT_SLICE_S)  # the heartbeat decides whether the coordinator died
                continue
            gen.break_all()

    def _await(self, key: str, gen: int | None = None) -> bytes:
        """Wait for a key the coordinator writes, in slices, for as long as it answers.

        Args:
            key: the key.
            gen: the generation the wait belongs to; once the coordinator has published a
                later one, this generation is over and the wait is abandoned.

        Raises:
            GenerationOver: when the coordinator moved on.
        """
        while True:
            try:
                self.store.wait([key], timedelta(seconds=_WAIT_SLICE_S))
                return bytes(self.store.get(key))
            except dist.DistStoreError:
                if gen is not None and self._current_gen() > gen:
                    raise GenerationOver(f"generation {gen} is over") from None

    def _current_gen(self) -> int:
        if not self.store.check([proto.CURRENT_GEN_KEY]):
            return 0
        return int(self.store.get(proto.CURRENT_GEN_KEY))

    def _directive(self, gen: int) -> tuple[int, dict[str, Any]]:
        """The directive of ``gen``, or of the newest generation if the coordinator has
        moved past ``gen`` (this worker was slow, or idle while generations came and went):
        a generation that is not the newest is over, and joining it would only delay."""
        while True:
            gen = max(gen, self._current_gen())
            key = proto.directive_key(gen)
            try:
                self.store.wait([key], timedelta(seconds=_WAIT_SLICE_S))
                return gen, json.loads(self.store.get(key))
            except dist.DistStoreError:
                continue

    def _report(self, fatal: bool, peer: int | None, message: str, gen: int) -> None:
        """Tell the coordinator: reserve a slot, then write the report into it."""
        report = proto.ErrorReport(worker=self.id, fatal=fatal, peer=peer, message=message)
        with contextlib.suppress(Exception):
            index = self.store.add(proto.error_slot_key(gen), 1) - 1
            self.store.set(proto.error_key(gen, index), report.to_json())

    def _refresh_faults(self) -> None:
        version = self.store.add(proto.FAULTS_VERSION_KEY, 0)
        if version == self.faults_version:
            return
        self.faults_version = version
        faults = json.loads(self.store.get(proto.FAULTS_KEY)) \
            if self.store.check([proto.FAULTS_KEY]) else []
        self.faults = [(index, int(step), str(kind), str(phase))
                       for index, (rank, step, kind, phase) in enumerate(faults)
                       if rank == self.id]

    def _maybe_fault(self, step: int, phase: str, gen: int) -> None:
        for fault in list(self.faults):
            index, fstep, kind, fphase = fault
            if fphase != phase or step < fstep:
                continue
            self.faults.remove(fault)
            if self.store.add(proto.fault_claim_key(index), 1) != 1:
                continue  # another process of this rank fired it already
            self.store.set(proto.fault_fired_key(index), json.dumps(
                {"time": time.time(), "step": step, "gen": gen, "worker": self.id,
                 "incarnation": self.incarnation, "pid": os.getpid()}))
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "glitch":
                raise CommError(f"worker {self.id}: injected glitch at step {step} ({phase})",
                                None)
            else:
                raise InjectedError(f"injected error on worker {self.id} at step {step} "
                                    f"({phase})")

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        """Register, then follow the coordinator's generations until told to stop.

        Raises:
            GenerationOver: never escapes; fenced workers return.
        """
        info = {"host": socket.gethostname(), "pid": os.getpid(), "address": self.address}
        self.store.set(proto.worker_info_key(self.id, self.incarnation), json.dumps(info))
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        threading.Thread(target=self._watch, daemon=True, name="abort-watcher").start()
        gen = 0
        if self.replacement:
            # a repaired worker: the coordinator says from which generation on it follows
            gen = int(self._await(proto.start_gen_key(self.id, self.incarnation)))
        previous: _Generation | None = None
        while True:
            gen, directive = self._directive(gen)
            _debug(f"w{self.id} read directive {gen} ({directive['action']}, world "
                   f"{directive.get('world')})")
            if directive["action"] == "stop":
                if previous is not None:
                    previous.close()
                self._stop(directive)
                return
            if directive["incarnations"].get(str(self.id)) != self.incarnation:
                _exit_now(EXIT_FENCED, f"chameleon worker {self.id}: fenced by the "
                          "coordinator (declared dead or replaced); exiting")
            self._refresh_faults()
            try:
                previous = self._run_generation(gen, directive, previous)
            except GenerationOver:
                previous = self.current
            except Exception as exc:  # injected, or a bug: the worker is going away
                self._report(True, None, f"{type(exc).__name__}: {exc}\n"
                             f"{traceback.format_exc()}", gen)
                raise
            gen += 1

    def _run_generation(self, gen: int, d: dict[str, Any],
                        previous: _Generation | None) -> _Generation | None:
        """Take part in generation ``gen`` until it ends; returns its groups (to close once
        the next generation is up), or None when this worker was idle in it."""
        plan = ExecutionPlan.from_dict(d["plan"])
        world: list[int] = d["world"]
        if self.id not in world:
            self._set_layers({})  # idle: ``held`` stays valid until a step commits without us
            if previous is not None:
                _close_later(previous)
            return None
        generation = _Generation(gen)
        with self.gen_changed:
            self.current = generation
            self.gen_changed.notify_all()
        try:
            _debug(f"w{self.id} gen {gen}: building groups")
            self.store.set(proto.setup_key(self.id, self.incarnation), str(gen))
            world_group = self._build_groups(gen, generation, world, d["rounds"],
                                             float(d["collective_timeout_s"]))
            _debug(f"w{self.id} gen {gen}: groups built")
            self._maybe_fault(d["step"], "recovery", gen)
            self._load_state(gen, d, plan, world_group)
            self.store.add(proto.ready_key(gen), 1)
            if previous is not None:  # the old groups are no longer needed: free them
                _close_later(previous)
                previous = None
            if self.id not in plan.workers:
                return generation  # only a migration source: idle in the new plan
            _debug(f"w{self.id} gen {gen} ready")
            for step in range(d["step"], d["steps"]):
                if not self._run_step(gen, step, plan, d, world_group):
                    break
        except CommError as exc:
            _debug(f"w{self.id} gen {gen}: {exc}")
            self._report(False, exc.peer, str(exc), gen)
            generation.break_all()
        finally:
            if previous is not None:
                _close_later(previous)
        return generation

    # ------------------------------------------------------------------ groups
    def _build_groups(self, gen: int, generation: _Generation, world: list[int],
                      rounds: list[list[list[list[int]]]],
                      timeout_s: float) -> dist.ProcessGroup:
        try:
            world_group = make_group(self.store, f"gen{gen}/world/", world.index(self.id),
                                     len(world), backend=self.backend, timeout_s=timeout_s,
                                     address=self.address)
            generation.add(world_group, world.index(self.id), len(world))
            # Every worker builds the groups it belongs to in one global order (sorted
            # member lists), so no two workers wait on each other in opposite orders.
            members = sorted({tuple(b[0]) for rnd in rounds for b in rnd
                              if self.id in b[0] and len(b[0]) > 1})
            self.buckets: dict[tuple[int, ...], dist.ProcessGroup] = {}
            for m in members:
                key = "_".join(map(str, m))
                group = make_group(self.store, f"gen{gen}/bucket/{key}/", m.index(self.id),
                                   len(m), backend=self.backend, timeout_s=timeout_s,
                                   address=self.address)
                generation.add(group, m.index(self.id), len(m))
                self.buckets[m] = group
        except (RuntimeError, dist.DistError) as exc:
            raise CommError(f"building the groups of generation {gen} failed: "
                            f"{str(exc).splitlines()[0][:200]}", None) from None
        self.world_rank = {w: i for i, w in enumerate(world)}
        self._warm_up(world_group, world)
        return world_group

    def _warm_up(self, group: dist.ProcessGroup, world: list[int]) -> None:
        """Exchange one tiny message with every peer in both directions.

        Gloo's first transfer on each direction of a pair is slow (hundreds of ms on a
        loaded 2-core machine); paying it here keeps it out of the first step.
        """
        works = []
        for peer in world:
            if peer == self.id:
                continue
            out, into = torch.zeros(1, device=self.device), torch.zeros(1, device=self.device)
            works.append((self._send(group, out, peer, _WARMUP_TAG), peer, out))
            try:
                works.append((group.recv([into], self.world_rank[peer], _WARMUP_TAG), peer,
                              into))
            except RuntimeError as exc:
                raise CommError(f"worker {self.id}: warm-up with {peer} failed: {exc}",
                                peer) from None
        for work, peer, _ in works:
            self._wait(work, peer, "warm-up")

    # ------------------------------------------------------------------ state
    def _set_layers(self, layers: dict[int, LayerTrainState]) -> None:
        self.layers = layers
        self.stage = StageModel()
        for i in sorted(layers):
            self.stage.layers[str(i)] = layers[i].module

    def _module(self, index: int) -> torch.nn.Module:
        """Layer ``index`` with its initial parameters, in the run's dtype, on the device."""
        module: torch.nn.Module = self.model.build_layer(index).to(self.dtype).to(self.device)
        return module

    def _new_layer(self, index: int) -> LayerTrainState:
        return LayerTrainState.create(self._module(index), self.opt_factory, self.lr_schedule)

    def _layer_from_bytes(self, index: int, data: bytes) -> LayerTrainState:
        try:
            return LayerTrainState.from_bytes(self._module(index), self.opt_factory, data,
                                              self.lr_schedule)
        except ValueError as exc:
            raise RuntimeError(f"worker {self.id}: the state received for layer {index} "
                               f"does not load: {exc}") from None

    def _boundary_buffer(self, layer: int) -> torch.Tensor:
        """An empty buffer for the input of ``layer`` (the output of ``layer - 1``)."""
        shape, dtype = self.job.boundaries[layer - 1]
        return torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)

    def _load_state(self, gen: int, d: dict[str, Any], plan: ExecutionPlan,
                    group: dist.ProcessGroup) -> None:
        """Fill the layers of this worker's new stage: keep, receive, restore or create."""
        wanted = list(plan.layers_by_worker.get(self.id, range(0)))
        load = d.get("load")
        layers = dict(self.held) if self.held_steps == d["step"] else {}
        if load is not None and load["kind"] == "init":
            layers = {i: self._new_layer(i) for i in wanted}
        elif load is not None and load["kind"] == "restore":
            layers = {}
            for i in wanted:
                try:
                    _, blob = self.blobs.request({"op": "get", "kind": "restore",
                                                  "step": load["step"], "layer": i,
                                                  "gen": gen})
                except BlobError as exc:
                    raise CommError(f"worker {self.id}: reading layer {i} of the checkpoint "
                                    f"after {load['step']} steps failed: {exc}", None) from None
                layers[i] = self._layer_from_bytes(i, blob)
        migration = d.get("migration")
        if migration:
            self._migrate(migration, layers, group, d["step"], gen)
        missing = [i for i in wanted if i not in layers]
        if missing:
            raise RuntimeError(f"worker {self.id}: no state for layers {missing} in "
                               f"generation {gen}")
        self.held, self.held_steps = layers, d["step"]
        self._set_layers({i: layers[i] for i in wanted})

    def _migrate(self, migration: dict[str, Any], layers: dict[int, LayerTrainState],
                 group: dist.ProcessGroup, step: int, gen: int) -> None:
        """Run the restorer's transfers round by round.

        A layer's state is packed into bytes (identical on every replica, so a layer may
        be split across several senders); each transfer sends the total length, then its
        slice of the bytes.
        """
        transfers = migration["transfers"]
        packed: dict[int, torch.Tensor] = {}
        parts: dict[int, dict[int, torch.Tensor]] = {}
        totals: dict[int, int] = {}
        first = True
        for rnd in migration["rounds"]:
            works: list[tuple[Any, int, Any]] = []
            receives: list[tuple[int, int, int, int]] = []
            for index in rnd:
                layer, src, dst, part, num_parts = transfers[index]
                tag = _MIGRATION_TAG + 2 * index
                if src == self.id:
                    if layer not in packed:
                        raw = layers[layer].to_bytes()
                        packed[layer] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    data = packed[layer]
                    size = torch.tensor([data.numel()], dtype=torch.int64)
                    piece = torch.tensor_split(data, num_parts)[part].contiguous()
                    works.append((self._send(group, size, dst, tag), dst, size))
                    works.append((self._send(group, piece.to(self.device), dst, tag + 1), dst,
                                  piece))
                elif dst == self.id:
                    receives.append((layer, src, part, num_parts))
                    size = torch.zeros(1, dtype=torch.int64)
                    self._recv(group, size, src, tag, "migration size")
                    total = int(size.item())
                    if totals.setdefault(layer, total) != total:
                        raise RuntimeError(f"layer {layer}: replicas disagree on the size of "
                                           "its state")
                    length = torch.tensor_split(torch.empty(total, dtype=torch.uint8),
                                                num_parts)[part].numel()
                    buf = torch.empty(length, dtype=torch.uint8, device=self.device)
                    parts.setdefault(layer, {})[part] = buf
                    try:
                        works.append((group.recv([buf], self.world_rank[src], tag + 1), src,
                                      buf))
                    except RuntimeError as exc:
                        raise CommError(f"worker {self.id}: migration from {src} failed: "
                                        f"{exc}", src) from None
                if first:
                    first = False
                    self._maybe_fault(step, "migration", gen)
            for work, peer, _ in works:
                self._wait(work, peer, "migration")
        expected = {t[0]: t[4] for t in transfers if t[2] == self.id}
        for layer, num_parts in expected.items():
            got = parts.get(layer, {})
            assert len(got) == num_parts, f"layer {layer}: {len(got)} of {num_parts} parts"
            data = torch.cat([got[p].cpu() for p in range(num_parts)])
            layers[layer] = self._layer_from_bytes(layer, data.numpy().tobytes())

    def _wait(self, work: Any, peer: int | None, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise CommError(f"worker {self.id}: {what} with worker {peer} failed: "
                            f"{str(exc).splitlines()[0][:200]}", peer) from None

    def _send(self, group: dist.ProcessGroup, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Post a send (it fails at once on a pair that is already closed)."""
        try:
            return group.send([tensor], self.world_rank[dst], tag)
        except RuntimeError as exc:
            raise CommError(f"worker {self.id}: send to worker {dst} failed: "
                            f"{str(exc).splitlines()[0][:200]}", dst) from None

    def _recv(self, group: dist.ProcessGroup, tensor: torch.Tensor, src: int, tag: int,
              what: str) -> None:
        """Receive into ``tensor`` and wait for it."""
        try:
            work = group.recv([tensor], self.world_rank[src], tag)
        except RuntimeError as exc:
            raise CommError(f"worker {self.id}: {what} from worker {src} failed: "
                            f"{str(exc).splitlines()[0][:200]}", src) from None
        self._wait(work, src, what)

    # ------------------------------------------------------------------ one step
    def _run_step(self, gen: int, step: int, plan: ExecutionPlan, d: dict[str, Any],
                  group: dist.ProcessGroup) -> bool:
        """Forward/backward per the schedule, all-reduce, vote, and apply on commit.

        Returns:
            False when the generation ends at this step (aborted, or a planned switch).

        Raises:
            CommError: when a transfer or all-reduce of this worker failed.
        """
        self._refresh_faults()
        ops = d["ops"].get(str(self.id), [])
        offsets = plan.microbatch_offsets()
        b = self.job.micro_batch
        for state in self.layers.values():
            state.zero_grad()
        inflight: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        sends: list[tuple[Any, int, torch.Tensor]] = []
        losses: list[tuple[int, float]] = []
        executors: dict[tuple[int, int], tuple[int, ...]] = {}

        def executor(p: int, s: int, m: int) -> int:
            if (p, s) not in executors:
                executors[(p, s)] = plan.executor(p, s)
            return executors[(p, s)][m]

        max_stages = max(pipe.num_stages for pipe in plan.pipelines)
        max_mb = max(pipe.num_microbatches for pipe in plan.pipelines)

        def tag(kind: int, p: int, s: int, m: int) -> int:
            return ((kind * plan.num_pipelines + p) * max_stages + s) * max_mb + m

        seen_forward = seen_backward = False
        op_s: dict[str, list[float]] = {"F": [], "B": []}  # compute only, without waits
        for kind, p, s, m in ops:
            num_stages = plan.pipelines[p].num_stages
            if kind == "F":
                if s == 0:
                    x, _ = self.data.microbatch(step, (offsets[p] + m) * b, b)
                    x = to_run(x, self.dtype, self.device)
                else:
                    src = executor(p, s - 1, m)
                    x = self._boundary_buffer(self.stage.indices()[0])
                    self._recv(group, x, src, tag(0, p, s, m), "activation receive")
                    x.requires_grad_(x.is_floating_point())
                t0 = time.perf_counter()
                out = self.stage(x)
                if s == num_stages - 1:
                    _, y = self.data.microbatch(step, (offsets[p] + m) * b, b)
                    out = self.model.loss(out, to_run(y, self.dtype, self.device)) \
                        / self.loss_count
                    losses.append((offsets[p] + m, float(out.detach())))
                else:
                    dst = executor(p, s + 1, m)
                    payload = out.detach().contiguous()
                    sends.append((self._send(group, payload, dst, tag(0, p, s + 1, m)), dst,
                                  payload))
                op_s["F"].append(time.perf_counter() - t0)
                inflight[(p, s, m)] = (x, out)
                if not seen_forward:
                    seen_forward = True
                    self._maybe_fault(step, "forward", gen)
            else:
                x, out = inflight.pop((p, s, m))
                if s == num_stages - 1:
                    t0 = time.perf_counter()
                    out.backward()
                else:
                    src = executor(p, s + 1, m)
                    grad = torch.empty_like(out)
                    self._recv(group, grad, src, tag(1, p, s, m), "gradient receive")
                    t0 = time.perf_counter()
                    out.backward(grad)
                op_s["B"].append(time.perf_counter() - t0)
                if s > 0:
                    dst = executor(p, s - 1, m)
                    payload = (x.grad if x.grad is not None else torch.zeros_like(x)).contiguous()
                    sends.append((self._send(group, payload, dst, tag(1, p, s - 1, m)), dst,
                                  payload))
                if not seen_backward:
                    seen_backward = True
                    self._maybe_fault(step, "backward", gen)
        for work, peer, _ in sends:
            self._wait(work, peer, "send")
        self._all_reduce(d["rounds"])
        if losses:
            self.store.set(proto.loss_key(gen, step, self.id), json.dumps(losses))
        held = self.stage.indices()
        self.store.set(proto.timing_key(gen, step, self.id), json.dumps(
            {"layers": [held[0], held[-1] + 1] if held else [], "f_s": op_s["F"],
             "b_s": op_s["B"], "optimizer_s": self.last_optimizer_s,
             "commit_wait_s": self.last_commit_wait_s}))
        _debug(f"w{self.id} step {step} reduced")
        t_reduced = time.perf_counter()
        self.store.add(proto.reduced_key(gen, step), 1)
        verdict = self._await(proto.verdict_key(gen, step), gen).decode()
        self.last_commit_wait_s = time.perf_counter() - t_reduced
        if verdict not in (proto.COMMIT, proto.COMMIT_END):
            return False
        self._maybe_fault(step, "optimizer", gen)
        t0 = time.perf_counter()
        for state in self.layers.values():
            state.step(step)
        self.last_optimizer_s = time.perf_counter() - t0
        self.held, self.held_steps = dict(self.layers), step + 1  # other layers are now stale
        self._maybe_checkpoint(step + 1, plan, gen)
        return verdict == proto.COMMIT

    def _all_reduce(self, rounds: list[list[list[list[int]]]]) -> None:
        """Sum each bucket's gradients over the workers holding its layers, round by round."""
        for rnd in rounds:
            for workers, layer_ids in rnd:
                if self.id not in workers:
                    continue
                grads = []
                for i in layer_ids:
                    for p in self.layers[i].module.parameters():
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        grads.append(p.grad)
                if len(workers) == 1:
                    continue
                flat = torch.cat([g.reshape(-1) for g in grads])
                group = self.buckets[tuple(workers)]
                try:
                    work = group.allreduce([flat])
                except RuntimeError as exc:
                    raise CommError(f"worker {self.id}: all-reduce over {workers} failed: "
                                    f"{exc}", None) from None
                self._wait(work, None, f"all-reduce over {workers}")
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()

    # ------------------------------------------------------------------ checkpoints
    def _writes(self, plan: ExecutionPlan, layer: int) -> bool:
        """Whether this worker uploads ``layer`` (its lowest-id live holder does)."""
        holders = plan.holders(layer)
        return bool(holders) and holders[0] == self.id

    def _upload(self, kind: str, layer: int, state: LayerTrainState, **fields: Any) -> None:
        try:
            self.blobs.request({"op": "put", "kind": kind, "layer": layer,
                                "worker": self.id, **fields}, state.to_bytes())
        except BlobError as exc:
            # a checkpoint that cannot complete is not fatal: the coordinator keeps the
            # previous one; say why
            print(f"worker {self.id}: upload of layer {layer} ({kind}) refused: {exc}",
                  file=sys.stderr, flush=True)

    def _maybe_checkpoint(self, num_steps: int, plan: ExecutionPlan, gen: int) -> None:
        every = self.job.checkpoint_every
        if every <= 0 or num_steps % every:
            return
        for i, state in self.layers.items():
            if self._writes(plan, i):
                self._upload("checkpoint", i, state, step=num_steps, gen=gen)

    def _stop(self, directive: dict[str, Any]) -> None:
        """Upload the state of every layer this worker is a listed holder of, then leave."""
        for layer, workers in directive["final"].items():
            if self.id in workers and int(layer) in self.held:
                self._upload("final", int(layer), self.held[int(layer)],
                             step=directive["step"], gen=directive["gen"])


def _debug(message: str) -> None:
    if os.environ.get("CHAMELEON_DEBUG"):
        print(f"[{time.time():.3f}] {message}", file=sys.stderr, flush=True)


def worker_main(worker_id: int, host: str, port: int, address: str, incarnation: str,
                secret: bytes, replacement: bool = False) -> None:
    """Entry point of a worker process; never returns normally (exits with ``os._exit``).

    Exits 0 after the final upload, 1 on an injected or unexpected error, 3 when the
    coordinator disappeared, 4 when fenced. ``os._exit`` skips the destructors of
    abandoned process groups, which could block on connections to dead peers.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # Ctrl-C in a terminal (SIGINT) or a scheduler's SIGTERM reach the whole process
    # group; the coordinator drains the run and tells the workers when to stop, and a
    # worker whose coordinator is gone exits by its heartbeat watchdog.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = EXIT_OK
    try:
        worker = Worker(worker_id, host, port, address=address, incarnation=incarnation,
                        secret=secret, replacement=replacement)
        worker.run()
    except InjectedError:
        code = EXIT_ERROR
    except dist.DistStoreError:
        code = EXIT_COORDINATOR_GONE
    except BaseException:
        traceback.print_exc()
        code = EXIT_ERROR
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
