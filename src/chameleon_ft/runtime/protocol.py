"""The control plane's vocabulary: store keys and the messages the coordinator and the
workers exchange through the ``TCPStore``, every one sealed (``runtime.signing``).

Everything of one generation lives under ``gen{g}/`` (directive, rendezvous, error
reports, votes, verdicts): a late message from before a failure is never mistaken for a
current one, and the coordinator deletes a generation's keys once its members moved on.
Per-process keys carry the process's *incarnation* (a nonce handed out with its worker
id): a fenced process that comes back never passes for its replacement.

Every value either side acts on is sealed and opened before it is acted on; a forged or
replayed one is ignored and counted. No count is trusted: a worker's vote, readiness or
error report is a key of its own (at most ``MAX_REPORTS`` reports per worker and
generation); the counters left (``gen{g}/errors``, checkpoint progress, the fault list's
version, join slots) only say where to look, and a value beyond what the members can
write is refused, never iterated. A generation's rendezvous keys live under a prefix
only holders of the key can compute (:func:`rendezvous_tag`). Join requests come from
strangers by design: bounded, and proved (``coordinator.admission``). Bulk state travels
on ``runtime.blobs``.
"""

from __future__ import annotations

import json
import secrets
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from chameleon_ft.runtime.documents import ErrorReport as ErrorReport
from chameleon_ft.runtime.documents import JobInfo as JobInfo
from chameleon_ft.runtime.signing import (
    Opened,
    Refusals,
    Reported,
    SignedStore,
    Signer,
    merge_counts,
)

JOB_KEY = "job"
"""JSON: what every worker needs to build its model and train (see ``JobInfo``)."""
JOIN_SLOTS_KEY = "join/slots"
"""Counter a joiner increments to reserve its request's index (a hint: bounded window)."""
JOIN_NONCE_KEY = "join/nonce"
"""The current join nonce (numbered: it changes once its proofs are too many to keep)."""

COMMIT = "commit"
COMMIT_END = "commit-end"
"""Commit, then leave the generation: a planned plan change at a step boundary."""
ABORT = "abort"

CURRENT_GEN_KEY = "gen/current"
"""The newest published generation (numbered by itself): workers behind skip to it."""

FAULTS_KEY = "faults/list"
"""JSON ``[[rank, step, kind, phase], ...]`` (numbered by version); an index is a fault id."""
FAULTS_VERSION_KEY = "faults/version"
"""Counter bumped whenever the fault list changes (a hint: workers re-read the list)."""

MAX_REPORTS = 8
"""Error reports of one worker in one generation, at most (it writes one or two)."""


def message_kind(key: str) -> str:
    """The kind of message a key holds (refusals are counted by it): ``verdict``..."""
    parts = key.split("/")
    head = parts[0]
    if head.startswith("gen") and head[3:].isdigit() and len(parts) > 1:
        return "rendezvous" if parts[1] in ("world", "world-down", "bucket") else parts[1]
    if head in ("gen", "faults", "join") and len(parts) > 1:
        return f"{head}-{parts[1]}"
    return {"hb": "heartbeat"}.get(head, head)


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
    """Set when generation ``gen`` ends, whatever the reason: workers blocked in its
    collectives are released."""
    return f"gen{gen}/abort"


def ready_key(gen: int, worker: int) -> str:
    """Set by ``worker`` once it built ``gen``'s groups and loaded its state."""
    return f"gen{gen}/ready/{worker}"


def reduced_key(gen: int, step: int, worker: int) -> str:
    """``worker``'s vote: it finished ``step``'s gradient all-reduce."""
    return f"gen{gen}/reduced/{step}/{worker}"


def verdict_key(gen: int, step: int) -> str:
    """``commit``, ``commit-end`` or ``abort`` for ``step``, written once by the coordinator."""
    return f"gen{gen}/verdict/{step}"


def loss_key(gen: int, step: int, worker: int) -> str:
    """JSON ``[[global micro-batch, loss], ...]`` of the micro-batches ``worker`` ended."""
    return f"gen{gen}/loss/{step}/{worker}"


def timing_key(gen: int, step: int, worker: int) -> str:
    """JSON: compute seconds of each forward and backward op of ``worker`` in ``step``."""
    return f"gen{gen}/timing/{step}/{worker}"


def error_bell_key(gen: int) -> str:
    """Counter a worker bumps after writing an error report of ``gen`` (a hint: the
    coordinator then looks at the members' next report keys)."""
    return f"gen{gen}/errors"


def error_key(gen: int, worker: int, index: int) -> str:
    """``worker``'s ``index``-th error report of ``gen`` (JSON ``ErrorReport``)."""
    return f"gen{gen}/error/{worker}/{index}"


def world_prefix(gen: int) -> str:
    """The store prefix of generation ``gen``'s world group."""
    return f"gen{gen}/world/"


def reverse_world_prefix(gen: int) -> str:
    """The store prefix of ``gen``'s second world group (messages to a lower worker id)."""
    return f"gen{gen}/world-down/"


def bucket_prefix(gen: int, members: tuple[int, ...] | list[int]) -> str:
    """The store prefix of generation ``gen``'s all-reduce group over ``members``."""
    return f"gen{gen}/bucket/{'_'.join(map(str, members))}/"


def rendezvous_tag(signer: Signer, gen: int, salt: str) -> str:
    """The part of generation ``gen``'s rendezvous prefixes only holders of the job key
    can compute, from the ``salt`` its directive carries (a stranger cannot write them
    before the members do)."""
    return signer.derive(f"rendezvous/{gen}/{salt}")


def hidden_prefix(prefix: str, tag: str) -> str:
    """Where a group whose prefix is ``prefix`` meets (``tag``: :func:`rendezvous_tag`)."""
    return f"{prefix}{tag}/" if tag else prefix


def rendezvous_keys(groups: list[tuple[str, int]]) -> list[str]:
    """The keys gloo's rendezvous writes under each group's ``(prefix, size)``: gloo's
    own layout (torch 2.13), one per rank, pinned by ``tests/runtime/test_gloo_teardown.py``
    (retiring a generation deletes them)."""
    return [f"{prefix}/0/{rank}" for prefix, size in groups for rank in range(size)]


def checkpoint_layer_key(gen: int, step: int, layer: int) -> str:
    """JSON ``{"file", "size", "sha256", "worker"}``: ``gen`` wrote ``layer`` of the
    checkpoint after ``step`` steps."""
    return f"gen{gen}/ckpt/{step}/layer/{layer}"


def checkpoint_count_key(gen: int, step: int) -> str:
    """Counter: layer files of that checkpoint written so far (a hint: the coordinator
    then reads the layers' reports)."""
    return f"gen{gen}/ckpt/{step}/count"


def checkpoint_failed_key(gen: int, step: int) -> str:
    """Why a worker could not write its share of that checkpoint (the disk refused)."""
    return f"gen{gen}/ckpt/{step}/failed"


def memory_copies_key(worker: int) -> str:
    """JSON ``[address, port]``: where ``worker`` serves its checkpoint copies in memory."""
    return f"memcopies/{worker}"


def memory_fetched_key(gen: int, worker: int) -> str:
    """Layers ``worker`` reloaded from peers' memory in generation ``gen``."""
    return f"gen{gen}/memcopies/fetched/{worker}"


def final_more_key(gen: int, worker: int) -> str:
    """JSON list: more layers ``worker`` writes for the final checkpoint (numbered)."""
    return f"gen{gen}/final/more/{worker}"


def final_done_key(gen: int) -> str:
    """Set when the final checkpoint is complete: the workers leave."""
    return f"gen{gen}/final/done"


def heartbeat_key(worker: int, incarnation: str) -> str:
    """The process ``incarnation`` of ``worker`` writes its beat count here every beat
    (numbered by the count: an older beat is a replay)."""
    return f"hb/{worker}/{incarnation}"


def refusals_key(worker: int, incarnation: str) -> str:
    """JSON: the values the process refused, per message kind (numbered)."""
    return f"refusals/{worker}/{incarnation}"


def setup_key(worker: int, incarnation: str) -> str:
    """The generation whose groups the process last began to build (numbered by it): a
    process can stay inside a superseded generation's uninterruptible set-up."""
    return f"setup/{worker}/{incarnation}"


def worker_info_key(worker: int, incarnation: str) -> str:
    """JSON: host, pid and address of a registered process."""
    return f"worker/{worker}/{incarnation}"


def start_gen_key(worker: int, incarnation: str) -> str:
    """The first generation a process admitted later (a repaired worker) follows."""
    return f"start/{worker}/{incarnation}"


def fault_claim_key(index: int) -> str:
    """Claimed once: the first claimant fires fault ``index`` (or retracts it)."""
    return f"faults/claim/{index}"


def fault_fired_key(index: int) -> str:
    """JSON: when, where and by whom fault ``index`` fired (written just before it does)."""
    return f"faults/fired/{index}"


def dumps(doc: dict[str, Any]) -> str:
    """Compact JSON."""
    return json.dumps(doc, separators=(",", ":"))


MISSING = "missing"
"""An error slot reserved but not written (the detector's word; never produced now)."""
MALFORMED = "malformed"
"""An error report whose seal holds but whose content is not a report."""
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

    # ------------------------------------------------------------------ faults
    def publish_faults(self, faults: list[list[Any]]) -> None:
        """The injected faults ``[rank, step, kind, phase]`` (workers re-read on change)."""
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
        """``step`` commits (``end``: and the generation ends at this boundary)."""
        self.signed.put(verdict_key(gen, step), COMMIT_END if end else COMMIT)

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

    def error_slots(self, gen: int, first: int) -> tuple[ErrorReport | str, ...]:
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

    def forget_heartbeat(self, worker: int, incarnation: str) -> None:
        """A fenced process's heartbeat is no longer watched."""
        if self._watched.get(worker) == incarnation:
            del self._watched[worker]
        self._reported.drop(worker, incarnation)
        self._delete([heartbeat_key(worker, incarnation), refusals_key(worker, incarnation)])
        self.signed.forget(heartbeat_key(worker, incarnation))

    def forgeries(self) -> dict[str, Any]:
        """Values refused, per message kind: by the coordinator, by the workers (as they
        reported them), and in all."""
        workers = self._reported.total(self._watched)
        mine = self.refusals.counts()
        return {"coordinator": mine, "workers": workers, "total": merge_counts(mine, workers)}

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

    def checkpoint_files(self, gen: int, step: int,
                         num_layers: int) -> dict[int, dict[str, Any]]:
        """The layer files reported so far: layer -> ``{file, size, sha256, worker}``."""
        out = {}
        for layer in range(num_layers):
            doc = self._json(checkpoint_layer_key(gen, step, layer))
            if isinstance(doc, dict):
                out[layer] = doc
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

    def forget_checkpoint(self, gen: int, step: int, num_layers: int) -> None:
        """Delete the keys of a checkpoint that completed or was dropped."""
        self._delete([checkpoint_count_key(gen, step), checkpoint_failed_key(gen, step),
                      *(checkpoint_layer_key(gen, step, i) for i in range(num_layers))])

    def final_more(self, gen: int, worker: int, layers: list[int]) -> None:
        """Ask ``worker`` to write these layers of the final checkpoint too."""
        self._final_asks += 1
        self.signed.put(final_more_key(gen, worker), json.dumps(layers), seq=self._final_asks)

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
