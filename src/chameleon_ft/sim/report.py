"""Reports of a scenario run: JSON, a Markdown table, PNG plots, and a progress bar.

This is the simulator's only module that does I/O. Every file is rendered in memory first
and written (to a temporary name, then renamed) only after the whole run succeeded, so a
failed run leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from chameleon_ft.jsontext import dumps
from chameleon_ft.sim.engine import RunResult
from chameleon_ft.sim.runner import CellRun, ScenarioRun

BASELINES = ("oobleck", "recycle", "reroute", "dynamic", "restart", "shrink", "bamboo")
"""Policies Chameleon is compared with: the published peers and our fixed strategies."""
PAPER_RATIOS = {"recycle": 1.355, "oobleck": 1.229}
"""The paper's average-throughput ratios of Chameleon to ReCycle and Oobleck (32 devices)."""
PUBLISHED_EFFECTIVE_TRAINING_TIME = (
    ("Llama 3 405B (Meta, arXiv:2407.21783): 16,384 H100, 54 days, restarts from "
     "checkpoints", "above 90%"),
    ("ByteRobust (ByteDance, arXiv:2509.16293): 9,600 GPUs, 3 months, warm standby",
     "97%"),
    ("FT-HSDP (Meta, arXiv:2602.00277): O(100k) GPUs, fault-tolerant all-reduce",
     "80% (44% without)"),
)
"""Effective training time as published (docs/design.md, "Sources of the defaults"); each
measures the share of wall time spent on training that is kept."""


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _std(values: Sequence[float]) -> float:
    return statistics.pstdev(values) if len(values) > 1 else 0.0


def _results(cell: CellRun, name: str) -> list[tuple[int, RunResult]]:
    """``(seed, result)`` of ``name`` on every trace of the cell where it finished."""
    out = []
    for run in cell.runs:
        result = run.result(name)
        if result is not None:
            out.append((run.seed, result))
    return out


def policy_summary(cell: CellRun, name: str) -> dict[str, Any]:
    """One policy's figures in one cell: means over seeds, with their spread.

    Args:
        cell: the cell.
        name: the policy.

    Returns:
        ``name``, ``avg_throughput_samples_s`` (mean), ``avg_throughput_std``,
        ``relative_to_failure_free`` (mean), ``relative_std``, ``effective_training_time``
        (mean: committed work at the failure-free speed over wall time, the same figure as
        the relative throughput), ``training_time_share`` (mean: wall time training kept
        work, at any speed), ``time_lost_s`` by cause (mean), ``num_decisions`` (mean),
        ``decisions`` by strategy (mean), ``num_software_restarts`` (mean), ``per_seed``
        and ``lost`` (one line per seed whose simulation process died; the means are over
        the other seeds, ``None`` when none is left).
    """
    pairs = _results(cell, name)
    results = [r for _, r in pairs]
    lost = [lost.line() for run in cell.runs for lost in run.lost
            if lost.policy == name or name in lost.not_run]
    if not results:
        return {"name": name, "avg_throughput_samples_s": None, "avg_throughput_std": None,
                "relative_to_failure_free": None, "relative_std": None,
                "effective_training_time": None, "training_time_share": None,
                "time_lost_s": {}, "num_decisions": None, "decisions": {},
                "num_software_restarts": None, "per_seed": [], "lost": lost}
    throughput = [r.avg_throughput_samples_s for r in results]
    relative = [r.relative_to_failure_free for r in results]
    causes = sorted({c for r in results for c, _ in r.time_lost_s})
    strategies = sorted({s for r in results for s, _ in r.decisions})
    n = len(results)
    return {
        "name": name,
        "avg_throughput_samples_s": _mean(throughput),
        "avg_throughput_std": _std(throughput),
        "relative_to_failure_free": _mean(relative),
        "relative_std": _std(relative),
        "effective_training_time": _mean([r.effective_training_time for r in results]),
        "training_time_share": _mean([r.training_time_share for r in results]),
        "time_lost_s": {c: math.fsum(dict(r.time_lost_s).get(c, 0.0) for r in results) / n
                        for c in causes},
        "num_decisions": _mean([float(r.num_decisions) for r in results]),
        "decisions": {s: math.fsum(dict(r.decisions).get(s, 0) for r in results) / n
                      for s in strategies},
        "num_software_restarts": _mean([float(r.num_software_restarts) for r in results]),
        "per_seed": [{"seed": seed, "avg_throughput_samples_s": r.avg_throughput_samples_s,
                      "relative_to_failure_free": r.relative_to_failure_free,
                      "effective_training_time": r.effective_training_time,
                      "training_time_share": r.training_time_share,
                      "samples": r.samples}
                     for seed, r in pairs],
        "lost": lost,
    }


def _ratios(policies: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Chameleon's mean average throughput over each other policy's."""
    if "chameleon" not in policies or policies["chameleon"]["avg_throughput_samples_s"] is None:
        return {}
    ours = policies["chameleon"]["avg_throughput_samples_s"]
    return {f"chameleon/{name}": ours / p["avg_throughput_samples_s"]
            for name, p in policies.items()
            if name != "chameleon" and p["avg_throughput_samples_s"]}


def _cell_doc(run: ScenarioRun, cell: CellRun) -> dict[str, Any]:
    policies = {name: policy_summary(cell, name) for name in run.policies}
    traces = []
    for seed_run in cell.runs:
        kinds: dict[str, int] = {}
        for event in seed_run.trace.events:
            kinds[event.kind.value] = kinds.get(event.kind.value, 0) + 1
        traces.append({"seed": seed_run.seed, "num_events": len(seed_run.trace.events),
                       "num_failures": seed_run.trace.num_failures,
                       "events_by_kind": dict(sorted(kinds.items()))})
    return {
        "node_mtbf_hours": cell.node_mtbf_hours,
        "repair_hours": cell.repair_hours,
        "traces": traces,
        "policies": list(policies.values()),
        "ratios": _ratios(policies),
    }


def report_doc(run: ScenarioRun) -> dict[str, Any]:
    """The JSON report of a scenario run.

    Args:
        run: the results.

    Returns:
        A JSON-ready mapping: the scenario, the failure-free figures, and per cell the traces,
        every policy's summary (:func:`policy_summary`) and Chameleon's ratios; ``lost``:
        one line per simulation whose process died. A single-cell scenario also has its
        ``policies`` and ``ratios`` at the top level.
    """
    scenario = run.scenario
    config = scenario.config
    doc: dict[str, Any] = {
        "scenario": scenario.name,
        "job": {
            "model": config.model.name if config.model is not None else None,
            "num_nodes": config.cluster.num_nodes,
            "spare_nodes": config.cluster.spare_nodes,
            "memory_checkpoint": config.recovery.memory_checkpoint,
            "devices_per_node": config.cluster.devices_per_node,
            "tp": config.job.tp, "pp": config.job.pp, "dp": config.job.dp,
            "global_batch": config.job.global_batch,
        },
        "duration_s": scenario.simulation.duration_s,
        "policies_run": list(run.policies),
        "failure_free_samples_s": run.failure_free_samples_s,
        "failure_free_step_s": run.failure_free_step_s,
        "cells": [_cell_doc(run, cell) for cell in run.cells],
        "lost": [lost.line() for lost in run.lost],
    }
    if len(run.cells) == 1:
        doc["policies"] = doc["cells"][0]["policies"]
        doc["ratios"] = doc["cells"][0]["ratios"]
    return doc


def report_json(run: ScenarioRun) -> str:
    """The JSON report as text: deterministic for a deterministic run (no timings)."""
    return dumps(report_doc(run)) + "\n"


def _repair_label(hours: float | None) -> str:
    if hours is None:
        return "never"
    return f"{hours * 60:.0f} min" if hours < 1 else f"{hours:g} h"


def report_markdown(run: ScenarioRun) -> str:
    """A Markdown report: one table per cell (policies as rows), and Chameleon's ratios.

    Args:
        run: the results.

    Returns:
        The Markdown text.
    """
    scenario = run.scenario
    seeds = len(run.cells[0].runs)
    config = scenario.config
    means = "".join(
        [f"; {config.cluster.spare_nodes} spare node(s)" if config.cluster.spare_nodes else "",
         "; checkpoints in memory" if config.recovery.memory_checkpoint else ""])
    lines = [f"# Scenario `{scenario.name}`", "",
             f"{scenario.simulation.days:g} days, {seeds} seed(s){means}; failure-free "
             f"throughput {run.failure_free_samples_s:.4g} samples/s (step "
             f"{run.failure_free_step_s:.4g} s).",
             ""]
    sweep = scenario.simulation.is_sweep
    if sweep:
        lines += ["Relative throughput (mean over seeds) per cell:", "",
                  "| node MTBF | repair | " + " | ".join(run.policies) + " |",
                  "|---|---|" + "---|" * len(run.policies)]
        for cell in run.cells:
            rel = [policy_summary(cell, n)["relative_to_failure_free"] for n in run.policies]
            lines.append(f"| {cell.node_mtbf_hours:g} h | {_repair_label(cell.repair_hours)} | "
                         + " | ".join("died" if r is None else f"{r:.3f}" for r in rel) + " |")
        lines.append("")
        return "\n".join(lines + _lost_lines(run))
    cell = run.cells[0]
    failures = [r.trace.num_failures for r in cell.runs]
    lines += [f"Failures per trace: {', '.join(str(f) for f in failures)}.", "",
              "| policy | avg samples/s | spread | effective training time | time training "
              "| decisions | main time lost (h) |",
              "|---|---|---|---|---|---|---|"]
    summaries = {n: policy_summary(cell, n) for n in run.policies}
    for name, s in summaries.items():
        if s["avg_throughput_samples_s"] is None:
            lines.append(f"| {name} | died | | | | | |")
            continue
        lost = sorted(s["time_lost_s"].items(), key=lambda kv: -kv[1])[:3]
        lost_text = ", ".join(f"{c.removesuffix('_s')} {v / 3600:.2f}" for c, v in lost) or "-"
        decisions = ", ".join(f"{k} {v:g}" for k, v in s["decisions"].items()) or "-"
        lines.append(f"| {name} | {s['avg_throughput_samples_s']:.4g} | "
                     f"±{s['avg_throughput_std']:.2g} | {s['effective_training_time']:.4f} | "
                     f"{s['training_time_share']:.4f} | {decisions} | {lost_text} |")
    ratios = _ratios(summaries)
    if ratios:
        lines += ["", "Chameleon's average throughput over each policy's:", ""]
        for key, value in ratios.items():
            other = key.split("/", 1)[1]
            paper = f" (paper: {PAPER_RATIOS[other]}x)" if other in PAPER_RATIOS else ""
            lines.append(f"- {key}: {value:.3f}x{paper}")
    lines += ["", "Effective training time: committed work at the failure-free speed over "
              "wall time (the relative throughput); time training: the share of wall time "
              "spent on steps that were kept, at any speed.", ""]
    return "\n".join(lines + _lost_lines(run))


def _lost_lines(run: ScenarioRun) -> list[str]:
    lost = run.lost
    if not lost:
        return []
    return ["Simulations whose process died (their policies have no result there):", "",
            *(f"- {lost.line()}" for lost in lost), ""]


def effective_training_table(variants: Sequence[tuple[str, ScenarioRun]]) -> str:
    """Effective training time of every policy under each variant of one scenario, next
    to the published figures: the table of RESULTS.md (llama3-16k).

    A variant is the scenario with some means of recovery added or removed (spare nodes,
    checkpoints in memory, ...): one column pair each, so a new means is one more entry.

    Args:
        variants: ``(label, run)`` pairs of single-cell runs over the same policies.

    Returns:
        A Markdown table (policies as rows; per variant the effective training time and the
        share of wall time training, means over seeds) and the published figures.

    Raises:
        ValueError: for a sweep or variants that ran different policies.
    """
    if not variants:
        raise ValueError("effective_training_table: give at least one run")
    policies = variants[0][1].policies
    for label, run in variants:
        if len(run.cells) != 1 or run.policies != policies:
            raise ValueError(f"effective_training_table: {label!r} is a sweep or ran other "
                             "policies")
    header = "| policy | " + " | ".join(f"{label}: effective training time | time training"
                                         for label, _ in variants) + " |"
    lines = [header, "|---|" + "---|---|" * len(variants)]
    for name in policies:
        cells = []
        for _, run in variants:
            s = policy_summary(run.cells[0], name)
            if s["effective_training_time"] is None:
                cells += ["died", ""]
            else:
                cells += [f"{s['effective_training_time']:.1%}", f"{s['training_time_share']:.1%}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Published:", ""]
    lines += [f"- {what}: {value}" for what, value in PUBLISHED_EFFECTIVE_TRAINING_TIME]
    return "\n".join(lines) + "\n"


def _figure_png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    # Fixed metadata keeps the bytes stable from run to run.
    fig.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    return buffer.getvalue()


def binned_throughput(timeline: Sequence[tuple[float, float]], duration_s: float, *,
                      num_bins: int) -> tuple[list[float], list[float]]:
    """Average throughput in equal time bins, exactly integrated from a rate timeline.

    Instantaneous rates drop to zero for every transition of a few seconds, which on a chart
    of days is a forest of spikes; bin averages show the work done instead.

    Args:
        timeline: ``(time_s, samples_s)`` change points, the first at 0.
        duration_s: the end of the last segment.
        num_bins: how many bins.

    Returns:
        The ``num_bins + 1`` bin edges and the ``num_bins`` average rates.
    """
    width = duration_s / num_bins
    edges = [i * width for i in range(num_bins)] + [duration_s]
    work = [0.0] * num_bins
    ends = [t for t, _ in timeline[1:]] + [duration_s]
    for (start, rate), end in zip(timeline, ends, strict=True):
        first = min(int(start / width), num_bins - 1)
        for b in range(first, num_bins):
            lo, hi = max(start, edges[b]), min(end, edges[b + 1])
            if hi <= lo:
                if edges[b] >= end:
                    break
                continue
            work[b] += rate * (hi - lo)
    return edges, [w / (edges[b + 1] - edges[b]) for b, w in enumerate(work)]


def timeline_png(run: ScenarioRun) -> bytes:
    """Throughput over time of every policy on the first seed of the first cell, one chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cell = run.cells[0]
    first = cell.runs[0]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    scale = 86400.0 if first.trace.duration_s > 4 * 86400 else 3600.0
    unit = "days" if scale == 86400.0 else "hours"
    for result in first.results:
        edges, rates = binned_throughput(result.timeline, result.duration_s, num_bins=200)
        ax.step([e / scale for e in edges], [*rates, rates[-1]], where="post",
                label=result.name, linewidth=1.0)
    ax.axhline(run.failure_free_samples_s, color="black", linestyle=":", linewidth=0.8,
               label="failure-free")
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("throughput (samples/s), 200 bins")
    ax.set_title(f"{run.scenario.name}: throughput over time (seed {first.seed})")
    ax.legend(loc="lower left", fontsize=8, ncol=4)
    fig.tight_layout()
    data = _figure_png(fig)
    plt.close(fig)
    return data


def relative_png(run: ScenarioRun) -> bytes:
    """Relative throughput per policy: bars for one cell, lines over the sweep grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run.scenario.simulation.is_sweep:
        cell = run.cells[0]
        fig, ax = plt.subplots(figsize=(7, 4))
        summaries = [s for s in (policy_summary(cell, n) for n in run.policies)
                     if s["relative_to_failure_free"] is not None]
        ax.bar([s["name"] for s in summaries], [s["relative_to_failure_free"] for s in summaries],
               yerr=[s["relative_std"] for s in summaries], capsize=3)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("average / failure-free throughput")
        ax.set_title(f"{run.scenario.name}: relative throughput per policy")
    else:
        repairs: list[float | None] = []
        for cell in run.cells:
            if cell.repair_hours not in repairs:
                repairs.append(cell.repair_hours)
        fig, axes = plt.subplots(1, len(repairs), figsize=(4 * len(repairs), 4), sharey=True,
                                 squeeze=False)
        for ax, repair in zip(axes[0], repairs, strict=True):
            cells = [c for c in run.cells if c.repair_hours == repair]
            xs = [c.node_mtbf_hours for c in cells]
            for name in run.policies:
                ys = [math.nan if y is None else y for y in
                      (policy_summary(c, name)["relative_to_failure_free"] for c in cells)]
                ax.plot(xs, ys, marker="o", label=name, linewidth=1.0)
            ax.set_xscale("log")
            ax.set_xlabel("node MTBF (h)")
            ax.set_title(f"repair {_repair_label(repair)}")
        axes[0][0].set_ylabel("average / failure-free throughput")
        axes[0][-1].legend(fontsize=8)
        fig.suptitle(f"{run.scenario.name}: relative throughput across the sweep")
    fig.tight_layout()
    data = _figure_png(fig)
    plt.close(fig)
    return data


def render(run: ScenarioRun) -> dict[str, bytes]:
    """Every report file of a run, by file name, rendered in memory.

    Args:
        run: the results.

    Returns:
        ``report.json``, ``report.md``, ``relative.png`` (and ``timeline.png`` unless a sweep).
    """
    files = {"report.json": report_json(run).encode(),
             "report.md": report_markdown(run).encode(),
             "relative.png": relative_png(run)}
    if not run.scenario.simulation.is_sweep:
        files["timeline.png"] = timeline_png(run)
    return files


def write_files(out_dir: str | Path, files: dict[str, bytes]) -> list[Path]:
    """Write rendered files into ``out_dir``, each atomically (temporary name, then rename).

    Args:
        out_dir: the folder (created if missing).
        files: contents by file name.

    Returns:
        The paths written.

    Raises:
        ValueError: when the folder cannot be created or written.
    """
    out = Path(out_dir)
    temps: list[tuple[Path, Path]] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            temps.append((out / f".{name}.tmp", out / name))
            temps[-1][0].write_bytes(data)
        for temp, final in temps:
            os.replace(temp, final)
    except OSError as exc:
        for temp, _ in temps:  # no half-written file stays behind
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
        raise ValueError(f"--out: cannot write to {str(out)!r}: {exc.strerror}") from None
    return [final for _, final in temps]


class ProgressBar:
    """A one-line progress bar on stderr that appears only once a run takes a while."""

    def __init__(self, label: str, *, stream: TextIO | None = None, after_s: float = 2.0,
                 width: int = 30) -> None:
        """Prepare the bar.

        Args:
            label: text before the bar.
            stream: where to draw (default stderr).
            after_s: stay silent until the run has taken this long.
            width: characters of the bar.
        """
        self._label = label
        self._stream = stream if stream is not None else sys.stderr
        self._after_s = after_s
        self._width = width
        self._start = time.monotonic()
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        """Redraw with ``done`` of ``total`` units (at most ten times a second)."""
        now = time.monotonic()
        if now - self._start < self._after_s or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        fraction = done / total if total else 1.0
        filled = int(self._width * fraction)
        bar = "#" * filled + "-" * (self._width - filled)
        self._stream.write(f"\r{self._label} [{bar}] {fraction:4.0%} "
                           f"{now - self._start:5.1f} s")
        self._stream.flush()
        self._shown = True

    def close(self) -> None:
        """End the line if the bar was drawn."""
        if self._shown:
            self._stream.write("\n")
            self._stream.flush()
