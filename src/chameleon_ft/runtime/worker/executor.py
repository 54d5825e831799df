"""The schedule executor: one step of a worker's stage, as the estimator timed it.

A step is the worker's list of actions from ``perf.build_schedule`` (``F`` or ``B`` of
pipeline ``p``, stage ``s``, micro-batch ``m``), run in order: a forward takes its input
from the data (first stage) or a receive, and ends in the loss (last stage) or a send; a
backward takes its gradient from a receive (or the loss) and sends the input's gradient
upstream (a stage whose output needs no gradient, every parameter up to it frozen, runs
no backward but still receives its gradient, as the schedule sends one). The gradients'
reductions that follow are ``worker.gradients``. Communication goes through
:class:`~chameleon_ft.runtime.worker.comm.Comm`; the executor never sees a group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.runtime.worker.comm import Comm
from chameleon_ft.runtime.worker.device import DeviceWatch, StepTimer
from chameleon_ft.runtime.workload.models import StageModel, to_run

FORWARD, BACKWARD = 0, 1
"""Tag kinds: activations flow forward, gradients backward."""


class Stage(Protocol):
    """What the executor needs of the worker: its layers, data and numerics."""

    stage: StageModel
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
    """One step's actions on one worker, with what is in flight between them.

    Args:
        worker: the stage, data and numerics.
        comm: the generation's communication.
        plan: the generation's plan.
        step: the step.
        first_action: called with ``forward`` / ``backward`` the first time each happens
            (where injected faults fire).
    """

    def __init__(self, worker: Stage, comm: Comm, plan: ExecutionPlan, step: int,
                 first_action: Callable[[str], None]) -> None:
        self.w, self.comm, self.plan, self.step = worker, comm, plan, step
        self.first_action = first_action
        self.offsets = plan.microbatch_offsets()
        self.inflight: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.sends: list[tuple[Any, int, torch.Tensor]] = []
        self.result = StepResult()
        self.executors: dict[tuple[int, int], tuple[int, ...]] = {}
        self.max_stages = max(pipe.num_stages for pipe in plan.pipelines)
        self.max_mb = max(pipe.num_microbatches for pipe in plan.pipelines)
        self.seen: set[str] = set()
        self.timer = StepTimer(worker.device)

    def _executor(self, p: int, s: int, m: int) -> int:
        """The worker that runs micro-batch ``m`` of stage ``s`` of pipeline ``p``."""
        if (p, s) not in self.executors:
            self.executors[(p, s)] = self.plan.executor(p, s)
        return self.executors[(p, s)][m]

    def _tag(self, kind: int, p: int, s: int, m: int) -> int:
        return ((kind * self.plan.num_pipelines + p) * self.max_stages + s) * self.max_mb + m

    def _first(self, what: str) -> None:
        if what not in self.seen:
            self.seen.add(what)
            self.first_action(what)

    def run(self, actions: Sequence[Sequence[Any]]) -> StepResult:
        """Run the actions in order, then wait for every send."""
        for kind, p, s, m in actions:
            if kind == "F":
                self.forward(p, s, m)
            else:
                self.backward(p, s, m)
        for work, peer, _ in self.sends:
            self.comm.wait(work, peer, "send")
        self.timer.resolve()
        return self.result

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
            x = self.w.boundary_buffer(self.w.stage.indices()[0])
            self.comm.recv(x, self._executor(p, s - 1, m), self._tag(FORWARD, p, s, m),
                           "activation receive")
            x.requires_grad_(x.is_floating_point())
        y = self._samples(p, m)[1] if last else None
        with self.timer.time(self.result.forward_s), self.w.watch.computing():
            out = self.w.stage(x)
            if y is not None:
                out = self.w.loss(out, y) / self.w.loss_count
            payload = out.detach().contiguous()
        if last:
            self.result.losses.append((self.offsets[p] + m, float(payload)))
        else:
            dst = self._executor(p, s + 1, m)
            self.sends.append((self.comm.send(payload, dst, self._tag(FORWARD, p, s + 1, m)),
                               dst, payload))
        self.inflight[(p, s, m)] = (x, out)
        self._first("forward")

    def backward(self, p: int, s: int, m: int) -> None:
        """``B(p, s, m)``: gradient from the loss or the next stage, the input's gradient
        to the previous stage."""
        x, out = self.inflight.pop((p, s, m))
        grad = None
        if s < self.plan.pipelines[p].num_stages - 1:
            grad = torch.empty_like(out)
            self.comm.recv(grad, self._executor(p, s + 1, m), self._tag(BACKWARD, p, s, m),
                           "gradient receive")
        with self.timer.time(self.result.backward_s), self.w.watch.computing():
            if out.requires_grad:  # not when every parameter up to here is frozen
                out.backward(grad)
        if s > 0:
            dst = self._executor(p, s - 1, m)
            payload = (x.grad if x.grad is not None else torch.zeros_like(x)).contiguous()
            self.sends.append((self.comm.send(payload, dst, self._tag(BACKWARD, p, s - 1, m)),
                               dst, payload))
        self._first("backward")
