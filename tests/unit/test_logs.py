"""The package's messages through ``logging``: levels, the edges' handlers (the default
lines unchanged, worker records stamped with the worker), and no ``print`` in the
library."""

from __future__ import annotations

import ast
import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from chameleon_ft import logs

SRC = Path(__file__).resolve().parents[2] / "src" / "chameleon_ft"
PRINTS_ALLOWED = {"cli", "runtime/profiler.py"}
"""The commands' own output: the CLI modules and the profiler's ``python -m`` entry (its
JSON result)."""


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The package's logger, as no edge configured it (an earlier test of the session may
    have run a command in-process, whose handlers write to a stream since closed), and
    restored after the test (configure changes it)."""
    logger = logging.getLogger(logs.ROOT)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    for handler in saved[0]:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    try:
        yield logger
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        for handler in saved[0]:
            logger.addHandler(handler)
        logger.setLevel(saved[1])
        logger.propagate = saved[2]
        logs._HANDLERS.clear()


def test_levels_parse_and_bad_ones_name_the_flag() -> None:
    assert logs.parse_level("DEBUG") == logging.DEBUG and logs.parse_level(30) == 30
    with pytest.raises(ValueError, match=r"^--log-level: 'loud' is not a level"):
        logs.parse_level("loud")
    assert logs.level_of("step   3  loss 2.1") == logging.INFO
    assert logs.level_of("warning: the checkpoint after 20 steps is corrupt") == logging.WARNING
    assert logs.level_of("training stopped: every worker failed") == logging.ERROR


def test_the_default_lines_are_the_bare_messages(root_logger: logging.Logger) -> None:
    out = io.StringIO()
    logs.configure("info", out)
    logging.getLogger("chameleon_ft.runtime.coordinator.shell").info("step    1  loss 2.0")
    logging.getLogger("chameleon_ft.x").debug("hidden")
    logging.getLogger("chameleon_ft.x").warning("warning: shown")
    assert out.getvalue() == "step    1  loss 2.0\nwarning: shown\n"


def test_warnings_go_to_their_own_stream_when_asked(root_logger: logging.Logger) -> None:
    out, err = io.StringIO(), io.StringIO()
    logs.configure("info", out, errors=err)
    log = logging.getLogger("chameleon_ft.cli.worker_cmd")
    log.info("worker 0 started")
    log.warning("SIGTERM received")
    assert out.getvalue() == "worker 0 started\n" and err.getvalue() == "SIGTERM received\n"
    logs.configure("warning", out, errors=err)  # replaces the handlers: no doubles
    log.info("not shown")
    log.warning("again")
    assert out.getvalue() == "worker 0 started\n"
    assert err.getvalue() == "SIGTERM received\nagain\n"


def test_debug_records_say_which_worker_and_which_logger(root_logger: logging.Logger) -> None:
    err = io.StringIO()
    logs.configure("debug", err, worker=3)
    logging.getLogger("chameleon_ft.runtime.worker.main").debug("read directive 2")
    (line,) = err.getvalue().splitlines()
    assert line.endswith(" DEBUG [worker 3] chameleon_ft.runtime.worker.main: read directive 2")
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):  # after the console's: sees the stamped record
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    root_logger.addHandler(Keep())
    logging.getLogger("chameleon_ft.runtime.worker.main").warning("x")
    (record,) = seen
    assert record.worker == 3 and record.who == "worker 3"  # type: ignore[attr-defined]


def test_the_api_shows_records_only_where_nothing_is_configured(
        root_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # an unconfigured application
    log = logging.getLogger("chameleon_ft.runtime.coordinator.shell")
    with logs.console_unless_configured(out):
        log.info("step    0  loss 5.5")
    log.info("after the call: not shown")
    assert out.getvalue() == "step    0  loss 5.5\n"
    assert not root_logger.handlers
    configured = logging.StreamHandler(io.StringIO())
    monkeypatch.setattr(logging.getLogger(), "handlers", [configured])
    with logs.console_unless_configured(out):
        log.info("the application's handlers take it")
    assert out.getvalue() == "step    0  loss 5.5\n"


def _prints(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name) and n.func.id == "print"]


def test_no_print_in_library_code() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.split("/")[0] in PRINTS_ALLOWED or rel in PRINTS_ALLOWED:
            continue
        offenders += [f"{rel}:{line}" for line in _prints(path)]
    assert not offenders, f"print in library code (log through logging): {offenders}"


def test_every_logger_is_its_modules() -> None:
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for call in ast.walk(ast.parse(text)):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                    and call.func.attr == "getLogger" and isinstance(call.func.value, ast.Name) \
                    and call.func.value.id == "logging" and call.args:
                arg = call.args[0]
                assert isinstance(arg, ast.Name) and arg.id in ("__name__", "ROOT"), path
