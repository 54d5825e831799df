"""The workers' forkserver: one server per coordinator process that imports torch once,
from which every worker and helper child is forked.

This module imports no torch, so a command can start the server first and let its
imports (seconds: torch, ``torch._dynamo``, transformers) run while the command's own
process imports and plans (:func:`start_early`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
from collections.abc import Iterable
from typing import Any

from chameleon_ft.spec.model_source import ModelSourceKind

HF_ADAPTER = "chameleon_ft.runtime.workload.models.hf"
"""The Hugging Face adapter's module (it imports transformers)."""
BUILTIN_GPT = "chameleon_ft.runtime.workload.models.gpt"
"""The built-in GPT's module."""


def forkserver_context(preload: Iterable[str] = ()) -> Any:
    """A forkserver context whose server preloads torch, the worker module and
    ``preload`` (e.g. the model's adapter: transformers takes seconds to import, once in
    the server instead of once per worker; a module that does not import is skipped).
    The server starts once per process: the first call's list is the one it keeps."""
    # Waits in slices make c10d log a warning per timed-out slice; keep errors only.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = multiprocessing.get_context("forkserver")
    # Workers fork from a server that already imported torch: ~0.3 s per worker, not 5-10 s.
    # torch._dynamo too: every worker imports it when it builds its optimizer, and the
    # coordinator's shape probe (layers on meta) in its child.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "chameleon_ft.runtime.worker.main", *preload])
    _start_sheltered()
    return ctx


def _start_sheltered() -> None:
    """Start the forkserver (once per process) with SIGTERM blocked in it for good.

    A scheduler stops a job by signalling every process of it (Slurm's ``scancel``, a
    requeue or a preemption; ``kill`` of a process group), the server included, which
    would die at once, and with it the pipes that report its children's exit statuses
    and start new ones, in the middle of the drain the signal asked for (the final
    checkpoint, the parameters' export). Its processes leave by the coordinator's
    directive or are killed by pid (SIGKILL); none needs SIGTERM (workers ignore it). The
    signal is blocked in the calling thread only while the server is spawned (a child
    keeps the mask across fork and exec, and nothing in the server unblocks it), as
    multiprocessing protects its own resource tracker: one that arrives meanwhile waits,
    then reaches this process's handler. The tracker is started first, since starting it
    unblocks the signal.
    """
    multiprocessing.resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def adapter_modules(model: Any) -> tuple[str, ...]:
    """The module of the model's adapter when it is one of ours (the Hugging Face one
    imports transformers), for the forkserver to preload; a user's own module is left to
    the workers (importing it may do anything)."""
    module = type(model).__module__
    return (module,) if module.startswith("chameleon_ft.") else ()


def source_modules(source: ModelSourceKind) -> tuple[str, ...] | None:
    """What :func:`adapter_modules` will name for the model a ``[model] source`` builds,
    known before it is built: the Hugging Face adapter's module for ``hf``, the built-in
    GPT's for ``gpt``; None for a user's factory (its model's class is known only
    once built)."""
    if source == ModelSourceKind.HF:
        return (HF_ADAPTER,)
    if source == ModelSourceKind.GPT:
        return (BUILTIN_GPT,)
    return None


def start_early(source: ModelSourceKind) -> bool:
    """Start the server now, preloading what the coordinator's launcher will ask for, so
    its imports overlap the command's own (the coordinator's later calls find it
    running). Returns whether it started: not for a user's factory (the server keeps its
    first list, which must be the launcher's), nor when it cannot start here (the
    launcher starts it, and says why)."""
    modules = source_modules(source)
    if modules is None:
        return False
    try:
        forkserver_context(modules)
    except OSError:
        return False
    return True
