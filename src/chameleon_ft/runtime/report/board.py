"""TensorBoard event files of a run (``--tensorboard``): the scalars of ``metrics.jsonl``
per committed step, written as steps commit, through ``torch.utils.tensorboard`` (which
needs the ``tensorboard`` package, an optional extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chameleon_ft.runtime.report.records import StepRecord

SCALARS = ("loss", "grad_norm", "lr", "tokens_per_s", "step_s")
"""The metrics written, each under ``train/<name>``."""
MISSING = ("--tensorboard: needs the tensorboard package; install the extra from the "
           "checkout: pip install -e '.[tensorboard]' (or pip install tensorboard)")


def summary_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``.

    Raises:
        ValueError: in one line, when the ``tensorboard`` package is not installed.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch raises it when tensorboard is missing
        raise ValueError(MISSING) from None
    return SummaryWriter


class Board:
    """A run's TensorBoard writer.

    Args:
        folder: where the event files go (``<run>/tensorboard``).

    Raises:
        ValueError: when the ``tensorboard`` package is not installed.
    """

    def __init__(self, folder: Path) -> None:
        self.writer = summary_writer_class()(log_dir=str(folder))

    def add(self, record: StepRecord, metrics: dict[str, Any]) -> None:
        """One committed step's scalars (a redone step is written again: TensorBoard shows
        the latest); flushed, so a run that dies keeps them."""
        for name in SCALARS:
            value = metrics.get(name)
            if value is not None:
                self.writer.add_scalar(f"train/{name}", float(value), record.step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
