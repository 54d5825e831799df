"""CUDA hygiene by construction (docs/design.md 4.3): what no CPU run can show, checked in
the source. A thread that calls CUDA without first making the worker's device its own
works on GPU 0, opening a context (hundreds of MB) on another worker's GPU."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "src" / "chameleon_ft" / "runtime"

TENSOR_FREE_THREADS = {
    "worker/nccl_like.py": "completes gloo operations: CPU tensors only",
    "storage/blobs.py": "the bulk channel's server: bytes only",
    "chaos.py": "the chaos driver fires faults through the store and signals",
}
"""Modules that may start plain threads, because those threads never touch a GPU."""


def _thread_calls(tree: ast.AST) -> list[int]:
    """Lines that construct ``threading.Thread``."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "Thread"]


def test_worker_threads_work_on_the_workers_device() -> None:
    """Outside ``worker/device.py`` (whose ``thread`` sets the device first) and the
    coordinator's side, a thread is started only where it never touches a tensor on a
    GPU."""
    offenders = []
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME).as_posix()
        if rel.startswith(("coordinator/", "report/", "control/")) or rel == "worker/device.py":
            continue
        lines = _thread_calls(ast.parse(path.read_text()))
        if lines and rel not in TENSOR_FREE_THREADS:
            offenders.append(f"{rel}:{lines}")
    assert not offenders, f"threads that do not set the worker's device: {offenders}"


def test_tensor_free_threads_are_tensor_free_of_cuda() -> None:
    for rel in TENSOR_FREE_THREADS:
        source = (RUNTIME / rel).read_text()
        assert "cuda" not in source, f"{rel} starts plain threads but mentions CUDA"


def test_the_device_helper_sets_the_device_before_the_target_runs() -> None:
    import threading

    import torch

    from chameleon_ft.runtime.worker import device as dev

    calls: list[str] = []
    original = dev.use_device
    dev.use_device = lambda d: calls.append(f"device {d}")  # type: ignore[assignment]
    try:
        t = dev.thread(lambda: calls.append("target"), torch.device("cpu"), "t")
        assert isinstance(t, threading.Thread) and t.daemon
        t.start()
        t.join(5.0)
    finally:
        dev.use_device = original  # type: ignore[assignment]
    assert calls == ["device cpu", "target"]
