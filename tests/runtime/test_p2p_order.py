"""The step program on real gloo groups, ranks as threads: the executor performs exactly
its program (runtime/traffic.py), over the generation's two world groups, and its
results do not depend on tags.

Gloo matches a receive to a send by pair and tag, NCCL by pair and order. With every tag
the same, gloo matches in order too, as NCCL does: a step whose pair 2 -> 3 carries two
pipelines' activations (pipeline 0 fully rerouted onto pipeline 1's workers) then gives
the same losses and gradients as with tags, while the old rule (each receive posted
where its action needs it) feeds a micro-batch another's activation.
"""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rerouted_step import FULLY_REROUTED, fully_rerouted_plan

from chameleon_ft.runtime.traffic import Do, Instruction, step_program
from chameleon_ft.runtime.worker import groups
from chameleon_ft.runtime.worker.comm import Comm
from chameleon_ft.runtime.worker.device import DeviceWatch
from chameleon_ft.runtime.worker.executor import StepRun

TIMEOUT_S = 5.0
WORLD = [2, 3]
PLAN = fully_rerouted_plan()
ACTIONS = FULLY_REROUTED
"""The list scheduler's merge for this plan (``tests/shared/rerouted_step.py``)."""
GEN = itertools.count()


class TinyStage:
    """A worker's stage for the executor: one linear layer, float64, a squared loss."""

    dtype = loss_dtype = torch.float64
    device = torch.device("cpu")
    micro_batch = 2
    loss_count = 1

    def __init__(self, worker: int) -> None:
        self.watch = DeviceWatch(self.device)
        self.stage = torch.nn.Linear(4, 4).double()
        with torch.no_grad():  # no shared random generator: the threads run at once
            self.stage.weight.copy_(torch.linspace(-1, 1, 16).reshape(4, 4) / worker)
            self.stage.bias.fill_(0.1 * worker)
        self.runner = self.stage

    def microbatch(self, step: int, first_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.arange(8, dtype=torch.float64).reshape(2, 4) + first_sample
        return x, torch.cos(x)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return ((output - targets) ** 2).sum()

    def boundary_buffer(self, layer: int) -> torch.Tensor:
        return torch.empty(2, 4, dtype=torch.float64)


class Recording(Comm):
    """The comm, recording what the executor asks of it."""

    calls: list[tuple[str, int]]

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        self.calls.append(("send", dst))
        return super().send(tensor, dst, tag)

    def post_recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> Any:
        self.calls.append(("post", src))
        return super().post_recv(tensor, src, tag, what)

    def wait(self, work: Any, peer: int | None, what: str) -> None:
        if "receive" in what:
            self.calls.append(("wait", peer or 0))
        super().wait(work, peer, what)


class OneTag(StepRun):
    """Every message under the same tag: gloo then matches each pair in order, as NCCL."""

    def _tag(self, message: Any) -> int:
        return 0


def receiver_order(program: tuple[Instruction, ...]) -> tuple[Instruction, ...]:
    """Each receive posted where its action needs it (the rule before)."""
    out: list[Instruction] = []
    for ins in program:
        if ins.do is not Do.POST_RECV:
            if ins.do is Do.WAIT_RECV:
                out.append(Instruction(Do.POST_RECV, ins.message))
            out.append(ins)
    return tuple(out)


def run_step(store: dist.TCPStore, run: type[StepRun], naive: bool = False
             ) -> dict[int, tuple[list[tuple[int, float]], list[torch.Tensor], list[Any]]]:
    """One step of ``PLAN`` on workers 2 and 3 (threads) over freshly built groups."""
    gen = next(GEN)
    out: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(me: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                               timeout=timedelta(seconds=TIMEOUT_S))
        generation = groups.Generation(gen)
        try:
            comm = groups.build(client, generation, me, WORLD, [], backend="gloo",
                                timeout_s=TIMEOUT_S, address="127.0.0.1",
                                device=torch.device("cpu"))
            comm.__class__ = Recording
            comm.calls = []
            program = step_program(PLAN, ACTIONS, me)
            stage = TinyStage(me)
            result = run(stage, comm, PLAN, 0, lambda _: None).run(
                receiver_order(program) if naive else program)
            grads = [p.grad.clone() for p in stage.stage.parameters()]
            out[me] = (sorted(result.losses), grads, comm.calls, program)
        except BaseException as exc:  # reported to the test's thread
            errors.append(exc)
        finally:
            generation.close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in WORLD]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT_S)
    assert not errors, errors
    return out


def _expected_calls(program: tuple[Instruction, ...]) -> list[tuple[str, int]]:
    calls = []
    for ins in program:
        if ins.message is None:
            continue
        if ins.do is Do.POST_RECV:
            calls.append(("post", ins.message.src))
        elif ins.do is Do.WAIT_RECV:
            calls.append(("wait", ins.message.src))
        elif ins.do is Do.POST_SEND:
            calls.append(("send", ins.message.dst))
    return calls


@pytest.mark.timeout(60)
def test_in_order_matching_gives_the_tagged_results_and_the_old_rule_does_not() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tagged = run_step(store, StepRun)
    for w in WORLD:
        _, _, calls, program = tagged[w]
        assert calls == _expected_calls(program)  # the executor performs its program
    assert len(tagged[3][0]) == 6  # the last stage's six micro-batches
    in_order = run_step(store, OneTag)
    for w in WORLD:
        assert in_order[w][0] == tagged[w][0]
        assert all(torch.equal(a, b) for a, b in zip(in_order[w][1], tagged[w][1],
                                                      strict=True))
    old_rule = run_step(store, OneTag, naive=True)
    assert old_rule[3][0] != tagged[3][0]  # a micro-batch computed on another's input


def test_the_comm_sends_each_direction_on_its_own_group() -> None:
    up, down = object(), object()
    comm = Comm(5, up, {2: 0, 5: 1, 9: 2}, {}, reverse=down)  # type: ignore[arg-type]
    assert comm.channel(5, 9) is up and comm.channel(9, 5) is down
    assert comm.channel(5, 2) is down and comm.channel(2, 5) is up
    single = Comm(5, up, {2: 0, 5: 1}, {})  # type: ignore[arg-type]
    assert single.channel(5, 2) is up and single.channel(2, 5) is up
