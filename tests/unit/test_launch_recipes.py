"""The cluster recipes (examples/slurm, examples/kubernetes) against the CLI: every
``chameleon`` command line they hold parses with the real argument parsers, and each keeps
what makes a job survive its scheduler (a stable run directory, requeue, the drain grace
inside the scheduler's, workers found through MASTER_ADDR/MASTER_PORT, re-join on)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from chameleon_ft.cli import COMMANDS, build_parser

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SBATCH = EXAMPLES / "slurm" / "chameleon.sbatch"
MANIFEST = EXAMPLES / "kubernetes" / "chameleon.yaml"
SHELL_ENDS = {"&", "&&", "||", ";", "|", ")"}


def chameleon_commands(script: str) -> list[list[str]]:
    """Every ``chameleon COMMAND ...`` in a shell script, as words (continuations joined,
    comments dropped, words up to the end of the command)."""
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line)  # not comments=True: it takes the # of ${#ARRAY[@]}
        words = words[:next((i for i, w in enumerate(words) if w.startswith("#")),
                            len(words))]
        for i, word in enumerate(words[:-1]):
            if word == "chameleon" and words[i + 1] in COMMANDS:
                command = []
                for w in words[i + 1:]:
                    if w in SHELL_ENDS:
                        break
                    command.append(w)
                out.append(command)
    return out


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def check_flags(command: list[str]) -> dict[str, str | None]:
    """The command's flags and their values (the next word, unless it is a flag), after
    checking that each exists for that sub-command and the required ones are given."""
    parser = _subparsers()[command[0]]
    known = {o: a for a in parser._actions for o in a.option_strings}
    flags: dict[str, str | None] = {}
    for i, word in enumerate(command[1:], start=1):
        if not word.startswith("--"):
            continue
        name, _, inline = word.partition("=")
        assert name in known, f"`chameleon {command[0]}` has no flag {name}: {command}"
        takes_value = known[name].nargs != 0
        value = inline or (command[i + 1] if takes_value and i + 1 < len(command) else None)
        flags[name] = value
    for action in parser._actions:
        if action.required:
            assert set(action.option_strings) & set(flags), (action.option_strings, command)
    return flags


def test_the_extractor_finds_commands_and_catches_a_wrong_flag() -> None:
    script = "x=1\nsrun -n1 \\\n  chameleon train --config a.toml --out \"$OUT\" &\n" \
             "exec chameleon worker --drain-timeout 5 # done\n"
    assert chameleon_commands(script) == [["train", "--config", "a.toml", "--out", "$OUT"],
                                          ["worker", "--drain-timeout", "5"]]
    with pytest.raises(AssertionError, match="has no flag --drain-grace"):
        check_flags(["worker", "--drain-grace", "5"])
    with pytest.raises(AssertionError, match="--config"):
        check_flags(["train", "--out", "x"])


# ---------------------------------------------------------------------- Slurm
def _sbatch_directives(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            name, _, value = line.removeprefix("#SBATCH ").strip().partition("=")
            out[name] = value
    return out


def test_the_slurm_recipe_survives_a_requeue() -> None:
    text = SBATCH.read_text()
    commands = {c[0]: check_flags(c) for c in chameleon_commands(text)}
    assert set(commands) == {"train", "worker"}
    directives = _sbatch_directives(text)
    assert "--requeue" in directives
    # SIGTERM to the batch shell only (B:), which passes it on after its lead time
    lead = re.fullmatch(r"B:TERM@(\d+)", directives["--signal"])
    assert lead, directives["--signal"]
    # the output and the run directory outlive the job id (a resubmission changes it)
    assert "%j" not in directives["--output"] and directives.get("--open-mode") == "append"
    out_line = next(line for line in text.splitlines() if line.startswith("OUT="))
    assert "SLURM_JOB_ID" not in out_line and "SLURM_JOB_NAME" in out_line
    # the drain grace is wired to both sides and fits the signal's lead time
    drain = re.search(r"^DRAIN_TIMEOUT=\$\{CHAMELEON_DRAIN_TIMEOUT:-(\d+)\}", text, re.M)
    assert drain and int(drain.group(1)) < int(lead.group(1))
    assert commands["train"]["--drain-timeout"] == commands["worker"]["--drain-timeout"] \
        == "$DRAIN_TIMEOUT"
    # workers find the coordinator from the launcher's variables, not from a flag
    assert "--coordinator" not in commands["worker"]
    assert re.search(r'^export MASTER_ADDR="\$HEAD" MASTER_PORT="\$PORT"', text, re.M)
    assert commands["train"]["--port"] == "$PORT"


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run_sbatch(tmp_path: Path, out: Path, *, terminate: bool) -> tuple[int, list[str]]:
    """The batch script with stand-ins for srun, scontrol and chameleon (each records its
    arguments): one node, so only the coordinator runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    _stub(bin_dir, "scontrol", f'echo "scontrol $*" >> {log}\n'
          'if [[ "$1 $2" == "show hostnames" ]]; then echo node0; fi\n'
          'if [[ "$1 $2" == "show job" ]]; then echo "JobId=7 JobState=RUNNING"; fi\n')
    # srun: drop its own options, run the command
    _stub(bin_dir, "srun", 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    # chameleon: record, then run until SIGTERM (exit 143, as after a drain) or finish
    _stub(bin_dir, "chameleon", f'echo "chameleon $*" >> {log}\n'
          "trap 'exit 143' TERM\n"
          f'if [[ -n "${{STAY:-}}" ]]; then touch {tmp_path}/up; '
          "while :; do sleep 0.05; done; fi\n")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NAME": "myrun",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node0", "CHAMELEON_OUT": str(out),
           "HOME": str(tmp_path)}
    if terminate:
        env["STAY"] = "1"
    proc = subprocess.Popen(["bash", str(SBATCH), "job.toml", "--steps", "9"], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    if terminate:
        deadline = time.monotonic() + 20
        while not (tmp_path / "up").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@... sends the batch shell
    proc.communicate(timeout=30)
    calls = log.read_text().splitlines()
    log.unlink()
    (tmp_path / "up").unlink(missing_ok=True)
    return proc.returncode, calls


def test_the_slurm_script_resumes_drains_and_requeues(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "myrun"
    status, calls = _run_sbatch(tmp_path, out, terminate=False)
    (train,) = [c for c in calls if c.startswith("chameleon train")]
    assert status == 0 and "--resume" not in train and f"--out {out}" in train
    assert train.endswith("--steps 9")
    # a checkpoint in the run directory: the next run (a requeue) resumes from it; its
    # SIGTERM reaches the coordinator, and the script requeues the job after the drain
    (out / "checkpoints" / "step00000020").mkdir(parents=True)
    (out / "checkpoints" / "step00000020" / "manifest.json").write_text("{}")
    status, calls = _run_sbatch(tmp_path, out, terminate=True)
    (train,) = [c for c in calls if c.startswith("chameleon train")]
    assert "--resume" in shlex.split(train)
    assert status == 143
    assert "scontrol requeue 7" in calls


# ---------------------------------------------------------------------- Kubernetes
def _manifests() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _container_commands(doc: dict[str, Any]) -> list[tuple[dict[str, Any], list[str]]]:
    spec = doc["spec"]["template"]["spec"]
    out = []
    for container in spec["containers"]:
        words = [str(w) for w in container.get("command", []) + container.get("args", [])]
        if words[:2] == ["sh", "-c"]:
            (command,) = chameleon_commands(words[2])
        else:
            assert words[0] == "chameleon", words
            command = words[1:]
        out.append((container, command))
    return out


def test_the_kubernetes_example_restarts_workers_that_rejoin() -> None:
    docs = _manifests()
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    service = kinds[("Service", "chameleon-coordinator")]
    # headless: its name is the coordinator pod's address (the bulk port is not listed)
    assert service["spec"]["clusterIP"] == "None"
    coordinator = kinds[("Job", "chameleon-coordinator")]
    workers = kinds[("Job", "chameleon-workers")]
    labels = coordinator["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ((_, train),) = _container_commands(coordinator)
    train_flags = check_flags(train)
    assert train[0] == "train" and "--rejoin" in train_flags
    port = train_flags["--port"]
    assert port is not None and int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert workers["spec"]["completionMode"] == "Indexed"
    assert workers["spec"]["completions"] == int(train_flags["--remote-workers"] or 0)
    assert workers["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    ((container, worker),) = _container_commands(workers)
    worker_flags = check_flags(worker)
    assert worker[0] == "worker" and "--coordinator" not in worker_flags
    env = {e["name"]: e for e in container["env"]}
    assert env["MASTER_ADDR"]["value"] == service["metadata"]["name"]
    assert env["MASTER_PORT"]["value"] == port and "LOCAL_RANK" in env
    assert "secretKeyRef" in env["CHAMELEON_TOKEN"]["valueFrom"]
    for job, flags in ((coordinator, train_flags), (workers, worker_flags)):
        grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert float(flags["--drain-timeout"] or "inf") < grace
