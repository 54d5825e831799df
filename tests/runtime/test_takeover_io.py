"""A coordinator replaced under live workers, its I/O without worker processes: the run's
record (the token kept readable by its owner only), what a resume takes from it and
refuses, and a worker's tie to its coordinator against real stores (lost by silence or a
frozen progress value, found again: a later term, the same one going on, nobody)."""

from __future__ import annotations

import copy
import os
import stat
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.coordinator import record
from chameleon_ft.runtime.coordinator.setup import config_digest, prepare
from chameleon_ft.runtime.signing import SignedStore, Signer, control_key
from chameleon_ft.runtime.worker import link as link_mod
from chameleon_ft.runtime.worker.link import Link, find
from chameleon_ft.spec.config import config_from_mapping

DOC: dict[str, Any] = {
    "model": {"name": "tiny", "num_blocks": 2, "hidden_size": 32, "num_heads": 2,
              "vocab_size": 256, "seq_len": 32},
    "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
    "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
    "train": {"steps": 6, "dtype": "float64"},
}
TOKEN = "a-token-of-enough-length"


def _config(**train: Any) -> Any:
    doc = copy.deepcopy(DOC)
    doc["train"].update(train)
    return config_from_mapping(doc)


def _record(tmp_path: Path, **changes: Any) -> record.RunRecord:
    from chameleon_ft.runtime.workload.bundle import Workload

    config = _config()
    fields = {"job_id": "j" * 32, "token": TOKEN, "host": "127.0.0.1", "port": 29999,
              "term": 2, "digest": config_digest(config, Workload(config, None, None, None,
                                                                 None)), **changes}
    rec = record.RunRecord(**fields)
    record.write(tmp_path, rec)
    return rec


def test_the_record_is_its_owners_alone_and_reads_back(tmp_path: Path) -> None:
    os.umask(0o022)  # a umask that would leave a plain file readable by everyone
    rec = _record(tmp_path, boundaries=[[[2, 32], "int64"]])
    path = tmp_path / record.RECORD_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert record.read(tmp_path) == rec
    record.write(tmp_path, rec.ending())
    assert record.read(tmp_path) == rec.ending() and rec.ending().ended
    path.chmod(0o644)
    with pytest.raises(ValueError, match="others may read it"):
        record.read(tmp_path)
    assert record.read(tmp_path / "nowhere") is None


def test_a_resume_continues_the_run_and_refuses_what_its_workers_would_not_find(
        tmp_path: Path) -> None:
    rec = _record(tmp_path)
    job = prepare(_config(), out_dir=tmp_path, resume=True, check_resources=False)
    assert (job.job_id, job.term, job.token, job.port) == (rec.job_id, 3, TOKEN, 29999)
    assert job.takeover and job.resumed_from is None  # no checkpoint: its workers or none
    for kwargs, field in (({"token": "another-token-of-length"}, "--token"),
                          ({"port": 30001}, "--port"), ({"host": "0.0.0.0"}, "--host")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            prepare(_config(), out_dir=tmp_path, resume=True, check_resources=False,
                    **kwargs)
    with pytest.raises(ValueError, match="another model or numerics"):
        prepare(_config(dtype="float32"), out_dir=tmp_path, resume=True,
                check_resources=False)
    # no grace: its workers left with their coordinator; an ended run has none: only a
    # checkpoint could resume it
    with pytest.raises(ValueError, match="no complete checkpoint"):
        prepare(_config(coordinator_grace_s=0.0), out_dir=tmp_path, resume=True,
                check_resources=False)
    record.write(tmp_path, rec.ending())
    with pytest.raises(ValueError, match="no complete checkpoint"):
        prepare(_config(), out_dir=tmp_path, resume=True, check_resources=False)
    # without --resume the folder's record is not this run's
    fresh = prepare(_config(), out_dir=tmp_path, check_resources=False)
    assert fresh.job_id != rec.job_id and fresh.term == 0 and not fresh.takeover


class FakeCoordinator:
    """A store with a job sealed for a term, and a progress value to advance."""

    def __init__(self, term: int, job_id: str = "job-1", port: int = 0) -> None:
        self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=5))
        self.port = self.store.port
        self.signer = Signer(control_key(b"s" * 32), job_id, term)
        self.signed = SignedStore(self.store, self.signer)
        job = proto.JobInfo(job_name="t", job_id=job_id, nonce="n", num_workers=1,
                            num_layers=1, dtype="float64", micro_batch=1, global_batch=1,
                            heartbeat_s=0.05, hang_timeout_s=0.4, backend="gloo",
                            data_digest="d", checkpoint_every=0, control_timeout_s=1.0,
                            blob_port=1, boundaries=[], targets_per_sample=1, workload="",
                            term=term)
        self.signed.put(proto.JOB_KEY, job.to_json())
        self.count = 0

    def advance(self) -> None:
        self.count += 1
        self.signed.put(proto.PROGRESS_KEY, "", seq=self.count)


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The process exits the tie would make, raised instead (``SystemExit``)."""
    said: list[str] = []

    def exit_now(code: int, message: str) -> None:
        said.append(message)
        raise SystemExit(code)

    monkeypatch.setattr(link_mod, "exit_now", exit_now)
    return said


def test_a_silent_or_frozen_coordinator_is_lost_and_the_grace_ends_the_process(
        exits: list[str]) -> None:
    """Time is moved by hand (the tie's clock readings set back), so nothing here depends
    on how fast a loaded host runs the test."""
    tie = Link("127.0.0.1", 1, hang_s=1.0, grace_s=5.0, term=0)
    tie.judge()
    assert not tie.lost
    tie.beat_s -= 1.5  # no heartbeat taken for the hang deadline
    tie.judge()
    assert tie.lost and "took no heartbeat" in tie.why
    assert tie.lost_at is not None and tie.lost_at <= time.monotonic() - 0.4
    tie.attached(0)
    tie.progress(7)
    tie.progress_s -= 1.5  # heartbeats taken, the loop's progress value frozen
    tie.judge()
    assert tie.lost and "made no progress" in tie.why
    tie.progress(7)  # the same value again: still frozen
    assert tie.lost
    tie.progress(8)  # it moved again: slow, not gone
    assert not tie.lost
    tie.progress_s -= 1.5
    tie.judge()
    assert tie.lost
    tie.recovering = True  # the training thread gave it up: only it decides now
    tie.progress(9)
    assert tie.lost
    tie.judge()  # within the grace
    assert not exits
    assert tie.lost_at is not None
    tie.lost_at -= 5.0
    with pytest.raises(SystemExit):
        tie.judge()
    assert "no other came within coordinator_grace_s" in exits[-1]


def test_a_later_term_is_found_the_same_one_only_once_it_goes_on(exits: list[str]) -> None:
    old = FakeCoordinator(term=1)
    tie = Link("127.0.0.1", old.port, hang_s=0.4, grace_s=3.0, term=1)
    old.advance()
    tie.progress(old.count)
    tie.lose(time.monotonic(), "frozen")
    assert link_mod._look(tie, b"s" * 32, "job-1", old.signer) is None  # no progress
    old.advance()  # it goes on: slow, not gone
    found = link_mod._look(tie, b"s" * 32, "job-1", old.signer)
    assert found is not None and found.job.term == 1
    other = FakeCoordinator(term=0, job_id="another-job")  # another job on the address
    tie2 = Link("127.0.0.1", other.port, hang_s=0.4, grace_s=3.0, term=0)
    tie2.lose(time.monotonic(), "gone")
    assert link_mod._look(tie2, b"s" * 32, "job-1", old.signer) is None
    # a coordinator of a later term that starts within the grace is found
    port = old.port
    del old
    later: list[FakeCoordinator] = []

    def start_later() -> None:  # on the same address, a little later
        time.sleep(0.3)
        later.append(FakeCoordinator(term=2, port=port))

    thread = threading.Thread(target=start_later)
    thread.start()
    try:
        found = find(tie, b"s" * 32, "job-1", Signer(control_key(b"s" * 32), "job-1", 1))
    finally:
        thread.join()
    assert found.job.term == 2 and found.signer.term == 2
    tie.attached(found.job.term)
    assert not tie.lost and tie.term == 2 and tie.epoch == 1
    # nobody: the grace ends the process
    tie.lose(time.monotonic(), "gone again")
    tie.grace_s = 0.2
    del later[:]
    with pytest.raises(SystemExit):
        find(tie, b"s" * 32, "job-1", found.signer)
    assert "gone again" in exits[-1]
