"""The run's report as it grows: committed steps, failures, re-joins, refused joins, and
the files a user reads (``metrics.jsonl`` and ``op_times.jsonl`` appended as steps commit,
so a run that dies keeps them, and with ``tensorboard`` the same scalars as TensorBoard
event files; ``report.json`` and ``report.png`` at the end).

Nothing here steers the run: the control plane decides from its own state. Memory stays
bounded however long the run: the newest ``MAX_RECORDS`` steps (every step is in
``metrics.jsonl``, read back for the report), each recovery held only until its
transition is measured, and at most ``MAX_RECORDS`` of each kind of event (the newest; the
report counts those left out). A streamed file the disk refuses loses its lines with one
warning; training goes on.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chameleon_ft.runtime.report.board import Board
from chameleon_ft.runtime.report.records import Event, StepRecord, TransitionMeter
from chameleon_ft.runtime.storage.checkpoint import write_atomic

Log = Callable[[str], None]

PLOT_S = 120.0
"""How long drawing ``report.png`` may take."""
MAX_RECORDS = 1000
"""Failures, re-joins, refused joins, dropped, corrupt and written checkpoints kept for the
report, each (the newest)."""


class Records(deque[dict[str, Any]]):
    """The newest ``maxlen`` records of one kind (default ``MAX_RECORDS``), and how many
    were left out."""

    def __init__(self, maxlen: int | None = None) -> None:
        super().__init__(maxlen=maxlen or MAX_RECORDS)
        self.left_out = 0

    def add(self, record: Any) -> None:
        """Keep ``record`` (the oldest goes when full)."""
        if len(self) == self.maxlen:
            self.left_out += 1
        self.append(record)

MAX_REFUSED = 100
"""Refused join requests the report lists (the newest; it counts them all)."""
MAX_REFUSED_SOURCES = 16
"""Sources (claimed hosts) whose first refusal is logged."""


class RunReport:
    """Records of one run, and their files under the run directory."""

    def __init__(self, out_dir: Path, *, steps: int, start_step: int, tokens_per_step: int,
                 log: Log, log_every: int | None, resumed: bool,
                 tensorboard: bool = False, takeover: bool = False) -> None:
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
        self.takeover = takeover
        """This coordinator takes the run over: the streamed files go on."""
        self.reattached: list[dict[str, Any]] = []
        """The previous coordinator's workers this one re-attached."""
        self.events: deque[Event] = deque(maxlen=MAX_RECORDS)
        self.events_left_out = 0
        self.meter = TransitionMeter()
        """Measures each recovery's transition as steps commit."""
        self.steps: dict[int, StepRecord] = {}
        """The last commit of each of the newest steps (a restart's redone steps replace
        the first); every step is in ``metrics.jsonl``."""
        self.low = start_step
        """This run's first step (lower after a restart to an older checkpoint)."""
        self.rejoins = Records()
        self.refused = Records(MAX_REFUSED)
        """The newest ``MAX_REFUSED`` join requests refused (:attr:`refused_total`: all)."""
        self._refusing: set[str] = set()
        """Sources whose refusals were logged."""
        self.dropped = Records()
        """Checkpoints that could not be written (the disk refused, or too slow)."""
        self.corrupt = Records()
        """Complete checkpoints found corrupt when loaded (set aside)."""
        self.checkpoint_writes = Records()
        """Each complete checkpoint: its bytes, how long after its commit every layer was
        written and the manifest too, each writer's bytes and seconds."""
        self.unwritten: set[str] = set()
        """Streamed files the disk refused (warned once each)."""
        self.metrics_path = out_dir / "metrics.jsonl"
        self.op_times_path = out_dir / "op_times.jsonl"
        self.board = Board(out_dir / "tensorboard") if tensorboard else None
        self.peak_memory: dict[int, list[int]] = {}
        """Each worker's peak resident bytes so far, one per process (rank) of the worker."""

    def open(self) -> None:
        """Start the streamed files: a resumed run keeps the metrics of its earlier steps,
        a run taken over all its files (its committed step is known once its workers
        reported: :meth:`took_over`)."""
        if self.takeover:
            return
        write_atomic(self.metrics_path, self._earlier_metrics().encode())
        write_atomic(self.op_times_path, b"")

    def took_over(self, step: int, workers: list[dict[str, Any]]) -> None:
        """The run was taken over at committed step ``step`` with these workers: its
        steps so far are this run's, and none from ``step`` on is committed."""
        self.reattached = workers
        steps = [int(doc["step"]) for doc in self._lines() if isinstance(doc.get("step"), int)]
        self.low, self.start_step = min([step, *steps]), step
        if any(s >= step for s in steps):
            self.rewind(step)

    def _earlier_metrics(self) -> str:
        """The metrics lines of the steps before this run's first (a resumed run's)."""
        if not self.resumed:
            return ""
        return "".join(f"{json.dumps(doc)}\n" for doc in self._lines()
                       if doc.get("step", -1) < self.low)

    def _lines(self) -> list[dict[str, Any]]:
        """The metrics file's lines (none when it cannot be read; a torn line skipped)."""
        try:
            text = self.metrics_path.read_text()
        except OSError:
            return []
        out = []
        for line in text.splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out

    def failed(self, event: Event) -> None:
        """A failure was detected."""
        if len(self.events) == self.events.maxlen:
            self.events_left_out += 1
        self.events.append(event)
        self.meter.failed(event)

    def rejoined(self, record: dict[str, Any]) -> None:
        """The policy answered about idle workers."""
        self.rejoins.add(record)

    def dropped_checkpoint(self, record: dict[str, Any]) -> None:
        """A checkpoint could not be written."""
        self.dropped.add(record)

    def checkpoint_written(self, record: dict[str, Any]) -> None:
        """A checkpoint is complete."""
        self.checkpoint_writes.add(record)

    def committed(self, record: StepRecord, timings: list[dict[str, Any]],
                  recovered: bool = False) -> None:
        """A step committed (``recovered``: the first since a failure): record it, append
        its metrics and timings, log it."""
        self.steps.pop(record.step, None)
        self.steps[record.step] = record
        if len(self.steps) > MAX_RECORDS:
            del self.steps[next(iter(self.steps))]
        self._append(self.metrics_path, [self._metrics_line(record)])
        if self.board is not None:
            self.board.add(record, self._metrics(record))
        if timings:
            self._append(self.op_times_path, [json.dumps(t) for t in timings])
            self._note_memory(timings)
        if record.step % self.every == 0 or record.step == self.total_steps - 1 or \
                record.step == self.start_step or recovered:
            norm = "" if record.grad_norm is None else f"  grad norm {record.grad_norm:.3f}"
            self.log(f"step {record.step:4d}  loss {record.loss:.4f}{norm}  step "
                     f"{record.step_s:.3f} s  gen {record.gen}")
        for event in self.meter.committed(record):
            origin = event.fault_at_s if event.fault_at_s is not None else event.detected_at_s
            self.log(f"recovered: first step after the failure committed "
                     f"{record.committed_at_s - origin:.3f} s after it ({event.strategy})")

    def _append(self, path: Path, lines: list[str]) -> None:
        """Append lines to a streamed file; a disk that refuses loses them (one warning
        per file until it takes lines again), training goes on."""
        try:
            with path.open("a") as f:
                f.writelines(line + "\n" for line in lines)
        except OSError as exc:
            if path.name not in self.unwritten:
                self.unwritten.add(path.name)
                self.log(f"warning: {path.name} not appended ({exc.strerror or exc}); "
                         "training goes on")
            return
        self.unwritten.discard(path.name)

    def _metrics(self, r: StepRecord) -> dict[str, Any]:
        tokens_per_s = self.tokens_per_step / r.step_s if r.step_s > 0 else None
        return {"step": r.step, "loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr,
                "step_s": r.step_s, "tokens_per_s": tokens_per_s, "gen": r.gen,
                "plan_workers": r.num_workers, "at_s": r.committed_at_s}

    def _metrics_line(self, r: StepRecord) -> str:
        return json.dumps(self._metrics(r))

    def rewind(self, to_step: int) -> None:
        """A restart threw the steps from ``to_step`` on away: they will be redone (their
        lines leave ``metrics.jsonl`` too)."""
        for step in [s for s in self.steps if s >= to_step]:
            del self.steps[step]
        self.low = min(self.low, to_step)
        kept = "".join(f"{json.dumps(doc)}\n" for doc in self._lines()
                       if doc.get("step", -1) < to_step)
        try:
            write_atomic(self.metrics_path, kept.encode())
        except OSError as exc:
            self.log(f"warning: {self.metrics_path.name} not rewound ({exc.strerror or exc})")

    def _note_memory(self, timings: list[dict[str, Any]]) -> None:
        """Keep each worker's peak resident bytes per rank (``rss_peak_bytes_ranks`` at
        ``tp > 1``, else its one process's ``rss_peak_bytes``)."""
        for t in timings:
            ranks = t.get("rss_peak_bytes_ranks") or [t.get("rss_peak_bytes")]
            if not all(isinstance(r, int) for r in ranks):
                continue
            old = self.peak_memory.get(int(t["worker"]), [])
            self.peak_memory[int(t["worker"])] = (
                [max(a, b) for a, b in zip(old, ranks, strict=True)]
                if len(old) == len(ranks) else list(ranks))

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
        self.refused.add(entry)
        if source in self._refusing or len(self._refusing) >= MAX_REFUSED_SOURCES:
            return False
        self._refusing.add(source)
        return True

    @property
    def refused_total(self) -> int:
        """Join requests refused in all (listed or left out)."""
        return len(self.refused) + self.refused.left_out

    def ordered_steps(self) -> list[StepRecord]:
        """This run's committed steps in order (a redone step's last commit): read back
        from ``metrics.jsonl``, the newest from memory."""
        steps: dict[int, StepRecord] = {}
        for doc in self._lines():
            step = doc.get("step")
            if not isinstance(step, int) or step < self.low:
                continue
            try:
                steps[step] = StepRecord(step, float(doc["loss"]), float(doc["step_s"]),
                                         int(doc["gen"]), float(doc.get("at_s", 0.0)),
                                         int(doc.get("plan_workers", 0)), doc.get("grad_norm"),
                                         doc.get("lr"))
            except (KeyError, TypeError, ValueError):
                continue  # a line of another version
        steps.update(self.steps)
        return [steps[k] for k in sorted(steps)]

    def write(self, report: dict[str, Any], files: bool = True) -> dict[str, Any]:
        """Measure the transitions, then write ``report.json``, the compacted metrics
        (one line per step, a redone step's last commit) and ``report.png`` (``files``
        False: ``report.json`` only, by this process alone)."""
        self.meter.close()
        if self.board is not None and files:
            self.board.close()
        report["events"] = [e.to_dict() for e in self.events]
        report["peak_memory_bytes"] = {str(w): ranks for w, ranks in
                                       sorted(self.peak_memory.items())}
        report["records_left_out"] = {
            "events": self.events_left_out, "rejoins": self.rejoins.left_out,
            "refused": self.refused.left_out, "dropped_checkpoints": self.dropped.left_out,
            "corrupt_checkpoints": self.corrupt.left_out,
            "checkpoint_writes": self.checkpoint_writes.left_out}
        write_atomic(self.out_dir / "report.json", json.dumps(report, indent=2).encode())
        if not files:
            return report
        lines = "".join(self._metrics_line(r) + "\n" for r in self.ordered_steps())
        try:
            write_atomic(self.metrics_path, (self._earlier_metrics() + lines).encode())
        except OSError as exc:  # the lines streamed as steps committed stay
            self.log(f"warning: {self.metrics_path.name} not compacted ({exc.strerror or exc})")
        try:  # matplotlib's ~40 MB live and die with a child, not the coordinator
            from chameleon_ft.runtime.coordinator.launcher import run_in_child
            from chameleon_ft.runtime.report.plots import write_report_png

            run_in_child(write_report_png, (report, self.out_dir / "report.png"),
                         limit_s=PLOT_S, name="chameleon-plot")
        except Exception as exc:  # a plot must never lose a finished run
            self.log(f"report.png not written: {exc}")
        return report
