"""Plans the runtime can run, for the point-to-point checker's tests: generated (uniform,
heterogeneous, rerouted, swapped onto spare ids) and reconstructed from the planner's
decisions on the multi-process tests' tiny job."""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from plan_shapes import even_pipelines
from tiny_job import TINY

from chameleon_ft.perf import Topology, build_schedule
from chameleon_ft.plan import ExecutionPlan, Pipeline
from chameleon_ft.plan.plan import Reroute
from chameleon_ft.profile import LayerCost, Profile, build_profile
from chameleon_ft.runtime.traffic import Action, actions_of, directive_ops
from chameleon_ft.spec.config import Config, config_from_mapping
from chameleon_ft.spec.job import RUNTIME_SCHEDULES

TOPOLOGY = Topology.from_config(config_from_mapping({
    "cluster": {"num_nodes": 8, "devices_per_node": 8},
    "job": {"pp": 8, "dp": 8, "global_batch": 8},
    "profile": {"kind": "uniform", "num_layers": 8, "fwd_s": 0.01, "bwd_input_s": 0.01,
                "bwd_weight_s": 0.01}}))
"""64 workers on 8 nodes: room for every generated plan and its spare ids."""


@functools.lru_cache(maxsize=64)
def profile_of(num_layers: int, seed: int) -> Profile:
    """Layers of uneven, seeded costs (so rerouted peers merge their streams in many
    orders)."""
    rng = random.Random(seed)
    return Profile(layers=tuple(LayerCost(name=f"layer{i}", fwd_s=rng.uniform(0.5, 2.0) * 1e-2,
                                   bwd_input_s=rng.uniform(0.5, 2.0) * 1e-2,
                                   bwd_weight_s=rng.uniform(0.5, 2.0) * 1e-2,
                                   param_bytes=1e6, optimizer_bytes=2e6,
                                   activation_bytes=1e4, output_bytes=1e4)
                         for i in range(num_layers)))


def schedule_actions(plan: ExecutionPlan, profile: Profile,
                     topology: Topology = TOPOLOGY) -> dict[int, tuple[Action, ...]]:
    """Every worker's actions as the coordinator publishes them for ``plan``."""
    return actions_of(directive_ops(build_schedule(plan, profile, topology).ops))


@dataclass(frozen=True)
class Case:
    """One plan with its profile, and what it is."""

    name: str
    plan: ExecutionPlan
    profile: Profile
    migration: Any = None
    """A recovery's migration (``recovery.types.Migration``) into ``plan``, if any."""


def _reroutes(rng: random.Random, pipelines: tuple[Pipeline, ...], dead_rate: float
              ) -> tuple[Reroute, ...]:
    """Dead stages, each rerouted over a random set of same-layer peers of other
    pipelines with random shares (a stage without a live peer stays alive)."""
    positions = [(p, s) for p, pipe in enumerate(pipelines) for s in range(len(pipe.stages))]
    dead = {pos for pos in positions if rng.random() < dead_rate}
    reroutes = []
    for p, s in sorted(dead):
        layers = pipelines[p].layout[s]
        peers = [pipelines[q].stages[t].worker for q, t in positions
                 if q != p and (q, t) not in dead and pipelines[q].layout[t] == layers]
        m = pipelines[p].num_microbatches
        if not peers:
            continue
        chosen = rng.sample(peers, rng.randint(1, min(len(peers), m)))
        cuts = sorted(rng.sample(range(1, m), len(chosen) - 1))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, m], strict=True)]
        reroutes.append(Reroute(p, s, tuple(zip(chosen, counts, strict=True))))
    return tuple(reroutes)


def _renamed(rng: random.Random, plan: ExecutionPlan, num_ids: int) -> ExecutionPlan:
    """``plan`` on other worker ids drawn from ``range(num_ids)`` (spares in its slots:
    which worker of a pair has the lower id changes)."""
    old = sorted({w for row in plan.worker_rows() for w in row})
    rename = dict(zip(old, rng.sample(range(num_ids), len(old)), strict=True))
    pipelines = tuple(pipe.on_workers([rename[w] for w in pipe.workers])
                      for pipe in plan.pipelines)
    reroutes = tuple(Reroute(r.pipeline, r.stage,
                             tuple((rename[w], n) for w, n in r.shares))
                     for r in plan.reroutes)
    return ExecutionPlan(num_layers=plan.num_layers, pipelines=pipelines, reroutes=reroutes,
                         schedule=plan.schedule)


def generated(seed: int) -> Case:
    """One random plan the runtime could run: 1-4 pipelines of 1-4 stages (equal, or of
    different lengths as after a dynamic re-plan, with different micro-batch counts),
    1-6 micro-batches each, ``1f1b`` or ``gpipe``, some stages dead and rerouted, and
    half the time on scattered worker ids."""
    rng = random.Random(seed)
    dp = rng.randint(1, 4)
    if rng.random() < 0.4:
        lengths = [rng.randint(1, 4) for _ in range(dp)]
        counts = [rng.randint(1, 6) for _ in range(dp)]
    else:
        lengths, counts = [rng.randint(1, 4)] * dp, [rng.randint(1, 6)] * dp
    num_layers = rng.randint(max(lengths), 8)
    pipelines = tuple(pipe.with_microbatches(n) for pipe, n in zip(
        even_pipelines(num_layers, lengths, 1), counts, strict=True))
    schedule = rng.choice(sorted(RUNTIME_SCHEDULES))
    reroutes = _reroutes(rng, pipelines, rng.choice([0.0, 0.2, 0.4]))
    plan = ExecutionPlan(num_layers=num_layers, pipelines=pipelines, reroutes=reroutes,
                         schedule=schedule)
    if rng.random() < 0.5:
        plan = _renamed(rng, plan, 2 * sum(lengths) + 4)
    plan.validate()
    kind = "rerouted" if reroutes else "heterogeneous" if len(set(lengths)) > 1 else "uniform"
    return Case(f"seed{seed}-{kind}-{schedule}", plan, profile_of(num_layers, seed % 7))


# ---------------------------------------------------------------------- the tiny job



def tiny_config(**cluster: Any) -> Config:
    """The tiny job, with ``[cluster]`` overrides (``spare_nodes``)."""
    doc = {k: dict(v) for k, v in TINY.items()}
    doc["cluster"].update(cluster)
    return config_from_mapping(doc)


POLICIES = ("reroute", "dynamic", "shrink", "restart", "reroute-then-dynamic", "chameleon")
"""The runtime's policies (``RUNTIME_POLICIES``) but ``swap``, which needs spare nodes."""


@functools.cache
def tiny_decisions() -> tuple[Case, ...]:
    """:func:`_tiny_decisions`, made once."""
    return tuple(_tiny_decisions())


def _tiny_decisions() -> Iterator[Case]:
    """The plans the multi-process recovery tests run, reconstructed with the planner on
    their job: the failure-free plan; every policy after each single death, after both
    holders of a stage die, and after a second death on the first recovery's plan; a
    repaired worker folded back in; ``swap`` onto a spare node's workers."""
    from chameleon_ft.policy import Planner

    config = tiny_config()
    profile = build_profile(config, runtime=True)
    for policy in POLICIES:
        planner = Planner(config, profile=profile, policy=policy)
        plan0 = planner.initial_plan
        yield Case(f"tiny-{policy}-initial", plan0, profile)
        for failed in ([0], [1], [2], [3], [2, 3], [0, 3]):
            decision = planner.decide(plan0, failed)
            yield Case(f"tiny-{policy}-{failed}", decision.plan, profile, decision.migration)
            alive = sorted(set(range(4)) - set(failed))
            if len(alive) > 2:
                second = planner.decide(decision.plan, alive[:1], alive=alive[1:])
                yield Case(f"tiny-{policy}-{failed}-then-{alive[0]}", second.plan, profile,
                           second.migration)
            back = planner.decide_rejoin(decision.plan, failed, alive=range(4))
            yield Case(f"tiny-{policy}-{failed}-rejoin", back.plan, profile, back.migration)
    spares = tiny_config(spare_nodes=1)
    for policy in ("swap", "chameleon"):
        planner = Planner(spares, profile=profile, policy=policy)
        for failed in ([1], [3], [2, 3]):
            decision = planner.decide(planner.initial_plan, failed,
                                      alive=sorted(set(range(6)) - set(failed)))
            yield Case(f"tiny-spares-{policy}-{failed}", decision.plan, profile,
                       decision.migration)


def planner_decisions(num: int, seed: int = 0) -> Iterator[Case]:
    """``num`` decisions of the planner under the runtime's policies on an 8-worker job
    (dp 4 x pp 2, and dp 2 x pp 4; ``swap`` and ``chameleon`` also with a spare node of 4
    idle workers), each after 1-3 random deaths on the failure-free plan or on the plan
    an earlier decision made."""
    from chameleon_ft.policy import Planner

    rng = random.Random(seed)
    planners = []
    for (dp, pp), spares in itertools.product(((4, 2), (2, 4)), (0, 1)):
        config = config_from_mapping({
            "cluster": {"num_nodes": 2, "devices_per_node": 4, "spare_nodes": spares},
            "job": {"pp": pp, "dp": dp, "global_batch": 16},
            "profile": {"kind": "uniform", "num_layers": 6, "fwd_s": 0.01,
                        "bwd_input_s": 0.01, "bwd_weight_s": 0.01}})
        profile = profile_of(6, dp)  # uneven layers: re-plans of uneven pipelines
        policies = ("swap", "chameleon") if spares else POLICIES
        planners += [(Planner(config, profile=profile, policy=policy), 8 + 4 * spares)
                     for policy in policies]
    for i in range(num):
        planner, num_alive = rng.choice(planners)
        plan, alive = planner.initial_plan, set(range(num_alive))
        for _ in range(rng.randint(1, 2)):
            running = sorted(set(plan.workers) & alive)
            failed = rng.sample(running, max(1, min(len(running) - 2, rng.randint(1, 3))))
            alive -= set(failed)
            decision = planner.decide(plan, failed, alive=sorted(alive), compare=False)
            plan = decision.plan
        yield Case(f"planner{i}-{decision.strategy}", plan, planner.profile,
                   decision.migration)
