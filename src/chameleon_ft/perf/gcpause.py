"""Planning work with Python's cyclic garbage collector paused.

An estimate of a rerouted stage of the 16k job builds about 70,000 small lists and tuples
(its operation graph); every few hundred allocations start a collection, and the older
generations' collections walk every object the process keeps, the planner's caches of
plans and timelines included: more than half of that estimate's time, and a third of a
cold decision's. Reference counting frees what the planning core drops (it makes no
reference cycles of its own), so pausing the cyclic collector around a decision or an
estimate changes nothing but the time; anything cyclic is collected once it resumes.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_depth = 0
_paused = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the cyclic collector off.

    Nested and concurrent blocks (a background precompute next to a decision) share one
    pause: the collector comes back, if it was on, when the last of them ends.
    """
    global _depth, _paused
    with _lock:
        if _depth == 0:
            _paused = gc.isenabled()
            if _paused:
                gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _paused:
                _paused = False
                gc.enable()


def with_gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run inside :func:`gc_paused`."""

    @functools.wraps(fn)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        with gc_paused():
            return fn(*args, **kwargs)

    return paused


__all__ = ["gc_paused", "with_gc_paused"]
