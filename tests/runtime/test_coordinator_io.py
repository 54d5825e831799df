"""The coordinator's and the worker's I/O edges without worker processes: the store
listens only where the job does, a verdict written just before the next generation is
still read, and the run's metrics and timings go to disk as steps commit."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.coordinator.shell import bound_store
from chameleon_ft.runtime.report.records import StepRecord
from chameleon_ft.runtime.report.run import RunReport
from chameleon_ft.runtime.signing import Signer
from chameleon_ft.runtime.worker.channel import Channel, GenerationOver, Shared


def _listening_on(port: int) -> set[str]:
    """The local addresses (hex, as the kernel writes them) listening on ``port``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                out.add(address)
    return out


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_the_store_listens_only_on_the_jobs_address() -> None:
    store = bound_store("127.0.0.1", 0, 5.0)
    assert _listening_on(store.port) == {"0100007F"}  # 127.0.0.1
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    # what a store started the plain way does: every interface
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _listening_on(plain.port) != {"0100007F"}


def test_a_port_in_use_is_one_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(OSError):
            bound_store("127.0.0.1", taken.getsockname()[1], 5.0)


class RacyStore:
    """A store whose wait times out exactly when the verdict lands and the coordinator
    publishes the next generation (the race a worker must not lose)."""

    def __init__(self, signer: Signer) -> None:
        self.signer = signer
        self.keys: dict[str, bytes] = {}
        self.waits = 0

    def wait(self, keys: list[str], timeout: Any) -> None:
        self.waits += 1
        if self.waits == 1:
            self.keys[keys[0]] = self.signer.seal(keys[0], proto.COMMIT_END)  # written meanwhile
            self.keys[proto.CURRENT_GEN_KEY] = self.signer.seal(proto.CURRENT_GEN_KEY, "6", 6)
            raise dist.DistStoreError("timeout")
        raise AssertionError("the verdict was there: no second wait")

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        assert expected == desired  # a read
        return self.keys.get(key, expected)


def test_a_verdict_written_just_before_the_next_generation_is_read() -> None:
    """A worker that saw generation 6 published after its wait timed out gave generation 5
    up, though the verdict of its step was written before: it skipped a committed step
    everyone else applied, and its stale state went into the final upload."""
    signer = Signer.private()
    store = RacyStore(signer)
    chan = Channel(store, Shared(signer, 0, "i0"))
    key = proto.verdict_key(5, 40)
    assert chan.await_value(key, 5) == proto.COMMIT_END.encode()
    late = RacyStore(signer)
    late.wait = lambda keys, timeout: (  # type: ignore[method-assign]
        late.keys.__setitem__(proto.CURRENT_GEN_KEY, signer.seal(proto.CURRENT_GEN_KEY, "6", 6)),
        (_ for _ in ()).throw(dist.DistStoreError("timeout")))
    with pytest.raises(GenerationOver):
        Channel(late, Shared(signer, 0, "i0")).await_value(key, 5)


def test_metrics_and_timings_go_to_disk_as_steps_commit(tmp_path: Path) -> None:
    report = RunReport(tmp_path, steps=10, start_step=0, tokens_per_step=64,
                       log=lambda _line: None, log_every=None, resumed=False)
    report.open()
    for step in range(3):
        report.committed(StepRecord(step, 1.0 / (step + 1), 0.5, 0, float(step), 4),
                         [{"step": step, "gen": 0, "worker": w, "f_s": [0.1]} for w in range(4)])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    assert json.loads(lines[0])["tokens_per_s"] == pytest.approx(128.0)
    assert len(report.op_times()) == 12
    assert not any(isinstance(v, list) and len(v) >= 12 for v in vars(report).values()), \
        "op timings kept in memory"
    report.rewind(1)  # a restart redoes steps 1 and 2
    report.committed(StepRecord(1, 0.7, 0.5, 1, 5.0, 4), [])
    written = report.write({})
    assert written["events"] == []
    final = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["gen"]) for m in final] == [(0, 0), (1, 1)]


def test_the_report_lists_each_worker_s_peak_memory_per_rank(tmp_path: Path) -> None:
    """Worker 0 one process (tp 1's ``rss_peak_bytes``), worker 1 two (``..._ranks``):
    the peak over the steps of each process, not of the last step."""
    report = RunReport(tmp_path, steps=10, start_step=0, tokens_per_step=64,
                       log=lambda _line: None, log_every=None, resumed=False)
    report.open()
    peaks = [(5, [7, 3]), (9, [4, 8]), (6, [2, 2])]
    for step, (alone, ranks) in enumerate(peaks):
        report.committed(StepRecord(step, 1.0, 0.5, 0, float(step), 4),
                         [{"step": step, "gen": 0, "worker": 0, "rss_peak_bytes": alone},
                          {"step": step, "gen": 0, "worker": 1, "rss_peak_bytes": 99,
                           "rss_peak_bytes_ranks": ranks}])
    assert report.write({}, files=False)["peak_memory_bytes"] == {"0": [9], "1": [7, 8]}


class _Fakes:
    """Stand-ins for the shell's handles: one of everything, nothing behind it."""

    def __init__(self, gen: int, step: int) -> None:
        self.gen, self.step = gen, step

    # bulk state
    def poll(self, store: Any, now_s: float) -> tuple[list[Any], list[Any]]:
        return [(self.step, self.gen, frozenset(range(4)))], []

    def gone(self, worker: int) -> bool:
        return False

    # processes
    def exits(self) -> dict[int, int]:
        return {3: -9}

    # the control store
    def progress(self, count: int) -> None:
        pass

    def error_reports(self, gen: int, first: int) -> tuple[Any, ...]:
        return ("malformed",)

    def beats(self, incarnations: dict[int, str]) -> dict[int, tuple[str, int]]:
        return {w: (inc, 1) for w, inc in incarnations.items()}

    def ready(self, gen: int) -> int:
        return 4

    def reduced(self, gen: int, step: int, workers: Any) -> int:
        return 4

    def registered(self, worker: int, incarnation: str) -> bool:
        return True

    # join requests
    def join_slots(self) -> int:
        return 0

    def take(self, slots: Any) -> tuple[Any, ...]:
        return ()


def test_one_poll_sees_checkpoints_and_reports_before_deaths_and_votes_before_time(
        tmp_path: Path) -> None:
    """Completed checkpoints were collected after a failure's decision (a restart rewound
    further than it had to), and unexplained errors were judged before the step's votes
    (a step every worker reduced could be aborted)."""
    from dataclasses import replace

    from chameleon_ft.runtime.control import machine
    from chameleon_ft.runtime.control import messages as m
    from chameleon_ft.runtime.control import state as st
    from chameleon_ft.runtime.control.model import initial
    from chameleon_ft.runtime.coordinator.shell import Coordinator
    from chameleon_ft.spec.config import config_from_mapping

    doc = {"model": {"name": "tiny", "num_blocks": 2, "hidden_size": 32, "num_heads": 2,
                     "vocab_size": 256, "seq_len": 32},
           "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
           "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
           "train": {"steps": 60, "dtype": "float64"}}
    coord = Coordinator(config_from_mapping(doc), out_dir=tmp_path, check_resources=False)
    coord.settings = coord._settings()
    c = initial(st.start(coord.job.plan0, range(4)), now_s=0.0, settings=coord.settings)
    c, _ = machine.step(c, m.Launched(0.0, {w: f"i{w}" for w in range(4)}, local=True,
                                      replacement=False), coord.settings)
    c, _ = machine.step(c, m.Registered(0.0, (0, 1, 2, 3)), coord.settings)
    coord.control = replace(c, ready_s=0.0)
    fakes = _Fakes(gen=0, step=0)
    coord.bulk = coord.launcher = coord.cs = coord.desk = fakes  # type: ignore[assignment]
    seen: list[str] = []
    coord.feed = lambda obs: seen.append(type(obs).__name__)  # type: ignore[method-assign]
    coord.poll(0.0)
    assert seen.index("CheckpointLayers") < seen.index("Exits")
    # a failing worker writes its report, then exits: the report comes first, so its
    # death is explained by its error (seen as "exit (status 1)" when polled late)
    assert seen.index("Errors") < seen.index("Exits")
    assert seen.index("Reduced") < seen.index("Tick")
    assert seen[-1] == "Tick"
