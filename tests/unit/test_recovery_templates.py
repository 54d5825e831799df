"""Templates: the memory-constrained split and the micro-batch allocation, by brute force."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.plan import layer_costs
from chameleon_ft.policy import Planner
from chameleon_ft.profile import LayerCost, Profile
from chameleon_ft.recovery.allocation import allocate, allocate_by_moves
from chameleon_ft.recovery.templates import memory_bounds, stage_memory_bytes
from chameleon_ft.spec.config import load_config

ROOT = Path(__file__).resolve().parents[2]


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


def _staircase(data: st.DataObject, top: int) -> list[float]:
    """A non-decreasing step table over 1..``top`` micro-batches with flat runs, values
    shared with other kinds (so kinds tie) and a memory limit (infinity from some count)."""
    incs = data.draw(st.lists(st.sampled_from([0, 0, 1, 1, 2, 5]), min_size=top, max_size=top))
    limit = data.draw(st.integers(1, top + 1))
    acc, table = data.draw(st.integers(1, 4)), []
    for m, inc in enumerate(incs, start=1):
        acc += inc
        table.append(float(acc) if m < limit else math.inf)
    return table


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_allocate_from_the_optimum_gives_the_split_of_the_moves(data: st.DataObject) -> None:
    """The split found from the optimum (``known`` given) is the one the moves reach, for
    any non-decreasing steps, whatever step times are known beforehand."""
    top = 40
    tables = [_staircase(data, top) for _ in range(data.draw(st.integers(1, 3)))]
    pipes = data.draw(st.lists(st.integers(0, len(tables) - 1), min_size=1, max_size=30))
    total = data.draw(st.integers(1, 200))
    asked: list[tuple[int, int]] = []

    def step(kind: int, m: int) -> float:
        asked.append((kind, m))
        return tables[kind][m - 1] if m <= top else math.inf

    priced = [{m: tables[k][m - 1] for m in data.draw(st.sets(st.integers(1, top)))}
              for k in range(len(tables))]
    expected = allocate_by_moves(pipes, total, step)
    assert allocate(pipes, total, step, known=priced.__getitem__) == expected
    assert allocate(pipes, total, step) == expected


def test_allocate_from_the_optimum_prices_only_near_it() -> None:
    """Eight slow-filling pipelines among many fast ones: the moves walk the eight down
    from a large start, pricing every count on the way; from the optimum, with the counts
    near it known, nothing more is priced."""
    def step(kind: str, m: int) -> float:
        if kind == "long":  # 16 stages: a bubble until 16 micro-batches, then a jump
            return 6.0 + 0.01 * m if m <= 17 else 7.0 + 0.2 * m
        return 5.5 + 0.1 * m if m <= 8 else 10.0 + m  # 8 stages

    pipes = ["long"] * 8 + ["short"] * 239
    near = {"long": {m: step("long", m) for m in (15, 16, 17, 18, 19)},
            "short": {m: step("short", m) for m in (7, 8, 9, 10)}}
    asked: set[tuple[str, int]] = set()

    def counted(kind: str, m: int) -> float:
        asked.add((kind, m))
        return step(kind, m)

    expected = allocate_by_moves(pipes, 2048, counted)
    walked = {m for kind, m in asked if kind == "long"}
    asked.clear()
    assert allocate(pipes, 2048, counted, known=near.__getitem__) == expected
    assert expected[1].count(17) == 8 and expected[1].count(8) == 239
    assert len(walked) > 50 and not asked - {(k, m) for k in near for m in near[k]}


@pytest.mark.parametrize(("example", "most"), [("paper32", 65), ("testbed8", 9),
                                               ("llama3-405b-16k", 20)])
def test_template_steps_never_decrease_with_the_micro_batches(example: str, most: int) -> None:
    """What :func:`allocate` relies on, over the pipeline lengths the dynamic search
    considers, up to about twice each pipeline's share of the job's micro-batches (the
    16k job: up to the step's jump past one group of 16)."""
    planner = Planner(load_config(ROOT / "examples" / f"{example}.toml"))
    templates, job = planner.templates, planner.config.job
    longest = min(templates.num_layers, job.pp + planner.config.recovery.search_extra_stages)
    lengths = templates.feasible_lengths(longest)
    assert lengths
    for length in lengths:
        steps = [templates.length_step_s(length, m) for m in range(1, most + 1)]
        assert steps == sorted(steps), length
