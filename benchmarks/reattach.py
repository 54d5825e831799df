"""Time from a coordinator's death to the next committed step, a new coordinator taking
the run over under live workers (docs/design.md 4.1, "A coordinator replaced under live
workers").

Each run trains ``examples/tiny_cpu.toml`` (4 worker processes, float64) with
``chameleon train``, SIGKILLs the coordinator once ``--kill-step`` steps committed, and at
once starts ``chameleon train --resume`` on the same run folder, as a scheduler restarting
it would. It reports, from the kill (wall clock, this process reading both commands'
lines as they are printed):

- ``listening_s``: the new coordinator published the job (its process started, the job
  was prepared and the policy built);
- ``taken_over_s``: every worker reported and the run was taken over;
- ``next_commit_s``: the first step committed after the kill (the goal: under 10 s);

and checks that no worker was relaunched (the same pids) and that the final parameters
equal an uninterrupted run's (float64, < 1e-9). The median of the runs is the figure.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/reattach.py [--runs 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny_cpu.toml"


def _job(folder: Path, steps: int) -> Path:
    """The example with ``steps`` steps, float64 (an exact comparison), its profile found."""
    text = CONFIG.read_text()
    text = re.sub(r"(?m)^steps = \d+", f"steps = {steps}", text)
    text = re.sub(r'(?m)^dtype = "float32"', 'dtype = "float64"', text)
    text = text.replace('path = "tiny_cpu_profile.json"',
                        f'path = "{CONFIG.parent / "tiny_cpu_profile.json"}"')
    path = folder / "job.toml"
    path.write_text(text)
    return path


class Command:
    """A ``chameleon`` command whose lines are stamped (wall clock) as they come."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT / "src")}
        self.proc = subprocess.Popen([sys.executable, "-m", "chameleon_ft", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append((time.time(), line.rstrip()))
                self.cond.notify_all()

    def until(self, pattern: str, limit_s: float = 120.0) -> tuple[float, re.Match[str]]:
        """The first line matching ``pattern``, waited for."""
        deadline = time.monotonic() + limit_s
        with self.cond:
            while True:
                for stamp, line in self.lines:
                    match = re.search(pattern, line)
                    if match:
                        return stamp, match
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.cond.wait(0.2)):
                    lines = [line for _, line in self.lines if not line.startswith(" ")]
                    raise RuntimeError(f"never saw {pattern!r}: {lines[-12:]}")
                self.cond.wait(min(left, 0.2))

    def wait(self, limit_s: float) -> int:
        return self.proc.wait(limit_s)

    def kill(self) -> float:
        """SIGKILL the command's own process (its workers live on); returns when."""
        os.kill(self.proc.pid, signal.SIGKILL)
        at = time.time()
        self.proc.wait(10)
        return at


def _stop_group(cmd: Command) -> None:
    """Leave nothing behind (the command's process group, by id)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(cmd.proc.pid, signal.SIGKILL)


def one_run(folder: Path, steps: int, kill_step: int) -> dict[str, Any]:
    """Train, kill the coordinator at ``kill_step``, take the run over; the figures."""
    job = _job(folder, steps)
    out = folder / "run"
    first = Command("train", "--config", str(job), "--out", str(out))
    second = None
    try:
        _, launched = first.until(r"launched workers 0-3 \(pids ([\d ]+)\)")
        pids = [int(p) for p in launched.group(1).split()]
        first.until(rf"step +({kill_step}|{kill_step + 1}|{kill_step + 2}|{kill_step + 3}) ")
        killed_at = first.kill()
        second = Command("train", "--config", str(job), "--out", str(out), "--resume",
                         "--json")
        listening, _ = second.until(r"taking the run over")
        taken, took = second.until(r"took the run over at step (\d+): re-attached "
                                   r"worker\(s\) \[([\d, ]+)\]")
        committed, _ = second.until(r"^step +\d+ ")
        status = second.wait(300)
        report = json.loads((out / "report.json").read_text())
        return {"killed_at_step": int(took.group(1)), "status": status,
                "listening_s": listening - killed_at, "taken_over_s": taken - killed_at,
                "next_commit_s": committed - killed_at,
                "same_pids": [r["pid"] for r in report["reattached"]] == pids,
                "relaunched": any("launched workers" in line for _, line in second.lines),
                "params": str(out / "params.pt")}
    finally:
        _stop_group(first)
        if second is not None:
            _stop_group(second)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--kill-step", type=int, default=30)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    import torch

    results = []
    with tempfile.TemporaryDirectory(prefix="reattach-") as tmp:
        ref = Path(tmp) / "reference"
        ref.mkdir()
        plain = Command("train", "--config", str(_job(ref, args.steps)), "--out",
                        str(ref / "run"))
        if plain.wait(600) != 0:
            print("the uninterrupted run failed", file=sys.stderr)
            return 1
        reference = torch.load(ref / "run" / "params.pt", weights_only=True)
        for i in range(args.runs):
            folder = Path(tmp) / f"run{i}"
            folder.mkdir()
            r = one_run(folder, args.steps, args.kill_step)
            params = torch.load(r.pop("params"), weights_only=True)
            r["max_diff"] = max(float((params[k] - reference[k]).abs().max())
                                for k in reference)
            results.append(r)
            print(json.dumps(r), flush=True)
    summary = {key: statistics.median(r[key] for r in results)
               for key in ("listening_s", "taken_over_s", "next_commit_s")}
    summary.update(runs=len(results), all_exact=all(r["max_diff"] < 1e-9 for r in results),
                   none_relaunched=all(r["same_pids"] and not r["relaunched"]
                                       for r in results),
                   all_trained=all(r["status"] == 0 for r in results))
    print(json.dumps({"median": summary}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "median": summary}, indent=1))
    return 0 if summary["all_exact"] and summary["none_relaunched"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
