"""What only a GPU can show (issue "Where users train", item 7): the runtime's numerics,
recovery, device placement and memory on CUDA, and NCCL's point-to-point where the host
has several GPUs. Run by ``tests/gpu/run.sh``; each test is one line of its summary.

With ``CHAMELEON_GPU_SUITE_DEVICE=cpu`` the same checks run on CPU processes (what needs a
GPU is skipped): a dry run of the suite's own code before a machine with a GPU is lent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import max_abs_diff, run_job
from events import failures
from test_train_numerics import BF16_STEP_LOSS_REL

from chameleon_ft.runtime.coordinator.shell import Coordinator, Hooks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DEVICE = os.environ.get("CHAMELEON_GPU_SUITE_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"
GPUS = torch.cuda.device_count() if ON_GPU else 0
BACKEND = "nccl" if GPUS >= 4 else "gloo"
"""The tiny job's four workers: NCCL where each has a GPU of its own, else gloo with the
GPU shared (transfers staged through host memory)."""
NEEDS_GPU = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
NEEDS_TWO = pytest.mark.skipif(GPUS < 2, reason="NCCL between processes needs 2 GPUs")


def _losses(report: dict[str, Any]) -> list[float]:
    return [s["loss"] for s in report["steps"]]


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Failure-free CPU runs the GPU runs are compared with, computed once."""
    cache: dict[str, Any] = {}

    def get(key: str, **kwargs: Any) -> Any:
        if key not in cache:
            report, params, _ = run_job(tmp_path_factory.mktemp(f"cpu-{key}"), device="cpu",
                                        backend="gloo", **kwargs)
            assert not failures(report)
            cache[key] = (report, params)
        return cache[key]

    return get  # type: ignore[return-value]


def test_bf16_on_the_device_trains_as_the_cpu_run(tmp_path: Path, cpu_runs: Any) -> None:
    """Mixed precision on CUDA kernels, against the CPU's bf16 run: the per-step loss
    within the tolerance the bf16 test states (2.5 units of bf16 roundoff)."""
    cpu, _ = cpu_runs("bf16", dtype="bfloat16", steps=8)
    gpu, _, _ = run_job(tmp_path, dtype="bfloat16", steps=8, device=DEVICE, backend=BACKEND)
    assert not gpu["events"]
    for got, want in zip(_losses(gpu), _losses(cpu), strict=True):
        assert got == pytest.approx(want, rel=BF16_STEP_LOSS_REL)


def test_a_worker_lost_in_the_all_reduce_is_recovered_by_abort_and_rebuild(
        tmp_path: Path, cpu_runs: Any) -> None:
    """A worker dies while its peers wait in the gradient all-reduce: over NCCL (two
    GPUs: dp 2) their operations never fail by themselves; the coordinator aborts the
    generation, the survivor aborts its communicators and builds the next ones in the
    same process. On one GPU the same path runs over gloo with NCCL's completion
    semantics. The float64 parameters equal the CPU's failure-free run."""
    if GPUS >= 2:
        shape = {"job": {"pp": 1, "dp": 2},
                 "cluster": {"num_nodes": 1, "devices_per_node": 2}}
        backend, extra = "nccl", {}
    else:
        shape, backend, extra = {}, "gloo", {"coordinator": {"nccl_semantics": True}}
    _, want = cpu_runs(f"shape-{bool(shape)}", **shape)
    report, params, pids = run_job(tmp_path, policy="dynamic", device=DEVICE, backend=backend,
                                   faults=("rank=1,step=2,kind=kill,phase=reduce",),
                                   **shape, **extra)
    (event,) = report["events"]
    assert event["workers"] == [1]
    assert [s["step"] for s in report["steps"]] == list(range(6))
    assert len(pids) == (2 if shape else 4)  # nobody relaunched: recovered in place
    assert max_abs_diff(params, want) < 1e-9


@pytest.mark.parametrize("memory", [False, True], ids=["from-checkpoint", "from-memory"])
def test_a_stage_lost_everywhere_reloads_on_the_device(tmp_path: Path, cpu_runs: Any,
                                                       memory: bool) -> None:
    """Workers 2 and 3 hold the second stage of both pipelines: both die, so every
    survivor reloads the last checkpoint in place, from storage, or with checkpoints in
    memory from the copies the survivors hold."""
    _, want = cpu_runs("steps8", steps=8)
    report, params, _ = run_job(
        tmp_path, policy="dynamic", steps=8, device=DEVICE, backend=BACKEND,
        recovery={"memory_checkpoint": memory}, collective_timeout_s=8.0,
        faults=("rank=2,step=5,kind=kill,phase=forward", "rank=3,step=5,kind=kill,phase=forward"))
    reloads = [e for e in report["events"] if e["lost_steps"] or e["strategy"] == "restart"]
    assert reloads, report["events"]
    from_memory = sum(e["from_memory_layers"] for e in reloads)
    assert (from_memory >= 2) if memory else from_memory == 0
    assert max_abs_diff(params, want) < 1e-9


def _gpu_processes() -> dict[int, set[str]]:
    """The processes holding a context on each GPU: pid -> GPU uuids (nvidia-smi)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                          "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    seen: dict[int, set[str]] = {}
    for line in out.splitlines():
        if line.strip():
            pid, uuid = (part.strip() for part in line.split(","))
            seen.setdefault(int(pid), set()).add(uuid)
    return seen


@NEEDS_GPU
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi")
def test_no_process_opens_a_context_on_another_workers_gpu(tmp_path: Path) -> None:
    """Mid-run, each worker holds a context on one GPU only (its own: every thread of it
    works on its device), and no other process of the job (the forkserver, children that
    probe shapes or export) holds one at all."""
    uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    by_index = {int(i): u.strip() for i, u in (ln.split(",") for ln in uuids.splitlines())}
    seen: dict[int, set[str]] = {}

    class Look(Hooks):
        def on_commit(self, coord: Coordinator, step: int) -> None:
            if step == 3 and not seen:  # checkpoints, groups and snapshots all exist by now
                seen.update(_gpu_processes())

    _, _, pids = run_job(tmp_path, device=DEVICE, backend=BACKEND, checkpoint_every=2,
                         coordinator={"hooks": Look()})
    ours = {pid: gpus for pid, gpus in seen.items() if pid != os.getpid()}
    assert set(ours) <= set(pids), f"processes other than the workers on a GPU: {ours}"
    assert set(pids) <= set(ours), f"workers without a context: {set(pids) - set(ours)}"
    for worker, pid in enumerate(pids):
        own = by_index[worker % max(GPUS, 1)] if BACKEND == "nccl" else by_index[0]
        assert ours[pid] == {own}, f"worker {worker} holds contexts on {ours[pid]}"


def test_device_memory_stays_flat_over_twenty_generations(tmp_path: Path) -> None:
    """Twenty transient failures, each redone as a new generation (new groups, new
    communicators): what a worker holds on the device, and what the device has in use,
    does not grow with the generations."""
    faults = tuple(f"rank={i % 4},step={i + 2},kind=glitch,phase=forward" for i in range(20))
    report, _, _ = run_job(tmp_path, steps=24, device=DEVICE, backend=BACKEND, faults=faults)
    assert [s["step"] for s in report["steps"]] == list(range(24))
    times = [json.loads(line) for line in (tmp_path / "op_times.jsonl").read_text().splitlines()]
    gens = sorted({t["gen"] for t in times})
    assert len(gens) >= 21, gens
    # on the dry run, host memory stands in (its peak moves by allocator noise: 8 MiB)
    key, slack = ("device_bytes", 2**20) if ON_GPU else ("rss_peak_bytes", 8 * 2**20)
    for worker in range(4):
        mine = [t for t in times if t["worker"] == worker]
        first = [t[key] for t in mine if t["gen"] == gens[1]]
        last = [t[key] for t in mine if t["gen"] == gens[-1]]
        assert first and last
        assert max(last) <= max(first) + slack, (worker, first, last)
        if ON_GPU:
            used_first = max(t["device_used_bytes"] for t in mine if t["gen"] == gens[1])
            used_last = max(t["device_used_bytes"] for t in mine if t["gen"] == gens[-1])
            assert used_last <= used_first * 1.05 + 64 * 2**20, (worker, used_first, used_last)


BIG = {"name": "big-activations", "num_blocks": 2, "hidden_size": 1024, "num_heads": 8,
       "vocab_size": 256, "seq_len": 1024}
"""One micro-batch's activation between stages: 2 x 1024 x 1024 float32 = 8 MiB, twice
NCCL's default buffer (4 MiB): a send completes only once its receive runs."""


@NEEDS_TWO
def test_nccl_point_to_point_with_activations_larger_than_its_buffers(tmp_path: Path) -> None:
    """1F1B with four micro-batches per pipeline: stage 0 sends activations while stage 1
    sends gradients back; over NCCL a pair's operations run in order on one stream, so an
    order that differs between the two sides deadlocks once a transfer exceeds NCCL's
    buffering. With four GPUs (dp 2 x pp 2) a worker is killed and its stage rerouted to
    its peer, so one pair carries two pipelines' micro-batches."""
    four = GPUS >= 4
    shape = {"job": {"pp": 2, "dp": 2 if four else 1},
             "cluster": {"num_nodes": 1, "devices_per_node": 4 if four else 2}}
    common = {"model_override": BIG, "dtype": "float32", "steps": 4, "device": DEVICE,
              "backend": "nccl", "collective_timeout_s": 60.0, **shape}
    clean, _, _ = run_job(tmp_path / "clean", **common)
    assert [s["step"] for s in clean["steps"]] == list(range(4))
    if not four:
        return
    report, _, _ = run_job(tmp_path / "rerouted", policy="reroute",
                           faults=("rank=1,step=1,kind=kill,phase=forward",), **common)
    (event,) = report["events"]
    assert event["strategy"] == "reroute"
    for got, want in zip(_losses(report), _losses(clean), strict=True):
        assert got == pytest.approx(want, rel=1e-4)
