"""One fully rerouted step, shared by the point-to-point tests on the NCCL model and on
real gloo: pipeline 0's two workers dead, both its stages rerouted onto pipeline 1's
workers 2 and 3, 3 micro-batches per pipeline."""

from __future__ import annotations

from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.plan.plan import Reroute

FULLY_REROUTED = {
    2: (("F", 0, 0, 0), ("F", 0, 0, 1), ("F", 1, 0, 0), ("F", 1, 0, 1), ("B", 0, 0, 0),
        ("F", 0, 0, 2), ("B", 0, 0, 1), ("B", 0, 0, 2), ("B", 1, 0, 0), ("F", 1, 0, 2),
        ("B", 1, 0, 1), ("B", 1, 0, 2)),
    3: (("F", 0, 1, 0), ("B", 0, 1, 0), ("F", 0, 1, 1), ("B", 0, 1, 1), ("F", 0, 1, 2),
        ("B", 0, 1, 2), ("F", 1, 1, 0), ("B", 1, 1, 0), ("F", 1, 1, 1), ("B", 1, 1, 1),
        ("F", 1, 1, 2), ("B", 1, 1, 2)),
}
"""The list scheduler's merge of the step: the pair 2 -> 3 carries two logical streams,
which worker 2 sends interleaved and worker 3 takes one after the other."""


def fully_rerouted_plan() -> ExecutionPlan:
    """The plan: pipelines (0, 1) and (2, 3) of two stages over 4 layers, pipeline 0's
    stages rerouted onto workers 2 and 3."""
    return ExecutionPlan(num_layers=4, pipelines=(
        Pipeline((Stage(0, 0, 2), Stage(1, 2, 4)), 3),
        Pipeline((Stage(2, 0, 2), Stage(3, 2, 4)), 3)),
        reroutes=(Reroute(0, 0, ((2, 3),)), Reroute(0, 1, ((3, 3),))))
