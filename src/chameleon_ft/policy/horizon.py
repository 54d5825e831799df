"""How long the chosen plan will run: the failure-rate estimate and the mean horizon.

Per-worker failure rate, gamma-prior style. The prior is one failure per prior MTBF of a
worker: node MTBF ``policy.node_mtbf_hours`` (Llama 3: ~6,335 h) times the workers per node
(a node failure is one event, so a worker alone fails ``workers_per_node`` times less
often). It is worth one event of exposure ``E0 = 1 / lambda0`` worker-seconds. After
``n`` observed failure events over ``W * now_s`` worker-seconds of exposure (``W`` the
cluster's workers, ``now_s`` the time since the job began) the posterior mean rate is::

    lambda = (1 + n) / (E0 + W * now_s)

so a few early failures raise the rate quickly, and a long quiet run lowers it. The next
failure among ``N`` live workers is exponential with mean ``Dbar = 1 / (N lambda)``; a
known repair time caps it, since the repaired node's return changes the plan again.
"""

from __future__ import annotations

import math

from chameleon_ft.spec.recovery import PolicySpec

HOUR_S = 3600.0


def prior_worker_rate_per_s(spec: PolicySpec, workers_per_node: int) -> float:
    """Prior failures per second of one worker."""
    return 1.0 / (spec.node_mtbf_hours * HOUR_S * workers_per_node)


def worker_rate_per_s(spec: PolicySpec, *, workers_per_node: int, num_workers: int,
                      num_failures: int, now_s: float) -> float:
    """Posterior mean failure rate of one worker (module docstring).

    Args:
        spec: the policy settings (prior MTBF).
        workers_per_node: workers sharing a node.
        num_workers: workers of the cluster (exposure per second of the job).
        num_failures: failure events observed so far.
        now_s: seconds since the job began.

    Raises:
        ValueError: for a negative ``now_s`` or ``num_failures``.
    """
    if now_s < 0 or math.isnan(now_s):
        raise ValueError(f"now_s: must be >= 0, got {now_s}")
    if num_failures < 0:
        raise ValueError(f"num_failures: must be >= 0, got {num_failures}")
    prior_exposure = 1.0 / prior_worker_rate_per_s(spec, workers_per_node)
    return (1.0 + num_failures) / (prior_exposure + num_workers * now_s)


def mean_horizon_s(rate_per_worker_s: float, num_live: int,
                   repair_hours: float | None = None) -> float:
    """Expected time to the next change: ``1 / (N lambda)``, capped by the repair time."""
    horizon = math.inf if num_live <= 0 or rate_per_worker_s <= 0 else (
        1.0 / (num_live * rate_per_worker_s))
    if repair_hours is not None:
        horizon = min(horizon, repair_hours * HOUR_S)
    return horizon
