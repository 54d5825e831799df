"""Where a worker computes and where it finds the coordinator, from what a cluster's
launcher sets: ``LOCAL_RANK``/``SLURM_LOCALID`` within ``CUDA_VISIBLE_DEVICES``, and
``MASTER_ADDR``/``MASTER_PORT``. Pure: fake environments, fake device counts."""

from __future__ import annotations

import json
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chameleon_ft.cli.worker_cmd import Drain, coordinator_address
from chameleon_ft.runtime import auth
from chameleon_ft.runtime.coordinator.launcher import Launcher
from chameleon_ft.runtime.placement import (
    MAX_LOCAL_INDEX,
    Place,
    device_index,
    launcher_index,
    task_places,
)


@pytest.mark.parametrize(("env", "index"), [
    ({}, None),
    ({"LOCAL_RANK": "3"}, 3),
    ({"SLURM_LOCALID": "2"}, 2),
    ({"LOCAL_RANK": "1", "SLURM_LOCALID": "5"}, 1),  # LOCAL_RANK wins
    ({"LOCAL_RANK": "", "SLURM_LOCALID": "5"}, 5),  # empty is unset
])
def test_the_launchers_index(env: dict[str, str], index: int | None) -> None:
    assert launcher_index(env) == index


@pytest.mark.parametrize("value", ["-1", "x", "1.5", str(MAX_LOCAL_INDEX)])
def test_a_malformed_index_names_its_variable(value: str) -> None:
    with pytest.raises(ValueError, match=r"^SLURM_LOCALID: expected"):
        launcher_index({"SLURM_LOCALID": value})


def test_a_tasks_workers_take_consecutive_indices() -> None:
    assert task_places(None, 2) == [None, None]  # the coordinator's admission order decides
    assert task_places(0, 1) == [0]
    assert task_places(3, 1) == [3]
    assert task_places(1, 2) == [2, 3]


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_one_gpu_per_task_is_cuda0_whatever_the_index(backend: str) -> None:
    # srun --ntasks-per-node=4 --gpus-per-task=1: each task sees one GPU (device_count 1)
    for local_rank in range(4):
        assert device_index(Place(local_rank), 1, backend) == 0


def test_the_hosts_gpus_go_by_node_local_index() -> None:
    # torchrun or a pod with every GPU visible: LOCAL_RANK r computes on GPU r
    for local_rank in range(8):
        assert device_index(Place(local_rank), 8, "nccl") == local_rank
    # one task running 4 workers on a host of 8 GPUs, started second (index 1)
    places = [Place(i, k, 4) for k, i in enumerate(task_places(1, 4)) if i is not None]
    assert [device_index(p, 8, "nccl") for p in places] == [4, 5, 6, 7]


def test_a_task_that_sees_its_own_gpus_uses_them_in_order() -> None:
    # --gpus-per-task=2, two workers per task, the second task of the node (indices 2, 3)
    assert [device_index(Place(2 + k, k, 2), 2, "nccl") for k in range(2)] == [0, 1]


def test_more_workers_than_gpus_share_under_gloo_and_are_refused_under_nccl() -> None:
    assert device_index(Place(5), 4, "gloo") == 1
    with pytest.raises(ValueError, match=r"^train\.backend: nccl .* node-local index 5"):
        device_index(Place(5), 4, "nccl")
    with pytest.raises(ValueError, match=r"^train\.device: cuda, but .* CUDA_VISIBLE_DEVICES"):
        device_index(Place(0), 0, "gloo")


@given(st.integers(0, 63), st.integers(1, 8), st.integers(1, 8))
def test_under_nccl_the_workers_of_a_host_never_share_a_gpu(first: int, num_workers: int,
                                                            num_visible: int) -> None:
    # one task per host running num_workers workers: distinct GPUs or a refusal, never a
    # silent double booking (NCCL cannot put two ranks of a group on one device)
    places = [Place(first + k, k, num_workers) for k in range(num_workers)]
    try:
        got = [device_index(p, num_visible, "nccl") for p in places]
    except ValueError:
        assert num_workers != num_visible and first + num_workers > num_visible
        return
    assert len(set(got)) == num_workers and all(0 <= g < num_visible for g in got)


def test_a_place_is_checked() -> None:
    with pytest.raises(ValueError, match="task index"):
        Place(0, task_index=2, task_workers=2)
    with pytest.raises(ValueError, match="local index"):
        Place(-1)


# ---------------------------------------------------------------------- the coordinator
def test_admission_honours_the_launchers_index_and_fills_gaps_without_one() -> None:
    launcher = Launcher("127.0.0.1", 1, b"k")
    assert launcher.admitted(4, "node-b", "inc-4", alive=[], wanted=3) == 3
    # no index from the launcher: the lowest one no live worker of that host holds
    assert launcher.admitted(5, "node-b", "inc-5", alive=[4]) == 0
    assert launcher.admitted(6, "node-b", "inc-6", alive=[4, 5]) == 1
    assert launcher.admitted(7, "node-c", "inc-7", alive=[4, 5, 6]) == 0  # another host
    assert launcher.admitted(8, "node-b", "inc-8", alive=[4, 5, 6, 7]) == 2
    # a dead worker's index is free again (8 died: its replacement takes index 2)
    assert launcher.admitted(9, "node-b", "inc-9", alive=[4, 5, 6, 7]) == 2


def test_a_join_request_carries_a_bounded_index() -> None:
    base = auth.JoinRequest(wnonce="n", proof="p", job="", host="h", address="a")
    assert auth.JoinRequest.from_json(base.to_json()).local_index is None
    with_index = auth.JoinRequest(wnonce="n", proof="p", job="", host="h", address="a",
                                  local_index=3)
    assert auth.JoinRequest.from_json(with_index.to_json()).local_index == 3
    doc = json.loads(base.to_json())
    old = {k: v for k, v in doc.items() if k != "local_index"}  # an older worker's request
    assert auth.JoinRequest.from_json(json.dumps(old)).local_index is None
    for bad in (-1, MAX_LOCAL_INDEX, "3", 2.0, True):
        with pytest.raises(ValueError, match="malformed"):
            auth.JoinRequest.from_json(json.dumps(doc | {"local_index": bad}))


# ---------------------------------------------------------------------- chameleon worker
@pytest.mark.parametrize(("flag", "env", "address"), [
    ("a:1", {"CHAMELEON_COORDINATOR": "b:2", "MASTER_ADDR": "c", "MASTER_PORT": "3"},
     ("a", 1)),
    (None, {"CHAMELEON_COORDINATOR": "b:2", "MASTER_ADDR": "c", "MASTER_PORT": "3"},
     ("b", 2)),
    (None, {"MASTER_ADDR": "coordinator.default.svc", "MASTER_PORT": "29500"},
     ("coordinator.default.svc", 29500)),
    (None, {"MASTER_ADDR": "[fd00::1]", "MASTER_PORT": "29500"}, ("fd00::1", 29500)),
])
def test_the_coordinator_comes_from_flag_then_chameleon_then_master(
        flag: str | None, env: dict[str, str], address: tuple[str, int]) -> None:
    assert coordinator_address(flag, env) == address


@pytest.mark.parametrize(("env", "message"), [
    ({}, "--coordinator: give HOST:PORT .* MASTER_ADDR and MASTER_PORT"),
    ({"MASTER_ADDR": "c"}, "MASTER_PORT is not set"),
    ({"MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
    ({"MASTER_ADDR": "c", "MASTER_PORT": "x"}, "^MASTER_ADDR/MASTER_PORT: expected"),
])
def test_a_missing_or_bad_coordinator_is_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        coordinator_address(None, env)


def test_a_drain_waits_for_its_grace_or_a_second_signal(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    now = [100.0]
    monkeypatch.setattr("chameleon_ft.cli.worker_cmd.time.monotonic", lambda: now[0])
    drain = Drain(timeout_s=30.0)
    assert not drain.over() and drain.status == 0
    drain.handler(signal.SIGTERM, None)
    assert drain.signal == "SIGTERM" and drain.status == 143 and not drain.over()
    now[0] += 29.0
    assert not drain.over()
    now[0] += 2.0
    assert drain.over()
    again = Drain(timeout_s=30.0)
    again.handler(signal.SIGINT, None)
    again.handler(signal.SIGTERM, None)
    assert again.over() and again.signal == "SIGINT" and again.status == 130
