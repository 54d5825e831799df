"""A worker process's edge (docs/design.md section 4): its entry point sets up logging,
signals and, at ``[job] tp = k`` (design 4.11), the watch over the worker's other
processes, runs :class:`worker.main.Worker`, and turns how it ended into the exit status
(``worker.exits``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from chameleon_ft import logs
from chameleon_ft.runtime.placement import Place
from chameleon_ft.runtime.worker import exits, groups, tp_group
from chameleon_ft.runtime.worker.exits import EXIT_COORDINATOR_GONE, EXIT_ERROR, EXIT_OK
from chameleon_ft.runtime.worker.faults import InjectedError
from chameleon_ft.runtime.worker.main import Worker
from chameleon_ft.runtime.worker.unit import UnitBeats, UnitWatch

_log = logging.getLogger(__name__)


def worker_main(worker_id: int, host: str, port: int, address: str, incarnation: str,
                secret: bytes, replacement: bool = False, place: Place | None = None,
                log_level: int = logging.WARNING, tp_rank: int = 0,
                beats: UnitBeats | None = None) -> None:
    """Entry point of a worker process; never returns normally (exits with ``os._exit``).

    Exits 0 after the final upload, 1 on an injected or unexpected error, 3 when the
    coordinator disappeared, 4 when fenced, 5 when an NCCL abort could not finish, 6 when
    the device stopped completing its work, 7 when another process of the worker failed
    (``worker.exits``). ``os._exit`` skips the
    destructors of abandoned process groups, which could block on connections to dead
    peers or on kernels that never finish.

    ``log_level``: this process's records on stderr from that level on (the level of the
    process that started it), stamped with the worker's id. ``tp_rank`` and ``beats``: this
    process's rank in a worker of ``[job] tp > 1`` and the unit's shared heartbeat slots
    (``worker.unit``): the slot beats from the start, and an error exit marks it failed.
    """
    logs.configure(log_level, sys.stderr, worker=worker_id)  # the process's edge
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    groups.set_nccl_environment()  # before any communicator exists
    torch.set_num_threads(1)
    # Ctrl-C in a terminal (SIGINT) or a scheduler's SIGTERM reach the whole process
    # group; the coordinator drains the run and tells the workers when to stop, and a
    # worker whose coordinator is gone exits by its watchdog.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    unit = None
    if beats is not None:  # a worker of several processes (design 4.11)
        unit = UnitWatch(beats, tp_rank, torch.device("cpu"))
        unit.start()
        exits.before_exit(unit.fail)  # an early exit (fenced, coordinator gone) is seen
        tp_group.init_process(tp_rank, beats.size)
    code = EXIT_OK
    try:
        Worker(worker_id, host, port, address=address, incarnation=incarnation,
               secret=secret, replacement=replacement, place=place, tp_rank=tp_rank,
               unit=unit).run()
    except InjectedError:
        code = EXIT_ERROR
    except dist.DistError:  # the coordinator went away before the worker followed it
        code = EXIT_COORDINATOR_GONE
    except BaseException:
        _log.error("%s", traceback.format_exc().rstrip())
        code = EXIT_ERROR
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if code != EXIT_OK and unit is not None:
        unit.fail()  # the worker's other processes see it at once
    os._exit(code)
