"""What a step reduces beyond the all-reduce buckets (runtime/step_sync.py, pure): the
tied pairs' groups and contributors under every kind of plan, and the norm's group."""

from __future__ import annotations

from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.runtime.step_sync import extra_groups, step_reductions

PAIR = ((0, "embed.weight"), (4, "head.weight"))


def _plan(*pipelines: tuple[tuple[int, int, int], ...]) -> ExecutionPlan:
    return ExecutionPlan(num_layers=5, pipelines=tuple(
        Pipeline(tuple(Stage(*s) for s in stages), 2) for stages in pipelines))


def test_embedding_and_head_on_different_workers() -> None:
    plan = ExecutionPlan.uniform(dp=2, pp=2, num_layers=5, num_microbatches=4)
    d = step_reductions(plan, [PAIR], 0.0)
    (tie,) = d["ties"]
    assert tie == {"members": [0, 1, 2, 3], "pair": [[0, "embed.weight"], [4, "head.weight"]],
                   "sources": [0, 2], "local": False}
    assert d["norm"] == {"members": [0, 1, 2, 3], "clip": 0.0}
    assert extra_groups(d) == [(0, 1, 2, 3)]  # the tie's; no clipping, no norm group


def test_every_holder_holds_both_layers_the_sum_is_local() -> None:
    plan = _plan(((0, 0, 5),), ((1, 0, 5),))
    d = step_reductions(plan, [PAIR], 1.0)
    assert d["ties"][0]["local"] and d["ties"][0]["sources"] == [0, 0]
    assert extra_groups(d) == [(0, 1)]  # the norm's, when clipping


def test_pipelines_of_different_lengths_mix_both_kinds_of_holder() -> None:
    """After a dynamic recovery: worker 3 holds the whole model, workers 0 and 2 one end
    each; the lowest holder of each layer contributes."""
    plan = _plan(((0, 0, 3), (2, 3, 5)), ((3, 0, 5),))
    d = step_reductions(plan, [PAIR], 1.0)
    (tie,) = d["ties"]
    assert tie["members"] == [0, 2, 3] and tie["sources"] == [0, 2] and not tie["local"]
    assert extra_groups(d) == [(0, 2, 3)]  # one group serves the tie and the norm


def test_a_single_worker_needs_no_group() -> None:
    plan = _plan(((0, 0, 5),))
    d = step_reductions(plan, [PAIR], 1.0)
    assert d["ties"][0]["local"] and extra_groups(d) == []
    assert step_reductions(plan, [], 0.0)["ties"] == []
