"""``chameleon_ft.train``: the runtime as a library, the same machinery as
``chameleon train``."""

from __future__ import annotations

import ast
import logging
import multiprocessing.process
import sys
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from chameleon_ft import logs
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.train import Fault, parse_fault

_log = logging.getLogger(__name__)

GUARD = 'if __name__ == "__main__":'
EXIT_USAGE = 2


def _is_main_guard(node: ast.stmt) -> bool:
    """Whether a top-level statement is ``if __name__ == "__main__":`` (or a test that
    compares ``__name__`` with ``"__main__"``)."""
    if not isinstance(node, ast.If):
        return False
    for part in ast.walk(node.test):
        if isinstance(part, ast.Compare):
            names = [part.left, *part.comparators]
            if (any(isinstance(n, ast.Name) and n.id == "__name__" for n in names)
                    and any(isinstance(n, ast.Constant) and n.value == "__main__"
                            for n in names)):
                return True
    return False


def _unguarded_call(frame: FrameType | None) -> tuple[str, int] | None:
    """Where the main module's top-level code leads to this call outside the guard:
    ``(file, line)``, or ``None`` when the call is guarded or cannot be told (no main
    file, a source that does not parse, a call from outside the main module's code)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    while frame is not None and not (frame.f_globals is getattr(main, "__dict__", None)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None or not path:
        return None
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            return None if _is_main_guard(node) else (str(path), line)
    return None


def check_main_guard(frame: FrameType | None) -> None:
    """Stop at once, in one line, when training would start again in every worker.

    Workers start from a server that imports the main module (multiprocessing's
    forkserver, as ``spawn`` does), so a script that calls :func:`train` at its top level
    without the guard runs it again in each of them. Two checks: in the script's own
    process, the call is found in the main module's source outside ``if __name__ ==
    "__main__":``; in a worker, the call happens while multiprocessing is still
    importing the main module (its ``_inheriting`` flag, what its own
    ``_check_not_importing_main`` reads).

    Raises:
        SystemExit: with status 2, after the one line as an error record (on stderr where
            the application configured no logging).
    """
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        where = "while a worker process imports the main module"
    else:
        found = _unguarded_call(frame)
        if found is None:
            return
        where = (f"at the top level of {found[0]} (line {found[1]}); every worker process "
                 "imports the main module and would call it again")
    _log.error("chameleon_ft.train: called %s: put the call under `%s`", where, GUARD)
    raise SystemExit(EXIT_USAGE)


def _with_overrides(config: Config, **train: Any) -> Config:
    """``config`` with the ``[train]`` keys given (not ``None``) replaced.

    Raises:
        ValueError: naming the ``train.`` field a value is wrong for.
    """
    overrides = {key: value for key, value in train.items() if value is not None}
    if not overrides:
        return config
    try:
        return replace(config, train=replace(config.train, **overrides))
    except ValueError as exc:
        raise ValueError(f"train.{exc}") from None


def train(config: Config | str | Path, *, model: Any = None, data: Any = None,
          optimizer: Callable[..., Any] | None = None, lr_schedule: Any = None,
          out_dir: str | Path | None = None, steps: int | None = None,
          dtype: str | None = None, policy: str | None = None,
          faults: Iterable[Fault | str] = (), resume: bool = False, rejoin: bool | None = None,
          log: Callable[[str], None] | None = None, **coordinator: Any) -> dict[str, Any]:
    """Train on worker processes of this host and survive their failures in place.

    Call it under ``if __name__ == "__main__":``: the workers are started from a server
    process that imports the main module. Called at a script's top level without that
    guard (or while a worker imports the main module), it stops at once with one line
    saying so, before any worker starts (:func:`check_main_guard`).

    Args:
        config: a job file or a loaded :class:`~chameleon_ft.spec.config.Config` (cluster,
            layout, profile, ``[train]``; ``[model]``/``[data]``/``[optimizer]`` for what the
            arguments below leave out).
        model: a layered model: ``num_layers``, ``build_layer(index)``, optionally
            ``loss(output, targets)`` (summed; default token cross-entropy).
        data: a data source: ``microbatch(step, first_sample, size) -> (inputs, targets)``.
        optimizer: ``params -> torch.optim.Optimizer``, built once per layer.
        lr_schedule: ``step -> learning rate`` (0-based steps), or a
            ``torch.optim.lr_scheduler`` class, factory (``optimizer -> scheduler``) or
            instance (:class:`~chameleon_ft.runtime.workload.schedules.TorchLRSchedule`).
        out_dir: the run directory (default: a new ``runs/train-<time>``).
        steps: overrides ``[train] steps``.
        dtype: overrides ``[train] dtype``.
        policy: the recovery policy (default ``[policy] name``).
        faults: injected faults (``Fault`` or ``"rank=R,step=S,kind=K,phase=P"``).
        resume: continue ``out_dir`` from its newest complete checkpoint.
        rejoin: overrides ``[train] rejoin``.
        log: receives each progress line (default: records of the coordinator's logger,
            routed by the application's logging; on stdout while it configured none).
        coordinator: the other keyword arguments of
            :class:`~chameleon_ft.runtime.coordinator.shell.Coordinator`: ``log_every``,
            ``tensorboard``, ``num_local_workers``, ``host``, ``port``, ``token``,
            ``job_name``, ``profile``, ``decide``, ``hooks``, ``check_resources``,
            ``trace``.

    Returns:
        The report (what ``chameleon train --json`` prints).

    Raises:
        ValueError: for bad input (one line naming the field).
        WorkerFailure: when training cannot go on.
        SystemExit: status 2, for a call outside the ``__main__`` guard.
    """
    check_main_guard(sys._getframe(1))
    from chameleon_ft.runtime.coordinator.shell import Coordinator
    from chameleon_ft.spec import load_config

    if not isinstance(config, Config):
        config = load_config(config)
    config = _with_overrides(config, steps=steps, dtype=dtype, rejoin=rejoin)
    parsed = [f if isinstance(f, Fault) else parse_fault(f) for f in faults]
    with logs.console_unless_configured(sys.stdout):
        coord = Coordinator(config, model=model, data=data, optimizer=optimizer,
                            lr_schedule=lr_schedule, out_dir=out_dir, policy=policy,
                            faults=parsed, resume=resume, log=log, **coordinator)
        return coord.run()
