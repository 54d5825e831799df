"""How a worker knows a transfer completed, on both backends' semantics.

gloo's ``wait()`` blocks and raises; NCCL's returns at once, so the worker polls
``is_completed()`` and ``exception()`` under a deadline and gives up when the generation
is aborted (``Comm._poll``). ``worker.nccl_like`` gives gloo groups NCCL's semantics, so
that the multi-process tests run that path on CPU; here both are pinned with fakes and
with ranks as threads."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from chameleon_ft.runtime.worker import groups
from chameleon_ft.runtime.worker.comm import Comm, CommError
from chameleon_ft.runtime.worker.nccl_like import NcclLikeGroup

TIMEOUT_S = 5.0


class FakeWork:
    """An operation that completes when told to, optionally with an error."""

    def __init__(self) -> None:
        self.done, self.error, self.waited = False, None, False

    def is_completed(self) -> bool:
        return self.done

    def exception(self) -> Any:
        return self.error

    def wait(self) -> bool:
        self.waited = True
        return True


def _comm(timeout_s: float = 1.0, aborted: Any = lambda: False) -> Comm:
    return Comm(0, None, {0: 0, 1: 1}, {}, polled=True,  # type: ignore[arg-type]
                timeout_s=timeout_s, aborted=aborted)


def _complete_later(work: FakeWork, after_s: float, error: Any = None) -> None:
    def finish() -> None:
        time.sleep(after_s)
        work.error = error
        work.done = True
    threading.Thread(target=finish, daemon=True).start()


def test_a_polled_wait_returns_once_complete_and_then_orders_the_stream() -> None:
    work = FakeWork()
    _complete_later(work, 0.05)
    _comm().wait(work, 1, "receive")
    assert work.done and work.waited


def test_an_operation_that_completes_with_an_error_raises_naming_the_peer() -> None:
    work = FakeWork()
    _complete_later(work, 0.01, RuntimeError("remote process exited"))
    with pytest.raises(CommError, match="remote process exited") as info:
        _comm().wait(work, 1, "receive")
    assert info.value.peer == 1 and not work.waited


def test_an_operation_that_never_completes_fails_at_its_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(CommError, match=r"did not complete within 0\.2 s"):
        _comm(timeout_s=0.2).wait(FakeWork(), 1, "receive")
    assert 0.2 <= time.monotonic() - start < 1.5


def test_an_aborted_generation_ends_a_pending_wait_at_once() -> None:
    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    start = time.monotonic()
    with pytest.raises(CommError, match="aborted"):
        _comm(timeout_s=30.0, aborted=flag.is_set).wait(FakeWork(), 1, "receive")
    assert time.monotonic() - start < 1.0


def _pair(store: dist.TCPStore, prefix: str) -> list[NcclLikeGroup]:
    out: list[Any] = [None, None]

    def build(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                               timeout=timedelta(seconds=TIMEOUT_S))
        out[rank] = groups.make_group(client, prefix, rank, 2, backend="gloo",
                                      timeout_s=TIMEOUT_S, address="127.0.0.1",
                                      nccl_like=True)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    assert all(isinstance(g, NcclLikeGroup) for g in out)
    return out


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.mark.timeout(30)
def test_nccl_like_receive_is_written_only_when_seen_complete(store: dist.TCPStore) -> None:
    """``wait()`` returns before the data is there; the poll is what makes it land."""
    a, b = _pair(store, "t1/")
    into = torch.zeros(3)
    work = b.recv([into], 0, 5)
    assert work.wait() is True and not into.any()  # returned at once, nothing written
    a.send([torch.tensor([1.0, 2.0, 3.0])], 1, 5)
    deadline = time.monotonic() + TIMEOUT_S
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert work.is_completed() and work.exception() is None
    assert into.tolist() == [1.0, 2.0, 3.0]
    a.shutdown()
    b.shutdown()


@pytest.mark.timeout(30)
def test_nccl_like_transfer_with_a_dead_peer_hangs_until_aborted(store: dist.TCPStore) -> None:
    a, b = _pair(store, "t2/")
    a.inner.shutdown()  # the peer's side is gone (gloo itself would raise at once)
    work = b.recv([torch.zeros(3)], 0, 6)
    time.sleep(0.3)
    assert not work.is_completed()  # as on NCCL: no error, no completion
    b.abort()
    deadline = time.monotonic() + TIMEOUT_S
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert isinstance(work.exception(), RuntimeError)
    comm = Comm(1, b, {0: 0, 1: 1}, {}, polled=True,  # type: ignore[arg-type]
                timeout_s=TIMEOUT_S)
    with pytest.raises(CommError, match="aborted"):
        comm.wait(b.recv([torch.zeros(1)], 0, 7), 0, "receive")


class _SlowGroup:
    """A group that is torn down by receives, as gloo's are (records them)."""

    def __init__(self) -> None:
        self.broken = False

    def name(self) -> str:
        return "gloo"

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self.broken = True
        raise RuntimeError("closed")


def test_a_set_up_past_its_deadline_is_given_up_and_torn_down_as_it_arrives() -> None:
    generation = groups.Generation(3)
    release = threading.Event()
    late = _SlowGroup()

    def connect() -> None:  # a handshake with a peer that died: stuck for several deadlines
        release.wait(10.0)
        generation.add(late, 0, 2)

    start = time.monotonic()
    with pytest.raises(CommError, match=r"did not finish within 0\.2 s"):
        groups._within(connect, generation, 0.2)
    assert time.monotonic() - start < 2.0
    assert generation.broken
    release.set()
    deadline = time.monotonic() + 5.0
    while not late.broken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late.broken  # what the abandoned set-up built later is closed at once


def test_an_aborted_generation_gives_its_set_up_up_at_once() -> None:
    generation = groups.Generation(4)
    threading.Timer(0.05, generation.break_all).start()
    start = time.monotonic()
    with pytest.raises(CommError, match="aborted during its set-up"):
        groups._within(lambda: time.sleep(10.0), generation, 30.0)
    assert time.monotonic() - start < 1.0


def test_nccl_environment_keeps_survivors_alive() -> None:
    env: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    groups.set_nccl_environment(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # abort the communicator only
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"


class _StuckGroup:
    def __init__(self, raises: bool) -> None:
        self.raises = raises

    def name(self) -> str:
        return "nccl"

    def abort(self) -> None:
        if self.raises:
            raise RuntimeError("ncclCommAbort failed")
        time.sleep(60.0)


def _abort_in_child(raises: bool) -> None:
    groups.abort_within(_StuckGroup(raises), 0.2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("raises", [False, True], ids=["hangs", "raises"])
def test_an_abort_that_cannot_finish_ends_the_process(raises: bool) -> None:
    """An NCCL abort that hangs or fails leaves the worker unable to trust its device: it
    exits with its own status (the coordinator replaces it like any dead worker)."""
    import multiprocessing

    from chameleon_ft.runtime.worker.exits import EXIT_ABORT_STUCK

    proc = multiprocessing.get_context("fork").Process(target=_abort_in_child, args=(raises,))
    start = time.monotonic()
    proc.start()
    proc.join(10.0)
    assert proc.exitcode == EXIT_ABORT_STUCK
    assert time.monotonic() - start < 5.0
