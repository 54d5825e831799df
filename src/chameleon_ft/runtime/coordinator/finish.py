"""The end of a run as the coordinator does it: ``params.pt`` and the model's own format
exported from the final state by a process of its own (the coordinator never holds the
model), and the report; or, when training could not go on, the reason.

Where the final state is was decided by the control plane
(:class:`~chameleon_ft.runtime.control.messages.FinalDone`): the final checkpoint in the
checkpoint folder, or the copy the final holders uploaded into the run folder when the
checkpoint folder refused it. Whatever fails here is said in one line and the report is
written if the run folder takes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.coordinator.bulk import FALLBACK_FOLDER
from chameleon_ft.runtime.coordinator.launcher import ChildError, run_in_child
from chameleon_ft.runtime.report.records import Event
from chameleon_ft.runtime.storage.checkpoint import step_dir_name
from chameleon_ft.runtime.storage.export import export_workload

if TYPE_CHECKING:
    from chameleon_ft.runtime.coordinator.shell import Coordinator


def _base_report(coord: Coordinator, stop: m.Stop, *, live: bool = True) -> dict[str, Any]:
    """The report's common part (``live`` False: nothing is read from the store, which a
    stuck loop may hold)."""
    job = coord.job
    steps = coord.report.ordered_steps()
    report: dict[str, Any] = {
        "steps": [{"step": r.step, "loss": r.loss, "step_s": r.step_s, "gen": r.gen}
                  for r in steps],
        "loss": [r.loss for r in steps],
        "step_s": [r.step_s for r in steps],
        "rejoins": list(coord.report.rejoins),
        "refused": list(coord.report.refused),
        "refused_total": coord.report.refused_total,
        "forgeries": _forgeries(coord) if live else {"coordinator": coord.cs.refusals.counts()},
        "faults": _faults(coord) if live else [{"fault": f.to_text()} for f in coord.faults],
        "initial_plan": job.plan0.to_dict(),
        "final_plan": coord.state.plan.to_dict(),
        "dtype": coord.train.dtype,
        "num_workers": coord.config.num_workers,
        "spare_workers": coord.config.num_spare_workers,
        "total_s": coord.now(),
        "run_dir": str(job.out_dir),
        "resumed_from_step": None if job.resumed_from is None or coord.report.reattached
        else job.resumed_from.step,
        "coordinator_term": job.term,
        "reattached": list(coord.report.reattached),
        "committed_steps": stop.step,
        "interrupted": stop.reason if stop.interrupted else None,
        "failed": stop.reason if stop.failed else None,
        "checkpoints": _steps_on_disk(coord),
        "final_state": _final_folder(coord),
        "dropped_checkpoints": list(coord.report.dropped),
        "checkpoint_writes": list(coord.report.checkpoint_writes),
        "corrupt_checkpoints": list(coord.report.corrupt),
    }
    if job.trace is not None:
        report.update(job.trace.report([r.committed_at_s for r in steps],
                                       coord.config.job.global_batch))
    return report


def _final_folder(coord: Coordinator) -> str | None:
    """The run folder's subfolder that holds the final state (None: none does)."""
    final = coord.final
    if final is None or final.folder is None:
        return None
    return coord.job.ckpt.root.name if final.folder == "checkpoints" else FALLBACK_FOLDER


def _faults(coord: Coordinator) -> list[dict[str, Any]]:
    try:
        return coord.fault_report()
    except Exception:  # the store is gone (the coordinator failed on it)
        return [{"fault": f.to_text(), "fired": None} for f in coord.faults]


def _forgeries(coord: Coordinator) -> dict[str, Any]:
    try:
        return coord.cs.forgeries()
    except Exception:  # the store is gone: the workers' counts cannot be read
        mine = coord.cs.refusals.counts()
        return {"coordinator": mine, "workers": {}, "total": mine}


def _steps_on_disk(coord: Coordinator) -> list[int]:
    try:
        return coord.job.ckpt.steps()
    except OSError:
        return []


def _write_report(coord: Coordinator, report: dict[str, Any]) -> str | None:
    """Write the report; returns why it could not be (None: written)."""
    try:
        coord.report.write(report)
    except OSError as exc:
        why = f"report.json not written ({exc.strerror or exc})"
        coord.log(why)
        return why
    return None


def stuck_report(coord: Coordinator, reason: str, stuck: dict[str, Any]) -> None:
    """The coordinator's loop is stuck (its watchdog's view, from another thread): the
    report says why and where, from what this process holds (no store read, no child).

    Raises:
        OSError: when the run folder refuses it.
    """
    run = coord.ctl.run
    stop = m.Stop(gen=run.gen, step=run.next_step, final={}, reason=reason, failed=True)
    _settle_events(coord)
    coord.report.write(_base_report(coord, stop, live=False) | {"param_hash": None,
                                                                 "stuck": stuck}, files=False)


def _failed(coord: Coordinator, stop: m.Stop) -> dict[str, Any]:
    """Training could not go on: every worker was told to stop; wait (at most the hang
    deadline) for them to leave (the rest are killed), write the report with the reason,
    raise."""
    from chameleon_ft.runtime.coordinator.shell import WorkerFailure

    coord.launcher.join(sorted(coord.launcher.procs), coord.job.hang_s)
    coord.launcher.kill(sorted(coord.launcher.procs))
    coord.log(f"training stopped: {stop.reason}")
    _settle_events(coord)
    _write_report(coord, _base_report(coord, stop) | {"param_hash": None})
    if stop.bad_input:
        raise ValueError(stop.reason)
    raise WorkerFailure(stop.reason)


def _settle_events(coord: Coordinator) -> None:
    for event in coord.report.events:  # an event whose recovery never committed a step
        if event.resumed_at_s is None and not event.idle and not event.strategy:
            event.strategy = "none"


def finish(coord: Coordinator) -> dict[str, Any]:
    """Export the final state and write the report (or, for a failed run, the reason).

    Raises:
        WorkerFailure: when training failed, or its final state could not be written
            anywhere (``report.json`` says why when the run folder takes it).
        ValueError: when the job could not start as given.
    """
    from chameleon_ft.runtime.coordinator.shell import WorkerFailure

    stop = coord.stopped
    assert stop is not None, "the run ended without a stop"
    if stop.failed:
        return _failed(coord, stop)
    _settle_events(coord)
    _wait_exits(coord)
    coord.bulk.sweep()  # a dropped checkpoint a late writer re-created leaves no files
    final = coord.final
    if final is None or final.folder is None:
        reason = final.reason if final is not None else (coord.crash or "no final state")
        return _failed(coord, m.Stop(stop.gen, stop.step, {}, reason=reason, failed=True))
    job = coord.job
    root = job.ckpt.root if final.folder == "checkpoints" else job.out_dir / FALLBACK_FOLDER
    digest, exported = _export(coord, root / step_dir_name(stop.step))
    if exported:
        coord.log(f"model exported in its own format under {job.out_dir}")
    report = _base_report(coord, stop) | {"param_hash": digest}
    if digest is None:
        report["failed"] = "params.pt not written: see the line above"
    unwritten = _write_report(coord, report)
    if digest is None:
        raise WorkerFailure(report["failed"])
    if unwritten is not None:
        raise WorkerFailure(f"trained, params.pt written, but {unwritten}")
    if final.folder != "checkpoints":
        coord.log(f"warning: the final checkpoint is not in {job.ckpt.root} (it refused it); "
                  f"the final state is in {root}, params.pt was written from it")
    return report


def _export(coord: Coordinator, folder: Any) -> tuple[str | None, bool]:
    """``params.pt`` and the model's own format, from the final state, by a child process
    (its memory, not the coordinator's, holds the parameters)."""
    try:
        digest, exported = run_in_child(
            export_workload,
            (Path(folder), coord.job.workload, Path(coord.job.out_dir), coord.train.dtype),
            limit_s=60.0 + 4 * coord.job.checkpoint_deadline_s(), name="chameleon-export")
    except ChildError as exc:
        coord.log(f"params.pt not written: {exc}")
        return None, False
    return str(digest), bool(exported)


def _wait_exits(coord: Coordinator) -> None:
    """Workers exit once the final checkpoint is over; a death after the last commit is
    reported."""
    alive = sorted(coord.state.alive)
    coord.launcher.join(alive, max(5.0, 2 * coord.job.hang_s))
    for w, code in sorted(coord.launcher.exits().items()):
        if w not in alive or code == 0 or coord.launcher.adopted(w):
            continue  # an adopted process's status is not this coordinator's to read
        now = coord.now()
        fault_at = coord.book.fault_time(coord.cs, [w], now)
        coord.report.failed(Event(
            workers=[w], cause=f"w{w}: exit (status {code}) after the last step committed",
            gen=coord.state.gen, step=coord.state.next_step, fault_at_s=fault_at,
            detected_at_s=now, detected_after_s=None if fault_at is None else now - fault_at,
            strategy="none", reason="training had finished; its replicas supplied the "
            "final parameters"))
        coord.log(f"worker {w} died after the last step; its replicas supplied the final "
                  "parameters")
