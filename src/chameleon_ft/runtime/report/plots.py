"""``report.png`` of a training run: loss and step time over the steps, with every failure
(and the strategy that recovered it) and every re-join marked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def write_report_png(report: dict[str, Any], path: Path) -> None:
    """Plot ``report`` (what ``chameleon train --json`` prints) into ``path`` atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in report["steps"]]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    top.plot(steps, [s["loss"] for s in report["steps"]], lw=1, color="tab:blue")
    top.set_ylabel("loss")
    bottom.plot(steps, [s["step_s"] for s in report["steps"]], lw=1, color="tab:gray")
    bottom.set_ylabel("step time (s)")
    if any(s["step_s"] > 0 for s in report["steps"]):
        bottom.set_yscale("log")
    bottom.set_xlabel("step")
    for event in report["events"]:
        if event.get("idle"):
            continue
        for axis in (top, bottom):
            axis.axvline(event["step"], color="tab:red", ls="--", lw=0.8)
        top.annotate(f"w{','.join(map(str, event['workers']))}: {event['strategy']}",
                     (event["step"], 1.0), xycoords=("data", "axes fraction"),
                     rotation=90, va="top", ha="right", fontsize=7, color="tab:red")
    for rejoin in report.get("rejoins", []):
        if rejoin["strategy"] == "keep":
            continue
        for axis in (top, bottom):
            axis.axvline(rejoin["step"], color="tab:green", ls=":", lw=0.8)
    failures = sum(1 for e in report["events"] if not e.get("idle"))
    title = f"{len(steps)} steps, {failures} failure{'' if failures == 1 else 's'} (red), " \
            "re-joins (green)"
    top.set_title(title, fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
