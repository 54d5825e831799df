"""The coordinator's side of the store: every key of ``runtime.protocol`` it reads, writes
or deletes, every value sealed and opened (``runtime.signing``). A worker's side is
``worker.channel``.

Pure Python (no torch): the store is duck-typed.
"""

from __future__ import annotations

import json
import secrets
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.runtime.protocol import (
    ABORT,
    COMMIT,
    COMMIT_END,
    CURRENT_GEN_KEY,
    FAULTS_KEY,
    FAULTS_VERSION_KEY,
    JOB_KEY,
    JOIN_NONCE_KEY,
    JOIN_SLOTS_KEY,
    MALFORMED,
    MAX_REPORTS,
    PROGRESS_KEY,
    STEPS_KEY,
    ErrorReport,
    JobInfo,
    ReattachReport,
    abort_key,
    checkpoint_count_key,
    checkpoint_failed_key,
    checkpoint_layer_key,
    directive_key,
    dumps,
    error_bell_key,
    error_key,
    fault_claim_key,
    fault_fired_key,
    final_done_key,
    final_more_key,
    heartbeat_key,
    hidden_prefix,
    join_reply_key,
    join_request_key,
    loss_key,
    memory_fetched_key,
    message_kind,
    probe_key,
    ready_key,
    reattach_key,
    reduced_key,
    refusals_key,
    rendezvous_keys,
    rendezvous_tag,
    setup_key,
    start_gen_key,
    timing_key,
    verdict_key,
    worker_info_key,
)
from chameleon_ft.runtime.signing import (
    Opened,
    Refusals,
    Reported,
    SignedStore,
    Signer,
    merge_counts,
)

MAX_REFUSAL_REPLIES = 64
"""Refusal replies left in the store at once (a joiner deletes its own; beyond, the oldest
are deleted)."""
MAX_FOLLOWED = 256
"""Generations and steps whose votes are followed at once (older ones are forgotten)."""


@dataclass
class _Reports:
    """What the coordinator found so far of one generation's error reports."""

    bell: int = 0
    """The hint counter as last read."""
    next: dict[int, int] = field(default_factory=dict)
    """Per member: the index of its next report."""
    found: list[ErrorReport | str] = field(default_factory=list)
    """Every report found, in the order found."""


def _followed(table: dict[Any, Any], key: Any, new: Callable[[], Any]) -> Any:
    """``table[key]``, made with ``new`` if missing; the oldest entry goes beyond
    ``MAX_FOLLOWED``."""
    if key not in table and len(table) >= MAX_FOLLOWED:
        table.pop(next(iter(table)))
    return table.setdefault(key, new())


class ControlStore:
    """The coordinator's side of the store: every key it reads, writes or deletes, every
    value sealed and opened through :class:`~chameleon_ft.runtime.signing.SignedStore`.

    ``store`` is a ``torch.distributed.TCPStore`` (duck-typed: this module imports no
    torch). No read here blocks (a read is one ``compare_set`` that changes nothing), so
    the coordinator's loop never waits on a worker, and no loop here runs longer than the
    job's members, layers and bounds allow, whatever a counter says.

    Args:
        store: the coordinator's store client.
        signer: the job's signer (default: a private key, for a store no worker shares).
        refusals: where refused values are counted (default: counted, not logged).
    """

    def __init__(self, store: Any, signer: Signer | None = None,
                 refusals: Refusals | None = None) -> None:
        self.store = store
        self.signer = signer or Signer.private()
        self.refusals = refusals or Refusals(kind_of=message_kind)
        self.signed = SignedStore(store, self.signer, self.refusals)
        self._groups: dict[int, list[tuple[str, int]]] = {}
        """Per published generation: its process groups ``(hidden prefix, size)``."""
        self._world: dict[int, tuple[int, ...]] = {}
        """Per published generation: its members."""
        self._reports: dict[int, _Reports] = {}
        self._ready: dict[int, set[int]] = {}
        self._votes: dict[tuple[int, int], set[int]] = {}
        self._watched: dict[int, str] = {}
        """The processes whose heartbeats were read last: worker -> incarnation."""
        self._reported = Reported(self.signed, refusals_key)
        self._faults_version = 0
        self._final_asks = 0
        self._refusal_replies: deque[str] = deque()

    def _delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            try:
                self.store.delete_key(key)
            except Exception:  # a key already gone, or the store closing
                continue

    def _json(self, key: str, source: str | None = None) -> Any:
        """The JSON sealed at ``key`` (None: absent, refused or not JSON)."""
        opened = self.signed.peek(key, source=source)
        if opened is None:
            return None
        try:
            return json.loads(opened.payload)
        except ValueError:
            self.refusals.refuse(key, opened.payload, "sealed but not JSON", source=source)
            return None

    def set_job(self, info: JobInfo) -> None:
        """Publish what every worker needs to know of the job."""
        self.signed.put(JOB_KEY, info.to_json())

    def job(self) -> JobInfo | None:
        """The job as published (None: not yet, or refused)."""
        opened = self.signed.peek(JOB_KEY)
        return None if opened is None else JobInfo.from_json(opened.payload)

    def progress(self, count: int) -> None:
        """The loop's progress value, numbered ``count`` (the workers watch it move)."""
        self.signed.put(PROGRESS_KEY, "", seq=count)

    def reattach_report(self, worker: int) -> ReattachReport | None:
        """What ``worker`` reported to this coordinator taking the run over (None: nothing
        yet, or refused: forged, of another term, or not a report of that worker)."""
        key = reattach_key(worker)
        opened = self.signed.peek(key, source=f"worker {worker}")
        if opened is None:
            return None
        try:
            report = ReattachReport.from_json(opened.payload)
        except ValueError:
            report = None
        if report is None or report.worker != worker:
            self.refusals.refuse(key, opened.payload, "sealed but not a re-attach report",
                                 source=f"worker {worker}")
            return None
        return report

    def forget_reports(self, num_workers: int) -> None:
        """Delete the re-attach reports (the run was taken over)."""
        self._delete(reattach_key(w) for w in range(num_workers))

    # ------------------------------------------------------------------ faults
    def publish_faults(self, faults: list[list[Any]]) -> None:
        """The injected faults ``[rank, step, kind, phase, factor, steps]`` (workers re-read
        on change)."""
        self._faults_version += 1
        self.signed.put(FAULTS_KEY, json.dumps(faults), seq=self._faults_version)
        self.store.add(FAULTS_VERSION_KEY, 1)

    def claim_fault(self, index: int) -> bool:
        """Claim fault ``index`` so that it never fires (False: it fired already)."""
        return self.signed.claim(fault_claim_key(index), f"coordinator/{secrets.token_hex(8)}")

    def fired(self, index: int) -> dict[str, Any] | None:
        """When, where and by whom fault ``index`` fired, or None."""
        doc = self._json(fault_fired_key(index))
        return doc if isinstance(doc, dict) else None

    # ------------------------------------------------------------------ generations
    def publish(self, gen: int, directive: dict[str, Any],
                groups: list[tuple[str, int]]) -> None:
        """End ``gen - 1`` (its abort key); publish ``gen``'s directive with the salt of
        its rendezvous prefixes."""
        salt = secrets.token_hex(8)
        tag = rendezvous_tag(self.signer, gen, salt)
        if gen > 0:
            self.signed.put(abort_key(gen - 1), "1")
        self._groups[gen] = [(hidden_prefix(prefix, tag), size) for prefix, size in groups]
        self._world[gen] = tuple(int(w) for w in directive.get("world", ()))
        self.signed.put(directive_key(gen), dumps({**directive, "rendezvous": salt}))
        self.signed.put(CURRENT_GEN_KEY, str(gen), seq=gen)

    def abort(self, gen: int, step: int) -> None:
        """Abort ``step`` and generation ``gen`` (workers in its collectives are released)."""
        self.signed.put(verdict_key(gen, step), ABORT)
        self.signed.put(abort_key(gen), "1")

    def commit(self, gen: int, step: int, *, end: bool) -> None:
        """``step`` commits (``end``: and the generation ends at this boundary); the job's
        progress says so to idle workers."""
        self.signed.put(verdict_key(gen, step), COMMIT_END if end else COMMIT)
        self.signed.put(STEPS_KEY, str(step + 1), seq=step + 1)

    def forget_step(self, gen: int, step: int) -> None:
        """Delete a committed step's votes and verdict (every worker read them)."""
        voters = self._world.get(gen, ())
        self._votes.pop((gen, step), None)
        self._delete([verdict_key(gen, step), *(reduced_key(gen, step, w) for w in voters)])

    def _count(self, done: set[int], keys: dict[int, str]) -> int:
        """``done`` grown by the members whose key in ``keys`` holds a sealed value; the
        keys are opened only once all exist (one request while any is missing)."""
        missing = {w: key for w, key in keys.items() if w not in done}
        if missing and self.signed.all_present(list(missing.values())):
            done.update(w for w, key in missing.items()
                        if self.signed.peek(key, source=f"worker {w}") is not None)
        return len(done)

    def ready(self, gen: int) -> int:
        """Members of ``gen`` known to have built their groups and loaded their state."""
        done = _followed(self._ready, gen, set)
        return self._count(done, {w: ready_key(gen, w) for w in self._world.get(gen, ())})

    def reduced(self, gen: int, step: int, workers: Iterable[int]) -> int:
        """``workers`` known to have reduced ``step`` in ``gen`` (each by its own vote)."""
        done = _followed(self._votes, (gen, step), set)
        return self._count(done, {w: reduced_key(gen, step, w) for w in workers})

    def error_reports(self, gen: int, first: int) -> tuple[ErrorReport | str, ...]:
        """``gen``'s error reports from the ``first``-th on, in the order found: each
        member's next report key is looked at when the bell moved (a forged report stays
        refused until the member's own is written over it and the bell moves again)."""
        found = _followed(self._reports, gen, _Reports)
        bell = int(self.store.add(error_bell_key(gen), 0))
        if bell != found.bell:
            world = self._world.get(gen, ())
            if bell > found.bell + MAX_REPORTS * len(world):
                self.refusals.refuse(error_bell_key(gen), str(bell).encode(),
                                     "a count beyond what the members can report",
                                     kind="errors-count")
            found.bell = bell
            for w in world:
                self._scan_reports(gen, w, found)
        return tuple(found.found[first:])

    def _scan_reports(self, gen: int, worker: int, found: _Reports) -> None:
        index = found.next.get(worker, 0)
        while index < MAX_REPORTS:
            opened = self.signed.peek(error_key(gen, worker, index), source=f"worker {worker}")
            if opened is None:
                break
            try:
                report: ErrorReport | str = ErrorReport.from_json(opened.payload)
            except ValueError:
                report = MALFORMED
            if isinstance(report, ErrorReport) and report.worker != worker:
                report = MALFORMED
            found.found.append(report)
            index += 1
        found.next[worker] = index

    def beats(self, incarnations: dict[int, str]) -> dict[int, tuple[str, int]]:
        """Each process's highest sealed beat count: worker -> (incarnation, count)."""
        for w, inc in list(self._watched.items()):
            if incarnations.get(w) != inc:
                self._reported.drop(w, inc)
        self._watched = dict(incarnations)
        out = {}
        for w, inc in incarnations.items():
            beat = self.signed.latest(heartbeat_key(w, inc), source=f"worker {w}")
            out[w] = (inc, 0 if beat is None else beat.seq)
        return out

    def forget_process(self, worker: int, incarnation: str) -> None:
        """A fenced process is no longer watched: its refusals are kept in the sum, and
        its heartbeat, refusals, registration, set-up and start keys are deleted."""
        if self._watched.get(worker) == incarnation:
            del self._watched[worker]
        self._reported.drop(worker, incarnation)
        keys = [heartbeat_key(worker, incarnation), refusals_key(worker, incarnation),
                worker_info_key(worker, incarnation), setup_key(worker, incarnation),
                start_gen_key(worker, incarnation), probe_key(worker, incarnation)]
        self._delete(keys)
        for key in keys:
            self.signed.forget(key)

    def forgeries(self) -> dict[str, Any]:
        """Values refused, per message kind: by the coordinator, by the workers (as they
        reported them), and in all."""
        workers = self._reported.total(self._watched)
        mine = self.refusals.counts()
        return {"coordinator": mine, "workers": workers, "total": merge_counts(mine, workers)}

    def probes(self, incarnations: dict[int, str]) -> dict[int, tuple[int, float]]:
        """The newest sealed probe of each process: worker -> (its number, its factor);
        a process without one, or whose probe is not a finite number, is left out."""
        out = {}
        for w, inc in incarnations.items():
            opened = self.signed.latest(probe_key(w, inc), source=f"worker {w}")
            if opened is None:
                continue
            try:
                factor = float(json.loads(opened.payload)["factor"])
            except (ValueError, TypeError, KeyError):
                continue
            out[w] = (opened.seq, factor)
        return out

    def registered(self, worker: int, incarnation: str) -> bool:
        """Whether the process ``incarnation`` of ``worker`` announced itself."""
        return self.signed.peek(worker_info_key(worker, incarnation),
                                source=f"worker {worker}") is not None

    def absent(self, gen: int, incarnations: dict[int, str]) -> dict[int, int | None]:
        """Members of ``gen`` that never began to build its groups, each with the
        generation whose groups it began last (None: none)."""
        setup = {w: self.setup_gen(w, inc) for w, inc in incarnations.items()}
        return {w: g for w, g in setup.items() if g is None or g < gen}

    def setup_gen(self, worker: int, incarnation: str) -> int | None:
        """The generation whose groups the process last began to build (None: none)."""
        opened = self.signed.latest(setup_key(worker, incarnation), source=f"worker {worker}")
        return None if opened is None else opened.seq

    def start_from(self, worker: int, incarnation: str, gen: int) -> None:
        """A repaired worker follows generations from ``gen`` on."""
        self.signed.put(start_gen_key(worker, incarnation), str(gen))

    def _take(self, key: str, worker: int) -> Opened | None:
        """The sealed value at ``key``, deleted (whatever it was)."""
        raw = self.signed.raw_peek(key)
        if raw is None:
            return None
        self._delete([key])
        return self.signed.open(key, raw, source=f"worker {worker}")

    def take_losses(self, gen: int, step: int, workers: list[int]) -> list[tuple[int, float]]:
        """The losses the workers reported for ``step``: ``(global micro-batch, loss)``."""
        pieces: list[tuple[int, float]] = []
        for w in workers:
            opened = self._take(loss_key(gen, step, w), w)
            if opened is not None:
                pieces.extend((int(mb), float(v)) for mb, v in json.loads(opened.payload))
        return pieces

    def take_timings(self, gen: int, step: int, workers: list[int]) -> list[dict[str, Any]]:
        """The per-op compute times the workers reported for ``step``."""
        out = []
        for w in workers:
            opened = self._take(timing_key(gen, step, w), w)
            if opened is not None:
                out.append({"step": step, "gen": gen, "worker": w, **json.loads(opened.payload)})
        return out

    def retire(self, gen: int, first_step: int, last_step: int, world: list[int]) -> None:
        """Delete every key of a generation whose members all moved on."""
        members = sorted(set(world) | set(self._world.pop(gen, ())))
        found = self._reports.pop(gen, _Reports())
        self._ready.pop(gen, None)
        keys = [directive_key(gen), abort_key(gen), error_bell_key(gen)]
        keys += [k for w in members for k in (ready_key(gen, w), memory_fetched_key(gen, w))]
        keys += [error_key(gen, w, i) for w in members
                 for i in range(min(found.next.get(w, 0) + 1, MAX_REPORTS))]
        # the committed steps and the one in flight when the generation ended
        for step in range(first_step, last_step + 2):
            self._votes.pop((gen, step), None)
            keys.append(verdict_key(gen, step))
            keys += [k for w in members for k in (reduced_key(gen, step, w),
                                                  loss_key(gen, step, w),
                                                  timing_key(gen, step, w))]
        keys += rendezvous_keys(self._groups.pop(gen, []))
        self._delete(keys)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_progress(self, gen: int, step: int) -> int:
        """Layer files of the checkpoint after ``step`` steps reported so far (a hint)."""
        return int(self.store.add(checkpoint_count_key(gen, step), 0))

    def checkpoint_files(self, gen: int, step: int, num_layers: int, tp: int = 1
                         ) -> dict[tuple[int, int | None], dict[str, Any]]:
        """The layer files reported so far: ``(layer, shard)`` -> ``{file, size, sha256,
        worker}`` (``shard`` None at ``tp = 1``; else each rank's shard, design 4.11)."""
        out = {}
        shards: list[int | None] = [None] if tp == 1 else list(range(tp))
        for layer in range(num_layers):
            for shard in shards:
                doc = self._json(checkpoint_layer_key(gen, step, layer, shard))
                if isinstance(doc, dict):
                    out[(layer, shard)] = doc
        return out

    def memory_fetched(self, gen: int) -> int:
        """Layers generation ``gen``'s workers reloaded from peers' memory so far."""
        total = 0
        for w in self._world.get(gen, ()):
            opened = self.signed.peek(memory_fetched_key(gen, w), source=f"worker {w}")
            if opened is not None and opened.payload.isdigit():
                total += int(opened.payload)
        return total

    def checkpoint_failure(self, gen: int, step: int) -> str | None:
        """Why a worker could not write its share, or None."""
        opened = self.signed.peek(checkpoint_failed_key(gen, step))
        return None if opened is None else opened.text()

    def forget_checkpoint(self, gen: int, step: int, num_layers: int, tp: int = 1) -> None:
        """Delete the keys of a checkpoint that completed or was dropped."""
        shards: list[int | None] = [None] if tp == 1 else list(range(tp))
        self._delete([checkpoint_count_key(gen, step), checkpoint_failed_key(gen, step),
                      *(checkpoint_layer_key(gen, step, i, r) for i in range(num_layers)
                        for r in shards)])

    def final_more(self, gen: int, worker: int, layers: list[int], *, attempt: int = 1,
                   upload: bool = False) -> None:
        """Ask ``worker`` to write these layers of the final checkpoint (attempt
        ``attempt``; ``upload``: over the bulk channel, into the run folder)."""
        self._final_asks += 1
        self.signed.put(final_more_key(gen, worker),
                        json.dumps({"layers": layers, "attempt": attempt, "upload": upload}),
                        seq=self._final_asks)

    def final_done(self, gen: int) -> None:
        """The final checkpoint is complete: the workers leave."""
        self.signed.put(final_done_key(gen), "1")

    # ------------------------------------------------------------------ joins
    def join_slots(self) -> int:
        """Join request slots reserved so far (a hint: anyone can count)."""
        return int(self.store.add(JOIN_SLOTS_KEY, 0))

    def take_join_request(self, index: int) -> bytes | None:
        """The ``index``-th join request, removed (None: not written yet); unsealed."""
        raw = self.signed.raw_peek(join_request_key(index))
        if raw is not None:
            self._delete([join_request_key(index)])
        return raw

    def join_nonce(self, nonce: str, seq: int) -> None:
        """Publish the join nonce that proofs must now be made with."""
        self.signed.put(JOIN_NONCE_KEY, nonce, seq=seq)

    def reply(self, wnonce: str, text: str, *, refusal: bool = False) -> None:
        """Answer the join request of ``wnonce`` (a refusal's key is deleted once
        ``MAX_REFUSAL_REPLIES`` later ones were written)."""
        key = join_reply_key(wnonce)
        self.signed.put(key, text)
        if refusal:
            self._refusal_replies.append(key)
            if len(self._refusal_replies) > MAX_REFUSAL_REPLIES:
                self._delete([self._refusal_replies.popleft()])
