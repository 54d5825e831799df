"""A stranger on the job's network: it reaches the coordinator's store port and knows the
open protocol (``runtime.protocol``), but not the token. Run by ``test_hostile_netns.py``
in a network namespace of its own.

It forges every message type either side acts on, each ahead of its real writer
(``compare_set`` with an empty expected value: a write only where nothing is yet, so it
stands in for a forger that is faster than the real writer, never for one that deletes),
replays a recorded join request and recorded sealed values, and floods the counters and
the join slots. What it did is written as JSON to ``--out`` when the store stops
answering (the run ended) or ``--limit-s`` passed.

Usage::

    python hostile_client.py HOST PORT --replay REQUEST.json --out DONE.json

It may start before the coordinator (it connects once the port listens), and plays the
recorded request back once the file exists.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.signing import Forged, payload_of

FORGED_TAG = b"0." + b"0" * 32 + b"."
"""A value with a sealed value's form and a tag made up."""


class Stranger:
    """The forger's state: what it learnt of the run and what it did."""

    def __init__(self, store: Any, replay: Path) -> None:
        self.store, self.replay = store, replay
        self.did: Counter[str] = Counter()
        self.flooded: set[str] = set()
        self.planted: set[str] = set()
        self.recorded: dict[str, bytes] = {}
        """Sealed values seen, to play back later."""
        self.replayed: Counter[str] = Counter()
        self.committed = False
        """Whether a step committed (every worker read the fault list by then)."""
        self.started_s = time.monotonic()

    def plant(self, kind: str, key: str, value: bytes | str) -> None:
        """Write ``value`` at ``key`` unless something is there already."""
        data = value.encode() if isinstance(value, str) else value
        if bytes(self.store.compare_set(key, b"", data)) == data and key not in self.planted:
            self.planted.add(key)
            self.did[kind] += 1

    def flood(self, kind: str, key: str, amount: int) -> None:
        if key not in self.flooded:
            self.flooded.add(key)
            self.store.add(key, amount)
            self.did[kind] += 1

    def read(self, key: str) -> bytes | None:
        value = bytes(self.store.compare_set(key, b"\x01", b"\x01"))
        return None if value == b"\x01" else value

    def doc(self, key: str) -> Any:
        raw = self.read(key)
        try:
            return None if raw is None else json.loads(payload_of(raw))
        except (Forged, ValueError):
            return None

    def once(self) -> None:
        """One round of forgeries against what the run shows now."""
        raw = self.read(proto.CURRENT_GEN_KEY)
        if raw is None:
            return
        gen = int(payload_of(raw))
        self.recorded.setdefault(f"current/{gen}", raw)
        directive = self.doc(proto.directive_key(gen)) or {}
        world = [int(w) for w in directive.get("world", range(4))]
        self.next_generations(gen, world)
        self.next_steps(gen, world, directive)
        self.once_only()
        self.play_back_request()
        self.play_back(gen, directive)
        self.rendezvous(gen)

    def next_generations(self, gen: int, world: list[int]) -> None:
        for g in range(gen + 1, gen + 5):
            migration = {"transfers": [[0, 0, 9, 0, 1]], "rounds": [[0]]}
            self.plant("directive", proto.directive_key(g), json.dumps(
                {"action": "train", "gen": g, "world": [*world, 9], "migration": migration,
                 "incarnations": {}, "step": 0, "steps": 10**6}))
            self.plant("abort", proto.abort_key(g), FORGED_TAG + b"1")
            self.plant("final", proto.final_done_key(g), "1")
            for w in world:
                self.plant("ready", proto.ready_key(g, w), "1")
                self.plant("error", proto.error_key(g, w, 0), proto.ErrorReport(
                    w, True, None, "forged: exit at once").to_json())
        self.flood("errors-count", proto.error_bell_key(gen + 1), 10**9)

    def next_steps(self, gen: int, world: list[int], directive: dict[str, Any]) -> None:
        first = int(directive.get("step", 0))
        verdicts = [int(k.rsplit("/", 1)[1]) for k in self.store.list_keys()
                    if k.startswith(f"gen{gen}/verdict/")]
        first = max([first, *(s + 1 for s in verdicts)])
        self.committed = self.committed or bool(verdicts)
        for step in range(first, first + 3):
            self.plant("verdict", proto.verdict_key(gen, step), proto.COMMIT)
            for w in world:
                self.plant("reduced", proto.reduced_key(gen, step, w), "1")
                self.plant("loss", proto.loss_key(gen, step, w), "[[0, 1e9]]")
            for after in (step + 1, step + 2):
                self.plant("ckpt", proto.checkpoint_failed_key(gen, after), "forged")
                self.plant("ckpt", proto.checkpoint_layer_key(gen, after, 0), json.dumps(
                    {"file": "../../etc/passwd", "size": 1, "sha256": "0", "worker": 0}))
                self.flood("ckpt-count", proto.checkpoint_count_key(gen, after), 10**6)

    def once_only(self) -> None:
        if self.committed and "faults-list" not in self.did:
            # over the real list once every worker read it (a step committed): before,
            # it would only deny a worker its faults, which a stranger may do
            self.store.set(proto.FAULTS_KEY, json.dumps([[w, 0, "kill", "forward"]
                                                         for w in range(4)]))
            self.store.add(proto.FAULTS_VERSION_KEY, 1000)
            self.did["faults-list"] += 1
        if "join-flood" in self.did:
            return
        for index in range(8):
            self.plant("faults-claim", proto.fault_claim_key(index), "1")
        self.flood("join-flood", proto.JOIN_SLOTS_KEY, 10**6)
        self.store.add(proto.JOIN_SLOTS_KEY, 3)  # reserved, never written
        self.did["join-slot"] += 3
        for i in range(40):  # requests without the token: bounded refusals
            index = self.store.add(proto.JOIN_SLOTS_KEY, 1) - 1
            text = "{not json" if i % 2 else json.dumps(
                {"wnonce": f"stranger{i}", "proof": "0" * 64, "job": "", "host": f"h{i}",
                 "address": "198.18.0.99"})
            self.store.set(proto.join_request_key(index), text)
        self.did["join-bad"] += 40

    def play_back_request(self) -> None:
        """A recorded join request played back (once it was recorded)."""
        if "join-replay" in self.did or not self.replay.exists():
            return
        recorded = self.replay.read_bytes()
        for _ in range(2):
            index = self.store.add(proto.JOIN_SLOTS_KEY, 1) - 1
            self.store.set(proto.join_request_key(index), recorded)
        self.did["join-replay"] += 2

    def play_back(self, gen: int, directive: dict[str, Any]) -> None:
        """Recorded sealed values written back at their own keys, and forged beats; a few
        times each, spaced (each stands until its real writer writes again)."""
        if gen >= 1 and self.replayed["gen-current"] < 1 and "current/0" in self.recorded:
            self.store.set(proto.CURRENT_GEN_KEY, self.recorded["current/0"])
            self.replayed["gen-current"] += 1
            self.did["gen-current"] += 1
        elapsed = time.monotonic() - self.started_s
        if self.replayed["heartbeat"] >= 6 or elapsed < 1.0 * self.replayed["heartbeat"]:
            return
        keys = [proto.heartbeat_key(int(w), str(inc))
                for w, inc in dict(directive.get("incarnations", {})).items()]
        for key in keys:
            value = self.read(key)
            if value is not None:
                self.recorded.setdefault(key, value)
        # for 0.2 s (two beats, a tenth of the hang deadline), an older beat or a forged
        # one stands at each worker's key: the coordinator reads some of them
        for burst in range(8):
            for key in keys:
                old = self.recorded.get(key)
                self.store.set(key, old if old is not None and burst % 2 else FORGED_TAG)
            time.sleep(0.025)
        self.replayed["heartbeat"] += 1
        self.did["heartbeat"] += 1

    def rendezvous(self, gen: int) -> None:
        """A member's rendezvous value copied to the other members' keys (best effort:
        the prefix is known only once a member wrote under it)."""
        for key in self.store.list_keys():
            if key.startswith(f"gen{gen}/world/") and key.endswith("//0/0"):
                value = self.read(key)
                if value is not None:
                    for rank in range(1, 4):
                        self.plant("rendezvous", key[:-1] + str(rank), value)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--replay", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit-s", type=float, default=150.0)
    args = parser.parse_args()
    end = time.monotonic() + args.limit_s
    store = None
    while store is None and time.monotonic() < end:  # started before the coordinator
        try:
            store = dist.TCPStore(args.host, args.port, is_master=False,
                                  timeout=timedelta(seconds=5))
        except Exception:  # not listening yet
            time.sleep(0.2)
    stranger = Stranger(store, Path(args.replay))
    try:
        while time.monotonic() < end:
            stranger.once()
            time.sleep(0.03)
    except Exception as exc:  # the run ended: its store is gone
        stranger.did["ended: " + type(exc).__name__] += 1
    with open(args.out, "w") as f:
        json.dump(dict(stranger.did), f)


if __name__ == "__main__":
    main()
