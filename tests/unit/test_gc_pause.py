"""The collector pause around estimates: nested and concurrent pauses share one, and the
collector's own state comes back."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from chameleon_ft.perf.gcpause import gc_paused


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_nested_pauses_resume_the_collector_once_the_outer_one_ends() -> None:
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_already_off_stays_off() -> None:
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_the_collector_resumes_after_an_error() -> None:
    with pytest.raises(ValueError, match="boom"), gc_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_concurrent_pauses_end_with_the_last_one() -> None:
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=other)
    with gc_paused():
        thread.start()
        assert inside.wait(5)
    assert not gc.isenabled()  # the other thread's pause still holds
    release.set()
    thread.join(5)
    assert not thread.is_alive()
    assert gc.isenabled()
