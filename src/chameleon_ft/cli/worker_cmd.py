"""``chameleon worker``: join a running ``chameleon train`` from another host.

The worker proves it belongs to the job (the job token, never sent: an HMAC over the
coordinator's nonce and its own), the coordinator hands it a worker id, and only then does
a worker process start. A wrong token, another job on that port, or a job that already has
all its workers is refused with one line and exit status 2. Workers then talk to each
other directly over TCP (gloo), and to the coordinator through its store and its bulk
channel. torch is imported only inside :func:`run`.

It follows the cluster's launchers: the coordinator from ``MASTER_ADDR``/``MASTER_PORT``
when neither ``--coordinator`` nor ``CHAMELEON_COORDINATOR`` is given, each worker's GPU
from the task's ``LOCAL_RANK`` or ``SLURM_LOCALID`` within ``CUDA_VISIBLE_DEVICES``
(``runtime.placement``). SIGTERM or SIGINT drains: no more joins, and the workers, which
ignore both, leave when the coordinator stops the run (after the final checkpoint), or
are killed here once ``--drain-timeout`` has passed; nothing is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from chameleon_ft import logs
from chameleon_ft.runtime import auth, placement

if TYPE_CHECKING:
    import torch.distributed as dist

    from chameleon_ft.runtime.protocol import JobInfo

_log = logging.getLogger(__name__)

MASTER_ADDR_ENV, MASTER_PORT_ENV = "MASTER_ADDR", "MASTER_PORT"
"""Where ``torch.distributed`` launchers (``torchrun``, Slurm and Kubernetes recipes) put
the rendezvous address: the coordinator's, when nothing more specific is given."""
POLL_S = 0.5
"""How often the wait for this host's workers looks at signals and the coordinator."""
CONNECT_RETRY_S = 0.5
"""Pause between attempts to reach a coordinator that does not answer yet."""
DRAIN_TIMEOUT_S = 30.0
"""Default grace after SIGTERM (Slurm's ``KillWait`` default, as ``[train]
drain_timeout_s``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chameleon worker``."""
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="the store address `chameleon train` printed "
                             f"(default: ${auth.COORDINATOR_ENV}, else "
                             "$MASTER_ADDR:$MASTER_PORT)")
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
                        help="seconds to wait for the coordinator to answer, trying again "
                             "meanwhile (default 10)")
    parser.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                        help="after SIGTERM or SIGINT, how long the workers may wait for the "
                             "coordinator to stop the run (it writes the final checkpoint "
                             "with them) before they are stopped here; give the scheduler's "
                             f"grace, as [train] drain_timeout_s (default {DRAIN_TIMEOUT_S:g})")


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
          timeout_s: float, local_index: int | None = None) -> auth.JoinReply:
    """Ask the coordinator for a worker id (and, without ``local_index`` from this task's
    launcher, for a node-local index).

    Raises:
        ValueError: when the coordinator refuses or does not answer.
    """
    from chameleon_ft.runtime import protocol as proto
    from chameleon_ft.runtime.signing import SignedStore, Signer, control_key

    signed = SignedStore(store, Signer(control_key(auth.secret_of(token)), job.job_id,
                                       job.term))
    nonce = signed.raw_peek(proto.JOIN_NONCE_KEY)  # unsealed here: a forged one only fails
    request = auth.JoinRequest(
        wnonce=auth.new_nonce(), proof="", job=wanted_job, host=socket.gethostname(),
        address=address, local_index=local_index).proved(
            token, job.job_id, job.nonce if nonce is None else _payload(nonce))
    index = store.add(proto.JOIN_SLOTS_KEY, 1) - 1
    store.set(proto.join_request_key(index), request.to_json())
    key = proto.join_reply_key(request.wnonce)
    deadline = time.monotonic() + timeout_s
    try:
        reply = _await_reply(signed, key, deadline, timeout_s)
    finally:
        with contextlib.suppress(Exception):
            store.delete_key(key)
    if not reply.ok:
        raise ValueError(f"refused by the coordinator: {reply.reason}")
    return reply


def _payload(raw: bytes) -> str:
    from chameleon_ft.runtime.signing import Forged, payload_of

    try:
        return payload_of(raw).decode()
    except (Forged, UnicodeDecodeError):
        return ""


def _await_reply(signed: Any, key: str, deadline: float, timeout_s: float) -> auth.JoinReply:
    """The coordinator's reply at ``key``: an admission only with its seal (a forged one
    is waited past); a refusal whatever its seal (a joiner with a wrong token cannot check
    it, and a refusal only stops the joiner).

    Raises:
        ValueError: when no answer comes by ``deadline``.
    """
    import torch.distributed as dist

    while True:
        try:  # short polls: a long server-side wait is at the mercy of one connection
            raw = signed.raw_peek(key)
            if raw is not None:
                opened = signed.open(key, raw)
                reply = auth.JoinReply.from_json(opened.payload if opened is not None
                                                 else _payload(raw))
                if opened is not None or not reply.ok:
                    return reply
        except (dist.DistError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"--coordinator: no answer to the join request within "
                             f"{timeout_s:g} s")
        time.sleep(0.05)


def coordinator_address(flag: str | None, env: Mapping[str, str]) -> tuple[str, int]:
    """Where the coordinator listens: ``--coordinator``, else ``CHAMELEON_COORDINATOR``,
    else ``MASTER_ADDR``/``MASTER_PORT`` (what ``srun`` recipes and Kubernetes Jobs set).

    Args:
        flag: ``--coordinator`` (None when not given).
        env: the environment (``os.environ`` here at the CLI's edge).

    Raises:
        ValueError: when none is given, or for a malformed address.
    """
    text = flag or env.get(auth.COORDINATOR_ENV)
    if text:
        return parse_address(text)
    master, master_port = env.get(MASTER_ADDR_ENV, ""), env.get(MASTER_PORT_ENV, "")
    if master and master_port:
        try:
            return parse_address(f"{master}:{master_port}")
        except ValueError:
            raise ValueError(f"{MASTER_ADDR_ENV}/{MASTER_PORT_ENV}: expected a host and a "
                             f"port, got {master!r} and {master_port!r}") from None
    if master or master_port:
        missing = MASTER_PORT_ENV if master else MASTER_ADDR_ENV
        raise ValueError(f"--coordinator: {missing} is not set (give both {MASTER_ADDR_ENV} "
                         f"and {MASTER_PORT_ENV}, or --coordinator HOST:PORT)")
    raise ValueError(f"--coordinator: give HOST:PORT (or set {auth.COORDINATOR_ENV}, or "
                     f"{MASTER_ADDR_ENV} and {MASTER_PORT_ENV})")


class Drain:
    """SIGTERM/SIGINT to ``chameleon worker``: the first starts a drain (no more joins;
    the workers leave when the coordinator stops the run, within ``timeout_s``), a second
    stops waiting. The workers themselves ignore both signals (a scheduler signals every
    process of a step): they leave by the coordinator's directive, or are killed here."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.signal: str | None = None
        self.since_s: float | None = None
        self.again = False

    def handler(self, signum: int, _frame: object) -> None:
        """Record the signal (async-signal-safe: only assignments)."""
        if self.signal is not None:
            self.again = True
            return
        self.signal = signal.Signals(signum).name
        self.since_s = time.monotonic()

    def install(self) -> dict[int, Any]:
        """Handle SIGTERM and SIGINT here; returns the handlers to restore."""
        return {sig: signal.signal(sig, self.handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def over(self) -> bool:
        """Whether waiting for the workers must stop (the grace ran out, or a second
        signal came)."""
        return self.again or (self.since_s is not None
                              and time.monotonic() - self.since_s > self.timeout_s)

    @property
    def status(self) -> int:
        """The exit status after a signal (128 + its number), else 0."""
        return 0 if self.signal is None else 128 + int(getattr(signal, self.signal))


def _connect(host: str, port: int, timeout_s: float) -> tuple[dist.TCPStore, JobInfo]:
    """The coordinator's store and its job. A coordinator that does not answer yet (its
    name not resolved yet, its port not open yet: a cluster starts the tasks of a job in
    any order) is tried again until ``timeout_s`` has passed.

    Raises:
        ValueError: when nothing answers there in time, or what answers is no coordinator.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, timeout_s)):
                break
        except OSError as exc:
            if time.monotonic() + CONNECT_RETRY_S > deadline:
                raise ValueError(f"--coordinator: {host}:{port} does not answer "
                                 f"({exc.strerror or exc}); is `chameleon train` running "
                                 "there?") from None
            time.sleep(CONNECT_RETRY_S)
    from datetime import timedelta

    import torch.distributed as dist

    from chameleon_ft.runtime import protocol as proto
    from chameleon_ft.runtime.protocol import JobInfo
    from chameleon_ft.runtime.signing import payload_of

    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        # unchecked until the token is known to be right (the workers check its seal)
        return store, JobInfo.from_json(payload_of(store.get(proto.JOB_KEY)))
    except (dist.DistStoreError, RuntimeError, ValueError):
        raise ValueError(f"--coordinator: {host}:{port} is not a chameleon coordinator of "
                         "this version") from None


def run(args: argparse.Namespace) -> int:
    """Join the run; returns 0 when every worker of this host finished cleanly, 1 when one
    did not, 128 + the signal's number after SIGTERM or SIGINT.

    Raises:
        ValueError: for a missing or malformed address or token, a silent coordinator, or
            a refusal (wrong token, another job, a full job).
    """
    env = os.environ  # the CLI's edge: everything below gets values
    # its lines where they always went: progress on stdout, warnings on stderr
    logs.configure(args.log_level, sys.stdout, errors=sys.stderr)
    host, port = coordinator_address(args.coordinator, env)
    token = auth.resolve_token(args.token)
    if token is None:
        raise ValueError(f"--token: the job's token is required (`chameleon train` printed "
                         f"it; or set {auth.TOKEN_ENV})")
    if args.num_workers < 1:
        raise ValueError(f"--num-workers: must be >= 1, got {args.num_workers}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout: must be >= 0 seconds, got {args.drain_timeout:g}")
    wanted = placement.task_places(placement.launcher_index(env), args.num_workers)
    wanted_job = args.job or env.get(auth.JOB_ENV, "")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch is imported
    # the workers' server imports torch while this process connects and does (seconds)
    from chameleon_ft.runtime.coordinator.forkserver import forkserver_context

    forkserver_context()
    store, job = _connect(host, port, args.connect_timeout)
    address = auth.advertise_address(host, port, args.address)
    if wanted_job and wanted_job != job.job_name:
        raise ValueError(f"refused: {host}:{port} runs job {job.job_name!r}, not "
                         f"{wanted_job!r}")
    drain = Drain(args.drain_timeout)
    old = drain.install() if threading.current_thread() is threading.main_thread() else {}
    procs: list[tuple[int, Any]] = []
    try:
        _start(procs, store, job, token, wanted_job, address, (host, port), wanted,
               args.connect_timeout, drain)
        _wait(procs, store, job, drain)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        _reap(procs, 0.0 if drain.over() else job.hang_timeout_s + 1)
    for worker_id, proc in procs:
        _log.info("worker %d exited with status %s", worker_id, proc.exitcode)
    if drain.signal is not None:
        return drain.status
    return 0 if all(proc.exitcode == 0 for _, proc in procs) else 1


def _start(procs: list[tuple[int, Any]], store: dist.TCPStore, job: JobInfo, token: str,
           wanted_job: str, address: str, coordinator: tuple[str, int],
           wanted: list[int | None], timeout_s: float, drain: Drain) -> None:
    """Join once per worker and start its process (none after a drain began)."""
    from chameleon_ft.runtime.coordinator.launcher import forkserver_context, start_unit
    from chameleon_ft.runtime.worker.process import worker_main

    ctx = forkserver_context()
    secret = auth.secret_of(token)
    host, port = coordinator
    for k, index in enumerate(wanted):
        if drain.signal is not None:
            return
        reply = _join(store, job, token, wanted_job, address, timeout_s, index)
        place = placement.Place(reply.local_index, task_index=k, task_workers=len(wanted))
        # a worker of [job] tp = k is k processes, one per device, started as one unit
        proc = start_unit(ctx, worker_main,
                          (reply.worker, host, port, address, reply.incarnation, secret,
                           reply.replacement), place, (logs.current_level(),),
                          tp=job.tp, name=f"chameleon-worker-{reply.worker}")
        procs.append((reply.worker, proc))
        _log.info("worker %d started (pid %s), reachable at %s%s", reply.worker, proc.pid,
                  address, " (replacement)" if reply.replacement else "")


def _wait(procs: list[tuple[int, Any]], store: dist.TCPStore, job: JobInfo,
          drain: Drain) -> None:
    """Wait for this host's workers: they leave by themselves when the coordinator stops
    the run, or when it went and no other came within ``coordinator_grace_s`` (their
    heartbeat is a watchdog). Bounded by the drain's grace after a signal, and by twice
    the hang deadline plus that grace once no coordinator answers on the job's address
    (a new one, taking the run over, answers on a new connection)."""
    from chameleon_ft.runtime import protocol as proto
    from chameleon_ft.runtime.worker.link import client, refused

    sentinels = [sentinel for _, proc in procs for sentinel in proc.sentinels]
    silent_since: float | None = None
    announced = False
    while any(proc.exitcode is None for _, proc in procs):
        multiprocessing.connection.wait(sentinels, timeout=POLL_S)
        if drain.signal is not None and not announced:
            announced = True
            _log.warning("%s received: waiting up to %g s for the coordinator to stop the "
                         "run", drain.signal, drain.timeout_s)
        if drain.over():
            _log.warning("the workers did not leave within %g s of %s; stopping them",
                         drain.timeout_s, drain.signal)
            return
        try:
            store.add(proto.JOIN_SLOTS_KEY, 0)
            silent_since = None
        except Exception:
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since > 2 * job.hang_timeout_s + \
                    job.coordinator_grace_s + 1:
                _log.warning("the coordinator is gone; stopping this host's workers")
                return
            host, port = store.host, store.port
            with contextlib.suppress(Exception):  # a coordinator that took the run over
                if not refused(host, port):
                    store = client(host, port, max(job.hang_timeout_s / 2, 0.2))


def _reap(procs: list[tuple[int, Any]], patience_s: float) -> None:
    """Leave no process behind: wait ``patience_s`` in all, then SIGKILL by pid (every
    process of each worker: ``launcher.Unit``)."""
    deadline = time.monotonic() + patience_s
    for _, proc in procs:
        if proc.is_alive():
            proc.join(max(0.0, deadline - time.monotonic()))
    for _, proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
