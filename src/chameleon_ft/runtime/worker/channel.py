"""A worker's side of the control plane: every key it reads or writes, each value sealed
and opened (``runtime.signing``), and the store its process groups meet in.

One :class:`Channel` per store connection (the training thread's, the heartbeat's, the
abort watcher's, the checkpoint writer's); they share the job's signer, the process's
refusal counts and the numbering of its error reports (:class:`Shared`). A value the
coordinator wrote is acted on only once its seal holds: a forged one is counted and
waited past (the coordinator's own value is written over it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.signing import (
    Forged,
    Opened,
    Refusals,
    SignedStore,
    Signer,
    control_key,
    payload_of,
)

WAIT_SLICE_S = 0.5
"""Granularity of the worker's waits on the coordinator: each slice it checks that the
coordinator still answers and that its generation is still current."""
FORGED_POLL_S = 0.005
"""How often a wait that found a forged value looks again."""
KEPT_GENERATIONS = 8
"""Generations whose error-report numbering a process remembers."""


class GenerationOver(RuntimeError):
    """The coordinator moved on past the generation this worker waits in."""


def read_job(raw: Any, secret: bytes) -> tuple[proto.JobInfo, Signer]:
    """The job's description from the store, its seal checked, and the job's signer.

    Raises:
        ValueError: when the store holds no job of this version, or one not sealed with
            this job's secret (a wrong token, or a forged job).
    """
    value = bytes(raw.get(proto.JOB_KEY))
    try:
        job = proto.JobInfo.from_json(payload_of(value))
    except Forged:
        raise ValueError("the store does not hold a chameleon job of this version") from None
    signer = Signer(control_key(secret), job.job_id, job.term)
    try:
        signer.open(proto.JOB_KEY, value)
    except Forged:
        raise ValueError("the job in the store is not sealed with this job's token (a wrong "
                         "token, or a forged job)") from None
    return job, signer


class Shared:
    """What a worker process's channels share.

    Args:
        signer: the job's signer.
        worker: the worker id.
        incarnation: this process's incarnation.
        warn: receives each warning line about refused values.
    """

    def __init__(self, signer: Signer, worker: int, incarnation: str,
                 warn: Callable[[str], None] | None = None, *, member: bool = True,
                 shard: int | None = None) -> None:
        self.signer, self.worker, self.incarnation = signer, worker, incarnation
        self.member = member
        """Whether this process is its worker in the control plane: rank 0 of a worker
        of ``[job] tp = k`` (design 4.11). The other ranks read what the coordinator
        writes and write nothing the control plane counts (no registration, beat,
        readiness, vote, report); only their checkpoint shards' reports."""
        self.shard = shard
        """This process's tensor-parallel rank at ``tp > 1`` (its checkpoint reports are
        per shard), else None."""
        self.refusals = Refusals(warn, kind_of=proto.message_kind)
        self.lock = threading.Lock()
        self.reports: dict[int, int] = {}
        """Per recent generation: error reports written."""
        self.fetched: dict[int, int] = {}
        """Per recent generation: layers reloaded from peers' memory."""
        self.refusals_written = 0

    def next_report(self, gen: int) -> int | None:
        """The index of this process's next error report of ``gen`` (None: none left)."""
        with self.lock:
            index = self.reports.get(gen, 0)
            if index >= proto.MAX_REPORTS:
                return None
            self.reports[gen] = index + 1
            for old in sorted(self.reports)[:-KEPT_GENERATIONS]:
                del self.reports[old]
            return index


class Channel:
    """One store connection of a worker process, through the job's seal.

    Args:
        raw: the store client (``TCPStore``).
        shared: what the process's channels share.
    """

    def __init__(self, raw: Any, shared: Shared) -> None:
        self.raw, self.shared = raw, shared
        self.signed = SignedStore(raw, shared.signer, shared.refusals)
        self.worker, self.incarnation = shared.worker, shared.incarnation

    def on(self, raw: Any) -> Channel:
        """A channel over another connection of the same process."""
        return Channel(raw, self.shared)

    # ------------------------------------------------------------------ the coordinator's
    def current_gen(self) -> int:
        """The newest generation the coordinator published (0 before any)."""
        opened = self.signed.latest(proto.CURRENT_GEN_KEY)
        return 0 if opened is None else opened.seq

    def _present(self, key: str) -> Opened | None:
        """Wait one slice for ``key``; its sealed value, or None (absent, or refused). A
        coordinator that is only slow is waited for (a dead one fails the request)."""
        try:
            self.raw.wait([key], timedelta(seconds=WAIT_SLICE_S))
        except dist.DistStoreError:
            return None
        opened = self.signed.peek(key)
        if opened is None:
            time.sleep(FORGED_POLL_S)  # a forged value: the coordinator writes over it
        return opened

    def await_value(self, key: str, gen: int | None = None) -> bytes:
        """Wait for the coordinator's value at ``key``, in slices, for as long as it
        answers, past forged values.

        Args:
            key: the key.
            gen: the generation the wait belongs to; once the coordinator has published a
                later one, this generation is over and the wait is abandoned, unless the
                value was written meanwhile (the coordinator writes a step's verdict before
                it publishes the next generation: a verdict that lands between a slice's
                end and the look at the current generation must still be read, or a
                committed step would be skipped here and applied everywhere else).

        Raises:
            GenerationOver: when the coordinator moved on.
        """
        while True:
            opened = self._present(key)
            if opened is not None:
                return opened.payload
            if gen is not None and self.current_gen() > gen:
                opened = self.signed.peek(key)
                if opened is not None:
                    return opened.payload
                raise GenerationOver(f"generation {gen} is over")

    def directive(self, gen: int,
                  again: Callable[[], None] | None = None) -> tuple[int, dict[str, Any]]:
        """The directive of ``gen``, or of the newest generation if the coordinator has
        moved past ``gen`` (a generation that is not the newest is over); ``again`` is
        called before each slice of the wait (a re-attached worker's report, an idle slow
        worker's probe)."""
        while True:
            if again is not None:
                again()
            gen = max(gen, self.current_gen())
            key = proto.directive_key(gen)
            opened = self._present(key)
            if opened is None:
                continue
            try:
                doc = json.loads(opened.payload)
            except ValueError:
                doc = None  # sealed by the coordinator, so never: acting on it would be worse
            if isinstance(doc, dict):
                return gen, doc
            time.sleep(FORGED_POLL_S)

    def start_gen(self) -> int:
        """The first generation a repaired worker follows."""
        return int(self.await_value(proto.start_gen_key(self.worker, self.incarnation)))

    def progress(self) -> int | None:
        """The coordinator's progress value (None: none yet, or refused)."""
        opened = self.signed.latest(proto.PROGRESS_KEY)
        return None if opened is None else opened.seq

    def aborted(self, gen: int) -> bool:
        """Wait one slice for ``gen``'s abort; whether it was aborted."""
        return self._present(proto.abort_key(gen)) is not None

    def final(self, gen: int) -> tuple[bool, dict[str, Any] | None]:
        """Whether the final checkpoint is over, and the coordinator's latest ask of this
        worker: ``{"layers", "attempt", "upload"}`` (``protocol.final_more_key``; None:
        none yet)."""
        if self.signed.peek(proto.final_done_key(gen)) is not None:
            return True, None
        more = self.signed.latest(proto.final_more_key(gen, self.worker))
        if more is None:
            return False, None
        try:
            ask = json.loads(more.payload)
        except ValueError:
            ask = None  # sealed by the coordinator, so never
        return False, ask if isinstance(ask, dict) else None

    def rendezvous_tag(self, gen: int, directive: dict[str, Any]) -> str:
        """The hidden part of ``gen``'s rendezvous prefixes (``protocol.rendezvous_tag``)."""
        return proto.rendezvous_tag(self.shared.signer, gen, str(directive.get("rendezvous", "")))

    # ------------------------------------------------------------------ this worker's
    def register(self, info: dict[str, Any]) -> None:
        """Announce this process (host, pid, address)."""
        if not self.shared.member:
            return
        self.signed.put(proto.worker_info_key(self.worker, self.incarnation), json.dumps(info))

    def reattach(self, report: str) -> None:
        """Tell a coordinator that took the run over what this worker holds (JSON
        ``ReattachReport``, sealed for its term): rank 0's alone at ``tp > 1``, the
        worker's other ranks hold what it holds (design 4.11)."""
        if not self.shared.member:
            return
        self.signed.put(proto.reattach_key(self.worker), report)

    def began(self, gen: int) -> None:
        """This process begins to build ``gen``'s groups."""
        if not self.shared.member:
            return
        self.signed.put(proto.setup_key(self.worker, self.incarnation), str(gen), seq=gen)

    def ready(self, gen: int) -> None:
        """This worker built ``gen``'s groups and loaded its state."""
        if not self.shared.member:
            return
        self.signed.put(proto.ready_key(gen, self.worker), self.incarnation)

    def reduced(self, gen: int, step: int) -> None:
        """This worker's vote: it reduced ``step``."""
        if not self.shared.member:
            return
        self.signed.put(proto.reduced_key(gen, step, self.worker), self.incarnation)

    def report(self, gen: int, report: proto.ErrorReport) -> bool:
        """Write an error report of ``gen`` (False: this process wrote its last one)."""
        if not self.shared.member:
            return False
        index = self.shared.next_report(gen)
        if index is None:
            return False
        self.signed.put(proto.error_key(gen, self.worker, index), report.to_json())
        self.raw.add(proto.error_bell_key(gen), 1)
        return True

    def step_report(self, gen: int, step: int, losses: list[Any] | None,
                    timing: dict[str, Any]) -> None:
        """The losses of the micro-batches this worker ended, and its timings."""
        if not self.shared.member:
            return
        if losses:
            self.signed.put(proto.loss_key(gen, step, self.worker), json.dumps(losses))
        self.signed.put(proto.timing_key(gen, step, self.worker), json.dumps(timing))

    def committed_steps(self) -> int:
        """The job's committed steps so far, as the coordinator last said (0: none)."""
        opened = self.signed.latest(proto.STEPS_KEY)
        return 0 if opened is None else opened.seq

    def probe(self, seq: int, factor: float) -> None:
        """Probe number ``seq`` of this idle process: its time over its own at start."""
        if not self.shared.member:
            return
        self.signed.put(proto.probe_key(self.worker, self.incarnation),
                        json.dumps({"factor": factor}), seq=seq)

    def fetched(self, gen: int, layers: int) -> None:
        """``layers`` more layers reloaded from peers' memory in ``gen``."""
        if not self.shared.member:
            return
        with self.shared.lock:
            total = self.shared.fetched[gen] = self.shared.fetched.get(gen, 0) + layers
            for old in sorted(self.shared.fetched)[:-KEPT_GENERATIONS]:
                del self.shared.fetched[old]
        self.signed.put(proto.memory_fetched_key(gen, self.worker), str(total))

    def beat(self, count: int) -> None:
        """Heartbeat number ``count`` (and the refusals, when they changed); returns once
        the coordinator's store answered (a ``set`` is never answered: the ``check`` after
        it is, so a stopped coordinator is seen here as before)."""
        if not self.shared.member:
            return
        key = proto.heartbeat_key(self.worker, self.incarnation)
        self.signed.put(key, "", seq=count)
        self.flush_refusals()
        self.raw.check([key])

    def flush_refusals(self) -> None:
        """Tell the coordinator what this process refused, when that changed."""
        if not self.shared.member:
            return
        refusals = self.shared.refusals
        version = refusals.version
        if version == self.shared.refusals_written:
            return
        self.signed.put(proto.refusals_key(self.worker, self.incarnation),
                        json.dumps(refusals.counts()), seq=version)
        self.shared.refusals_written = version

    def layer_written(self, gen: int, step: int, layer: int, doc: dict[str, Any]) -> None:
        """A layer file of the checkpoint after ``step`` steps is written (at ``tp > 1``
        this rank's shard of it)."""
        key = proto.checkpoint_layer_key(gen, step, layer, self.shared.shard)
        self.signed.put(key, json.dumps(doc))
        self.raw.add(proto.checkpoint_count_key(gen, step), 1)

    def checkpoint_failed(self, gen: int, step: int, why: str) -> None:
        """This worker could not write its share of that checkpoint."""
        self.signed.put(proto.checkpoint_failed_key(gen, step), why)

    def serve_copies(self, address: str, port: int) -> None:
        """Where this worker serves its checkpoint copies in memory."""
        self.signed.put(proto.memory_copies_key(self.worker), json.dumps([address, port]))

    def copies_of(self, holder: int) -> tuple[str, int] | None:
        """Where ``holder`` serves its copies (None: it never said)."""
        opened = self.signed.peek(proto.memory_copies_key(holder))
        if opened is None:
            return None
        host, port = json.loads(opened.payload)
        return str(host), int(port)

    # ------------------------------------------------------------------ faults
    def faults_version(self) -> int:
        """The fault list's version counter (a hint that it changed)."""
        return int(self.raw.add(proto.FAULTS_VERSION_KEY, 0))

    def faults(self) -> list[Any]:
        """The injected faults (empty: none, or none sealed)."""
        opened = self.signed.latest(proto.FAULTS_KEY)
        doc = [] if opened is None else json.loads(opened.payload)
        return doc if isinstance(doc, list) else []

    def claim_fault(self, index: int, pid: int) -> bool:
        """Claim fault ``index`` for this process (False: claimed before)."""
        return self.signed.claim(proto.fault_claim_key(index),
                                 f"{self.worker}/{self.incarnation}/{pid}")

    def fired(self, index: int, doc: dict[str, Any]) -> None:
        """Fault ``index`` fires now (when, where, by whom)."""
        self.signed.put(proto.fault_fired_key(index), json.dumps(doc))

    def rendezvous(self, timeout_s: float) -> RendezvousStore:
        """The store this process's groups meet in (``timeout_s``: how long a read waits
        for a member's sealed value when the group gives no deadline of its own)."""
        return RendezvousStore(self.signed, timeout_s)


class RendezvousStore(dist.Store):
    """The store a generation's process groups meet in (under ``dist.PrefixStore``): what
    gloo's or NCCL's rendezvous writes is sealed, what it reads is opened, and a read waits
    past forged values for the member's own (or until its deadline).

    Keep a reference for as long as the groups live: torch calls these methods through the
    Python object.
    """

    def __init__(self, signed: SignedStore, timeout_s: float) -> None:
        super().__init__()
        self.signed = signed
        self.timeout_s = timeout_s

    def set(self, key: str, value: Any) -> None:
        self.signed.put(key, bytes(value))

    def _sealed(self, key: str, deadline: float) -> bytes:
        while True:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise dist.DistStoreError(f"rendezvous: no sealed value at {key!r} in time")
            try:
                self.signed.raw.wait([key], timedelta(seconds=min(left_s, WAIT_SLICE_S)))
            except dist.DistStoreError:
                continue
            opened = self.signed.peek(key)
            if opened is not None:
                return opened.payload
            time.sleep(FORGED_POLL_S)

    def get(self, key: str) -> bytes:
        return self._sealed(key, time.monotonic() + self.timeout_s)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit_s = self.timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit_s
        for key in keys:
            self._sealed(key, deadline)

    def check(self, keys: list[str]) -> bool:
        return all(self.signed.peek(key) is not None for key in keys)

    def add(self, key: str, value: int) -> int:
        # no rendezvous of ours counts; a counter proves nothing, so nothing acts on one
        return int(self.signed.raw.add(key, value))

    def delete_key(self, key: str) -> bool:
        return bool(self.signed.raw.delete_key(key))

    def num_keys(self) -> int:
        return int(self.signed.raw.num_keys())
