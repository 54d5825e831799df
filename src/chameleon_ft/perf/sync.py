"""Gradient synchronisation: the all-reduce buckets of a plan, their rounds, and when each
worker is done reducing (docs/design.md section 3.1).

One ring all-reduce per *bucket* of layers held by the same set of workers (a layer's
gradient is reduced over every live worker holding it); buckets sharing a worker cannot
run together, so they are grouped into rounds by DSATUR colouring; a bucket starts when all
its workers are done with compute and with their earlier rounds; for a model whose head is
tied to its embedding, one more all-reduce after the rounds sums the two copies' gradients
over the holders of either layer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from chameleon_ft.perf.coloring import rounds
from chameleon_ft.perf.network import Topology
from chameleon_ft.plan.plan import ExecutionPlan
from chameleon_ft.profile.profile import Profile


@dataclass(frozen=True, slots=True)
class Bucket:
    """Layers whose gradients are all-reduced together over the same set of workers."""

    workers: tuple[int, ...]
    layers: tuple[int, ...]


def sync_buckets(plan: ExecutionPlan, profile: Profile) -> list[tuple[Bucket, float]]:
    """Group layers by the set of live workers holding them, with each bucket's bytes.

    Returns:
        ``(bucket, gradient bytes per device)`` pairs, in layer order.
    """
    out = []
    for holders, layers in plan.layers_by_holders.items():
        grad_bytes = sum(profile.layers[i].param_bytes for i in layers)
        out.append((Bucket(holders, tuple(layers)), grad_bytes))
    return out


def sync_rounds(plan: ExecutionPlan, profile: Profile) -> tuple[tuple[Bucket, ...], ...]:
    """The gradient all-reduce rounds of ``plan`` (buckets with more than one worker).

    Each bucket's members hold its layers, as the runtime's all-reduce needs; the tied
    copies' sum, over workers that hold one of the two layers only, is not a bucket: it
    follows the rounds (:func:`tie_members`).
    """
    buckets = [b for b, _ in sync_buckets(plan, profile) if len(b.workers) > 1]
    groups = rounds([b.workers for b in buckets])
    return tuple(tuple(buckets[i] for i in group) for group in groups)


def tie_members(plan: ExecutionPlan, profile: Profile) -> tuple[int, ...]:
    """The workers that all-reduce the tied copies' gradients: the holders of either tied
    layer (:attr:`Profile.tied_layers`), sorted, as the runtime's
    ``step_sync.tie_reductions`` forms the group.

    Returns:
        Empty when the profile has no tie, or when every holder of one layer holds the
        other and only they do (each then sums its two copies locally).
    """
    if profile.tied_bytes <= 0:
        return ()
    first, last = profile.tied_layers
    a, b = plan.holders(first), plan.holders(last)
    if a == b:
        return ()
    return tuple(sorted({*a, *b}))


def _bucket_conflicts(plan: ExecutionPlan, buckets: list[tuple[Bucket, float]]
                      ) -> list[tuple[int, int]]:
    """Pairs of buckets that share a worker (the conflict graph of the all-reduce rounds).

    A bucket holds every live holder of its layers, so two buckets share a worker exactly
    when some worker's layer range meets both: one pass over the few distinct ranges
    instead of over every worker.
    """
    return _conflicts(_buckets_met(plan.layers_by_worker.values(), buckets).values())


def _buckets_met(ranges: Iterable[range], buckets: list[tuple[Bucket, float]]
                 ) -> dict[range, list[int]]:
    """The buckets each distinct layer range meets (their indices, sorted), in the order
    ``ranges`` first names them: a worker holding the range is a member of exactly those
    buckets (a bucket holds every live holder of its layers)."""
    bucket_of_layer = {layer: i for i, (b, _) in enumerate(buckets) for layer in b.layers}
    return {layers: sorted({bucket_of_layer[layer] for layer in layers
                            if layer in bucket_of_layer})
            for layers in dict.fromkeys(ranges)}


def _conflicts(met: Iterable[list[int]]) -> list[tuple[int, int]]:
    """Pairs of buckets met by one range (each list sorted), sorted."""
    return sorted({pair for ids in met for pair in itertools.combinations(ids, 2)})



def synchronise(plan: ExecutionPlan, profile: Profile, topo: Topology,
                ready: dict[range, float], latest_finish: float,
                ) -> tuple[float, dict[range, float],
                           tuple[tuple[Bucket, ...], ...], tuple[int, ...]]:
    """Gradient synchronisation after each worker's backward ends: all-reduce rounds
    of the buckets with more than one member, then a tied pair's sum. ``ready`` holds
    each live layer range's latest finish (updated to its last end), ``latest_finish``
    the latest finish of any simulated worker. Returns when the last worker is done
    reducing, the time spent reducing by the workers of each layer range, the rounds'
    buckets and the tied pair's group.

    The workers holding one layer range are in the same buckets (a bucket holds every
    live holder of its layers), so they are tracked as one: a bucket starts at the
    latest of its classes and sets all of them to its end, and each class adds up
    its buckets' times in their order (the same maxima and sums as worker by worker).
    """
    buckets = [(b, n) for b, n in sync_buckets(plan, profile) if len(b.workers) > 1]
    met = _buckets_met(ready, buckets)
    groups = rounds([b.workers for b, _ in buckets], edges=_conflicts(met.values()))
    sync_s = dict.fromkeys(ready, 0.0)
    classes: list[list[range]] = [[] for _ in buckets]
    for layers, ids in met.items():
        for i in ids:
            classes[i].append(layers)

    def reduce(members: tuple[int, ...], ranges: list[range], num_bytes: float) -> None:
        t = topo.allreduce_s(members, num_bytes)
        done = max(map(ready.__getitem__, ranges)) + t
        for layers in ranges:
            ready[layers] = done
            sync_s[layers] += t

    for group in groups:
        for i in group:
            reduce(buckets[i][0].workers, classes[i], buckets[i][1])
    # A tied model sums the copies after every round of its members (the runtime's
    # order), so it waits for, and delays, any bucket sharing a worker with it.
    tie = tie_members(plan, profile)
    if tie:
        first, last = profile.tied_layers
        reduce(tie, [r for r in ready if first in r or last in r], profile.tied_bytes)
    # a reduction ends no earlier than its members finished: the latest end is the
    # latest of the classes' ends and of every finish (workers outside the plan's
    # live table included)
    return (max(latest_finish, max(ready.values(), default=-math.inf)), sync_s,
            tuple(tuple(buckets[i][0] for i in group) for group in groups), tie)

