"""``chameleon_ft.train`` called while multiprocessing imports the main module in a worker
(its ``_inheriting`` flag, as its own bootstrapping check reads) stops in one line."""

from __future__ import annotations

import multiprocessing.process
import sys

import pytest

from chameleon_ft.runtime.workload.api import check_main_guard


def test_a_worker_importing_the_main_module_stops(capsys: pytest.CaptureFixture[str]) -> None:
    process = multiprocessing.process.current_process()
    process._inheriting = True  # type: ignore[attr-defined]
    try:
        with pytest.raises(SystemExit) as info:
            check_main_guard(sys._getframe())
    finally:
        del process._inheriting  # type: ignore[attr-defined]
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("chameleon_ft.train: called while a worker process imports the main "
                    'module: put the call under `if __name__ == "__main__":`')


def test_a_guarded_or_unknown_caller_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    check_main_guard(sys._getframe())  # pytest's own __main__ is guarded
    check_main_guard(None)
    assert capsys.readouterr().err == ""
