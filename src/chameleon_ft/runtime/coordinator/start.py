"""The run's start as the coordinator does it: its handles (the store on the job's
address, the sealed control store, the bulk channel, the launcher) and the run's record,
what every worker needs to know of the job (published in the store) and the lines that
say where it listens."""

from __future__ import annotations

import socket
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from chameleon_ft.runtime import auth
from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.coordinator import record
from chameleon_ft.runtime.coordinator.admission import JoinDesk
from chameleon_ft.runtime.coordinator.bulk import BulkState
from chameleon_ft.runtime.coordinator.forkserver import adapter_modules
from chameleon_ft.runtime.coordinator.launcher import ChildError, Launcher, run_in_child
from chameleon_ft.runtime.coordinator.store import ControlStore
from chameleon_ft.runtime.deadlines import Deadline
from chameleon_ft.runtime.protocol import message_kind
from chameleon_ft.runtime.signing import Refusals, Signer, control_key
from chameleon_ft.runtime.workload.bundle import Workload, seal_workload
from chameleon_ft.runtime.workload.models import probe_outputs, targets_per_sample
from chameleon_ft.runtime.workload.precision import torch_dtype

if TYPE_CHECKING:
    from chameleon_ft.runtime.coordinator.shell import Coordinator


def bound_store(host: str, port: int, timeout_s: float) -> Any:
    """The job's ``TCPStore``, listening on ``host`` only (a store started without a
    listening socket of its own listens on every interface, whatever address the job
    gave). The store owns the socket from then on (it closes it when it goes)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def open_run(coord: Coordinator) -> None:
    """The store on the job's address, the control store sealed for this coordinator's
    term, the bulk channel and the launcher; the run's record written with the port.

    Raises:
        ValueError: when the address is taken.
    """
    job, train = coord.job, coord.train
    try:
        coord.store = bound_store(coord.host, coord.port, train.join_timeout_s)
    except OSError as exc:
        hint = " (is the run's previous coordinator still running?)" if job.takeover else ""
        raise ValueError(f"port: the coordinator cannot listen on {coord.host}:{coord.port} "
                         f"({exc.strerror or exc}){hint}; give another --port or 0") from None
    coord.port = coord.store.port
    coord.record = record.RunRecord(job_id=job.job_id, token=job.token, host=coord.host,
                                    port=coord.port, term=job.term, digest=job.digest)
    record.write(job.out_dir, coord.record)
    coord.cs = ControlStore(
        coord.store, Signer(control_key(job.secret), job.job_id, job.term),
        Refusals(lambda line: coord.log(f"warning: {line}"), kind_of=message_kind))
    coord.bulk = BulkState(coord.host, job.secret, job.ckpt, job.num_layers,
                           timeout_s=max(train.join_timeout_s, 10 * job.hang_s),
                           deadline=Deadline(job.hang_s, train.bulk_gb_per_s),
                           tp=coord.config.job.tp)
    coord.launcher = Launcher(coord.host, coord.port, job.secret,
                              preload=adapter_modules(job.model), num_local=job.num_local,
                              tp=coord.config.job.tp)


def job_info(coord: Coordinator) -> proto.JobInfo:
    """What every worker needs to know of the job (published in the store)."""
    job, train = coord.job, coord.train
    x, y = job.data.microbatch(0, 0, coord.config.job.micro_batch)
    boundaries = job.boundaries or [[list(shape), str(out_dtype).removeprefix("torch.")]
                                    for shape, out_dtype in _boundaries(coord, x)]
    return proto.JobInfo(
        job_name=job.job_name, job_id=job.job_id, nonce=job.nonce,
        num_workers=job.num_workers, num_layers=job.num_layers, dtype=train.dtype,
        micro_batch=coord.config.job.micro_batch, global_batch=coord.config.job.global_batch,
        heartbeat_s=train.heartbeat_s, hang_timeout_s=job.hang_s, backend=coord.backend,
        data_digest=Workload.data_digest(job.data), checkpoint_every=train.checkpoint_every,
        control_timeout_s=max(train.join_timeout_s, 10 * job.hang_s),
        blob_port=coord.bulk.port, boundaries=boundaries,
        targets_per_sample=targets_per_sample(y),
        workload=seal_workload(job.workload, job.secret),
        checkpoint_dir=str(job.ckpt.root), device=coord.device,
        storage_gb_per_s=train.storage_gb_per_s, bulk_gb_per_s=train.bulk_gb_per_s,
        memory_copies=coord.config.recovery.memory_checkpoint,
        workers_per_node=coord.config.workers_per_node, tp=coord.config.job.tp,
        nccl_semantics=coord.nccl_semantics, term=job.term,
        coordinator_grace_s=train.coordinator_grace_s)


PROBE_S = 600.0
"""How long the child learning the stage boundaries' shapes may take (a model that
cannot be built on meta is built on the CPU, layer by layer)."""


def _boundaries(coord: Coordinator, x: Any) -> list[tuple[tuple[int, ...], Any]]:
    """Every layer's output shape and dtype (:func:`probe_outputs`), learnt by a child
    process: building layers, even on meta, imports much of torch (about 80 MB the
    coordinator would keep for the whole run). A model the child cannot take (it does not
    pickle) is probed here."""
    job, dtype = coord.job, torch_dtype(coord.train.dtype)
    try:
        return run_in_child(probe_outputs, (job.model, x, dtype), limit_s=PROBE_S,
                            name="chameleon-probe", preload=coord.launcher.preload)
    except ChildError:
        return probe_outputs(job.model, x, dtype)


STORE_VALUE_BYTES = 8 << 20
"""The largest value the store carries (torch's ``TCPStore``)."""


def announce(coord: Coordinator) -> None:
    """Publish the job and its faults; say where it listens.

    Raises:
        ValueError: when the objects given to ``train`` are too large to send the workers.
    """
    job = coord.job
    info = job_info(coord)
    size = len(info.to_json())
    if size > STORE_VALUE_BYTES - (64 << 10):
        raise ValueError(f"workload: the model, data and optimizer objects given to train() "
                         f"pickle to {size / 2**20:.1f} MiB; the workers receive at most "
                         f"{STORE_VALUE_BYTES >> 20} MiB through the store: give file paths or "
                         "small factories that load the data on the workers")
    coord.record = replace(coord.record, boundaries=info.boundaries)
    record.write(job.out_dir, coord.record)
    coord.cs.set_job(info)
    coord.book.publish(coord.cs)
    coord.desk = JoinDesk(coord.cs, token=job.token, job_name=job.job_name, job_id=job.job_id,
                          nonce=job.nonce)
    coord.log(f"coordinator listening on {coord.host}:{coord.port}; job {job.job_name!r}, "
              f"{job.num_local} local workers, {job.num_workers - job.num_local} to join")
    for note in job.notes:
        coord.log(note)
    if job.announce_token:
        coord.log(f"job token: {job.token}  (give it to remote workers: --token or "
                  f"{auth.TOKEN_ENV})")
    resuming = None if job.resumed_from is None else \
        f"resuming from {job.resumed_from.folder} ({job.resumed_from.step} steps)"
    if job.takeover:
        coord.log(f"taking the run over (coordinator term {job.term}): waiting up to "
                  f"{coord.settings.reattach_s:g} s for its workers to report"
                  + (f", else {resuming}" if resuming else ""))
    elif resuming is not None:
        coord.log(resuming)
