"""Run a function on ``world`` real processes forming one gloo group (a tensor-parallel
group on CPU): forked from a server that already imported torch and transformers, a
store on port 0 owned by the parent, a unique prefix per run, every wait bounded, every
child reaped by pid, a child's traceback sent back to the parent."""

from __future__ import annotations

import contextlib
import os
import signal
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from chameleon_ft.runtime.chaos import alive
from chameleon_ft.runtime.coordinator.launcher import forkserver_context

PRELOAD = ("transformers", "chameleon_ft.runtime.workload.models.hf",
           "chameleon_ft.runtime.workload.tensor_parallel",
           "chameleon_ft.runtime.workload.tp_state")
"""What every rank imports: in the server, once, instead of once per rank."""


def _entry(target: Callable[..., Any], rank: int, world: int, port: int, prefix: str,
           timeout_s: float, args: tuple[Any, ...], kwargs: dict[str, Any],
           results: Any) -> None:
    """A rank: join the group under ``prefix``, run ``target(rank, world, *args,
    **kwargs)``, send back ``(rank, ok, value or traceback)``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        timeout = timedelta(seconds=timeout_s)
        store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False,
                                                       timeout=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        results.put((rank, True, target(rank, world, *args, **kwargs)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(target: Callable[..., Any], world: int, *args: Any,
              timeout_s: float = 60.0, **kwargs: Any) -> list[Any]:
    """``target(rank, world, *args, **kwargs)`` on ``world`` processes of one gloo group.

    Returns:
        Each rank's return value, by rank.

    Raises:
        AssertionError: with a rank's traceback when it failed, or when a rank did not
            answer within ``timeout_s``.
    """
    ctx = forkserver_context(PRELOAD)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    results = ctx.Queue()
    prefix = f"tp-{uuid.uuid4().hex}/"
    procs = [ctx.Process(target=_entry, args=(target, rank, world, store.port, prefix,
                                              timeout_s, args, kwargs, results),
                         daemon=True)
             for rank in range(world)]
    answers: dict[int, Any] = {}
    try:
        for proc in procs:
            proc.start()
        for _ in procs:
            rank, ok, value = results.get(timeout=timeout_s)
            assert ok, f"rank {rank} failed:\n{value}"
            answers[rank] = value
        for proc in procs:
            proc.join(timeout=10)
    finally:
        for proc in procs:
            if proc.pid is not None and alive(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=5)
    return [answers[r] for r in range(world)]
