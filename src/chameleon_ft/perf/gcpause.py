"""Planning work with Python's cyclic garbage collector paused.

An estimate of a rerouted stage of the 16k job builds about 70,000 small lists and tuples
(its operation graph); every few hundred allocations start a collection, and the older
generations' collections walk every object the process keeps, the planner's caches of
plans and timelines included: more than half of that estimate's time, and a third of a
cold decision's. Reference counting frees what the planning core drops (it makes no
reference cycles of its own), so pausing the cyclic collector around an estimate changes
nothing but the time; anything cyclic is collected once it resumes. (Around a whole
decision it does not pay: the collection of what the decision keeps only moves to its
end.)
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_paused = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the cyclic collector off.

    Nested and concurrent blocks (a background precompute next to a decision's estimates)
    share one pause: the collector comes back, if it was on, when the last of them ends.
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


__all__ = ["gc_paused"]
