"""The control plane's vocabulary: store keys and the messages the coordinator and the
workers exchange through the ``TCPStore``.

Everything of one generation lives under ``gen{g}/``: the directive (plan, schedule,
migration, what to load), the process groups' rendezvous, error reports, the per-step
"reduced" counters and the commit verdicts. A new generation never reads an old one's
keys, so a late message from before a failure cannot be mistaken for a current one; the
coordinator deletes a generation's keys once every live worker has moved past it.

Per-process keys carry the process's *incarnation* (a nonce the coordinator hands out
when a process takes a worker id), so a fenced process that comes back (a hung remote
worker that is continued) can never pass for the replacement that took its id.

Messages from many writers (error reports, join requests) go into numbered slots: a
writer reserves a slot with a counter, then writes it. The coordinator reads the slots in
order and checks a key exists before it reads it, so no read in its watch loop ever
blocks; a slot reserved by a writer that died before writing is skipped after the hang
deadline; a malformed message is ignored. Bulk state (checkpoints, the final state) does not travel here: see
``runtime.blobs``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

JOB_KEY = "job"
"""JSON: what every worker needs to build its model and train (see ``JobInfo``)."""
JOIN_SLOTS_KEY = "join/slots"
"""Counter a remote worker increments to reserve the index of its join request (it then
writes the request; the coordinator skips a slot left unwritten past the hang deadline)."""

COMMIT = "commit"
COMMIT_END = "commit-end"
"""Commit, then leave the generation: a planned plan change at a step boundary."""
ABORT = "abort"

CURRENT_GEN_KEY = "gen/current"
"""The newest published generation (workers that fell behind skip to it)."""

FAULTS_KEY = "faults/list"
"""JSON list of injected faults ``[rank, step, kind, phase]``; the index is the fault's id."""
FAULTS_VERSION_KEY = "faults/version"
"""Counter bumped whenever the fault list changes (workers re-read it at each step)."""


def join_request_key(index: int) -> str:
    """The ``index``-th join request (JSON ``JoinRequest``)."""
    return f"join/req/{index}"


def join_reply_key(wnonce: str) -> str:
    """The coordinator's answer to the join request with nonce ``wnonce``."""
    return f"join/reply/{wnonce}"


def directive_key(gen: int) -> str:
    """JSON directive of generation ``gen``."""
    return f"gen{gen}/directive"


def abort_key(gen: int) -> str:
    """Set when generation ``gen`` ends, whatever the reason (failure, retry, a planned
    switch, the end of training): workers blocked in its collectives are released."""
    return f"gen{gen}/abort"


def ready_key(gen: int) -> str:
    """Counter: workers that finished building groups and loading state."""
    return f"gen{gen}/ready"


def reduced_key(gen: int, step: int) -> str:
    """Counter: workers that finished ``step``'s gradient all-reduce."""
    return f"gen{gen}/reduced/{step}"


def verdict_key(gen: int, step: int) -> str:
    """``commit``, ``commit-end`` or ``abort`` for ``step``, written once by the coordinator."""
    return f"gen{gen}/verdict/{step}"


def loss_key(gen: int, step: int, worker: int) -> str:
    """JSON ``[[global micro-batch, loss], ...]`` of the micro-batches ``worker`` ended."""
    return f"gen{gen}/loss/{step}/{worker}"


def timing_key(gen: int, step: int, worker: int) -> str:
    """JSON: compute seconds of each forward and backward op of ``worker`` in ``step``."""
    return f"gen{gen}/timing/{step}/{worker}"


def error_slot_key(gen: int) -> str:
    """Counter a worker increments to reserve the index of its error report (it then
    writes the report; the coordinator skips a slot left unwritten past the deadline)."""
    return f"gen{gen}/error_slots"


def error_key(gen: int, index: int) -> str:
    """The ``index``-th error report (JSON ``ErrorReport``)."""
    return f"gen{gen}/error/{index}"


def world_prefix(gen: int) -> str:
    """The store prefix of generation ``gen``'s world group."""
    return f"gen{gen}/world/"


def reverse_world_prefix(gen: int) -> str:
    """The store prefix of generation ``gen``'s second world group (point-to-point
    messages to a lower worker id; the first carries those to a higher one)."""
    return f"gen{gen}/world-down/"


def bucket_prefix(gen: int, members: tuple[int, ...] | list[int]) -> str:
    """The store prefix of generation ``gen``'s all-reduce group over ``members``."""
    return f"gen{gen}/bucket/{'_'.join(map(str, members))}/"


def rendezvous_keys(groups: list[tuple[str, int]]) -> list[str]:
    """The keys gloo's rendezvous writes under each group's ``(prefix, size)``.

    Gloo's own layout (torch 2.13): one key per rank under the prefix. Only retiring a
    generation uses it, to delete those keys; ``tests/runtime/test_gloo_teardown.py``
    pins it, so a torch whose layout differs fails a test instead of leaking keys.
    """
    return [f"{prefix}/0/{rank}" for prefix, size in groups for rank in range(size)]


def checkpoint_layer_key(gen: int, step: int, layer: int) -> str:
    """JSON ``{"file", "size", "sha256", "worker"}``: layer ``layer`` of the checkpoint
    after ``step`` steps was written by generation ``gen``."""
    return f"gen{gen}/ckpt/{step}/layer/{layer}"


def checkpoint_count_key(gen: int, step: int) -> str:
    """Counter: layer files of that checkpoint written so far."""
    return f"gen{gen}/ckpt/{step}/count"


def checkpoint_failed_key(gen: int, step: int) -> str:
    """Why a worker could not write its share of that checkpoint (the disk refused)."""
    return f"gen{gen}/ckpt/{step}/failed"


def memory_copies_key(worker: int) -> str:
    """JSON ``[address, port]``: where worker ``worker`` serves the checkpoint copies it
    holds in memory (``worker/memcopies.py``)."""
    return f"memcopies/{worker}"


def memory_fetched_key(gen: int) -> str:
    """Counter: layers generation ``gen``'s workers reloaded from peers' memory."""
    return f"gen{gen}/memcopies/fetched"


def final_more_key(gen: int, worker: int) -> str:
    """JSON list: more layers ``worker`` writes for the final checkpoint (their first
    writer is gone)."""
    return f"gen{gen}/final/more/{worker}"


def final_done_key(gen: int) -> str:
    """Set when the final checkpoint is complete: the workers leave."""
    return f"gen{gen}/final/done"


def heartbeat_key(worker: int, incarnation: str) -> str:
    """Counter the process ``incarnation`` of ``worker`` increments every heartbeat."""
    return f"hb/{worker}/{incarnation}"


def setup_key(worker: int, incarnation: str) -> str:
    """The generation whose groups the process ``incarnation`` of ``worker`` last began to
    build (gloo's group set-up cannot be interrupted: a process can stay inside a superseded
    generation's set-up until that generation's deadline)."""
    return f"setup/{worker}/{incarnation}"


def worker_info_key(worker: int, incarnation: str) -> str:
    """JSON: host, pid and address of a registered process."""
    return f"worker/{worker}/{incarnation}"


def start_gen_key(worker: int, incarnation: str) -> str:
    """The first generation a process admitted later (a repaired worker) follows."""
    return f"start/{worker}/{incarnation}"


def fault_claim_key(index: int) -> str:
    """Counter: the first process to increment it fires fault ``index`` (it fires once)."""
    return f"faults/claim/{index}"


def fault_fired_key(index: int) -> str:
    """JSON: when, where and by whom fault ``index`` fired (written just before it does)."""
    return f"faults/fired/{index}"


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
    checkpoint_dir: str = ""
    """The run's checkpoint folder on the coordinator's host (a worker that sees it there,
    with this job's marker, writes and reads its layer files itself)."""
    device: str = "cpu"
    """``cpu`` or ``cuda``: where workers compute."""
    storage_gb_per_s: float = 0.1
    """Checkpoint folder bandwidth: write and read deadlines are sized by it."""
    bulk_gb_per_s: float = 0.1
    """Bulk channel bandwidth: transfer deadlines are sized by it."""
    memory_copies: bool = False
    """Checkpoints in memory (``[recovery] memory_checkpoint``): each written layer is
    also copied into a worker's memory on another node."""
    workers_per_node: int = 1
    """Workers per node (``worker // workers_per_node`` is a worker's node)."""
    nccl_semantics: bool = False
    """Run gloo groups behind NCCL's completion semantics (``worker.nccl_like``): how the
    tests exercise the NCCL path on CPU."""

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


@dataclass(frozen=True)
class ErrorReport:
    """What a worker tells the coordinator when something went wrong in its step."""

    worker: int
    fatal: bool
    """True when the worker is going away (an exception in its own code)."""
    peer: int | None
    """The worker on the other end of the failed operation, when known."""
    message: str
    corrupt_step: int | None = None
    """Set when the report is a checkpoint (after this many steps) whose file does not
    match its manifest: the worker read it to load and refused it."""

    def to_json(self) -> str:
        """Serialise."""
        return json.dumps({"worker": self.worker, "fatal": self.fatal, "peer": self.peer,
                           "message": self.message, "corrupt_step": self.corrupt_step})

    @classmethod
    def from_json(cls, text: str | bytes) -> ErrorReport:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: for a malformed report.
        """
        try:
            d = json.loads(text)
            corrupt = d.get("corrupt_step")
            return cls(worker=int(d["worker"]), fatal=bool(d["fatal"]),
                       peer=None if d["peer"] is None else int(d["peer"]),
                       message=str(d["message"]),
                       corrupt_step=None if corrupt is None else int(corrupt))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError("malformed error report") from None


def dumps(doc: dict[str, Any]) -> str:
    """Compact JSON."""
    return json.dumps(doc, separators=(",", ":"))


MISSING = "missing"
"""An error slot reserved but not written (yet)."""
MALFORMED = "malformed"
"""An error slot whose content is not a report."""


class ControlStore:
    """The coordinator's side of the store: every key it reads, writes or deletes.

    ``store`` is a ``torch.distributed.TCPStore`` (duck-typed: this module imports no
    torch). No read here blocks: a key is checked before it is read, so the coordinator's
    loop never waits on a worker.
    """

    def __init__(self, store: Any) -> None:
        self.store = store
        self._groups: dict[int, list[tuple[str, int]]] = {}
        """Per published generation: its process groups ``(prefix, size)``."""

    def has(self, key: str) -> bool:
        """Whether ``key`` exists."""
        return bool(self.store.check([key]))

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.store.delete_key(key)
            except Exception:  # a key already gone, or the store closing
                continue

    def set_job(self, info: JobInfo) -> None:
        """Publish what every worker needs to know of the job."""
        self.store.set(JOB_KEY, info.to_json())

    # ------------------------------------------------------------------ faults
    def publish_faults(self, faults: list[list[Any]]) -> None:
        """The injected faults ``[rank, step, kind, phase]`` (workers re-read on change)."""
        self.store.set(FAULTS_KEY, json.dumps(faults))
        self.store.add(FAULTS_VERSION_KEY, 1)

    def claim_fault(self, index: int) -> bool:
        """Claim fault ``index`` so that it never fires (False: it fired already)."""
        return int(self.store.add(fault_claim_key(index), 1)) == 1

    def fired(self, index: int) -> dict[str, Any] | None:
        """When, where and by whom fault ``index`` fired, or None."""
        key = fault_fired_key(index)
        if not self.has(key):
            return None
        doc: dict[str, Any] = json.loads(self.store.get(key))
        return doc

    # ------------------------------------------------------------------ generations
    def publish(self, gen: int, directive: dict[str, Any],
                groups: list[tuple[str, int]]) -> None:
        """End generation ``gen - 1`` (its abort key) and publish ``gen``'s directive."""
        if gen > 0:
            self.store.set(abort_key(gen - 1), "1")
        self._groups[gen] = groups
        self.store.set(directive_key(gen), dumps(directive))
        self.store.set(CURRENT_GEN_KEY, str(gen))

    def abort(self, gen: int, step: int) -> None:
        """Abort ``step`` and generation ``gen`` (workers in its collectives are released)."""
        self.store.set(verdict_key(gen, step), ABORT)
        self.store.set(abort_key(gen), "1")

    def commit(self, gen: int, step: int, *, end: bool) -> None:
        """``step`` commits (``end``: and the generation ends at this boundary)."""
        self.store.set(verdict_key(gen, step), COMMIT_END if end else COMMIT)

    def forget_step(self, gen: int, step: int) -> None:
        """Delete a committed step's counter and verdict (every worker read them)."""
        self._delete([verdict_key(gen, step), reduced_key(gen, step)])

    def ready(self, gen: int) -> int:
        """Members of ``gen`` that built their groups and loaded their state."""
        return int(self.store.add(ready_key(gen), 0))

    def reduced(self, gen: int, step: int) -> int:
        """Workers of ``gen`` that reduced ``step``."""
        return int(self.store.add(reduced_key(gen, step), 0))

    def error_slots(self, gen: int, first: int) -> tuple[ErrorReport | str, ...]:
        """``gen``'s error slots from ``first`` to the reserved count, as found."""
        slots = int(self.store.add(error_slot_key(gen), 0))
        out: list[ErrorReport | str] = []
        for index in range(first, slots):
            key = error_key(gen, index)
            if not self.has(key):
                out.append(MISSING)
                continue
            try:
                out.append(ErrorReport.from_json(self.store.get(key)))
            except ValueError:
                out.append(MALFORMED)
        return tuple(out)

    def beats(self, incarnations: dict[int, str]) -> dict[int, tuple[str, int]]:
        """Each process's heartbeat counter: worker -> (incarnation, count)."""
        return {w: (inc, int(self.store.add(heartbeat_key(w, inc), 0)))
                for w, inc in incarnations.items()}

    def forget_heartbeat(self, worker: int, incarnation: str) -> None:
        """A fenced process's heartbeat is no longer watched."""
        self._delete([heartbeat_key(worker, incarnation)])

    def registered(self, worker: int, incarnation: str) -> bool:
        """Whether the process ``incarnation`` of ``worker`` announced itself."""
        return self.has(worker_info_key(worker, incarnation))

    def absent(self, gen: int, incarnations: dict[int, str]) -> dict[int, int | None]:
        """Members of ``gen`` that never began to build its groups, each with the
        generation whose groups it began last (None: none)."""
        setup = {w: self.setup_gen(w, inc) for w, inc in incarnations.items()}
        return {w: g for w, g in setup.items() if g is None or g < gen}

    def setup_gen(self, worker: int, incarnation: str) -> int | None:
        """The generation whose groups the process last began to build (None: none)."""
        key = setup_key(worker, incarnation)
        try:
            return int(self.store.get(key)) if self.has(key) else None
        except (RuntimeError, ValueError):
            return None

    def start_from(self, worker: int, incarnation: str, gen: int) -> None:
        """A repaired worker follows generations from ``gen`` on."""
        self.store.set(start_gen_key(worker, incarnation), str(gen))

    def take_losses(self, gen: int, step: int, workers: list[int]) -> list[tuple[int, float]]:
        """The losses the workers reported for ``step``: ``(global micro-batch, loss)``."""
        pieces: list[tuple[int, float]] = []
        for w in workers:
            key = loss_key(gen, step, w)
            if self.has(key):
                pieces.extend((int(mb), float(v)) for mb, v in json.loads(self.store.get(key)))
                self._delete([key])
        return pieces

    def take_timings(self, gen: int, step: int, workers: list[int]) -> list[dict[str, Any]]:
        """The per-op compute times the workers reported for ``step``."""
        out = []
        for w in workers:
            key = timing_key(gen, step, w)
            if self.has(key):
                out.append({"step": step, "gen": gen, "worker": w,
                            **json.loads(self.store.get(key))})
                self._delete([key])
        return out

    def retire(self, gen: int, first_step: int, last_step: int, world: list[int]) -> None:
        """Delete every key of a generation whose members all moved on."""
        keys = [directive_key(gen), abort_key(gen), ready_key(gen), error_slot_key(gen),
                memory_fetched_key(gen)]
        try:
            slots = int(self.store.add(error_slot_key(gen), 0))
        except Exception:
            slots = 0
        keys += [error_key(gen, i) for i in range(slots)]
        # the committed steps and the one in flight when the generation ended
        for step in range(first_step, last_step + 2):
            keys += [reduced_key(gen, step), verdict_key(gen, step)]
            keys += [k for w in world for k in (loss_key(gen, step, w), timing_key(gen, step, w))]
        keys += rendezvous_keys(self._groups.pop(gen, []))
        self._delete(keys)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_progress(self, gen: int, step: int) -> int:
        """Layer files of the checkpoint after ``step`` steps written by ``gen``."""
        return int(self.store.add(checkpoint_count_key(gen, step), 0))

    def checkpoint_files(self, gen: int, step: int,
                         num_layers: int) -> dict[int, dict[str, Any]]:
        """The layer files reported so far: layer -> ``{file, size, sha256, worker}``."""
        out = {}
        for layer in range(num_layers):
            key = checkpoint_layer_key(gen, step, layer)
            if self.has(key):
                out[layer] = json.loads(self.store.get(key))
        return out

    def memory_fetched(self, gen: int) -> int:
        """Layers generation ``gen``'s workers reloaded from peers' memory so far."""
        return int(self.store.add(memory_fetched_key(gen), 0))

    def checkpoint_failure(self, gen: int, step: int) -> str | None:
        """Why a worker could not write its share, or None."""
        key = checkpoint_failed_key(gen, step)
        return self.store.get(key).decode() if self.has(key) else None

    def forget_checkpoint(self, gen: int, step: int, num_layers: int) -> None:
        """Delete the keys of a checkpoint that completed or was dropped."""
        self._delete([checkpoint_count_key(gen, step), checkpoint_failed_key(gen, step),
                      *(checkpoint_layer_key(gen, step, i) for i in range(num_layers))])

    def final_more(self, gen: int, worker: int, layers: list[int]) -> None:
        """Ask ``worker`` to write these layers of the final checkpoint too."""
        self.store.set(final_more_key(gen, worker), json.dumps(layers))

    def final_done(self, gen: int) -> None:
        """The final checkpoint is complete: the workers leave."""
        self.store.set(final_done_key(gen), "1")

    # ------------------------------------------------------------------ joins
    def join_slots(self) -> int:
        """Join request slots reserved so far."""
        return int(self.store.add(JOIN_SLOTS_KEY, 0))

    def take_join_request(self, index: int) -> str | bytes | None:
        """The ``index``-th join request, removed (None: not written yet)."""
        key = join_request_key(index)
        if not self.has(key):
            return None
        raw: bytes = self.store.get(key)
        self._delete([key])
        return raw

    def reply(self, wnonce: str, text: str) -> None:
        """Answer the join request of ``wnonce``."""
        self.store.set(join_reply_key(wnonce), text)
