"""Cluster specification: nodes, devices per node, and the two link types."""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_ft.spec._fields import check_int, check_positive
from chameleon_ft.spec.device import DeviceSpec


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A homogeneous cluster of ``num_nodes`` hosts with ``devices_per_node`` devices each.

    Bandwidths are per device and per direction: a worker of ``tp`` devices moves its
    share of a tensor over ``tp`` links in parallel.
    """

    num_nodes: int
    """Hosts in the job: the job's layout (``dp x pp x tp`` devices) fills them."""
    spare_nodes: int = 0
    """Warm spares: hosts beyond ``num_nodes`` whose workers start idle, launched and ready
    to take a failed worker's place in the running plan (the ``swap`` strategy; TrainMover,
    DeadPool and ByteRobust keep such standby machines). They are part of the fleet: they
    fail like the others, and a repaired node the policy does not fold in is a spare
    again. A plan never uses more workers than the job's layout has: spares replace
    workers, they do not add pipelines. Their workers are numbered after the job's."""
    devices_per_node: int
    """Accelerators per host."""
    device: DeviceSpec | None = None
    """The accelerator; may be omitted when the profile is ``uniform`` or ``file``."""
    intra_node_gb_per_s: float = 200.0
    """Device-to-device bandwidth inside a node, GB/s (1e9 bytes/s)."""
    intra_node_latency_us: float = 5.0
    """Latency of one transfer inside a node, microseconds."""
    inter_node_gb_per_s: float = 25.0
    """Per-device bandwidth between nodes, GB/s (25 GB/s = one 200 Gb/s NIC per device)."""
    inter_node_latency_us: float = 10.0
    """Latency of one transfer between nodes, microseconds."""
    ideal_network: bool = False
    """Make every transfer free (for checking the closed forms)."""

    def __post_init__(self) -> None:
        check_int("num_nodes", self.num_nodes)
        check_int("spare_nodes", self.spare_nodes, minimum=0)
        check_int("devices_per_node", self.devices_per_node)
        check_positive("intra_node_gb_per_s", self.intra_node_gb_per_s)
        check_positive("inter_node_gb_per_s", self.inter_node_gb_per_s)
        check_positive("intra_node_latency_us", self.intra_node_latency_us, allow_zero=True)
        check_positive("inter_node_latency_us", self.inter_node_latency_us, allow_zero=True)

    @property
    def num_devices(self) -> int:
        """The devices of the job's layout (the spare nodes' not counted)."""
        return self.num_nodes * self.devices_per_node

    @property
    def total_nodes(self) -> int:
        """Every host of the fleet: the job's and the spares."""
        return self.num_nodes + self.spare_nodes

    def link(self, same_node: bool) -> tuple[float, float]:
        """Return ``(latency_s, bandwidth_bytes_s)`` of one device's link."""
        if same_node:
            return self.intra_node_latency_us * 1e-6, self.intra_node_gb_per_s * 1e9
        return self.inter_node_latency_us * 1e-6, self.inter_node_gb_per_s * 1e9
