"""The coordinator's children (``run_in_child``): a value back, an error in one line, and
never a child left behind, whatever it does."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from chameleon_ft.runtime.coordinator.launcher import ChildError, run_in_child


def _fail(message: str) -> None:
    raise ValueError(message)


def _hang_and_say(pid_file: str) -> None:
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def _die() -> None:
    os._exit(3)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_value_comes_back() -> None:
    assert run_in_child(sorted, ([3, 1, 2],), limit_s=60, name="t-value") == [1, 2, 3]


def test_an_error_is_one_line_naming_its_type() -> None:
    with pytest.raises(ChildError, match=r"^ValueError: bad field x$"):
        run_in_child(_fail, ("bad field x",), limit_s=60, name="t-error")


def test_a_child_that_dies_is_reported() -> None:
    with pytest.raises(ChildError, match=r"t-die died \(status 3\)"):
        run_in_child(_die, (), limit_s=60, name="t-die")


def test_a_child_past_its_limit_is_killed(tmp_path: Path) -> None:
    pid_file = str(tmp_path / "pid")
    started = time.monotonic()
    with pytest.raises(ChildError, match=r"t-hang did not answer within 2 s"):
        run_in_child(_hang_and_say, (pid_file,), limit_s=2, name="t-hang")
    assert time.monotonic() - started < 30  # the limit, and the reaping after it
    assert _gone(int(Path(pid_file).read_text()))


def _sigterm_blocked(pid: int) -> bool:
    """Whether SIGTERM is in ``pid``'s blocked mask (Linux ``/proc``)."""
    import signal

    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    raise AssertionError("no SigBlk line")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_the_forkserver_outlives_a_schedulers_sigterm_and_this_process_still_gets_it() -> None:
    # Slurm and `kill -TERM -PGID` signal every process of a job: the server whose pipes
    # report the children's statuses must not die in the middle of the drain
    import multiprocessing.forkserver
    import signal

    from chameleon_ft.runtime.coordinator.launcher import forkserver_context

    forkserver_context()
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert server is not None and _sigterm_blocked(server)
    assert not _sigterm_blocked(os.getpid())  # blocked only while the server was spawned
    os.kill(server, signal.SIGTERM)
    time.sleep(0.2)
    assert os.waitpid(server, os.WNOHANG) == (0, 0)  # still running
    assert run_in_child(sorted, ([2, 1],), limit_s=60, name="t-after-term") == [1, 2]
