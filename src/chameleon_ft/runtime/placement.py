"""Which GPU a worker computes on, from what the cluster's launcher tells it (pure).

A cluster starts *tasks*: ``srun`` one per ``--ntasks-per-node`` slot, Kubernetes one per
pod, ``chameleon train`` itself for its local workers. A task knows its node-local index
from the launcher (``LOCAL_RANK``, else Slurm's ``SLURM_LOCALID``) and sees the GPUs
``CUDA_VISIBLE_DEVICES`` leaves it (all of the host's, or only its own with Slurm's
``--gpus-per-task``). A task runs one worker or more (``chameleon worker --num-workers
N``). The rule (:func:`device_index`):

- a task that sees exactly as many GPUs as it runs workers owns them: its k-th worker
  takes its k-th visible GPU (one GPU per task: ``cuda:0``, whatever the task's index);
- otherwise the GPUs are the host's: a worker takes the one at its node-local index;
- a node-local index beyond the visible GPUs shares one under gloo (which stages
  transfers through host memory) and is refused under NCCL (one rank per device).

The node-local index of a task's k-th worker is ``index * N + k`` when the launcher gave
the task an index, else the coordinator's admission order (the lowest index no other
live worker of the job holds on that host). Nothing here reads the environment or
imports torch: the CLI reads the variables (:func:`launcher_index`) and the worker asks
torch how many GPUs it sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

LOCAL_INDEX_ENV = ("LOCAL_RANK", "SLURM_LOCALID")
"""The variables a launcher sets to a task's node-local index, first found wins
(``torchrun`` and Kubernetes recipes set ``LOCAL_RANK``; ``srun`` sets ``SLURM_LOCALID``)."""
MAX_LOCAL_INDEX = 4096
"""Bound on a node-local index (it arrives over the network in a join request)."""


@dataclass(frozen=True)
class Place:
    """Where a worker process sits on its host: what picks its GPU."""

    local_index: int
    """Its node-local index among the job's workers on its host."""
    task_index: int = 0
    """Its place among the workers its task runs (0 ..``task_workers`` - 1)."""
    task_workers: int = 1
    """How many workers its task runs."""

    def __post_init__(self) -> None:
        if not 0 <= self.local_index < MAX_LOCAL_INDEX:
            raise ValueError(f"local index: {self.local_index} is outside 0..{MAX_LOCAL_INDEX - 1}")
        if not 0 <= self.task_index < self.task_workers:
            raise ValueError(f"task index: {self.task_index} is outside "
                             f"0..{self.task_workers - 1}")


def launcher_index(env: Mapping[str, str]) -> int | None:
    """The node-local index a launcher gave this task, or None where it gave none.

    Args:
        env: the task's environment (``os.environ`` at the CLI's edge).

    Returns:
        ``LOCAL_RANK``, else ``SLURM_LOCALID``, else None.

    Raises:
        ValueError: naming the variable, for a value that is not a non-negative integer.
    """
    for name in LOCAL_INDEX_ENV:
        text = env.get(name, "").strip()
        if not text:
            continue
        if not text.isdigit() or int(text) >= MAX_LOCAL_INDEX:
            raise ValueError(f"{name}: expected this task's node-local index (0, 1, ...), "
                             f"got {text!r}; unset it or fix the launcher's setting")
        return int(text)
    return None


def task_places(index: int | None, num_workers: int) -> list[int | None]:
    """The node-local index each of a task's workers asks for (None: the coordinator's
    admission order decides).

    Args:
        index: the task's node-local index from its launcher (:func:`launcher_index`).
        num_workers: workers the task runs.
    """
    if index is None:
        return [None] * num_workers
    return [index * num_workers + k for k in range(num_workers)]


def device_index(place: Place, num_visible: int, backend: str) -> int:
    """The index, among the GPUs this process sees, of the worker's GPU.

    Args:
        place: where the worker sits on its host.
        num_visible: GPUs this process sees (``torch.cuda.device_count()``, which honours
            ``CUDA_VISIBLE_DEVICES``).
        backend: ``gloo`` or ``nccl``.

    Raises:
        ValueError: when no GPU is visible, or under NCCL when the worker's node-local
            index has no GPU of its own.
    """
    if num_visible < 1:
        raise ValueError("train.device: cuda, but this process sees no GPU (none on the "
                         "host, or CUDA_VISIBLE_DEVICES hides them)")
    if num_visible == place.task_workers:  # the task's own GPUs (e.g. --gpus-per-task)
        return place.task_index
    if place.local_index < num_visible:  # the host's GPUs, one per node-local index
        return place.local_index
    if backend == "nccl":
        raise ValueError(f"train.backend: nccl puts one worker on each GPU; node-local index "
                         f"{place.local_index} on a host where this task sees {num_visible}; "
                         "give each task its own GPUs (CUDA_VISIBLE_DEVICES, --gpus-per-task), "
                         "start fewer workers per host, or use backend = \"gloo\" to share")
    return place.local_index % num_visible


def rank_place(place: Place, tp: int, rank: int) -> Place:
    """Where rank ``rank`` of a worker of ``tp`` processes sits (design 4.11): the
    worker's node-local index ``i`` and task place ``t`` of ``n`` become device ``tp * i +
    rank``, place ``tp * t + rank`` of ``tp * n``, so the rule of :func:`device_index`
    gives each rank a device of its own (a task that sees exactly its workers' ``tp * n``
    GPUs owns them; otherwise the host's)."""
    if tp == 1:
        return place
    return Place(tp * place.local_index + rank, task_index=tp * place.task_index + rank,
                 task_workers=tp * place.task_workers)
