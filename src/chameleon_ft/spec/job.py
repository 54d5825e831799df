"""Job specification: the parallel layout and the batch."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from chameleon_ft.spec._fields import check_choice, check_int, fail


class Schedule(StrEnum):
    """Pipeline schedules the estimator and the runtime both execute."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"


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
    """``1f1b`` (one forward one backward) or ``gpipe`` (all forwards, then all backwards)."""
    placement: str = Placement.STAGE_MAJOR.value
    """``stage-major`` (worker ``s*dp+p``) or ``pipeline-major`` (worker ``p*pp+s``)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "global_batch", "micro_batch"):
            check_int(name, getattr(self, name))
        check_choice("schedule", self.schedule, [s.value for s in Schedule])
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
