"""Fast multi-process harness: the coordinator runs in the test process and forks its
workers from a forkserver that already imported torch; every wait is bounded and every
worker is reaped by pid. Every directive a run publishes is checked on the model of
NCCL (``runtime.nccl_model``): its warm-up, migration and step."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tiny_job import TINY

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.chaos import alive
from chameleon_ft.runtime.coordinator.shell import Coordinator, Hooks
from chameleon_ft.runtime.nccl_model import check_directive
from chameleon_ft.spec.config import config_from_mapping
from chameleon_ft.spec.train import parse_fault




def tiny_config(model_override: dict[str, Any] | None = None,
                cluster: dict[str, Any] | None = None,
                recovery: dict[str, Any] | None = None,
                job: dict[str, Any] | None = None,
                optimizer: dict[str, Any] | None = None, **train: Any) -> Any:
    """The tiny job with ``[train]`` overrides (optionally another ``[model]``, and
    ``[cluster]``, ``[recovery]``, ``[job]`` and ``[optimizer]`` overrides such as
    ``spare_nodes``)."""
    doc = copy.deepcopy(TINY)
    doc["train"].update(train)
    doc["cluster"].update(cluster or {})
    doc["recovery"].update(recovery or {})
    doc["job"].update(job or {})
    if optimizer:
        doc["optimizer"] = {**doc.get("optimizer", {}), **optimizer}
    if model_override is not None:
        doc["model"] = dict(model_override)
    return config_from_mapping(doc)


class CheckedTraffic(Hooks):
    """The test's hooks, with every published directive's point-to-point traffic checked
    (findings are kept and fail the run once it ended: the coordinator's loop goes on)."""

    def __init__(self, inner: Hooks | None) -> None:
        self.inner = inner or Hooks()
        self.findings: list[str] = []
        self.checked = 0

    def before_publish(self, coord: Coordinator, directive: dict[str, Any]) -> None:
        self.inner.before_publish(coord, directive)
        job_info = coord.cs.job()
        assert job_info is not None
        boundaries = job_info.boundaries
        self.findings += [f"generation {directive['gen']}: {f}"
                          for f in check_directive(directive, boundaries)]
        self.checked += 1

    def on_commit(self, coord: Coordinator, step: int) -> None:
        self.inner.on_commit(coord, step)

    def on_failure(self, coord: Coordinator, event: Any) -> None:
        self.inner.on_failure(coord, event)


def run_job(out_dir: Path | None, *, policy: str = "chameleon", faults: tuple[str, ...] = (),
            on_log: Callable[[Coordinator, str], None] | None = None,
            coordinator: dict[str, Any] | None = None,
            model_override: dict[str, Any] | None = None,
            cluster: dict[str, Any] | None = None,
            recovery: dict[str, Any] | None = None,
            job: dict[str, Any] | None = None,
            optimizer: dict[str, Any] | None = None,
            config: Any = None,
            **train: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[int]]:
    """Train the tiny job; return the report, the final parameters and the worker pids.

    Every worker is gone when this returns (the coordinator reaps them; the finally here
    kills any survivor by pid as a last resort).

    Args:
        out_dir: the run directory (None: the coordinator's default).
        policy: the recovery policy.
        faults: injected faults.
        on_log: called with each log line.
        coordinator: more keyword arguments of :class:`Coordinator` (hooks, decide...).
        cluster: ``[cluster]`` overrides (``spare_nodes``).
        recovery: ``[recovery]`` overrides (``memory_checkpoint``).
        job: ``[job]`` overrides (``pp``, ``dp``, ``tp``).
        optimizer: ``[optimizer]`` overrides (``clip_grad_norm``).
        config: a whole job of its own instead of the tiny one and its overrides.
        train: ``[train]`` overrides.
    """
    if config is None:
        config = tiny_config(model_override, cluster, recovery, job, optimizer, **train)
    lines: list[str] = []
    holder: dict[str, Coordinator] = {}

    def log(message: str) -> None:
        lines.append(message)
        if on_log is not None:
            on_log(holder["c"], message)

    extra = dict(coordinator or {})
    hooks = CheckedTraffic(extra.pop("hooks", None))
    coord = Coordinator(config, policy=policy, faults=[parse_fault(f) for f in faults],
                        out_dir=out_dir, log=log, hooks=hooks, **extra)
    holder["c"] = coord
    try:
        report = coord.run()
    except BaseException:
        print("\n".join(lines[-40:]))  # pytest shows it with the failure
        raise
    finally:
        pids = list(coord.launched_pids)
        for pid in pids:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    report["log"] = lines
    assert hooks.checked and not hooks.findings, hooks.findings
    return report, coord.params, pids


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest elementwise difference over identically named parameters."""
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)
