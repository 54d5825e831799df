"""``chameleon_ft.train`` called while multiprocessing imports the main module in a worker
(its ``_inheriting`` flag, as its own bootstrapping check reads) stops in one line."""

from __future__ import annotations

import logging
import multiprocessing.process
import sys

import pytest

from chameleon_ft.runtime.workload.api import check_main_guard


def test_a_worker_importing_the_main_module_stops(caplog: pytest.LogCaptureFixture) -> None:
    # one error record (on stderr where the application configured no logging:
    # tests/e2e/test_readme_api.py runs that case)
    process = multiprocessing.process.current_process()
    process._inheriting = True  # type: ignore[attr-defined]
    try:
        with pytest.raises(SystemExit) as info:
            check_main_guard(sys._getframe())
    finally:
        del process._inheriting  # type: ignore[attr-defined]
    assert info.value.code == 2
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.name.startswith("chameleon_ft.")
    assert record.getMessage() == (
        "chameleon_ft.train: called while a worker process imports the main module: put "
        'the call under `if __name__ == "__main__":`')


def test_a_guarded_or_unknown_caller_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    check_main_guard(sys._getframe())  # pytest's own __main__ is guarded
    check_main_guard(None)
    assert not caplog.records
