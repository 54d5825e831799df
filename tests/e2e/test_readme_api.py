"""The README's Python API example, extracted from README.md and run as a script: it
trains as written, and without its ``if __name__ == "__main__":`` guard it stops at once
with one line saying to add it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_helpers import env

ROOT = Path(__file__).resolve().parents[2]
GUARD = 'if __name__ == "__main__":'


def readme_example() -> str:
    """The README's Python block that calls ``chameleon_ft.train``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (example,) = [b for b in blocks if "chameleon_ft.train(" in b]
    return example


def _workspace(tmp_path: Path, script: str) -> Path:
    """The script in a folder holding the example's job file, shortened to 6 steps."""
    (tmp_path / "examples").mkdir()
    job = (ROOT / "examples" / "mlp_cpu.toml").read_text()
    job, count = re.subn(r"(?m)^steps = \d+$", "steps = 6", job)
    assert count == 1
    (tmp_path / "examples" / "mlp_cpu.toml").write_text(job.replace("checkpoint_every = 20",
                                                                    "checkpoint_every = 0"))
    (tmp_path / "example.py").write_text(script, encoding="utf-8")
    return tmp_path / "example.py"


def _run(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script)], cwd=script.parent,
                          capture_output=True, text=True, timeout=150, env=env())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_readme_example_runs_as_written(tmp_path: Path) -> None:
    example = readme_example()
    assert GUARD in example
    proc = _run(_workspace(tmp_path, example))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "runs" / "mlp" / "report.json").read_text())
    assert len(report["steps"]) == 6


def test_the_example_without_its_guard_stops_in_one_line(tmp_path: Path) -> None:
    example = readme_example()
    head, _, body = example.partition(GUARD)
    unguarded = head + textwrap.dedent(body.split("\n", 1)[1])  # the guarded block, dedented
    assert GUARD not in unguarded and "\nreport = chameleon_ft.train(" in unguarded
    proc = _run(_workspace(tmp_path, unguarded))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("chameleon_ft.train: called at the top level of ")
    assert lines[0].endswith(f"put the call under `{GUARD}`")
    assert not (tmp_path / "runs").exists(), "no worker started, nothing written"


def test_a_call_reached_from_unguarded_top_level_code_stops_too(tmp_path: Path) -> None:
    example = readme_example()
    head, _, body = example.partition(GUARD)
    wrapped = head + "def main():" + body + "\n\nmain()\n"  # the guard's body in a function
    proc = _run(_workspace(tmp_path, wrapped))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    lines_of_script = wrapped.splitlines()
    number = int(re.search(r"\(line (\d+)\)", line).group(1))  # type: ignore[union-attr]
    assert lines_of_script[number - 1] == "main()"
