"""The schedule executor: one step of a worker's stage, as the estimator timed it.

A step is the worker's list of actions from ``perf.build_schedule`` (``F`` or ``B`` of
pipeline ``p``, stage ``s``, micro-batch ``m``), run in order: a forward takes its input
from the data (first stage) or a receive, and ends in the loss (last stage) or a send; a
backward takes its gradient from a receive (or the loss) and sends the input's gradient
upstream (a stage whose output needs no gradient, every parameter up to it frozen, runs
no backward but still receives its gradient, as the schedule sends one). The gradients'
reductions that follow are ``worker.gradients``. Communication goes through
:class:`~chameleon_ft.runtime.worker.comm.Comm`; the executor never sees a group.

The executor performs the worker's step program (``runtime.traffic.step_program``, built
once per generation): the actions with, in front of each, the receives to post in each
sender's order, and behind it the send of its output, posted as soon as the compute that
produces it ends. The NCCL checker (``runtime.nccl_model``) runs the same programs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.runtime.traffic import Do, Instruction, Kind, Message
from chameleon_ft.runtime.worker.comm import Comm
from chameleon_ft.runtime.worker.device import DeviceWatch, StepTimer
from chameleon_ft.runtime.workload.models import StageModel, to_run

FORWARD, BACKWARD = 0, 1
"""Tag kinds: activations flow forward, gradients backward (gloo matches by tag; NCCL
ignores tags, and the order of the program makes the matching right without them)."""


class Stage(Protocol):
    """What the executor needs of the worker: its layers, data and numerics."""

    stage: StageModel
    runner: torch.nn.Module
    """What a step computes: the stage (behind ``TensorParallelStage`` at tp > 1: local
    tensors in and out)."""
    dtype: torch.dtype
    """What the layers compute in (floating-point inputs take it)."""
    loss_dtype: torch.dtype
    """What the loss computes in (floating-point targets take it)."""
    device: torch.device
    watch: DeviceWatch
    """Where the compute the executor runs or enqueues is marked (the heartbeat reads it)."""
    micro_batch: int
    loss_count: int
    """The loss normaliser: target elements in the whole global batch."""

    def microbatch(self, step: int, first_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples from global position ``first_sample`` of ``step``."""
        ...

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's summed loss."""
        ...

    def boundary_buffer(self, layer: int) -> torch.Tensor:
        """An empty buffer for the input of ``layer``."""
        ...


@dataclass
class StepResult:
    """What one step produced on this worker."""

    losses: list[tuple[int, float]] = field(default_factory=list)
    """``(global micro-batch, loss / loss_count)`` of the micro-batches it ended."""
    forward_s: list[float] = field(default_factory=list)
    """Compute seconds of each forward, without waits (on a GPU: measured on the device)."""
    backward_s: list[float] = field(default_factory=list)


class StepRun:
    """One step's program on one worker, with what is in flight between its actions.

    Args:
        worker: the stage, data and numerics.
        comm: the generation's communication.
        plan: the generation's plan.
        step: the step.
        first_action: called with ``forward`` / ``backward`` the first time each happens
            (where injected faults fire).
        stretch: each compute lasts this many times its own duration (an injected
            slowdown, ``worker.slowdown``).
    """

    def __init__(self, worker: Stage, comm: Comm, plan: ExecutionPlan, step: int,
                 first_action: Callable[[str], None], stretch: float = 1.0) -> None:
        self.w, self.comm, self.plan, self.step = worker, comm, plan, step
        self.first_action = first_action
        self.offsets = plan.microbatch_offsets()
        self.inflight: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.posted: dict[Message, tuple[Any, torch.Tensor]] = {}
        """Receives posted and not yet taken: their work and buffer."""
        self.arrived: dict[tuple[Kind, tuple[int, int, int]], torch.Tensor] = {}
        """Receives waited for, by kind and key, until their action takes them."""
        self.output: torch.Tensor | None = None
        """What the action just computed sends (the next instruction posts it)."""
        self.sends: list[tuple[Any, int, torch.Tensor]] = []
        self.result = StepResult()
        self.max_stages = max(pipe.num_stages for pipe in plan.pipelines)
        self.max_mb = max(pipe.num_microbatches for pipe in plan.pipelines)
        self.seen: set[str] = set()
        self.timer = StepTimer(worker.device)
        self.stretch = stretch

    def _tag(self, message: Message) -> int:
        kind = FORWARD if message.kind is Kind.ACTIVATION else BACKWARD
        p, s, m = message.key
        return ((kind * self.plan.num_pipelines + p) * self.max_stages + s) * self.max_mb + m

    def _first(self, what: str) -> None:
        if what not in self.seen:
            self.seen.add(what)
            self.first_action(what)

    def run(self, program: Sequence[Instruction]) -> StepResult:
        """Perform the program's instructions in order (the last waits for every send)."""
        for ins in program:
            if ins.do is Do.POST_RECV:
                self._post(_message(ins))
            elif ins.do is Do.WAIT_RECV:
                message = _message(ins)
                work, buf = self.posted.pop(message)
                self.comm.wait(work, message.src, f"{message.kind} receive")
                self.arrived[(message.kind, message.key)] = buf
            elif ins.do is Do.COMPUTE:
                assert ins.action is not None
                kind, p, s, m = ins.action
                if kind == "F":
                    self.forward(p, s, m)
                else:
                    self.backward(p, s, m)
            elif ins.do is Do.POST_SEND:
                self._send(_message(ins))
            elif ins.do is Do.WAIT_ALL:
                for work, peer, _ in self.sends:
                    self.comm.wait(work, peer, "send")
                self.sends.clear()
        self.timer.resolve()
        return self.result

    def _post(self, message: Message) -> None:
        """Post a receive into a buffer of the boundary's shape and dtype."""
        buf = self.w.boundary_buffer(message.layer)
        work = self.comm.post_recv(buf, message.src, self._tag(message),
                                   f"{message.kind} receive")
        self.posted[message] = (work, buf)

    def _send(self, message: Message) -> None:
        payload, self.output = self.output, None
        assert payload is not None, f"nothing computed to send as {message}"
        self.sends.append((self.comm.send(payload, message.dst, self._tag(message)),
                           message.dst, payload))

    def _take(self, kind: Kind, p: int, s: int, m: int) -> torch.Tensor:
        """The received input of an action: the message of ``kind`` into stage ``s``."""
        buf = self.arrived.pop((kind, (p, s, m)), None)
        assert buf is not None, f"no {kind} of pipeline {p} stage {s} micro-batch {m} arrived"
        return buf

    def _samples(self, p: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.w.microbatch(self.step, (self.offsets[p] + m) * self.w.micro_batch)
        return to_run(x, self.w.dtype, self.w.device), to_run(y, self.w.loss_dtype, self.w.device)

    def forward(self, p: int, s: int, m: int) -> None:
        """``F(p, s, m)``: input from the data or the previous stage, output to the loss or
        the next stage."""
        last = s == self.plan.pipelines[p].num_stages - 1
        if s == 0:
            x, _ = self._samples(p, m)
        else:
            x = self._take(Kind.ACTIVATION, p, s, m)
            x.requires_grad_(x.is_floating_point())
        y = self._samples(p, m)[1] if last else None
        with self.timer.time(self.result.forward_s, self.stretch), self.w.watch.computing():
            out = self.w.runner(x)
            if y is not None:
                out = self.w.loss(out, y) / self.w.loss_count
            payload = out.detach().contiguous()
        if last:
            self.result.losses.append((self.offsets[p] + m, float(payload)))
        else:
            self.output = payload
        self.inflight[(p, s, m)] = (x, out)
        self._first("forward")

    def backward(self, p: int, s: int, m: int) -> None:
        """``B(p, s, m)``: gradient from the loss or the next stage, the input's gradient
        to the previous stage."""
        x, out = self.inflight.pop((p, s, m))
        grad = None
        if s < self.plan.pipelines[p].num_stages - 1:
            grad = self._take(Kind.GRADIENT, p, s, m)
            if grad.shape != out.shape or grad.dtype != out.dtype:
                raise RuntimeError(f"pipeline {p} stage {s}: the gradient received is "
                                   f"{tuple(grad.shape)} {grad.dtype}, the stage's output "
                                   f"{tuple(out.shape)} {out.dtype}")
        with self.timer.time(self.result.backward_s, self.stretch), \
                self.w.watch.computing():
            if out.requires_grad:  # not when every parameter up to here is frozen
                out.backward(grad)
        if s > 0:
            self.output = (x.grad if x.grad is not None else torch.zeros_like(x)).contiguous()
        self._first("backward")


def _message(ins: Instruction) -> Message:
    assert ins.message is not None, f"{ins.do} without a message"
    return ins.message
