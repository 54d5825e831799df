"""Templates: the memory-constrained split and the micro-batch allocation, by brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.plan import layer_costs
from chameleon_ft.profile import LayerCost, Profile
from chameleon_ft.recovery.templates import allocate, memory_bounds, stage_memory_bytes


def _profile(costs: list[float], params: list[float], acts: list[float]) -> Profile:
    return Profile(layers=tuple(
        LayerCost(name=f"l{i}", fwd_s=c, bwd_input_s=c, bwd_weight_s=c, param_bytes=p,
                  optimizer_bytes=2 * p, activation_bytes=a)
        for i, (c, p, a) in enumerate(zip(costs, params, acts, strict=True))))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_memory_bounds_is_the_best_split_that_fits(data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 7))
    costs = data.draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    params = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    acts = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    stages = data.draw(st.integers(1, n))
    capacity = data.draw(st.integers(1, 60))
    profile = _profile([float(c) for c in costs], [float(p) for p in params],
                       [float(a) for a in acts])
    per_layer = layer_costs(profile)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = list(itertools.pairwise((0, *cuts, n)))
        fits = all(stage_memory_bytes(profile, lo, hi, stages - i) <= capacity
                   for i, (lo, hi) in enumerate(bounds))
        if fits:
            best = min(best, max(sum(per_layer[lo:hi]) for lo, hi in bounds))
    got = memory_bounds(profile, stages, float(capacity))
    if math.isinf(best):
        assert got is None
        return
    assert got is not None
    assert len(got) == stages and got[0][0] == 0 and got[-1][1] == n
    for i, (lo, hi) in enumerate(got):
        assert stage_memory_bytes(profile, lo, hi, stages - i) <= capacity
    assert max(sum(per_layer[lo:hi]) for lo, hi in got) == pytest.approx(best)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_allocate_is_the_min_max_split(data: st.DataObject) -> None:
    """Any non-decreasing per-kind step functions; compare with every split."""
    num_kinds = data.draw(st.integers(1, 3))
    # step[kind][m-1], non-decreasing in m, sometimes infinite (does not fit memory)
    tables = []
    for _ in range(num_kinds):
        steps = data.draw(st.lists(st.integers(0, 5), min_size=8, max_size=8))
        cap = data.draw(st.integers(1, 9))
        acc, table = 0, []
        for m, inc in enumerate(steps, start=1):
            acc += inc
            table.append(float(acc + 1) if m < cap else math.inf)
        tables.append(table)
    pipes = data.draw(st.lists(st.integers(0, num_kinds - 1), min_size=1, max_size=4))
    total = data.draw(st.integers(1, 8))

    def step(kind: int, m: int) -> float:
        return tables[kind][m - 1] if 1 <= m <= 8 else math.inf

    best = math.inf
    for split in itertools.product(range(1, total + 1), repeat=len(pipes)):
        if sum(split) == total:
            best = min(best, max(step(k, m) for k, m in zip(pipes, split, strict=True)))
    value, counts = allocate(pipes, total, step)
    if math.isinf(best):
        assert math.isinf(value) or not counts
        return
    assert sum(counts) == total and min(counts) >= 1
    assert value == best
    assert max(step(k, m) for k, m in zip(pipes, counts, strict=True)) == best
