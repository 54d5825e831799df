"""Tensor parallelism on the runtime (design 4.11, issue 33): ``[job] tp = 2`` x pp 2 x dp 2,
8 worker processes on CPU (gloo), one worker killed mid-step (both its processes go: one
worker failure), clipping by the global norm active at every step, float64: the final
parameters (``params.pt``, and for Hugging Face the ``hf/`` export) equal plain
single-process training to 1e-9, and the metrics' gradient norms are the reference's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_harness import alive, max_abs_diff, run_job, tiny_config
from hf_jobs import exported, max_diff
from test_train_numerics import BF16_STEP_LOSS_REL

import chameleon_ft
from chameleon_ft.runtime.coordinator.shell import Coordinator, Hooks
from chameleon_ft.runtime.workload.models.hf import save_random_hf
from chameleon_ft.runtime.workload.reference import train_reference
from chameleon_ft.spec.config import config_from_mapping

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from hf_families import SEQ_LEN, VOCAB, family_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TP = {"tp": 2}
CLUSTER = {"devices_per_node": 4}
"""2 nodes x 4 devices: dp 2 x pp 2 x tp 2, 4 workers of 2 processes."""
TRAIN: dict[str, Any] = {"steps": 3, "checkpoint_every": 2, "timeout_s": 6.0}
"""Few steps; deadlines a loaded 2-core host keeps with 8 processes (a kill is seen at
once whatever they are)."""
CLIP = 0.5
"""Below every step's gradient norm: clipping acts at every step."""
KILL = "rank=3,step=1,kind=kill,phase=backward"


def _clean(pids: list[int], processes: int = 8) -> None:
    assert len(pids) >= processes, pids  # every process of every worker was launched
    assert not [pid for pid in pids if alive(pid)], "processes left behind"


def _norms(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["grad_norm"] for line in lines]


STRATEGIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # policy -> (fault, [cluster] and [train] overrides)
    "reroute": (KILL, {}, {}),  # the survivors carry its micro-batches: nothing moves
    "dynamic": (KILL, {}, {}),  # every layer moves: each rank sends its shard
    "shrink": ("rank=0,step=1,kind=kill,phase=optimizer", {}, {}),
    "swap": (KILL, {"spare_nodes": 1}, {}),  # a spare worker (2 processes) takes its place
    # reloads the checkpoint after 2 steps, each rank its own shard files
    "restart": ("rank=1,step=3,kind=kill,phase=forward", {}, {"steps": 4}),
}


@pytest.mark.parametrize("policy", list(STRATEGIES))
def test_gpt_survives_a_kill_as_one_process(tmp_path: Path, policy: str) -> None:
    fault, cluster, more = STRATEGIES[policy]
    train = {**TRAIN, **more}
    cluster = {**CLUSTER, **cluster}
    report, params, pids = run_job(tmp_path, policy=policy, faults=(fault,), job=TP,
                                   cluster=cluster, optimizer={"clip_grad_norm": CLIP},
                                   **train)
    config = tiny_config(None, cluster, None, TP, {"clip_grad_norm": CLIP}, **train)
    reference = train_reference(config)
    assert min(reference.grad_norms) > CLIP, "clipping must be active"
    _clean(pids, 12 if "spare_nodes" in cluster else 8)
    dead = int(fault.split(",")[0].removeprefix("rank="))
    assert [(e["workers"], e["strategy"]) for e in report["events"]] == [([dead], policy)]
    assert [s["step"] for s in report["steps"]] == list(range(train["steps"]))
    assert max_abs_diff(params, reference.params) < 1e-9
    assert _norms(tmp_path) == pytest.approx(reference.grad_norms, rel=1e-9)
    timings = [json.loads(line) for line in
               (tmp_path / "op_times.jsonl").read_text().splitlines()]
    peaks = [t["rss_peak_bytes_ranks"] for t in timings]  # every rank's, with rank 0's
    assert peaks and all(len(p) == 2 and min(p) > 100 * 2**20 for p in peaks)


def test_a_relaunched_worker_rejoins_with_its_shards(tmp_path: Path) -> None:
    """Re-join: the dead worker is relaunched (both processes), idles until the policy
    folds it back in, and receives its layers shard by shard."""
    train = {**TRAIN, "steps": 30, "rejoin": True}
    report, params, pids = run_job(tmp_path, policy="dynamic", faults=(KILL,), job=TP,
                                   cluster=CLUSTER, optimizer={"clip_grad_norm": CLIP},
                                   **train)
    _clean(pids, 10)  # four workers and one replacement, two processes each
    used = [r for r in report["rejoins"] if r["strategy"] != "keep"]
    assert [(r["workers"], r["strategy"]) for r in used] == [([3], "dynamic")]
    assert 3 in {w for p in report["final_plan"]["pipelines"] for w, _, _ in p["stages"]}
    config = tiny_config(None, CLUSTER, None, TP, {"clip_grad_norm": CLIP}, **train)
    assert max_abs_diff(params, train_reference(config).params) < 1e-9


def test_bf16_at_tp2_is_plain_bf16_training(tmp_path: Path) -> None:
    """Mixed precision at tp 2: each rank's bf16 compute copy of its shards, fp32 masters,
    a kill under dynamic (bf16 copies rebuilt from the moved masters): every step's loss
    within the bf16 test's tolerance of plain bf16 training, the masters exported."""
    train = {**TRAIN, "dtype": "bfloat16"}
    report, params, pids = run_job(tmp_path, policy="dynamic", faults=(KILL,), job=TP,
                                   cluster=CLUSTER, optimizer={"clip_grad_norm": CLIP},
                                   **train)
    _clean(pids)
    assert [e["workers"] for e in report["events"]] == [[3]]
    config = tiny_config(None, CLUSTER, None, TP, {"clip_grad_norm": CLIP}, **train)
    reference = train_reference(config)
    assert len(report["loss"]) == len(reference.losses) == train["steps"]
    for got, want in zip(report["loss"], reference.losses, strict=True):
        assert got == pytest.approx(want, rel=BF16_STEP_LOSS_REL)
    assert {p.dtype for p in params.values()} == {torch.float32}


class SignalSibling(Hooks):
    """At the commit of step 0, signal rank 1 of worker 2 (not the process the control
    plane knows)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.pid: int | None = None
        self.signalled_s = self.detected_s = 0.0

    def on_commit(self, coord: Coordinator, step: int) -> None:
        if step == 0 and self.pid is None:
            self.pid = coord.procs[2].process.pids[1]
            os.kill(self.pid, self.signum)
            self.signalled_s = time.monotonic()

    def on_failure(self, coord: Coordinator, event: Any) -> None:
        self.detected_s = self.detected_s or time.monotonic()


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_sibling_killed_or_stopped_is_its_workers_failure(tmp_path: Path,
                                                             signum: int) -> None:
    """Rank 1 dies (the launcher ends the unit: one exit) or stops (rank 0 finds its slot
    silent for the hang deadline, reports the worker failed and leaves): either way one
    worker failure, recovered exactly, nothing left behind."""
    hooks = SignalSibling(signum)
    report, params, pids = run_job(tmp_path, policy="reroute", job=TP, cluster=CLUSTER,
                                   optimizer={"clip_grad_norm": CLIP},
                                   coordinator={"hooks": hooks}, **TRAIN)
    config = tiny_config(None, CLUSTER, None, TP, {"clip_grad_norm": CLIP}, **TRAIN)
    _clean(pids)
    assert hooks.pid in pids
    (event,) = report["events"]
    assert event["workers"] == [2] and event["strategy"] == "reroute"
    if signum == signal.SIGSTOP:  # found by its silence, within the hang deadline
        assert "silent" in event["cause"], event["cause"]
        assert hooks.detected_s - hooks.signalled_s < TRAIN["timeout_s"] + 2.0
    assert max_abs_diff(params, train_reference(config).params) < 1e-9


@pytest.fixture(scope="module")
def written_at_tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder whose checkpoint after 2 steps was written at tp 2 (shards)."""
    run: Path = tmp_path_factory.mktemp("tp2")
    _, _, pids = run_job(run, job=TP, cluster=CLUSTER, optimizer={"clip_grad_norm": CLIP},
                         **{**TRAIN, "steps": 2})
    _clean(pids)
    manifest = json.loads((run / "checkpoints" / "step00000002" / "manifest.json").read_text())
    assert all(layer["degree"] == 2 and len(layer["shards"]) == 2
               for layer in manifest["layers"].values())
    return run


RESUMED = {  # layout -> ([job], [cluster]) overrides
    "tp1": ({"tp": 1}, {"devices_per_node": 2}),
    "tp2-pp4": ({"tp": 2, "pp": 4, "dp": 1}, CLUSTER),  # another plan: a stage per layer
}


@pytest.mark.parametrize("layout", sorted(RESUMED))
def test_a_tp2_checkpoint_resumes_at_another_layout(written_at_tp2: Path, tmp_path: Path,
                                                    layout: str) -> None:
    """Each reader joins the shards and splits them for its own degree: the resumed run
    ends where the uninterrupted one does."""
    job, cluster = RESUMED[layout]
    run = tmp_path / "run"
    shutil.copytree(written_at_tp2, run)
    train = {**TRAIN, "steps": 4}
    report, params, pids = run_job(run, job=job, cluster=cluster,
                                   optimizer={"clip_grad_norm": CLIP},
                                   coordinator={"resume": True}, **train)
    _clean(pids, 4 * job["tp"])
    assert report["resumed_from_step"] == 2
    config = tiny_config(None, cluster, None, job, {"clip_grad_norm": CLIP}, **train)
    assert max_abs_diff(params, train_reference(config).params) < 1e-9


def _family_job(family: str, root: Path) -> Any:
    save_random_hf(family_config(family), root / family, seed=4, dtype=torch.float64)
    (np.arange(3000) * 31 % VOCAB).astype(np.uint16).tofile(root / "tokens.bin")
    return config_from_mapping({
        "cluster": {"num_nodes": 2, "device": "cpu", **CLUSTER},
        "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2, **TP},
        "recovery": {"detect_s": 0.05, "rebuild_s": 0.05, "restart_s": 0.1,
                     "checkpoint_load_s": 0.05, "checkpoint_interval_s": 3.0},
        "profile": {"kind": "analytic"},
        "model": {"source": "hf", "path": family, "seq_len": SEQ_LEN},
        "data": {"kind": "tokens", "path": "tokens.bin", "shuffle": True},
        "optimizer": {"name": "AdamW", "lr": 1e-2, "weight_decay": 0.1,
                      "clip_grad_norm": CLIP},
        "train": {**TRAIN, "dtype": "float64", "heartbeat_s": 0.1}}, base_dir=str(root))


FAMILIES = {  # family -> policy after the kill
    "qwen2": "dynamic",   # biases, a tied head, grouped key/value heads: all moved
    "mistral": "reroute",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hugging_face_survives_a_kill_as_one_process(family: str, tmp_path: Path) -> None:
    config = _family_job(family, tmp_path)
    run = tmp_path / "run"
    report = chameleon_ft.train(config, out_dir=run, log=None, policy=FAMILIES[family],
                                faults=[KILL])
    assert [e["workers"] for e in report["events"]] == [[3]]
    reference = train_reference(config)
    assert min(reference.grad_norms) > CLIP, "clipping must be active"
    assert max_diff(dict(torch.load(run / "params.pt")), reference.params) < 1e-9
    assert max_diff(exported(config, run), reference.params) < 1e-9
    assert _norms(run) == pytest.approx(reference.grad_norms, rel=1e-9)
