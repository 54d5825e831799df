"""A worker's tensor-parallel group for one generation, as DTensor needs it (design 4.11).

DTensor reaches its group through a ``DeviceMesh``, and a mesh needs what
``torch.distributed`` keeps for groups made by ``new_group``: a default process group (its
ranks are the mesh's coordinates) and the group registered by name (DTensor's collectives
find it that way). A worker has neither: its groups are built per generation straight
from the coordinator's store under sealed prefixes (``worker.groups``). So each process of
a worker of ``tp = k`` first makes a default group that never communicates (rank = its
tensor-parallel rank, size k: torch's own fake process group, registered under a backend
name of ours), and each generation's group is made by ``new_group`` through a second
backend of ours whose constructor builds the real gloo (or NCCL) group on the store and
prefix the worker hands it, so it meets through the seal like every other group. The old
generation's group is destroyed (``destroy_process_group``: unregistered, shut down) when
the generation is closed.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

LOCAL_BACKEND = "chameleon-local"
"""The default group's backend: no communication (its ranks only place the meshes)."""
GROUP_BACKEND = "chameleon-tp"
"""The backend of a generation's tensor-parallel groups (gloo or NCCL underneath)."""
_REGISTERED = threading.Lock()
_WORLD = threading.Lock()
"""``torch.distributed``'s registry of groups is not thread-safe: a generation's group is
made on its set-up thread while the previous one is destroyed on another."""


@dataclass(frozen=True)
class GroupOptions:
    """What :func:`_create_group` builds a generation's group from (``new_group``'s
    ``pg_options``, handed to the backend's constructor as they are)."""

    store: Any
    """The store the group meets in (a ``PrefixStore`` under the generation's sealed
    prefix)."""
    backend: str
    """``gloo`` or ``nccl``."""
    timeout_s: float
    address: str
    """The interface gloo listens on."""
    device: torch.device


def _create_local(common: Any, options: Any) -> Any:
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)


def _create_group(common: Any, options: GroupOptions) -> Any:
    rank, size = common.group_rank, common.group_size
    if options.backend == "nccl":  # pragma: no cover - needs GPUs
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=options.timeout_s)
        group = dist.ProcessGroupNCCL(options.store, rank, size, opts)
        group.eager_connect_single_device(options.device)
        return group
    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = timedelta(seconds=options.timeout_s)
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=options.address)]
    return dist.ProcessGroupGloo(options.store, rank, size, gloo)


def _register() -> None:
    with _REGISTERED:
        if GROUP_BACKEND not in dist.Backend.backend_list:
            dist.Backend.register_backend(LOCAL_BACKEND, _create_local, extended_api=True,
                                          devices=["cpu", "cuda"])
            dist.Backend.register_backend(GROUP_BACKEND, _create_group, extended_api=True,
                                          devices=["cpu", "cuda"])


def init_process(rank: int, size: int) -> None:
    """Make this process's default group (rank ``rank`` of ``size``, never communicating);
    once per process, before any tensor-parallel group."""
    _register()
    if not dist.is_initialized():
        dist.init_process_group(LOCAL_BACKEND, store=dist.HashStore(), rank=rank,
                                world_size=size)


def new_group(options: GroupOptions) -> Any:
    """A generation's tensor-parallel group over the worker's ranks (every rank calls it;
    it connects eagerly: gloo at construction, NCCL bound to the device).

    Raises:
        RuntimeError: when the group cannot be built (a peer did not come in time).
    """
    size = dist.get_world_size()
    with _WORLD:
        return dist.new_group(list(range(size)), backend=GROUP_BACKEND, pg_options=options,
                              timeout=timedelta(seconds=options.timeout_s))


def backend_of(group: Any, device: torch.device) -> Any:
    """The gloo or NCCL group under a tensor-parallel group (what a generation breaks and
    shuts down)."""
    return group._get_backend(torch.device(device.type))


def destroy(group: Any) -> None:
    """Unregister and shut a generation's group down (its generation is closed)."""
    with _WORLD, contextlib.suppress(RuntimeError, ValueError, KeyError):  # already gone
        dist.destroy_process_group(group)
