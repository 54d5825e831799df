"""The sealed control plane without processes: a value is acted on only when its seal
holds for its own key, generation, job and sequence number; refusals are counted once and
logged boundedly; no counter a stranger can set is iterated; join proofs are single-use
and join slots a bounded window."""

from __future__ import annotations

import json

import pytest

from chameleon_ft.runtime import auth
from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import slots
from chameleon_ft.runtime.coordinator import admission
from chameleon_ft.runtime.coordinator.admission import JoinDesk
from chameleon_ft.runtime.coordinator.store import ControlStore
from chameleon_ft.runtime.signing import (
    Forged,
    Refusals,
    SignedStore,
    Signer,
    control_key,
    payload_of,
)

KEY = control_key(auth.secret_of("a-test-token-of-enough-length"))


class MemStore:
    """A store with ``TCPStore``'s semantics for what the control plane uses, counting
    requests."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.requests = 0

    def set(self, key: str, value: bytes | str) -> None:
        self.requests += 1
        self.keys[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        self.requests += 1
        return self.keys[key]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self.requests += 1
        current = self.keys.get(key)
        if current is None:
            if expected == b"":
                self.keys[key] = desired
                return desired
            return expected
        if current == expected:
            self.keys[key] = desired
            return desired
        return current

    def check(self, keys: list[str]) -> bool:
        self.requests += 1
        return all(k in self.keys for k in keys)

    def add(self, key: str, n: int) -> int:
        self.requests += 1
        self.keys[key] = b"%d" % (int(self.keys.get(key, b"0")) + n)
        return int(self.keys[key])

    def delete_key(self, key: str) -> bool:
        self.requests += 1
        return self.keys.pop(key, None) is not None


def _signer(job: str = "job-1") -> Signer:
    return Signer(KEY, job)


# ---------------------------------------------------------------- the seal


def test_a_sealed_value_opens_only_at_its_own_key_generation_and_job() -> None:
    signer = _signer()
    sealed = signer.seal(proto.verdict_key(3, 4), proto.COMMIT)
    assert signer.open(proto.verdict_key(3, 4), sealed).payload == proto.COMMIT.encode()
    assert payload_of(sealed) == proto.COMMIT.encode()
    refused = {
        "another key": lambda: signer.open(proto.verdict_key(3, 5), sealed),
        "another generation": lambda: signer.open(proto.verdict_key(4, 4), sealed),
        "another job": lambda: _signer("job-2").open(proto.verdict_key(3, 4), sealed),
        "another token": lambda: Signer(control_key(b"x" * 32), "job-1").open(
            proto.verdict_key(3, 4), sealed),
        "a changed payload": lambda: signer.open(
            proto.verdict_key(3, 4), sealed.replace(b"commit", b"abort!")),
        "a changed number": lambda: signer.open(proto.verdict_key(3, 4), b"1" + sealed[1:]),
        "no seal": lambda: signer.open(proto.verdict_key(3, 4), b"commit"),
        "a forged tag": lambda: signer.open(proto.verdict_key(3, 4),
                                            b"0." + b"0" * 32 + b".commit"),
    }
    for what, attempt in refused.items():
        with pytest.raises(Forged):
            attempt()
            pytest.fail(f"{what} was accepted")


def test_a_numbered_key_refuses_an_older_value_and_keeps_the_newest() -> None:
    store = MemStore()
    refusals = Refusals(kind_of=proto.message_kind)
    signed = SignedStore(store, _signer(), refusals)
    key = proto.heartbeat_key(2, "inc")
    signed.put(key, "", seq=5)
    recorded = store.keys[key]
    signed.put(key, "", seq=9)
    latest = signed.latest(key)
    assert latest is not None and latest.seq == 9
    store.keys[key] = recorded  # a stranger replays beat 5
    latest = signed.latest(key)
    assert latest is not None and latest.seq == 9
    assert refusals.counts() == {"heartbeat": 1}
    signed.latest(key)  # read again at the next poll: counted once
    assert refusals.counts() == {"heartbeat": 1}
    store.keys[key] = _signer().seal(proto.heartbeat_key(3, "inc"), "", 10**6)  # another's
    latest = signed.latest(key)
    assert latest is not None and latest.seq == 9 and refusals.counts() == {"heartbeat": 2}


def test_refusals_warn_once_per_source_and_stop_warning() -> None:
    lines: list[str] = []
    refusals = Refusals(lines.append, kind_of=proto.message_kind, max_sources=2)
    for i in range(50):
        refusals.refuse(proto.verdict_key(0, i), b"x%d" % i, "bad tag", source=f"s{i % 5}")
    assert refusals.counts() == {"verdict": 50}
    assert len(lines) == 3 and "s0" in lines[0] and "s1" in lines[1]
    assert "more sources" in lines[2]
    refusals.refuse(proto.verdict_key(0, 1), b"x1", "bad tag", source="s1")  # seen: once
    assert refusals.counts() == {"verdict": 50}


def test_a_claim_is_won_once_and_a_forged_claim_is_replaced() -> None:
    store = MemStore()
    signed = SignedStore(store, _signer())
    key = proto.fault_claim_key(0)
    store.keys[key] = b"1"  # a stranger claims first (a counter, as the old protocol had)
    assert signed.claim(key, "worker 1")
    assert not signed.claim(key, "worker 1")  # the same process again
    assert not signed.claim(key, "coordinator")
    assert signed.refusals.counts() == {"faults": 1}


# ---------------------------------------------------------------- the coordinator's reads


def _control(world: tuple[int, ...] = (0, 1, 2, 3)) -> tuple[ControlStore, MemStore]:
    store = MemStore()
    control = ControlStore(store, _signer())
    control.publish(0, {"action": "train", "world": list(world)}, [])
    return control, store


def _report(worker: int, fatal: bool = True) -> str:
    return proto.ErrorReport(worker, fatal, None, f"worker {worker} failed").to_json()


@pytest.mark.timeout(10)
def test_a_billion_announced_reports_cost_a_bounded_look() -> None:
    control, store = _control()
    store.add(proto.error_bell_key(0), 10**9)
    before = store.requests
    assert control.error_reports(0, 0) == ()
    assert store.requests - before <= 1 + 4  # the hint, then each member's next key once
    assert control.refusals.counts() == {"errors-count": 1}


def test_forged_reports_are_refused_and_the_real_one_is_read_over_them() -> None:
    control, store = _control()
    signer = _signer()
    store.set(proto.error_key(0, 1, 0), _report(1))  # no seal
    store.set(proto.error_key(0, 2, 0), signer.seal(proto.error_key(0, 3, 0), _report(3)))
    store.set(proto.error_key(1, 3, 0), signer.seal(proto.error_key(1, 3, 0), _report(3)))
    store.add(proto.error_bell_key(0), 3)
    assert control.error_reports(0, 0) == ()  # nothing a worker wrote for generation 0
    assert control.refusals.counts() == {"error": 2}
    store.set(proto.error_key(0, 1, 0), signer.seal(proto.error_key(0, 1, 0), _report(1)))
    assert control.error_reports(0, 0) == ()  # the hint did not move: not looked at yet
    store.add(proto.error_bell_key(0), 1)
    (report,) = control.error_reports(0, 0)
    assert isinstance(report, proto.ErrorReport) and report.worker == 1 and report.fatal
    assert control.error_reports(0, 1) == ()
    assert control.refusals.counts() == {"error": 2}


def test_votes_and_readiness_count_only_each_members_sealed_key() -> None:
    control, store = _control()
    signer = _signer()
    for w in range(4):  # a stranger votes for everyone, and reports everyone ready
        store.set(proto.reduced_key(0, 7, w), "1")
        store.set(proto.ready_key(0, w), signer.seal(proto.ready_key(1, w), "i"))
    store.add("gen0/reduced/7", 10**9)  # the old counter: nothing reads it
    assert control.reduced(0, 7, [0, 1, 2, 3]) == 0
    assert control.ready(0) == 0
    for w in (0, 2):
        store.set(proto.reduced_key(0, 7, w), signer.seal(proto.reduced_key(0, 7, w), "i"))
    assert control.reduced(0, 7, [0, 1, 2, 3]) == 2
    store.set(proto.reduced_key(0, 7, 1), signer.seal(proto.reduced_key(0, 6, 1), "i"))
    assert control.reduced(0, 7, [0, 1, 2, 3]) == 2  # a vote of another step
    assert control.refusals.counts() == {"ready": 4, "reduced": 5}


def test_a_heartbeat_replayed_does_not_move() -> None:
    control, store = _control()
    signer = _signer()
    key = proto.heartbeat_key(1, "inc")
    store.set(key, signer.seal(key, "", 4))
    assert control.beats({1: "inc"}) == {1: ("inc", 4)}
    old = store.keys[key]
    store.set(key, signer.seal(key, "", 5))
    assert control.beats({1: "inc"}) == {1: ("inc", 5)}
    store.set(key, old)
    store.set(proto.heartbeat_key(2, "x"), b"999999999")  # forged for a dead worker
    assert control.beats({1: "inc", 2: "x"}) == {1: ("inc", 5), 2: ("x", 0)}
    assert control.refusals.counts() == {"heartbeat": 2}


def test_the_rendezvous_prefix_needs_the_key() -> None:
    control, store = _control()
    doc = json.loads(payload_of(store.keys[proto.directive_key(0)]))
    tag = proto.rendezvous_tag(control.signer, 0, doc["rendezvous"])
    assert len(tag) == 16 and tag != proto.rendezvous_tag(_signer("job-2"), 0, doc["rendezvous"])
    control.publish(1, {"action": "train", "world": [0]}, [])
    again = json.loads(payload_of(store.keys[proto.directive_key(1)]))["rendezvous"]
    assert again != doc["rendezvous"]  # a fresh salt per generation


# ---------------------------------------------------------------- joins


def _desk(store: MemStore) -> tuple[JoinDesk, ControlStore]:
    control = ControlStore(store, _signer())
    return JoinDesk(control, token="a-test-token-of-enough-length", job_name="tiny",
                    job_id="job-1", nonce="n0"), control


def _request(nonce: str, wnonce: str = "w1", address: str = "10.0.0.2") -> str:
    return auth.JoinRequest(wnonce=wnonce, proof="", job="", host="h", address=address
                            ).proved("a-test-token-of-enough-length", "job-1", nonce).to_json()


def _join(store: MemStore, text: str) -> None:
    index = store.add(proto.JOIN_SLOTS_KEY, 1) - 1
    store.set(proto.join_request_key(index), text)


class _Reader:
    """The shell and the control plane reading join slots, as one poll does: the reserved
    count, the window's slots (:mod:`control.slots`), each taken by the desk."""

    def __init__(self, desk: JoinDesk, hang_s: float = 1.0) -> None:
        self.desk, self.hang_s = desk, hang_s
        self.window = slots.Window()

    def poll(self, now_s: float) -> list[m.Joiner | str]:
        look = slots.look(self.window, self.desk.store.join_slots(), now_s)
        if look.skipped:
            self.desk.store.refusals.refuse(proto.JOIN_SLOTS_KEY, None, "flood",
                                            kind="join-flood")
        found = self.desk.take(look.due)
        self.window, taken, given_up = slots.settle(look.window, found, now_s=now_s,
                                                    hang_s=self.hang_s)
        for index in given_up:
            self.desk.store.refusals.refuse(proto.join_request_key(index), None, "never",
                                            kind="join-slot")
        return [t for t in taken if t != proto.REPLAYED]


def test_a_recorded_join_proof_replayed_is_refused_and_never_answered() -> None:
    store = MemStore()
    desk, control = _desk(store)
    recorded = _request("n0")
    _join(store, recorded)
    ((_, first),) = desk.take([0])
    assert isinstance(first, m.Joiner) and first.refusal is None
    desk.reply(first.request, auth.JoinReply(ok=True, worker=3, incarnation="abc"))
    _join(store, recorded)
    _join(store, recorded.replace("10.0.0.2", "10.6.6.6"))  # the same proof, elsewhere
    (_, replayed), (_, moved) = desk.take([1, 2])
    assert replayed == proto.REPLAYED
    assert isinstance(moved, m.Joiner) and moved.refusal == (
        "wrong token (check --token or CHAMELEON_TOKEN on both sides)")
    assert control.refusals.counts() == {"join-replay": 1}
    reply = auth.JoinReply.from_json(payload_of(store.keys[proto.join_reply_key("w1")]))
    assert reply.ok and reply.worker == 3  # the joiner's answer was not overwritten
    assert desk.take([0, 1, 2]) == ((0, proto.MISSING), (1, proto.MISSING), (2, proto.MISSING))


@pytest.mark.timeout(10)
def test_join_slots_are_a_bounded_window_and_unwritten_ones_block_nothing() -> None:
    store = MemStore()
    desk, control = _desk(store)
    reader = _Reader(desk, hang_s=1.0)
    store.add(proto.JOIN_SLOTS_KEY, 10**6)  # a flood of reservations, never written
    before = store.requests
    assert reader.poll(0.0) == []
    assert store.requests - before <= 1 + slots.MAX_BACKLOG
    assert len(reader.window.pending) <= slots.MAX_PENDING
    _join(store, _request("n0"))
    (item,) = reader.poll(0.01)  # read at once: the unwritten slots hold nothing up
    assert isinstance(item, m.Joiner) and item.refusal is None
    store.add(proto.JOIN_SLOTS_KEY, 2)  # reserved and never written
    reader.poll(0.02)
    assert reader.window.pending
    assert reader.poll(5.0) == [] and not reader.window.pending  # given up at the deadline
    counts = control.refusals.counts()
    assert counts["join-flood"] == 1 and counts["join-slot"] >= 2


def test_a_slot_written_late_is_read_while_it_is_waited_for() -> None:
    store = MemStore()
    desk, _ = _desk(store)
    reader = _Reader(desk, hang_s=1.0)
    store.add(proto.JOIN_SLOTS_KEY, 1)  # reserved; its joiner writes it a moment later
    assert reader.poll(0.0) == [] and list(reader.window.pending) == [0]
    store.set(proto.join_request_key(0), _request("n0"))
    assert reader.poll(0.01) == []  # looked at again only every RECHECK_S
    (item,) = reader.poll(0.01 + slots.RECHECK_S)
    assert isinstance(item, m.Joiner) and not reader.window.pending


def test_the_join_nonce_changes_once_its_proofs_are_many(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(admission, "MAX_PROOFS", 3)
    store = MemStore()
    desk, _ = _desk(store)
    reader = _Reader(desk)

    def refusals(now_s: float) -> list[str | None]:
        return [r.refusal for r in reader.poll(now_s) if isinstance(r, m.Joiner)]

    for i in range(3):
        _join(store, _request("n0", wnonce=f"a{i}"))
    assert refusals(0.0) == [None] * 3
    published = store.keys[proto.JOIN_NONCE_KEY]
    current = payload_of(published).decode()
    assert current != "n0" and desk.nonces == [current, "n0"]
    _join(store, _request("n0", wnonce="late"))  # made with the previous nonce: still good
    _join(store, _request(current, wnonce="b0"))
    assert refusals(0.1) == [None, None]
    for i in range(1, 3):
        _join(store, _request(current, wnonce=f"b{i}"))
    refusals(0.2)  # a third change: "n0" is no longer accepted
    _join(store, _request("n0", wnonce="too-late"))
    (old,) = refusals(0.3)
    assert old is not None and "wrong token" in old
    assert sum(len(u) for u in desk.used) <= 2 * admission.MAX_PROOFS
