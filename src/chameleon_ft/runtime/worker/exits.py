"""How a worker process ends, and what its exit status says.

A worker leaves with ``os._exit``: the destructors of abandoned process groups could block
on connections to dead peers (gloo) or on kernels that never finish (NCCL), and an exit
that waits on them is a hang the coordinator would have to find by silence.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

EXIT_OK = 0
"""The run ended and this worker's share of the final checkpoint is written."""
EXIT_ERROR = 1
"""An injected or unexpected error (the traceback went to the coordinator)."""
EXIT_COORDINATOR_GONE = 3
"""The coordinator stopped answering for the hang deadline, or refused connections."""
EXIT_FENCED = 4
"""The coordinator declared this process dead or replaced it."""
EXIT_ABORT_STUCK = 5
"""Aborting a generation's communicators did not finish within its deadline: the process
cannot be trusted to free them, so it leaves and its state is restored from replicas or
the checkpoint."""
EXIT_DEVICE_STALLED = 6
"""Work enqueued on the device did not complete within the hang deadline (a hung kernel
or collective): nothing in the process can interrupt it."""

EXIT_UNIT_BROKEN = 7
"""Another process of this worker (``[job] tp > 1``) failed, went silent or left: the
worker fails whole (design 4.11)."""


_last_words: list[Callable[[], None]] = []
"""Called by :func:`exit_now` before the process leaves (``before_exit``)."""


def before_exit(call: Callable[[], None]) -> None:
    """Have :func:`exit_now` call ``call`` first (a rank of a tensor-parallel worker marks
    its unit slot failed: its siblings leave at once instead of after the hang deadline)."""
    _last_words.append(call)


def exit_now(code: int, message: str) -> None:
    """Leave at once (no destructors: abandoned groups could block), saying why."""
    with contextlib.suppress(Exception):
        os.write(2, f"{message}\n".encode())
    for call in _last_words:
        with contextlib.suppress(Exception):
            call()
    os._exit(code)
