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

The coordinator reads and writes all of this through ``coordinator.store.ControlStore``,
a worker through ``worker.channel.Channel``.
"""

from __future__ import annotations

import json
from typing import Any

from chameleon_ft.runtime.documents import ErrorReport as ErrorReport
from chameleon_ft.runtime.documents import JobInfo as JobInfo
from chameleon_ft.runtime.documents import ReattachReport as ReattachReport
from chameleon_ft.runtime.signing import Signer

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

PROGRESS_KEY = "coordinator/progress"
"""Numbered by the coordinator's loop, which advances it as it polls (not the store's own
thread): a worker that sees it frozen for the hang deadline takes the coordinator for
gone, as one that refuses connections."""

FAULTS_KEY = "faults/list"
"""JSON ``[[rank, step, kind, phase, factor, steps], ...]`` (numbered by version; factor
and steps null but for a ``slow`` fault); an index is a fault id."""
FAULTS_VERSION_KEY = "faults/version"
"""Counter bumped whenever the fault list changes (a hint: workers re-read the list)."""

STEPS_KEY = "steps/committed"
"""The committed steps so far (numbered by them): how an idle worker follows the job's
steps (a slowdown lasts so many of them)."""

MAX_REPORTS = 8
"""Error reports of one worker in one generation, at most (it writes one or two)."""


def message_kind(key: str) -> str:
    """The kind of message a key holds (refusals are counted by it): ``verdict``..."""
    parts = key.split("/")
    head = parts[0]
    if head.startswith("gen") and head[3:].isdigit() and len(parts) > 1:
        group = parts[1].startswith(("plane", "tp")) or parts[1] in ("world", "world-down",
                                                                     "bucket")
        return "rendezvous" if group else parts[1]
    if head in ("gen", "faults", "join", "coordinator") and len(parts) > 1:
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


def in_plane(prefix: str, plane: int | None) -> str:
    """Where a generation's group of prefix ``prefix`` (one of the three above) lives for
    the ranks of tensor-parallel plane ``plane`` (``gen{g}/plane{r}/...``: design 4.11;
    None: a job without tensor parallelism, the prefix itself)."""
    if plane is None:
        return prefix
    head, rest = prefix.split("/", 1)
    return f"{head}/plane{plane}/{rest}"


def tp_prefix(gen: int, worker: int) -> str:
    """The store prefix of ``worker``'s tensor-parallel group in generation ``gen``."""
    return f"gen{gen}/tp{worker}/"


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


def checkpoint_layer_key(gen: int, step: int, layer: int, shard: int | None = None) -> str:
    """JSON ``{"file", "size", "sha256", "worker"}``: ``gen`` wrote ``layer`` of the
    checkpoint after ``step`` steps (``shard``: tensor-parallel rank ``shard`` wrote its
    shard of it, ``{..., "shard", "degree"}``)."""
    key = f"gen{gen}/ckpt/{step}/layer/{layer}"
    return key if shard is None else f"{key}/tp{shard}"


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
    """JSON ``{"layers", "attempt", "upload"}`` (numbered): the layers ``worker`` writes
    for the final checkpoint's attempt ``attempt`` (their first writer is gone, or an
    attempt failed; ``upload``: over the bulk channel into the run folder, the checkpoint
    folder refused them)."""
    return f"gen{gen}/final/more/{worker}"


def final_done_key(gen: int) -> str:
    """Set when the final checkpoint is complete: the workers leave."""
    return f"gen{gen}/final/done"


def reattach_key(worker: int) -> str:
    """JSON ``ReattachReport``: what ``worker`` holds, for a coordinator that took the run
    over (sealed for its term)."""
    return f"reattach/{worker}"


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


def probe_key(worker: int, incarnation: str) -> str:
    """JSON ``{"factor": F}`` (numbered): a probe of the idle process ``incarnation``, its
    time over its own probe at start (a slow worker out of the plan, fail-slow)."""
    return f"probe/{worker}/{incarnation}"


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
"""A join slot reserved but not written (yet)."""
MALFORMED = "malformed"
"""An error report whose seal holds but whose content is not a report, or a join request
that is not one."""
REPLAYED = "replayed"
"""A join request whose proof was used before (refused, counted, never answered)."""
