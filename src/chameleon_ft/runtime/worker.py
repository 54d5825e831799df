"""A training worker: runs its stage of the plan, generation after generation.

The worker loop (docs/design.md section 5):

1. read the directive of generation ``g`` (plan, schedule, migration, what to load);
2. build the generation's process groups from ``PrefixStore(gen{g}/...)``: one group over
   every participating worker for point-to-point sends, one per gradient bucket;
3. receive migrated layers (parameters and AdamW moments) or load a checkpoint;
4. run steps: the schedule's forward/backward operations with sends and receives, the
   gradient all-reduce rounds, then report "reduced" and wait for the coordinator's
   verdict; apply AdamW only on ``commit``;
5. on any communication error: report it, break every connection of the generation (so
   peers blocked on this worker fail at once instead of waiting for the timeout), and go
   to step 1 with ``g + 1``.

Two helper threads, each with its own store connection: a heartbeat, and a watcher that
breaks the generation's connections as soon as the coordinator sets its abort key (so a
worker blocked on a live peer is released within milliseconds of a failure elsewhere).

Gloo note: ``ProcessGroupGloo.abort()`` does not wake operations already waiting, but a
receive that times out closes its pair, and the peer's pending operations on that pair
then fail at once. :func:`break_connections` uses that to tear a generation down.
"""

from __future__ import annotations

import contextlib
import functools
import io
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
from chameleon_ft.runtime.data import ByteCorpus, corpus_digest
from chameleon_ft.runtime.model import (
    AdamW,
    GPTShape,
    LayerState,
    StageModel,
    build_layer,
    loss_sum,
    torch_dtype,
)

_BREAK_TAG = 2_000_000_000
"""Tag of the throw-away receive that closes a pair (never sent by anyone)."""
_MIGRATION_TAG = 1_000_000_000
_WARMUP_TAG = 1_500_000_000


class InjectedError(RuntimeError):
    """The ``error`` kind of injected fault."""


class CommError(RuntimeError):
    """A send, receive or all-reduce of the current generation failed."""

    def __init__(self, message: str, peer: int | None) -> None:
        super().__init__(message)
        self.peer = peer


@dataclass(frozen=True)
class JobInfo:
    """What the coordinator tells every worker about the job (the ``job`` store key)."""

    shape: GPTShape
    dtype: str
    lr: float
    weight_decay: float
    seed: int
    micro_batch: int
    global_batch: int
    timeout_s: float
    heartbeat_s: float
    backend: str
    faults: tuple[tuple[int, int, str, str], ...]
    """``(rank, step, kind, phase)``."""
    corpus_digest: str
    checkpoint_every: int
    control_timeout_s: float
    """Deadline of one wait on the coordinator (a directive, a verdict); waits are re-armed
    as long as the coordinator's store answers."""

    def to_json(self) -> str:
        """Serialise."""
        d = dict(vars(self))
        d["shape"] = vars(self.shape)
        d["faults"] = [list(f) for f in self.faults]
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobInfo:
        """Parse :meth:`to_json` output."""
        d = json.loads(text)
        d["shape"] = GPTShape(**d["shape"])
        d["faults"] = tuple(tuple(f) for f in d["faults"])
        return cls(**d)


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


class Worker:
    """One training process: its layers, optimizer state and the generation loop."""

    def __init__(self, worker_id: int, host: str, port: int, *, address: str,
                 connect_timeout_s: float = 30.0, replacement: bool = False) -> None:
        """Connect to the coordinator's store and read the job.

        Args:
            worker_id: this worker's id (its place in every plan).
            host: the coordinator's store host.
            port: the store port.
            address: the address other workers reach this one at.
            connect_timeout_s: deadline of connecting and reading the job; later waits
                use the job's ``control_timeout_s``.
            replacement: a repaired worker rejoining a running job under a dead one's id.
        """
        self.id = worker_id
        self.replacement = replacement
        self.host, self.port, self.address = host, port, address
        self.control_timeout = timedelta(seconds=connect_timeout_s)
        self.store = self._connect()
        self.job = JobInfo.from_json(self.store.get(proto.JOB_KEY))
        self.control_timeout = timedelta(seconds=self.job.control_timeout_s)
        self.store.set_timeout(self.control_timeout)
        self.dtype = torch_dtype(self.job.dtype)
        self.backend = resolve_backend(self.job.backend)
        if self.backend == "nccl":  # pragma: no cover - needs GPUs
            self.device = torch.device("cuda", worker_id % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        digest = corpus_digest()
        if digest != self.job.corpus_digest:
            raise ValueError(f"data: this host's corpus {digest} differs from the "
                             f"coordinator's {self.job.corpus_digest}; use the same Python")
        self.corpus = ByteCorpus(self.job.shape.seq_len, seed=self.job.seed)
        self.optimizer = AdamW(lr=self.job.lr, weight_decay=self.job.weight_decay)
        self.layers: dict[int, LayerState] = {}
        """The layers of this worker's current stage (trained and updated)."""
        self.held: dict[int, LayerState] = {}
        """Every layer whose state this worker holds, valid after ``held_steps`` committed
        steps: the stage's layers plus, until the next commit, the previous stage's (a
        generation that fails before committing leaves the older placement intact, and the
        coordinator plans the next recovery from it)."""
        self.held_steps = 0
        self.last_optimizer_s: float | None = None
        """Seconds of the last optimizer step (reported with the next step's timings)."""
        self.last_commit_wait_s: float | None = None
        """Seconds from reporting "reduced" to reading the verdict, last step (the last
        worker to reduce waits only for the coordinator: the control overhead)."""
        self.stage = StageModel()
        self.faults = [f for f in self.job.faults if f[0] == worker_id]
        self.fired: set[tuple[int, int, str, str]] = set()
        self.current: _Generation | None = None
        self.graveyard: list[_Generation] = []  # old groups: destroying them could block
        self.gen_changed = threading.Condition()
        self.num_tokens_global = self.job.global_batch * self.job.shape.seq_len
        self._warm_up_kernels()

    def _warm_up_kernels(self) -> None:
        """One throw-away forward and backward through every layer kind, before joining.

        CPU matmul kernels are prepared per shape on first use (a float64 stage's first
        backward costs ~0.6 s); running the real micro-batch shapes once at start keeps
        that out of step 0 and out of the first step after a recovery that hands this
        worker a new kind of layer.
        """
        stage = StageModel()
        last = self.job.shape.num_layers - 1
        for i in sorted({0, min(1, last), last}):
            stage.layers[str(i)] = build_layer(self.job.shape, i, seed=0,
                                               dtype=self.dtype).to(self.device)
        x, y = self.corpus.microbatch(0, 0, self.job.micro_batch)
        loss_sum(stage(x.to(self.device)), y.to(self.device), 1).backward()
        # The first backward from a non-scalar output with a given gradient (what every
        # stage but the last runs) is slow once per process, whatever the shapes.
        hidden = stage.layers["0"](x.to(self.device))
        hidden.backward(torch.ones_like(hidden))

    # ------------------------------------------------------------------ plumbing
    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False,
                             timeout=self.control_timeout)

    def _heartbeat(self) -> None:
        store = self._connect()
        key = proto.heartbeat_key(self.id)
        while True:
            try:
                store.add(key, 1)
            except Exception:  # the coordinator is gone: nobody will ever need us again
                os._exit(3)
            time.sleep(self.job.heartbeat_s)

    def _watch(self) -> None:
        """Break the current generation's connections when the coordinator aborts it."""
        store = self._connect()
        watched = -1
        while True:
            with self.gen_changed:
                self.gen_changed.wait_for(functools.partial(self._moved_past, watched))
                gen = self.current
            assert gen is not None
            watched = gen.gen
            while True:
                try:
                    store.wait([proto.abort_key(watched)])
                    break
                except dist.DistStoreError:
                    if not _answers(store):
                        os._exit(3)
                except Exception:
                    os._exit(3)
            gen.break_all()

    def _await(self, key: str) -> bytes:
        """Wait for a key the coordinator writes, ``control_timeout_s`` at a time, for as
        long as the coordinator answers (an idle worker may wait for the whole run).

        Raises:
            DistStoreError: when the coordinator no longer answers.
        """
        while True:
            try:
                return bytes(self.store.get(key))
            except dist.DistStoreError:
                if not _answers(self.store):
                    raise

    def _moved_past(self, gen: int) -> bool:
        return self.current is not None and self.current.gen != gen

    def _report(self, fatal: bool, peer: int | None, message: str, gen: int) -> None:
        report = proto.ErrorReport(worker=self.id, fatal=fatal, peer=peer, message=message)
        index = self.store.add(proto.num_errors_key(gen), 1) - 1
        self.store.set(proto.error_key(gen, index), report.to_json())

    def _maybe_fault(self, step: int, phase: str) -> None:
        for fault in self.faults:
            rank, fstep, kind, fphase = fault
            if fstep != step or fphase != phase or fault in self.fired:
                continue
            self.fired.add(fault)
            self.store.set(proto.fault_time_key(self.id), repr(time.time()))
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                raise InjectedError(f"injected error on worker {rank} at step {step} ({phase})")

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        """Register, then follow the coordinator's generations until told to stop."""
        info = {"host": socket.gethostname(), "pid": os.getpid(), "address": self.address}
        self.store.set(proto.worker_info_key(self.id), json.dumps(info))
        threading.Thread(target=self._heartbeat, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()
        gen = 0
        if self.replacement:
            # a repaired worker: wait until the coordinator folds it into a generation
            self.faults = []  # the injected faults were for the process it replaces
            self.store.set(proto.rejoin_ready_key(self.id), "1")
            gen = int(self._await(proto.rejoin_gen_key(self.id)))
        else:
            self.store.add(proto.REGISTERED_KEY, 1)
        while True:
            directive = json.loads(self._await(proto.directive_key(gen)))
            if directive["action"] == "stop":
                self._upload_final(directive)
                return
            if self.id in directive["dead"]:
                return  # fenced: the coordinator already gave up on this worker
            try:
                self._run_generation(gen, directive)
            except Exception as exc:  # injected, or a bug: the worker is going away
                self._report(True, None, f"{type(exc).__name__}: {exc}\n"
                             f"{traceback.format_exc()}", gen)
                raise
            gen += 1

    def _run_generation(self, gen: int, d: dict[str, Any]) -> None:
        plan = ExecutionPlan.from_dict(d["plan"])
        world: list[int] = d["world"]
        if self.id not in world:
            self._set_layers({})  # idle: ``held`` stays valid until a step commits without us
            return
        generation = _Generation(gen)
        with self.gen_changed:
            if self.current is not None:
                self.graveyard.append(self.current)
            self.current = generation
            self.gen_changed.notify_all()
        try:
            world_group = self._build_groups(gen, generation, world, d["rounds"])
            self._load_state(gen, d, plan, world, world_group)
            self.store.add(proto.ready_key(gen), 1)
            if self.id not in plan.workers:
                return  # only a migration source: idle in the new plan (must not vote)
            _debug(f"w{self.id} gen {gen} ready")
            for step in range(d["step"], d["steps"]):
                if not self._run_step(gen, step, plan, d, world, world_group):
                    return
        except CommError as exc:
            self._report(False, exc.peer, str(exc), gen)
            generation.break_all()

    # ------------------------------------------------------------------ groups
    def _build_groups(self, gen: int, generation: _Generation, world: list[int],
                      rounds: list[list[list[list[int]]]]) -> dist.ProcessGroup:
        timeout_s = self.job.timeout_s
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
            raise CommError(f"building the groups of generation {gen} failed: {exc}",
                            None) from None
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
    def _set_layers(self, layers: dict[int, LayerState]) -> None:
        self.layers = layers
        self.stage = StageModel()
        for i in sorted(layers):
            self.stage.layers[str(i)] = layers[i].module

    def _new_layer(self, index: int) -> LayerState:
        module = build_layer(self.job.shape, index, seed=self.job.seed, dtype=self.dtype)
        return LayerState(module.to(self.device))

    def _load_state(self, gen: int, d: dict[str, Any], plan: ExecutionPlan, world: list[int],
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
                state = self._new_layer(i)
                blob = self.store.get(proto.restore_layer_key(gen, i))
                state.load_flat(torch.load(io.BytesIO(blob), weights_only=True)
                                .to(self.device, self.dtype))
                layers[i] = state
        migration = d.get("migration")
        if migration:
            self._migrate(migration, layers, group)
        missing = [i for i in wanted if i not in layers]
        if missing:
            raise RuntimeError(f"worker {self.id}: no state for layers {missing} in "
                               f"generation {gen}")
        self.held, self.held_steps = layers, d["step"]
        self._set_layers({i: layers[i] for i in wanted})

    def _migrate(self, migration: dict[str, Any], layers: dict[int, LayerState],
                 group: dist.ProcessGroup) -> None:
        """Run the restorer's transfers round by round: slices of flattened state."""
        transfers = migration["transfers"]
        parts: dict[int, dict[int, torch.Tensor]] = {}
        for rnd in migration["rounds"]:
            works: list[tuple[Any, int, torch.Tensor | None]] = []
            for index in rnd:
                layer, src, dst, part, num_parts = transfers[index]
                tag = _MIGRATION_TAG + index
                if src == self.id:
                    piece = torch.tensor_split(layers[layer].flat(), num_parts)[part].contiguous()
                    works.append((self._send(group, piece, dst, tag), dst, piece))
                elif dst == self.id:
                    size = torch.tensor_split(torch.empty(self._new_layer(layer).numel()),
                                              num_parts)[part].numel()
                    buf = torch.empty(size, dtype=self.dtype, device=self.device)
                    parts.setdefault(layer, {})[part] = buf
                    try:
                        work = group.recv([buf], self.world_rank[src], tag)
                    except RuntimeError as exc:
                        raise CommError(f"worker {self.id}: migration from {src} failed: "
                                        f"{exc}", src) from None
                    works.append((work, src, None))
            for work, peer, _ in works:
                self._wait(work, peer, "migration")
        expected = {t[0]: t[4] for t in transfers if t[2] == self.id}
        for layer, num_parts in expected.items():
            got = parts.get(layer, {})
            assert len(got) == num_parts, f"layer {layer}: {len(got)} of {num_parts} parts"
            state = self._new_layer(layer)
            state.load_flat(torch.cat([got[p] for p in range(num_parts)]))
            layers[layer] = state

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
                  world: list[int], group: dist.ProcessGroup) -> bool:
        """Forward/backward per the schedule, all-reduce, vote, and apply on commit.

        Returns:
            False when the coordinator aborted the step (a failure elsewhere).

        Raises:
            CommError: when a transfer or all-reduce of this worker failed.
        """
        ops = d["ops"].get(str(self.id), [])
        offsets = plan.microbatch_offsets()
        b, t, h = self.job.micro_batch, self.job.shape.seq_len, self.job.shape.hidden_size
        for p in self.stage.parameters():
            p.grad = None
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
                    x, _ = self.corpus.microbatch(step, offsets[p] + m, b)
                    x = x.to(self.device)
                else:
                    src = executor(p, s - 1, m)
                    x = torch.empty((b, t, h), dtype=self.dtype, device=self.device)
                    self._recv(group, x, src, tag(0, p, s, m), "activation receive")
                    x.requires_grad_(True)
                t0 = time.perf_counter()
                out = self.stage(x)
                if s == num_stages - 1:
                    _, y = self.corpus.microbatch(step, offsets[p] + m, b)
                    out = loss_sum(out, y.to(self.device), self.num_tokens_global)
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
                    self._maybe_fault(step, "forward")
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
                    assert x.grad is not None
                    payload = x.grad.contiguous()
                    sends.append((self._send(group, payload, dst, tag(1, p, s - 1, m)), dst,
                                  payload))
                if not seen_backward:
                    seen_backward = True
                    self._maybe_fault(step, "backward")
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
        verdict = self._await(proto.verdict_key(gen, step)).decode()
        self.last_commit_wait_s = time.perf_counter() - t_reduced
        if verdict not in (proto.COMMIT, proto.COMMIT_END):
            return False
        self._maybe_fault(step, "optimizer")
        t0 = time.perf_counter()
        for state in self.layers.values():
            self.optimizer.apply(state, step + 1)
        self.last_optimizer_s = time.perf_counter() - t0
        self.held, self.held_steps = dict(self.layers), step + 1  # other layers are now stale
        self._maybe_checkpoint(step + 1, plan)
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

    def _maybe_checkpoint(self, num_steps: int, plan: ExecutionPlan) -> None:
        every = self.job.checkpoint_every
        if every <= 0 or num_steps % every:
            return
        for i, state in self.layers.items():
            if self._writes(plan, i):
                buf = io.BytesIO()
                torch.save(state.flat().cpu(), buf)
                self.store.set(proto.checkpoint_layer_key(num_steps, i), buf.getvalue())
                self.store.add(proto.checkpoint_count_key(num_steps), 1)

    def _upload_final(self, directive: dict[str, Any]) -> None:
        """Upload the final parameters of every layer this worker is a listed holder of."""
        for layer, workers in directive["final"].items():
            if self.id not in workers:
                continue
            state = self.layers[int(layer)]
            named = {n: p.detach().cpu() for n, p in state.module.named_parameters()}
            buf = io.BytesIO()
            torch.save(named, buf)
            self.store.set(proto.final_layer_key(int(layer), self.id), buf.getvalue())


def _answers(store: dist.TCPStore) -> bool:
    """Whether the coordinator's store still answers."""
    try:
        store.check([proto.JOB_KEY])
    except Exception:
        return False
    return True


def _debug(message: str) -> None:
    if os.environ.get("CHAMELEON_DEBUG"):
        print(f"[{time.time():.3f}] {message}", file=sys.stderr, flush=True)


def local_address(host: str, port: int) -> str:
    """The address of the interface that reaches ``host:port`` (what peers should dial).

    A coordinator bound to every interface (``0.0.0.0``) has workers on other hosts, so
    its local workers advertise this host's own address rather than loopback.
    """
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    with socket.create_connection((host, port), timeout=5) as s:
        return str(s.getsockname()[0])


def worker_main(worker_id: int, host: str, port: int, address: str | None = None,
                replacement: bool = False) -> None:
    """Entry point of a worker process; never returns normally (exits with ``os._exit``).

    Exits 0 after the final upload, 1 on an injected or unexpected error, 3 when the
    coordinator disappeared. ``os._exit`` skips the destructors of abandoned process
    groups, which could block on connections to dead peers.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    code = 0
    try:
        worker = Worker(worker_id, host, port, address=address or local_address(host, port),
                        replacement=replacement)
        worker.run()
    except InjectedError:
        code = 1
    except dist.DistStoreError:
        code = 3
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
