"""A planner's decision arguments, checked: workers of the cluster, a horizon, a policy,
the ages of the checkpoints, the time. Bad input is a ``ValueError`` naming the argument.

The checks are cheap on thousands of workers: a set of the cluster's workers is taken as
it is, and when it is most of the cluster the cluster's other workers (found once) are
kept for the event's canonical form (``Planner._lookup``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Iterable

from chameleon_ft.perf import Topology
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.policy.horizon import LiveExposure
from chameleon_ft.recovery.transition import lost_progress_s, memory_lost_progress_s
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.recovery import POLICY_NAMES


class DecisionInputs:
    """Checks a planner's decision arguments against its cluster.

    Args:
        config: the job.
        topology: workers, nodes and links.
        exposure: the live worker-seconds the failure-rate estimate counts; each decision
            tells it the live workers once they are checked.
    """

    def __init__(self, config: Config, topology: Topology, exposure: LiveExposure) -> None:
        self.config = config
        self.topology = topology
        self.exposure = exposure
        self.others: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())
        """The last set of workers checked whole, and the cluster's other workers."""

    def workers(self, field: str, workers: Iterable[int]) -> frozenset[int]:
        """``workers`` as a set of the cluster's workers.

        Raises:
            ValueError: naming ``field`` for a worker outside the cluster.
        """
        n = self.topology.num_workers
        if type(workers) is frozenset:  # a set of the cluster's workers already?
            everyone = self.topology.all_workers
            if len(workers) * 2 <= len(everyone):  # few: looked up one by one
                if workers <= everyone and _only_ints(workers):
                    return workers
            else:
                # Most of the cluster (the simulator's live workers): the cluster's other
                # workers, found once, say that it is its workers (``n - k`` of them
                # leave ``k``), and are kept for the event's canonical form.
                others = everyone - workers
                if len(others) == len(everyone) - len(workers) and _only_ints(workers):
                    self.others = (workers, others)
                    return workers
        items = list(workers)
        if set(map(type, items)) <= {int} and (not items or (min(items) >= 0
                                                            and max(items) < n)):
            return frozenset(items)  # the common case, checked in bulk (plain ints only)
        for w in items:
            if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < n:
                raise ValueError(f"{field}: worker {w!r} is not in the cluster (workers 0.."
                                 f"{n - 1})")
        return frozenset(items)

    def failure(self, plan: ExecutionPlan, failed: Iterable[int],
                alive: Iterable[int] | None, now_s: float,
                since_checkpoint_s: float | None,
                since_memory_checkpoint_s: float | None,
                ) -> tuple[frozenset[int], frozenset[int]]:
        """``Planner.decide``'s arguments checked: the failed workers and the live ones.

        Raises:
            ValueError: naming the argument that is out of range.
        """
        failed_set = self.workers("failed", failed)
        if since_checkpoint_s is not None:
            lost_progress_s(self.config.recovery, since_checkpoint_s)  # validates
        if since_memory_checkpoint_s is not None:
            memory_lost_progress_s(self.config.recovery, 0.0, since_memory_checkpoint_s)
        if now_s < 0 or math.isnan(now_s):
            raise ValueError(f"now_s: must be >= 0, got {now_s}")
        alive_set = (frozenset(plan.workers) if alive is None
                     else self.workers("alive", alive))
        if not failed_set.isdisjoint(alive_set):
            alive_set -= failed_set
        self.exposure.observe(now_s, len(alive_set))
        if not alive_set:
            raise ValueError("failed: no worker is left alive")
        return failed_set, alive_set

    def rejoin(self, plan: ExecutionPlan, returned: Iterable[int],
               alive: Iterable[int] | None, now_s: float, horizon_s: float | None,
               policy: str) -> tuple[frozenset[int], frozenset[int], float | None, str]:
        """``Planner.decide_rejoin``'s arguments checked: the returned workers, the live
        ones (the returned among them), the horizon and the policy.

        Raises:
            ValueError: naming the argument that is out of range.
        """
        returned_set = self.workers("returned", returned)
        horizon = check_horizon(horizon_s)
        if now_s < 0 or math.isnan(now_s):
            raise ValueError(f"now_s: must be >= 0, got {now_s}")
        chosen_policy = check_policy(policy)
        alive_set = (frozenset(plan.workers) if alive is None
                     else self.workers("alive", alive))
        if not returned_set <= alive_set:
            alive_set |= returned_set
        self.exposure.observe(now_s, len(alive_set))
        return returned_set, alive_set, horizon, chosen_policy


def check_horizon(horizon_s: float | None) -> float | None:
    """``horizon_s`` as a float (``None`` stays).

    Raises:
        ValueError: for anything but a number >= 0.
    """
    if horizon_s is None:
        return None
    if isinstance(horizon_s, bool) or not isinstance(horizon_s, (int, float)) or (
            math.isnan(horizon_s) or horizon_s < 0):
        raise ValueError(f"horizon_s: must be a number >= 0, got {horizon_s!r}")
    return float(horizon_s)


def check_policy(name: str) -> str:
    """``name``, a known policy.

    Raises:
        ValueError: for an unknown policy.
    """
    if name not in POLICY_NAMES:
        raise ValueError(f"policy: unknown policy {name!r}; choose one of "
                         f"{', '.join(POLICY_NAMES)}")
    return name


def _only_ints(workers: Collection[object]) -> bool:
    """Whether every item is a plain ``int`` (not a bool, not a float equal to one),
    checked at C speed."""
    return operator.countOf(map(type, workers), int) == len(workers)
