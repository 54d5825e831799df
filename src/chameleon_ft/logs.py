"""The package's messages as ``logging`` records, and the one place handlers are set.

Every module logs through its own logger (``logging.getLogger(__name__)``, under
``chameleon_ft``). Nothing below configures a handler: the edges do, with
:func:`configure`: the ``chameleon`` command (``--log-level``), a worker process at its
entry (at the level of the process that started it), and ``chameleon_ft.train`` only
while the application configured no logging at all (:func:`console_unless_configured`).
A record made in a worker process carries the worker's id (``record.worker``, and
``record.who``: ``worker 3``, else ``coordinator``); at ``debug`` the console shows it
with the time, the level and the logger, at the other levels only the message, so the
lines are the same as the command has always printed. Pure Python (no torch).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TextIO

ROOT = "chameleon_ft"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
DEFAULT_LEVEL = "info"
PLAIN_FORMAT = "%(message)s"
DEBUG_FORMAT = "%(asctime)s %(levelname)s [%(who)s] %(name)s: %(message)s"


def parse_level(name: str | int) -> int:
    """A level from its name (``debug``, ``info``, ``warning``, ``error``) or number.

    Raises:
        ValueError: naming ``--log-level`` for an unknown name.
    """
    if isinstance(name, int):
        return name
    try:
        return LEVELS[name.lower()]
    except KeyError:
        raise ValueError(f"--log-level: {name!r} is not a level; give one of "
                         f"{', '.join(LEVELS)}") from None


def level_of(message: str) -> int:
    """The level of one of the coordinator's progress lines: the control plane says what
    happened in words, a warning or a stop in their first word."""
    if message.startswith(("warning", "internal:")):
        return logging.WARNING
    if message.startswith("training stopped"):
        return logging.ERROR
    return logging.INFO


class _Who(logging.Filter):
    """Stamps every record with the process it comes from (a worker's id, or none)."""

    def __init__(self, worker: int | None) -> None:
        super().__init__()
        self.worker = worker
        self.who = "coordinator" if worker is None else f"worker {worker}"

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.worker
        record.who = self.who
        return True


class _Below(logging.Filter):
    """Passes records below a level (the other stream takes the rest)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


_HANDLERS: list[logging.Handler] = []
"""The handlers :func:`configure` attached (replaced by its next call)."""


def configure(level: str | int, stream: TextIO, *, errors: TextIO | None = None,
              worker: int | None = None) -> None:
    """Show the package's records at ``level`` and above on ``stream``: the edges' call.

    Args:
        level: a name of :data:`LEVELS` or a ``logging`` level.
        stream: where the records go (warnings and errors too, unless ``errors``).
        errors: where warnings and errors go instead, when given.
        worker: this process's worker id (None: the coordinator or a command).

    Raises:
        ValueError: for an unknown level name.
    """
    number = parse_level(level)
    logger = logging.getLogger(ROOT)
    for old in _HANDLERS:
        logger.removeHandler(old)
    _HANDLERS.clear()
    formatter = logging.Formatter(DEBUG_FORMAT if number <= logging.DEBUG else PLAIN_FORMAT)
    outs = [(stream, None)] if errors is None else [(stream, _Below(logging.WARNING)),
                                                    (errors, None)]
    for out, only in outs:
        handler = logging.StreamHandler(out)
        handler.setFormatter(formatter)
        handler.addFilter(_Who(worker))
        if only is not None:
            handler.addFilter(only)
        elif errors is not None:
            handler.setLevel(logging.WARNING)
        logger.addHandler(handler)
        _HANDLERS.append(handler)
    logger.setLevel(number)
    logger.propagate = False  # the edge owns the console: no second copy via the root


def current_level() -> int:
    """The level of the package's records in this process: the one the worker processes
    it starts log at."""
    return logging.getLogger(ROOT).getEffectiveLevel()


@contextlib.contextmanager
def console_unless_configured(stream: TextIO) -> Iterator[None]:
    """Show the package's records on ``stream`` for the duration, unless the application
    configured logging (a handler on the root or on the package's logger), which then
    receives them as it decided."""
    logger = logging.getLogger(ROOT)
    if logging.getLogger().handlers or logger.handlers:
        yield
        return
    level = logger.level
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(PLAIN_FORMAT))
    handler.addFilter(_Who(None))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if level == logging.NOTSET else level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
