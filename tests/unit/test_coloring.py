"""DSATUR colouring (perf/coloring.py): the pairs' colouring is the general one."""

from __future__ import annotations

import random

import pytest

from chameleon_ft.perf.coloring import pair_rounds, rounds


@pytest.mark.parametrize("seed", range(6))
def test_pairs_are_coloured_as_any_groups(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        workers = rng.randint(1, 30)
        senders = rng.sample(range(workers), max(1, workers // 4))
        pairs: list[tuple[int, int]] = []
        for _ in range(rng.randint(0, 80)):
            a, b = rng.choice(senders), rng.randrange(workers)
            if rng.random() < 0.2:
                a, b = b, a
            # a receiver pulls several layers from one sender: repeated pairs
            pairs += [(a, b)] * rng.randint(1, 4)
        assert pair_rounds(pairs) == rounds(pairs)


def test_a_group_of_one_worker_and_no_groups() -> None:
    pairs = [(0, 0), (0, 1), (1, 1), (1, 0), (2, 2)]
    assert pair_rounds(pairs) == rounds(pairs)
    assert pair_rounds([]) == rounds([]) == []
