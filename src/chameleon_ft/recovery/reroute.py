"""``reroute``: keep every layout; peers holding a dead stage's layers run its micro-batches.

Works from the CURRENT plan, which may already be rerouted or heterogeneous: every stage
whose worker is dead (newly, or rerouted before) has its micro-batches spread over the
live stages of other pipelines that hold exactly the same layer range. Micro-batches are
handed out one at a time to the peer with the least work so far (its own pipeline's
micro-batches plus those already rerouted to it), so peers shared by two dead stages are
not overloaded. When that does not fit device memory, a second spread gives micro-batches
to peers in proportion to the memory the current plan leaves them free. Infeasible, with
the reason, when some dead stage has no such peer or the peers run out of memory.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import replace

from chameleon_ft.plan import Reroute
from chameleon_ft.recovery.transition import reroute_terms
from chameleon_ft.recovery.types import (
    Candidate,
    RecoveryState,
    Strategy,
    candidate_from_estimate,
    infeasible,
)


def dead_stages(state: RecoveryState) -> list[tuple[int, int]]:
    """``(pipeline, stage)`` of every stage of the current plan whose worker is not alive."""
    plan = state.plan
    return [(p, s) for p, s, st in plan.iter_stages()
            if (p, s) in plan.reroute_map or st.worker not in state.alive]


def _spread(state: RecoveryState, dead: list[tuple[int, int]],
            headroom: dict[int, float] | None) -> list[Reroute] | str:
    """Reroutes for every dead stage, or the reason there are none.

    Without ``headroom`` each micro-batch goes to the peer with the least work so far.
    With it, peers without free memory are skipped and the rest take micro-batches in
    proportion to their free bytes (the second attempt when the first does not fit).
    """
    plan = state.plan
    dead_set = set(dead)
    load: dict[int, float] = {}
    peers_of_range: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for p, s, st in plan.iter_stages():
        if (p, s) in dead_set:
            continue
        load[st.worker] = float(plan.pipelines[p].num_microbatches)
        peers_of_range[(st.first_layer, st.end_layer)].append((p, st.worker))
    extra: dict[int, int] = defaultdict(int)
    reroutes = []
    for p, s in dead:
        st = plan.pipelines[p].stages[s]
        peers = [w for q, w in peers_of_range.get((st.first_layer, st.end_layer), []) if q != p]
        if headroom is not None:
            peers = [w for w in peers if headroom.get(w, 0.0) > 0]
        if not peers:
            return (f"stage {s} of pipeline {p} (layers {st.first_layer}..{st.end_layer - 1}) "
                    "has no live replica in another pipeline"
                    + (" with free memory" if headroom is not None else ""))
        shares: dict[int, int] = defaultdict(int)

        def key(w: int) -> float:
            if headroom is None:
                return load[w]
            return (extra[w] + 1) / headroom[w]

        heap = [(key(w), w) for w in peers]
        heapq.heapify(heap)
        for _ in range(plan.pipelines[p].num_microbatches):
            _, w = heapq.heappop(heap)
            shares[w] += 1
            extra[w] += 1
            load[w] += 1.0
            heapq.heappush(heap, (key(w), w))
        reroutes.append(Reroute(p, s, tuple(sorted(shares.items()))))
    return reroutes


def candidates(state: RecoveryState, failed: frozenset[int]) -> list[Candidate]:
    """The rerouted plan, or why there is none.

    Args:
        state: the job and the current plan; ``state.alive`` excludes ``failed``.
        failed: the newly failed workers.

    Returns:
        One candidate (feasible or not).
    """
    plan = state.plan
    dead = dead_stages(state)
    spread = _spread(state, dead, None)
    if isinstance(spread, str):
        return [infeasible(Strategy.REROUTE, spread)]
    reroutes = spread
    new_plan = replace(plan, reroutes=tuple(reroutes))
    new_plan.validate()
    est = state.estimate(new_plan)
    how = "to same-stage peers"
    if not est.memory_fits:
        # Second attempt: weight the peers by the memory the current plan leaves them.
        capacity = state.topology.memory_capacity_bytes
        before = state.estimate(plan).peak_memory_bytes
        headroom = {w: capacity - peak for w, peak in before.items()}
        second = _spread(state, dead, headroom)
        if not isinstance(second, str):
            candidate_plan = replace(plan, reroutes=tuple(second))
            candidate_plan.validate()
            second_est = state.estimate(candidate_plan)
            if second_est.memory_fits:
                new_plan, est, reroutes = candidate_plan, second_est, second
                how = "to same-stage peers by free memory"
    newly = sorted((p, s) for p, s in dead if (p, s) not in plan.reroute_map)
    what = ", ".join(f"p{p}s{s}" for p, s in newly) or "nothing new"
    return [candidate_from_estimate(Strategy.REROUTE, new_plan, est,
                                    reroute_terms(state.config.recovery),
                                    f"reroute {what} {how} "
                                    f"({len(reroutes)} stage(s) rerouted in all)")]
