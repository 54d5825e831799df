"""``chameleon worker``: join a running ``chameleon train`` from another host.

The worker proves it belongs to the job (the job token, never sent: an HMAC over the
coordinator's nonce and its own), the coordinator hands it a worker id, and only then does
a worker process start. A wrong token, another job on that port, or a job that already has
all its workers is refused with one line and exit status 2. Workers then talk to each
other directly over TCP (gloo), and to the coordinator through its store and its bulk
channel. torch is imported only inside :func:`run`.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

from chameleon_ft.runtime import auth

if TYPE_CHECKING:
    import torch.distributed as dist

    from chameleon_ft.runtime.protocol import JobInfo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chameleon worker``."""
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="the store address `chameleon train` printed "
                             f"(default: ${auth.COORDINATOR_ENV})")
    parser.add_argument("--token", metavar="TOKEN",
                        help=f"the job token `chameleon train` printed (default: "
                             f"${auth.TOKEN_ENV})")
    parser.add_argument("--job", metavar="NAME",
                        help="refuse to join unless the coordinator runs this job "
                             f"(default: ${auth.JOB_ENV}, or any job)")
    parser.add_argument("--num-workers", type=int, default=1, metavar="N",
                        help="worker processes to start on this host (default 1)")
    parser.add_argument("--advertise-address", "--address", dest="address", metavar="ADDR",
                        help="address other workers reach this host at (default: the "
                             "interface that reaches the coordinator; never loopback)")
    parser.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                        help="seconds to wait for the coordinator to answer (default 10)")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port).

    Raises:
        ValueError: for a malformed address.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _join(store: dist.TCPStore, job: JobInfo, token: str, wanted_job: str, address: str,
          timeout_s: float) -> auth.JoinReply:
    """Ask the coordinator for a worker id.

    Raises:
        ValueError: when the coordinator refuses or does not answer.
    """
    import torch.distributed as dist

    from chameleon_ft.runtime import protocol as proto

    wnonce = auth.new_nonce()
    request = auth.JoinRequest(
        wnonce=wnonce, proof=auth.join_proof(token, job.job_id, job.nonce, wnonce),
        job=wanted_job, host=socket.gethostname(), address=address)
    index = store.add(proto.JOIN_SLOTS_KEY, 1) - 1
    store.set(proto.join_request_key(index), request.to_json())
    key = proto.join_reply_key(wnonce)
    deadline = time.monotonic() + timeout_s
    reply = None
    while reply is None:
        try:  # short polls: a long server-side wait is at the mercy of one connection
            if store.check([key]):
                reply = auth.JoinReply.from_json(store.get(key))
                break
        except (dist.DistError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"--coordinator: no answer to the join request within "
                             f"{timeout_s:g} s")
        time.sleep(0.05)
    with contextlib.suppress(Exception):
        store.delete_key(key)
    if not reply.ok:
        raise ValueError(f"refused by the coordinator: {reply.reason}")
    return reply


def run(args: argparse.Namespace) -> int:
    """Join the run; returns 0 when every worker of this host finished cleanly.

    Raises:
        ValueError: for a missing or malformed address or token, a silent coordinator, or
            a refusal (wrong token, another job, a full job).
    """
    text = args.coordinator or os.environ.get(auth.COORDINATOR_ENV)
    if not text:
        raise ValueError(f"--coordinator: give HOST:PORT (or set {auth.COORDINATOR_ENV})")
    host, port = parse_address(text)
    token = auth.resolve_token(args.token)
    if token is None:
        raise ValueError(f"--token: the job's token is required (`chameleon train` printed "
                         f"it; or set {auth.TOKEN_ENV})")
    if args.num_workers < 1:
        raise ValueError(f"--num-workers: must be >= 1, got {args.num_workers}")
    try:
        with socket.create_connection((host, port), timeout=args.connect_timeout):
            pass
    except OSError as exc:
        raise ValueError(f"--coordinator: {host}:{port} does not answer ({exc.strerror or exc}); "
                         "is `chameleon train` running there?") from None
    address = auth.advertise_address(host, port, args.address)
    wanted_job = args.job or os.environ.get(auth.JOB_ENV, "")

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from datetime import timedelta

    import torch.distributed as dist

    from chameleon_ft.runtime import protocol as proto
    from chameleon_ft.runtime.coordinator.launcher import forkserver_context
    from chameleon_ft.runtime.protocol import JobInfo
    from chameleon_ft.runtime.worker.main import worker_main

    try:
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=timedelta(seconds=args.connect_timeout))
        job = JobInfo.from_json(store.get(proto.JOB_KEY))
    except (dist.DistStoreError, RuntimeError, ValueError):
        raise ValueError(f"--coordinator: {host}:{port} is not a chameleon coordinator of "
                         "this version") from None
    if wanted_job and wanted_job != job.job_name:
        raise ValueError(f"refused: {host}:{port} runs job {job.job_name!r}, not "
                         f"{wanted_job!r}")
    ctx = forkserver_context()
    secret = auth.secret_of(token)
    procs = []
    try:
        for _ in range(args.num_workers):
            reply = _join(store, job, token, wanted_job, address, args.connect_timeout)
            proc = ctx.Process(target=worker_main,
                               args=(reply.worker, host, port, address, reply.incarnation,
                                     secret, reply.replacement, reply.local_index),
                               name=f"chameleon-worker-{reply.worker}")
            proc.start()
            procs.append((reply.worker, proc))
            print(f"worker {reply.worker} started (pid {proc.pid}), reachable at {address}"
                  + (" (replacement)" if reply.replacement else ""), flush=True)
        # The workers leave by themselves when the coordinator goes (their heartbeat is a
        # watchdog); this process only waits for them, within bounds.
        sentinels = [proc.sentinel for _, proc in procs]
        silent_since: float | None = None
        while any(proc.exitcode is None for _, proc in procs):
            multiprocessing.connection.wait(sentinels, timeout=1.0)
            try:
                store.add(proto.JOIN_SLOTS_KEY, 0)
                silent_since = None
            except Exception:
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since > 2 * job.hang_timeout_s + 1:
                    print("the coordinator is gone; stopping this host's workers",
                          file=sys.stderr, flush=True)
                    break
    finally:
        for _, proc in procs:
            if proc.exitcode is None and proc.pid is not None:
                proc.join(job.hang_timeout_s + 1)
            if proc.exitcode is None and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join(5.0)
    codes = [proc.exitcode for _, proc in procs]
    for worker_id, proc in procs:
        print(f"worker {worker_id} exited with status {proc.exitcode}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1
