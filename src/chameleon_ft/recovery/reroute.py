"""``reroute``: keep every layout; peers holding a dead stage's layers run its micro-batches.

Works from the CURRENT plan, which may already be rerouted or heterogeneous: every stage
whose worker is dead (newly, or rerouted before) has its micro-batches spread over the
live stages of other pipelines that hold exactly the same layer range. Micro-batches are
handed out one at a time to the peer with the least work so far (its own pipeline's
micro-batches plus those already rerouted to it, over its speed), so peers shared by two
dead stages are not overloaded. Infeasible, with the reason, when some dead stage has no
such peer or the peers run out of memory.
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
    dead_set = set(dead)
    load: dict[int, float] = {}
    peers_of_range: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for p, s, st in plan.iter_stages():
        if (p, s) in dead_set:
            continue
        load[st.worker] = float(plan.pipelines[p].num_microbatches)
        peers_of_range[(st.first_layer, st.end_layer)].append((p, st.worker))
    reroutes = []
    for p, s in dead:
        st = plan.pipelines[p].stages[s]
        peers = [w for q, w in peers_of_range.get((st.first_layer, st.end_layer), []) if q != p]
        if not peers:
            return [infeasible(Strategy.REROUTE,
                               f"stage {s} of pipeline {p} (layers {st.first_layer}.."
                               f"{st.end_layer - 1}) has no live replica in another pipeline")]
        shares: dict[int, int] = defaultdict(int)
        heap = [(load[w], w) for w in peers]
        heapq.heapify(heap)
        for _ in range(plan.pipelines[p].num_microbatches):
            work, w = heapq.heappop(heap)
            shares[w] += 1
            load[w] = work + 1.0
            heapq.heappush(heap, (load[w], w))
        reroutes.append(Reroute(p, s, tuple(sorted(shares.items()))))
    new_plan = replace(plan, reroutes=tuple(reroutes))
    new_plan.validate()
    est = state.estimate(new_plan)
    newly = sorted((p, s) for p, s in dead if (p, s) not in plan.reroute_map)
    what = ", ".join(f"p{p}s{s}" for p, s in newly) or "nothing new"
    return [candidate_from_estimate(Strategy.REROUTE, new_plan, est,
                                    reroute_terms(state.config.recovery),
                                    f"reroute {what} to same-stage peers "
                                    f"({len(reroutes)} stage(s) rerouted in all)")]
