"""Job specification: the parallel layout and the batch."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from chameleon_ft.spec._fields import check_choice, check_int, fail


class Schedule(StrEnum):
    """Pipeline schedules (docs/design.md section 3.1). The estimator prices all of them;
    the runtime executes only :data:`RUNTIME_SCHEDULES`."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"
    """Interleaved 1F1B (Narayanan et al. 2021): each worker holds ``virtual_stages``
    non-contiguous model chunks."""
    ZERO_BUBBLE = "zero-bubble"
    """ZB-H1 (Qi et al. 2024): the backward split into input gradient and weight gradient,
    weight gradients deferred into idle time at 1F1B's peak memory."""


RUNTIME_SCHEDULES = frozenset({Schedule.ONE_F_ONE_B.value, Schedule.GPIPE.value})
"""Schedules the torch runtime executes (fused backward, one chunk per worker). The planner
never switches a job to another schedule: only ``[job] schedule`` chooses it."""


class Placement(StrEnum):
    """How worker ids map to (stage, pipeline) in the initial plan."""

    STAGE_MAJOR = "stage-major"
    """Worker ``s * dp + p`` runs stage s of pipeline p (pipeline axis outermost)."""
    PIPELINE_MAJOR = "pipeline-major"
    """Worker ``p * pp + s`` runs stage s of pipeline p (a pipeline's stages are adjacent)."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Tensor x pipeline x data parallel layout and batch sizes."""

    tp: int = 1
    """Tensor-parallel degree: devices per worker, all inside one node."""
    pp: int
    """Pipeline stages per pipeline."""
    dp: int
    """Pipelines (data-parallel replicas)."""
    global_batch: int
    """Samples per optimizer step, kept constant through every recovery."""
    micro_batch: int = 1
    """Samples per micro-batch."""
    schedule: str = Schedule.ONE_F_ONE_B.value
    """``1f1b`` (one forward one backward), ``gpipe`` (all forwards, then all backwards),
    ``interleaved`` (1F1B over ``virtual_stages`` chunks per worker) or ``zero-bubble``
    (ZB-H1). The runtime executes only ``1f1b`` and ``gpipe``."""
    virtual_stages: int = 1
    """Model chunks per worker for ``interleaved`` (v in Narayanan et al. 2021); 1 otherwise."""
    placement: str = Placement.STAGE_MAJOR.value
    """``stage-major`` (worker ``s*dp+p``) or ``pipeline-major`` (worker ``p*pp+s``)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "global_batch", "micro_batch"):
            check_int(name, getattr(self, name))
        check_choice("schedule", self.schedule, [s.value for s in Schedule])
        check_int("virtual_stages", self.virtual_stages)
        if self.virtual_stages > 1 and self.schedule != Schedule.INTERLEAVED:
            fail("virtual_stages", f"{self.virtual_stages} chunks per worker need schedule = "
                 f'"interleaved", got {self.schedule!r}')
        check_choice("placement", self.placement, [p.value for p in Placement])
        if self.global_batch % self.micro_batch:
            fail("global_batch", f"{self.global_batch} is not divisible by micro_batch "
                 f"{self.micro_batch}; pick a multiple of it")
        if self.num_microbatches % self.dp:
            fail("global_batch", f"{self.num_microbatches} micro-batches do not split evenly over "
                 f"dp={self.dp} pipelines; make global_batch a multiple of "
                 f"micro_batch * dp = {self.micro_batch * self.dp}")

    @property
    def num_workers(self) -> int:
        """Workers (tensor-parallel groups) in the initial plan."""
        return self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step over all pipelines."""
        return self.global_batch // self.micro_batch

    def worker_id(self, pipeline: int, stage: int) -> int:
        """Worker id of (pipeline, stage) in the initial plan."""
        if self.placement == Placement.PIPELINE_MAJOR:
            return pipeline * self.pp + stage
        return stage * self.dp + pipeline
