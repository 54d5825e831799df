"""The run's report as it grows: committed steps, failures, re-joins, refused joins, and
the files a user reads (``metrics.jsonl`` and ``op_times.jsonl`` appended as steps commit,
so a run that dies keeps them, and with ``tensorboard`` the same scalars as TensorBoard
event files; ``report.json`` and ``report.png`` at the end).

Nothing here steers the run: the control plane decides from its own state.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chameleon_ft.runtime.report.board import Board
from chameleon_ft.runtime.report.records import Event, StepRecord, measure_transitions
from chameleon_ft.runtime.storage.checkpoint import write_atomic

Log = Callable[[str], None]

PLOT_S = 120.0
"""How long drawing ``report.png`` may take."""


MAX_REFUSED = 100
"""Refused join requests the report lists (it counts them all)."""
MAX_REFUSED_SOURCES = 16
"""Sources (claimed hosts) whose first refusal is logged."""


class RunReport:
    """Records of one run, and their files under the run directory."""

    def __init__(self, out_dir: Path, *, steps: int, start_step: int, tokens_per_step: int,
                 log: Log, log_every: int | None, resumed: bool,
                 tensorboard: bool = False) -> None:
        """Raises:
            ValueError: ``tensorboard`` without the ``tensorboard`` package.
        """
        self.out_dir = out_dir
        self.total_steps = steps
        self.start_step = start_step
        self.tokens_per_step = tokens_per_step
        self.log = log
        self.every = log_every or (max(1, steps // 25) if steps > 50 else 1)
        self.resumed = resumed
        self.events: list[Event] = []
        self.steps: dict[int, StepRecord] = {}
        """The last commit of each step (a restart's redone steps replace the first)."""
        self.commits: list[StepRecord] = []
        """Every commit in order, redone steps too."""
        self.rejoins: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []
        """The first ``MAX_REFUSED`` join requests refused (``refused_total``: all)."""
        self.refused_total = 0
        self._refusing: set[str] = set()
        """Sources whose refusals were logged."""
        self.dropped: list[dict[str, Any]] = []
        """Checkpoints that could not be written (the disk refused, or too slow)."""
        self.corrupt: list[dict[str, Any]] = []
        """Complete checkpoints found corrupt when loaded (set aside)."""
        self.checkpoint_writes: list[dict[str, Any]] = []
        """Each complete checkpoint: its bytes, how long after its commit every layer was
        written and the manifest too, each writer's bytes and seconds."""
        self.metrics_path = out_dir / "metrics.jsonl"
        self.op_times_path = out_dir / "op_times.jsonl"
        self.board = Board(out_dir / "tensorboard") if tensorboard else None

    def open(self) -> None:
        """Start the streamed files: a resumed run keeps the metrics of its earlier steps."""
        write_atomic(self.metrics_path, self._earlier_metrics().encode())
        write_atomic(self.op_times_path, b"")

    def _earlier_metrics(self) -> str:
        """The metrics lines of the steps before a resumed run's first."""
        if not self.resumed or not self.metrics_path.exists():
            return ""
        lines = [ln for ln in self.metrics_path.read_text().splitlines() if ln.strip()]
        return "".join(f"{ln}\n" for ln in lines
                       if json.loads(ln).get("step", -1) < self.start_step)

    @property
    def recovering(self) -> bool:
        """A failure's recovery has not committed a step yet."""
        return bool(self.events) and self.events[-1].resumed_at_s is None and \
            not self.events[-1].idle

    def committed(self, record: StepRecord, timings: list[dict[str, Any]]) -> None:
        """A step committed: record it, append its metrics and timings, log it."""
        recovering = self.recovering
        self.steps[record.step] = record
        self.commits.append(record)
        with self.metrics_path.open("a") as f:
            f.write(self._metrics_line(record) + "\n")
        if self.board is not None:
            self.board.add(record, self._metrics(record))
        if timings:
            with self.op_times_path.open("a") as f:
                f.writelines(json.dumps(t) + "\n" for t in timings)
        if record.step % self.every == 0 or record.step == self.total_steps - 1 or \
                record.step == self.start_step or recovering:
            norm = "" if record.grad_norm is None else f"  grad norm {record.grad_norm:.3f}"
            self.log(f"step {record.step:4d}  loss {record.loss:.4f}{norm}  step "
                     f"{record.step_s:.3f} s  gen {record.gen}")
        for event in self.events:
            if event.resumed_at_s is None and not event.idle:
                event.resumed_at_s = record.committed_at_s
                origin = event.fault_at_s if event.fault_at_s is not None \
                    else event.detected_at_s
                self.log(f"recovered: first step after the failure committed "
                         f"{record.committed_at_s - origin:.3f} s after it ({event.strategy})")

    def _metrics(self, r: StepRecord) -> dict[str, Any]:
        tokens_per_s = self.tokens_per_step / r.step_s if r.step_s > 0 else None
        return {"step": r.step, "loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr,
                "step_s": r.step_s, "tokens_per_s": tokens_per_s, "gen": r.gen,
                "plan_workers": r.num_workers}

    def _metrics_line(self, r: StepRecord) -> str:
        return json.dumps(self._metrics(r))

    def rewind(self, to_step: int) -> None:
        """A restart threw the steps from ``to_step`` on away: they will be redone."""
        for step in [s for s in self.steps if s >= to_step]:
            del self.steps[step]

    def op_times(self) -> list[dict[str, Any]]:
        """Every committed step's per-op compute times, read back from the file."""
        if not self.op_times_path.exists():
            return []
        return [json.loads(ln) for ln in self.op_times_path.read_text().splitlines()
                if ln.strip()]

    def refuse(self, entry: dict[str, Any], source: str) -> bool:
        """Record a refused join request; whether to log it (the first refusal of each
        source, for at most ``MAX_REFUSED_SOURCES`` sources: a flood writes nothing
        without bound)."""
        self.refused_total += 1
        if len(self.refused) < MAX_REFUSED:
            self.refused.append(entry)
        if source in self._refusing or len(self._refusing) >= MAX_REFUSED_SOURCES:
            return False
        self._refusing.add(source)
        return True

    def ordered_steps(self) -> list[StepRecord]:
        """The committed steps in order."""
        return [self.steps[k] for k in sorted(self.steps)]

    def write(self, report: dict[str, Any]) -> dict[str, Any]:
        """Measure the transitions, then write ``report.json``, the compacted metrics
        (one line per step, a redone step's last commit) and ``report.png``."""
        measure_transitions(self.events, self.commits)
        if self.board is not None:
            self.board.close()
        report["events"] = [e.to_dict() for e in self.events]
        write_atomic(self.out_dir / "report.json", json.dumps(report, indent=2).encode())
        lines = "".join(self._metrics_line(r) + "\n" for r in self.ordered_steps())
        write_atomic(self.metrics_path, (self._earlier_metrics() + lines).encode())
        try:  # matplotlib's ~40 MB live and die with a child, not the coordinator
            from chameleon_ft.runtime.coordinator.launcher import run_in_child
            from chameleon_ft.runtime.report.plots import write_report_png

            run_in_child(write_report_png, (report, self.out_dir / "report.png"),
                         limit_s=PLOT_S, name="chameleon-plot")
        except Exception as exc:  # a plot must never lose a finished run
            self.log(f"report.png not written: {exc}")
        return report
