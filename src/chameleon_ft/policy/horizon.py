"""How long the chosen plan will run: the failure-rate estimate and the mean horizon.

Per-worker failure rate, gamma-prior style. The prior is one failure per prior MTBF of a
worker: node MTBF ``policy.node_mtbf_hours`` (Llama 3: ~6,335 h) times the workers per node
(a node failure is one event, so a worker alone fails ``workers_per_node`` times less
often). It is worth one event of exposure ``E0 = 1 / lambda0`` worker-seconds. After
``n`` observed failure events over ``E`` worker-seconds of exposure the posterior mean rate
is::

    lambda = (1 + n) / (E0 + E)

so a few early failures raise the rate quickly, and a long quiet run lowers it. ``E`` counts
the live workers over time (:class:`LiveExposure`), not the cluster's: a dead worker cannot
fail, so hours spent waiting for a repair must not dilute the rate. Counting them did: with
a node MTBF of 1 h and repairs of 24 h, a 2-node job spends most of its time down, and the
estimate fell 8x below the true rate, so the policy expected hours of calm where minutes
came, and took fast plans a single node's loss ends in a restart. The next
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


def worker_rate_per_s(spec: PolicySpec, *, workers_per_node: int, num_failures: int,
                      exposure_worker_s: float) -> float:
    """Posterior mean failure rate of one worker (module docstring).

    Args:
        spec: the policy settings (prior MTBF).
        workers_per_node: workers sharing a node.
        num_failures: failure events observed so far.
        exposure_worker_s: worker-seconds the observed workers were alive
            (:meth:`LiveExposure.at`).

    Raises:
        ValueError: for a negative ``exposure_worker_s`` or ``num_failures``.
    """
    if exposure_worker_s < 0 or math.isnan(exposure_worker_s):
        raise ValueError(f"exposure_worker_s: must be >= 0, got {exposure_worker_s}")
    if num_failures < 0:
        raise ValueError(f"num_failures: must be >= 0, got {num_failures}")
    prior_exposure = 1.0 / prior_worker_rate_per_s(spec, workers_per_node)
    return (1.0 + num_failures) / (prior_exposure + exposure_worker_s)


class LiveExposure:
    """Worker-seconds of exposure to failures: the live workers integrated over time.

    The count of live workers is known at each decision (failures and returns); between
    two it holds. It starts with every one of ``num_workers`` alive at time 0, and counts
    at most ``num_workers`` (idle workers beyond the job's layout, warm spares, fail without
    the policy being told). A time earlier than the last one seen (a what-if decision)
    adds nothing.

    Args:
        num_workers: the job's workers.
    """

    def __init__(self, num_workers: int) -> None:
        self._cap = num_workers
        self._live = num_workers
        self._since_s = 0.0
        self._total = 0.0

    def observe(self, now_s: float, num_live: int) -> None:
        """From ``now_s`` on, ``num_live`` workers are alive."""
        if now_s > self._since_s:
            self._total += self._live * (now_s - self._since_s)
            self._since_s = now_s
        self._live = min(num_live, self._cap)

    def at(self, now_s: float) -> float:
        """Worker-seconds of exposure up to ``now_s``."""
        return self._total + self._live * max(0.0, now_s - self._since_s)


def mean_horizon_s(rate_per_worker_s: float, num_live: int,
                   repair_hours: float | None = None) -> float:
    """Expected time to the next change: ``1 / (N lambda)``, capped by the repair time."""
    horizon = math.inf if num_live <= 0 or rate_per_worker_s <= 0 else (
        1.0 / (num_live * rate_per_worker_s))
    if repair_hours is not None:
        horizon = min(horizon, repair_hours * HOUR_S)
    return horizon
