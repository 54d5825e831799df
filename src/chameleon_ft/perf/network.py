"""The network as the estimator sees it: which node a worker is on, and what moving bytes
between workers costs."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property

from chameleon_ft.spec.cluster import ClusterSpec
from chameleon_ft.spec.config import Config


@dataclass(frozen=True)
class Topology:
    """Workers placed on nodes, with the cluster's two link types.

    Worker ``w`` lives on node ``w // workers_per_node``; the spare nodes
    (``[cluster] spare_nodes``) follow the job's. A worker of ``tp`` devices moves a
    tensor as ``tp`` per-device shares over ``tp`` links in parallel, so the time of a
    transfer of ``per_device_bytes`` is that of one device link.
    """

    cluster: ClusterSpec
    workers_per_node: int
    tp: int = 1

    @classmethod
    def from_config(cls, config: Config) -> Topology:
        """The topology of a job file."""
        return cls(cluster=config.cluster, workers_per_node=config.workers_per_node,
                   tp=config.job.tp)

    @property
    def num_workers(self) -> int:
        """Workers of the whole fleet, spare nodes included (``[cluster] spare_nodes``)."""
        return self.cluster.total_nodes * self.workers_per_node

    @cached_property
    def all_workers(self) -> frozenset[int]:
        """Every worker id of the fleet, as one set (built once per topology)."""
        return frozenset(range(self.num_workers))

    @property
    def num_nodes(self) -> int:
        """Nodes of the whole fleet, spare nodes included."""
        return self.cluster.total_nodes

    @property
    def memory_capacity_bytes(self) -> float:
        """One device's memory, or infinity when the device is not specified."""
        device = self.cluster.device
        return math.inf if device is None else float(device.memory_bytes)

    @property
    def placement_free(self) -> bool:
        """Whether which worker runs which stage cannot change an estimate: one worker per
        node, one node, or free links (every transfer crosses the same kind of link)."""
        return (self.workers_per_node == 1 or self.cluster.total_nodes == 1
                or self.cluster.ideal_network)

    def node_of(self, worker: int) -> int:
        """The node holding ``worker``."""
        return worker // self.workers_per_node

    def workers_of_node(self, node: int) -> range:
        """The workers of ``node``."""
        return range(node * self.workers_per_node, (node + 1) * self.workers_per_node)

    def link(self, src: int, dst: int) -> tuple[float, float]:
        """``(latency_s, bandwidth_bytes_s)`` between two workers."""
        return self.cluster.link(self.node_of(src) == self.node_of(dst))

    def p2p_s(self, src: int, dst: int, num_bytes: float) -> float:
        """Seconds to send ``num_bytes`` (per device) from ``src`` to ``dst``; 0 on one worker."""
        if src == dst or self.cluster.ideal_network:
            return 0.0
        latency_s, bw = self.link(src, dst)
        return latency_s + num_bytes / bw

    def allreduce_s(self, workers: Collection[int], num_bytes: float) -> float:
        """Ring all-reduce of ``num_bytes`` (per device) over ``workers``.

        ``2 (k-1)/k * n / bw + 2 (k-1) * latency`` with ``bw`` and latency of the slowest link
        in the ring (inter-node as soon as the ring spans two nodes).
        """
        k = len(workers)
        if k <= 1 or num_bytes <= 0 or self.cluster.ideal_network:
            return 0.0
        per_node = self.workers_per_node
        # nodes are blocks of consecutive ids: one node exactly when the extremes share it
        latency_s, bw = self.cluster.link(min(workers) // per_node == max(workers) // per_node)
        return 2 * (k - 1) / k * num_bytes / bw + 2 * (k - 1) * latency_s
