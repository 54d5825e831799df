"""Plans of given pipeline lengths, for the estimator's property tests."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from chameleon_ft.plan import Pipeline, Stage


def even_pipelines(num_layers: int, lengths: Sequence[int], microbatches: int
                   ) -> tuple[Pipeline, ...]:
    """One pipeline per length, each cutting the layers into that many near-even stages;
    workers numbered in order, every pipeline running ``microbatches``."""
    pipelines, worker = [], 0
    for length in lengths:
        bounds = [round(i * num_layers / length) for i in range(length + 1)]
        stages = []
        for lo, hi in itertools.pairwise(bounds):
            stages.append(Stage(worker, lo, hi))
            worker += 1
        pipelines.append(Pipeline(tuple(stages), microbatches))
    return tuple(pipelines)
