"""Process handling the end-to-end tests share."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def kill_groups(*procs: subprocess.Popen[str]) -> None:
    """SIGKILL every process group started here (each command and its workers), by id,
    and reap the leaders (bounded)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
