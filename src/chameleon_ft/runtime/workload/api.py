"""``chameleon_ft.train``: the runtime as a library, the same machinery as
``chameleon train``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from chameleon_ft.spec.config import Config
from chameleon_ft.spec.train import Fault, parse_fault


def train(config: Config | str | Path, *, model: Any = None, data: Any = None,
          optimizer: Any = None, lr_schedule: Callable[[int], float] | None = None,
          out_dir: str | Path | None = None, steps: int | None = None,
          dtype: str | None = None, policy: str | None = None,
          faults: Iterable[Fault | str] = (), resume: bool = False, rejoin: bool | None = None,
          log: Callable[[str], None] | None = print, **coordinator: Any) -> dict[str, Any]:
    """Train on worker processes of this host and survive their failures in place.

    Call it under ``if __name__ == "__main__":``: the workers are started from a server
    process that imports the main module.

    Args:
        config: a job file or a loaded :class:`~chameleon_ft.spec.config.Config` (cluster,
            layout, profile, ``[train]``; ``[model]``/``[data]``/``[optimizer]`` for what the
            arguments below leave out).
        model: a layered model: ``num_layers``, ``build_layer(index)``, optionally
            ``loss(output, targets)`` (summed; default token cross-entropy).
        data: a data source: ``microbatch(step, first_sample, size) -> (inputs, targets)``.
        optimizer: ``params -> torch.optim.Optimizer``, built once per layer.
        lr_schedule: ``step -> learning rate`` (0-based steps).
        out_dir: the run directory (default: a new ``runs/train-<time>``).
        steps: overrides ``[train] steps``.
        dtype: overrides ``[train] dtype``.
        policy: the recovery policy (default ``[policy] name``).
        faults: injected faults (``Fault`` or ``"rank=R,step=S,kind=K,phase=P"``).
        resume: continue ``out_dir`` from its newest complete checkpoint.
        rejoin: overrides ``[train] rejoin``.
        log: receives each progress line (None: silent).
        coordinator: further keyword arguments of
            :class:`~chameleon_ft.runtime.coordinator.shell.Coordinator`.

    Returns:
        The report (what ``chameleon train --json`` prints).

    Raises:
        ValueError: for bad input (one line naming the field).
        WorkerFailure: when training cannot go on.
    """
    from chameleon_ft.runtime.coordinator.shell import Coordinator
    from chameleon_ft.spec import load_config

    if not isinstance(config, Config):
        config = load_config(config)
    overrides: dict[str, Any] = {}
    if steps is not None:
        overrides["steps"] = steps
    if dtype is not None:
        overrides["dtype"] = dtype
    if rejoin is not None:
        overrides["rejoin"] = rejoin
    if overrides:
        try:
            config = replace(config, train=replace(config.train, **overrides))
        except ValueError as exc:
            raise ValueError(f"train.{exc}") from None
    parsed = [f if isinstance(f, Fault) else parse_fault(f) for f in faults]
    coord = Coordinator(config, model=model, data=data, optimizer=optimizer,
                        lr_schedule=lr_schedule, out_dir=out_dir, policy=policy,
                        faults=parsed, resume=resume, log=log, **coordinator)
    return coord.run()
