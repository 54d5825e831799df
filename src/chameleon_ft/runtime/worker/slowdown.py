"""A worker's fail-slow: the injected slowdown it runs under, and the probe it times while
it sits out of the plan (docs/design.md 4.3, "Slow workers").

An injected ``slow`` fault (``rank=R,step=S,kind=slow,factor=F,steps=N``) makes the worker
compute ``F`` times slower from the first step ``>= S`` it runs, for ``N`` of the job's
steps: each timed operation (forward, backward, optimizer step; ``device.StepTimer``)
waits ``F - 1`` times its own measured duration before it ends, so its reported time is
``F`` times the real one, on any model. A worker out of the plan follows the job's steps
through the committed-steps key (``protocol.STEPS_KEY``), so its slowdown ends on time too.

The probe is one forward and backward of one layer (the first middle layer, on a buffer
of the shape it takes) on a fixed micro-batch, timed the way the steps are (under the
slowdown, if any); three passes, read as the fastest. The worker times it five times when
it starts (the fastest is its own speed) and, while the coordinator lists it among the
slow workers out of the plan, about every half second while it waits for the next
directive, reporting each time over that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from chameleon_ft.runtime.worker.channel import Channel
from chameleon_ft.runtime.worker.device import StepTimer
from chameleon_ft.runtime.worker.faults import Faults

_log = logging.getLogger(__name__)

PROBE_EVERY_S = 0.5
"""Time between two probes of an idle slow worker."""
PROBE_REPEATS = 3
"""Forward-and-backward passes in one probe; it reads the fastest (a loaded host delays
some passes, never speeds one up)."""
BASELINE_PROBES = 5
"""Probes at start; the fastest is the worker's own speed (a probe at start, among the
other workers starting, reads slower than it is: a baseline from those would make a slow
worker read fast later)."""


class Slowdown:
    """The injected slowdown this process runs under (none: factor 1).

    Args:
        faults: the process's armed faults.
    """

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.factor = 1.0
        """How many times slower each timed operation runs now."""
        self._end_step = 0
        self._fired: tuple[int, dict[str, object]] | None = None

    def at_step(self, step: int, gen: int | None) -> float:
        """The job reached ``step``: a slowdown whose steps ran out ends (recorded), and one
        due starts (``gen`` None: the worker is idle, no fault starts). Returns the factor
        from now on."""
        if self._fired is not None and step >= self._end_step:
            index, doc = self._fired
            self._fired, self.factor = None, 1.0
            try:
                self.faults.slow_ended(index, doc, step)
            except Exception as exc:  # the record only; the slowdown ended anyway
                _log.debug("slowdown end not recorded: %s", exc)
        if gen is not None and self._fired is None:
            fired = self.faults.slow_from(step, gen)
            if fired is not None:
                index, factor, end, doc = fired
                self._fired, self.factor, self._end_step = (index, doc), factor, end
        return self.factor


class Probe:
    """What an idle worker times to tell whether it is slow (module docstring).

    The layer is built only while it is timed (at start, then while the worker probes):
    a worker holds no extra layer while it trains.

    Args:
        make: builds the layer timed (in the compute dtype, on the device) and its input
            (a micro-batch's shape).
        device: the worker's device.
    """

    def __init__(self, make: Callable[[], tuple[torch.nn.Module, torch.Tensor]],
                 device: torch.device) -> None:
        self.make, self.device = make, device
        self._held: tuple[torch.nn.Module, torch.Tensor] | None = None
        self.base_s = min(self.time_s(1.0) for _ in range(BASELINE_PROBES))
        self.release()
        self.seq = 0
        self.last_s = 0.0

    def release(self) -> None:
        """Drop the layer (the worker trains, or waits without probing)."""
        self._held = None

    def time_s(self, stretch: float) -> float:
        """One probe's seconds: the fastest of ``PROBE_REPEATS`` passes (on a GPU,
        measured on the device)."""
        if self._held is None:
            self._held = self.make()
        layer, inputs = self._held
        timer = StepTimer(self.device)
        seconds: list[float] = []
        for _ in range(PROBE_REPEATS):
            x = inputs.detach().requires_grad_(inputs.is_floating_point())
            with timer.time(seconds, stretch=stretch):
                out = layer(x)
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
        timer.resolve()
        layer.zero_grad(set_to_none=True)
        return min(seconds)

    def due(self) -> bool:
        """Whether a probe is due (one per ``PROBE_EVERY_S``)."""
        return time.monotonic() - self.last_s >= PROBE_EVERY_S

    def report(self, chan: Channel, stretch: float) -> None:
        """Time one probe and tell the coordinator its factor over the worker's own."""
        self.last_s = time.monotonic()
        self.seq += 1
        factor = self.time_s(stretch) / self.base_s if self.base_s > 0 else 1.0
        chan.probe(self.seq, factor)


def probe_inputs(worker: Any) -> tuple[torch.nn.Module, torch.Tensor]:
    """The probe's layer and input for ``worker`` (``main.Worker``): its first middle layer
    on a zero buffer of its input's shape, or layer 0 on the data when there is none. The
    layer is whole at any ``tp``, so is its input (a rank's shard of a layer's input need
    not fit the whole layer: a boundary split along the features does not)."""
    if worker.job.num_layers > 2:
        return (worker.module(1).to(worker.dtype),
                worker.boundary_buffer(1, whole=True).zero_())
    x, _ = worker.microbatch(0, 0)
    return worker.module(0).to(worker.dtype), worker.precision.inputs(x, worker.device)


def prober(worker: Any) -> Callable[[], None]:
    """What an idle slow worker does between slices of its wait for a directive: follow
    the job's steps (its slowdown ends on time) and time a probe when one is due."""

    def probe_once() -> None:
        try:
            factor = worker.slowdown.at_step(worker.chan.committed_steps(), None)
            if worker.probe.due():
                worker.probe.report(worker.chan, factor)
        except dist.DistStoreError as exc:  # the coordinator is slow or gone: the watchdog
            _log.debug("probe not reported: %s", exc)
    return probe_once


def between(again: Callable[[], None] | None,
            probe: Callable[[], None] | None) -> Callable[[], None] | None:
    """Both callbacks of a wait for a directive, or the one given (a re-attached worker's
    report, an idle slow worker's probe)."""
    if again is None or probe is None:
        return again if again is not None else probe

    def both() -> None:
        again()
        probe()
    return both
