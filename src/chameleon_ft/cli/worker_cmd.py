"""``chameleon worker``: join a running ``chameleon train`` from another host.

The coordinator hands out worker ids as workers join; workers then talk to each other
directly over TCP (gloo), and to the coordinator only through its store. torch is imported
only inside :func:`run`.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing.connection
import os
import signal
import socket


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chameleon worker``."""
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                        help="the store address `chameleon train` printed")
    parser.add_argument("--num-workers", type=int, default=1, metavar="N",
                        help="worker processes to start on this host (default 1)")
    parser.add_argument("--address", metavar="ADDR",
                        help="address other workers reach this host at (default: the "
                             "interface that reaches the coordinator)")
    parser.add_argument("--connect-timeout", type=float, default=5.0, metavar="S",
                        help="seconds to wait for the coordinator to answer (default 5)")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port).

    Raises:
        ValueError: for a malformed address.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def run(args: argparse.Namespace) -> int:
    """Join the run; returns 0 when every worker of this host finished cleanly.

    Raises:
        ValueError: for a malformed or silent coordinator address, or a full run.
    """
    host, port = parse_address(args.coordinator)
    if args.num_workers < 1:
        raise ValueError(f"--num-workers: must be >= 1, got {args.num_workers}")
    try:
        with socket.create_connection((host, port), timeout=args.connect_timeout):
            pass
    except OSError as exc:
        raise ValueError(f"--coordinator: {host}:{port} does not answer ({exc.strerror or exc}); "
                         "is `chameleon train` running there?") from None

    from datetime import timedelta

    import torch.distributed as dist

    from chameleon_ft.runtime import protocol as proto
    from chameleon_ft.runtime.coordinator import forkserver_context
    from chameleon_ft.runtime.worker import JobInfo, local_address, worker_main

    store = dist.TCPStore(host, port, is_master=False,
                          timeout=timedelta(seconds=args.connect_timeout))
    job = JobInfo.from_json(store.get(proto.JOB_KEY))
    del job  # fetched only to fail early when this is not a chameleon store
    address = args.address or local_address(host, port)
    ctx = forkserver_context()
    procs = []
    try:
        for _ in range(args.num_workers):
            worker_id = store.add(proto.NEXT_ID_KEY, 1) - 1
            proc = ctx.Process(target=worker_main, args=(worker_id, host, port, address),
                               name=f"chameleon-worker-{worker_id}")
            proc.start()
            procs.append((worker_id, proc))
            print(f"worker {worker_id} started (pid {proc.pid}), reachable at {address}",
                  flush=True)
        # Wait for the workers; if the coordinator goes away, nobody will stop them (a
        # stopped or fenced worker would wait forever): kill them.
        sentinels = [proc.sentinel for _, proc in procs]
        while any(proc.exitcode is None for _, proc in procs):
            multiprocessing.connection.wait(sentinels, timeout=1.0)
            try:
                store.add(proto.REGISTERED_KEY, 0)
            except Exception:
                print("the coordinator is gone; stopping this host's workers", flush=True)
                break
    finally:
        for _, proc in procs:
            if proc.exitcode is None and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join(5.0)
    codes = [proc.exitcode for _, proc in procs]
    for worker_id, proc in procs:
        print(f"worker {worker_id} exited with status {proc.exitcode}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1
