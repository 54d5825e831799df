"""The runtime on CUDA: workers computing on the GPU recover from a kill exactly as on the
CPU (float64), over gloo (several workers sharing one GPU, transfers staged through host
memory) and over NCCL where the host has a GPU per worker; and the layers' measured times
next to the analytic profile's.

Run by ``tests/gpu/run.sh`` on a machine with a GPU (skipped elsewhere)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import max_abs_diff, run_job
from events import failures

pytestmark = pytest.mark.slow

KILL = ("rank=3,step=2,kind=kill,phase=backward",)


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    report, params, _ = run_job(tmp_path_factory.mktemp("cpu"), device="cpu", backend="gloo")
    assert not failures(report)
    return params


NCCL = pytest.mark.skipif(torch.cuda.device_count() < 4,
                          reason="NCCL needs a GPU per worker (4)")


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=NCCL)])
@pytest.mark.parametrize("policy", ["reroute", "dynamic"])
def test_a_kill_on_cuda_recovers_exactly(tmp_path: Path, policy: str, backend: str,
                                         cpu_reference: dict[str, Any]) -> None:
    """Over gloo several workers share the GPU (transfers staged through host memory);
    over NCCL each has its own."""
    report, params, _ = run_job(tmp_path, policy=policy, faults=KILL, device="cuda",
                                backend=backend)
    (event,) = report["events"]
    assert event["strategy"] == policy
    assert max_abs_diff(params, cpu_reference) < 1e-9


def test_layer_times_next_to_the_analytic_profile() -> None:
    """Time a GPT block's forward and backward on this GPU and write them beside what the
    analytic profile of the GPU's preset predicts (``$OUT/layer_times.json`` when set)."""
    from chameleon_ft.runtime.profiler import measure_layers
    from chameleon_ft.runtime.workload.models.gpt_layers import GPTShape

    shape = GPTShape(num_blocks=4, hidden_size=2048, num_heads=16, vocab_size=256,
                     seq_len=1024, ffn_size=8192)
    measured = measure_layers(shape, micro_batch=4, dtype_name="float32", device="cuda")
    blocks = [layer for layer in measured["layers"] if layer["name"].startswith("block")]
    assert blocks and all(layer["fwd_s"] > 0 for layer in blocks)
    from chameleon_ft.profile import build_profile
    from chameleon_ft.spec.config import config_from_mapping

    config = config_from_mapping({
        "model": {"name": "gpu-block", "num_blocks": shape.num_blocks,
                  "hidden_size": shape.hidden_size, "num_heads": shape.num_heads,
                  "vocab_size": shape.vocab_size, "seq_len": shape.seq_len},
        "cluster": {"num_nodes": 1, "devices_per_node": 1, "device": "h200"},
        "job": {"pp": 1, "dp": 1, "global_batch": 4, "micro_batch": 4},
        "profile": {"kind": "analytic"}})
    analytic = build_profile(config).layers[1]
    out = os.environ.get("OUT")
    if out:
        (Path(out) / "layer_times.json").write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "shape": vars(shape),
            "measured_block": blocks[0],
            "analytic_block_h200": {"fwd_s": analytic.fwd_s,
                                    "bwd_s": analytic.bwd_input_s + analytic.bwd_weight_s},
            "measured": measured}, indent=2))


def test_a_slowdown_is_measured_on_the_device() -> None:
    """An injected slowdown stretches a kernel's time as the device measures it (not its
    launch), and an idle worker's probe reads the factor."""
    from chameleon_ft.runtime.worker.device import StepTimer
    from chameleon_ft.runtime.worker.slowdown import Probe

    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    for stretch in (1.0, 3.0):
        timer = StepTimer(device)
        times: list[float] = []
        for _ in range(5):
            with timer.time(times, stretch):
                for _ in range(8):
                    a = torch.tanh(a @ a / 64)
        timer.resolve()
        if stretch == 1.0:
            base = min(times)
        else:
            assert 2.5 <= min(times) / base <= 3.5, (times, base)
    layer = torch.nn.Linear(4096, 4096).to(device)
    probe = Probe(lambda: (layer, torch.randn(64, 4096, device=device)), device)
    assert probe.base_s > 0
    assert 2.5 <= probe.time_s(3.0) / probe.base_s <= 3.5
