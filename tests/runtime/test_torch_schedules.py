"""PyTorch's learning-rate schedulers where a schedule is accepted: each step's rate is the
one a single-process loop's optimizer has (``optimizer.step()``, then
``scheduler.step()``), equal to the equivalent built-in schedule; instances are read
without being touched; metric-driven schedules are refused; and what ``chameleon_ft``
exports is the real thing."""

from __future__ import annotations

import functools
import inspect
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler

import chameleon_ft
from chameleon_ft.runtime.workload import api
from chameleon_ft.runtime.workload.bundle import Workload
from chameleon_ft.runtime.workload.schedules import LRSchedule, TorchLRSchedule
from chameleon_ft.spec.config import config_from_mapping

SGD = functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9)
STEPS = 30


def warm_cosine(optimizer: torch.optim.Optimizer, *, warmup: int, decay: int,
                min_lr: float) -> lr_scheduler.LRScheduler:
    """PyTorch's spelling of the built-in warm-up + cosine schedule."""
    return lr_scheduler.SequentialLR(optimizer, [
        lr_scheduler.LinearLR(optimizer, start_factor=1 / warmup, end_factor=1.0,
                              total_iters=warmup - 1),
        lr_scheduler.CosineAnnealingLR(optimizer, T_max=decay - warmup, eta_min=min_lr)],
        milestones=[warmup])


def _loop_rates(factory: functools.partial[lr_scheduler.LRScheduler], steps: int
                ) -> list[float]:
    """The rate of each optimizer step of a plain training loop driven by the scheduler."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = SGD([param])
    scheduler = factory(optimizer)
    rates = []
    for _ in range(steps):
        param.grad = torch.ones(3)
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("factory", [
    functools.partial(lr_scheduler.CosineAnnealingLR, T_max=STEPS, eta_min=0.01),
    functools.partial(lr_scheduler.StepLR, step_size=7, gamma=0.5),
    functools.partial(lr_scheduler.LinearLR, start_factor=0.1, total_iters=5),
    functools.partial(warm_cosine, warmup=5, decay=STEPS, min_lr=0.02),
], ids=["cosine", "step", "linear", "warm-cosine"])
def test_each_steps_rate_is_the_plain_loops(factory: functools.partial[Any]) -> None:
    schedule = TorchLRSchedule(factory, SGD)
    assert [schedule(s) for s in range(STEPS)] == pytest.approx(_loop_rates(factory, STEPS),
                                                                rel=0, abs=1e-15)


def test_the_same_rates_as_the_equivalent_builtin_schedules() -> None:
    cosine = TorchLRSchedule(functools.partial(warm_cosine, warmup=4, decay=24, min_lr=0.01),
                             SGD)
    builtin = LRSchedule(lr=0.2, kind="cosine", warmup_steps=4, decay_steps=24, min_lr=0.01)
    assert max(abs(cosine(s) - builtin(s)) for s in range(24)) < 1e-12
    plain = TorchLRSchedule(functools.partial(lr_scheduler.CosineAnnealingLR, T_max=20), SGD)
    builtin = LRSchedule(lr=0.2, kind="cosine", decay_steps=20)
    assert max(abs(plain(s) - builtin(s)) for s in range(21)) < 1e-12
    warm = TorchLRSchedule(functools.partial(lr_scheduler.LinearLR, start_factor=1 / 6,
                                             total_iters=5), SGD)
    assert max(abs(warm(s) - LRSchedule(lr=0.2, warmup_steps=6)(s)) for s in range(20)) < 1e-12


def test_an_instance_is_read_from_where_it_is_and_left_alone() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    own = torch.optim.SGD([param], lr=0.5)
    instance = lr_scheduler.ExponentialLR(own, gamma=0.9)
    own.step()
    instance.step()  # one step taken already: the run starts at 0.45
    schedule = TorchLRSchedule(instance, steps=5)
    assert [schedule(s) for s in range(5)] == pytest.approx([0.5 * 0.9 ** (k + 1)
                                                             for k in range(5)], abs=1e-15)
    assert instance.last_epoch == 1 and own.param_groups[0]["lr"] == pytest.approx(0.45)
    with pytest.raises(ValueError, match="read for 5 steps, not 6"):
        schedule(5)
    copy = pickle.loads(pickle.dumps(schedule))  # its rates travel, not the scheduler
    assert copy(4) == schedule(4)


def test_the_workload_takes_schedulers_and_seals_them() -> None:
    config = config_from_mapping({
        "model": {"name": "tiny", "num_blocks": 2, "hidden_size": 32, "num_heads": 2,
                  "vocab_size": 256, "seq_len": 32},
        "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
        "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
        "train": {"steps": 12}})
    factory = functools.partial(lr_scheduler.CosineAnnealingLR, T_max=12)
    by_class = Workload(config, optimizer_obj=SGD, lr_schedule_obj=factory)
    schedule = by_class.lr_schedule()
    assert isinstance(schedule, TorchLRSchedule) and schedule(0) == pytest.approx(0.2)
    unsealed = pickle.loads(pickle.dumps(by_class))
    assert unsealed.lr_schedule()(6) == pytest.approx(schedule(6))
    instance = lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))],
                                                   lr=1.0), step_size=4, gamma=0.1)
    by_instance = pickle.loads(pickle.dumps(Workload(config, lr_schedule_obj=instance)))
    assert [by_instance.lr_schedule()(s) for s in (0, 3, 4, 11)] == \
        pytest.approx([1.0, 1.0, 0.1, 0.01])
    for bad in (functools.partial(lr_scheduler.ReduceLROnPlateau, patience=2),
                lr_scheduler.ReduceLROnPlateau(torch.optim.SGD(
                    [torch.nn.Parameter(torch.ones(1))], lr=1.0))):
        with pytest.raises(ValueError, match=r"^lr_schedule: ReduceLROnPlateau follows a "):
            Workload(config, optimizer_obj=SGD, lr_schedule_obj=bad).lr_schedule()


def test_the_package_exports_the_real_objects_without_importing_torch() -> None:
    assert chameleon_ft.train is api.train
    assert inspect.signature(chameleon_ft.train).parameters["lr_schedule"].kind is \
        inspect.Parameter.KEYWORD_ONLY
    assert chameleon_ft.TorchLRSchedule is TorchLRSchedule
    from chameleon_ft import Fault, FaultKind, LRSchedule, load_config, parse_fault

    assert parse_fault("rank=1,step=2,kind=kill") == Fault(rank=1, step=2, kind=FaultKind.KILL)
    assert LRSchedule(lr=1.0)(3) == 1.0 and callable(load_config)
    code = ("import sys, chameleon_ft\n"
            "from chameleon_ft import train, load_config, LRSchedule, Fault, ScheduleKind\n"
            "assert 'torch' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        chameleon_ft.nothing  # noqa: B018
