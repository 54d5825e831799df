"""The end of a run: the final checkpoint written by the workers that hold the final
state, ``params.pt`` and the model's own format exported from it by a process of its own
(the coordinator never holds the model), and the report; or, when training could not go
on, the reason."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.coordinator.launcher import ChildError, run_in_child
from chameleon_ft.runtime.report.records import Event
from chameleon_ft.runtime.storage.checkpoint import step_dir_name, writer_of
from chameleon_ft.runtime.storage.export import export_workload

if TYPE_CHECKING:
    from chameleon_ft.runtime.coordinator.shell import Coordinator


def _base_report(coord: Coordinator, stop: m.Stop) -> dict[str, Any]:
    job = coord.job
    steps = coord.report.ordered_steps()
    report: dict[str, Any] = {
        "steps": [{"step": r.step, "loss": r.loss, "step_s": r.step_s, "gen": r.gen}
                  for r in steps],
        "loss": [r.loss for r in steps],
        "step_s": [r.step_s for r in steps],
        "rejoins": coord.report.rejoins,
        "refused": coord.report.refused,
        "refused_total": coord.report.refused_total,
        "forgeries": coord.cs.forgeries(),
        "faults": coord.fault_report(),
        "initial_plan": job.plan0.to_dict(),
        "final_plan": coord.state.plan.to_dict(),
        "dtype": coord.train.dtype,
        "num_workers": coord.config.num_workers,
        "spare_workers": coord.config.num_spare_workers,
        "total_s": coord.now(),
        "run_dir": str(job.out_dir),
        "resumed_from_step": None if job.resumed_from is None else job.resumed_from.step,
        "committed_steps": stop.step,
        "interrupted": stop.reason if stop.interrupted else None,
        "failed": stop.reason if stop.failed else None,
        "checkpoints": job.ckpt.steps(),
        "dropped_checkpoints": coord.report.dropped,
        "checkpoint_writes": coord.report.checkpoint_writes,
        "corrupt_checkpoints": coord.report.corrupt,
    }
    if job.trace is not None:
        report.update(job.trace.report([r.committed_at_s for r in steps],
                                       coord.config.job.global_batch))
    return report


def _failed(coord: Coordinator, stop: m.Stop) -> dict[str, Any]:
    """Training could not go on: every worker was told to stop; wait (at most the hang
    deadline) for them to leave, write the report with the reason, raise."""
    from chameleon_ft.runtime.coordinator.shell import WorkerFailure

    coord.launcher.join(sorted(coord.launcher.procs), coord.job.hang_s)
    coord.log(f"training stopped: {stop.reason}")
    _settle_events(coord)
    coord.report.write(_base_report(coord, stop) | {"param_hash": None})
    if stop.bad_input:
        raise ValueError(stop.reason)
    raise WorkerFailure(stop.reason)


def _settle_events(coord: Coordinator) -> None:
    for event in coord.report.events:  # an event whose recovery never committed a step
        if event.resumed_at_s is None and not event.idle and not event.strategy:
            event.strategy = "none"


def finish(coord: Coordinator, stop: m.Stop) -> dict[str, Any]:
    """Write the final state and the report (or, for a failed run, the reason)."""
    from chameleon_ft.runtime.coordinator.shell import WorkerFailure

    if stop.failed:
        return _failed(coord, stop)
    _settle_events(coord)
    try:
        _final_checkpoint(coord, stop)
    finally:
        coord.cs.final_done(stop.gen)  # the workers leave, whatever happened
    _wait_exits(coord)
    job = coord.job
    digest, exported = _export(coord, job.ckpt.root / step_dir_name(stop.step))
    if exported:
        coord.log(f"model exported in its own format under {job.out_dir}")
    if digest is None:
        raise WorkerFailure("params.pt not written: see the line above")
    return coord.report.write(_base_report(coord, stop) | {"param_hash": digest})


def _final_checkpoint(coord: Coordinator, stop: m.Stop) -> None:
    """Wait (by the checkpoint's bytes) until the final step has a complete checkpoint:
    one written in the background, or the one the stop directive asked for. A layer
    whose writer is gone is asked of its next holder.

    Raises:
        WorkerFailure: when no holder of some layer is left, or the time is up.
    """
    from chameleon_ft.runtime.coordinator.shell import WorkerFailure

    job = coord.job
    deadline = time.monotonic() + 2 * job.checkpoint_deadline_s()
    asked: dict[int, set[int]] = {}
    """Per worker: every layer asked of it so far (each ask repeats the earlier ones: a
    worker that reads only the latest still writes them all)."""
    tried: dict[int, set[int]] = {}
    retried = False
    while stop.step not in job.ckpt.steps():
        coord.poll_checkpoints()
        if stop.step in job.ckpt.steps():
            return
        entry = coord.bulk.get(stop.step, stop.gen)
        if entry is None and not coord.bulk.is_pending(stop.step):
            if retried:
                raise WorkerFailure(f"the final checkpoint after {stop.step} steps could not "
                                    f"be written: {coord.report.dropped[-1]['reason']}"
                                    if coord.report.dropped else "no final checkpoint")
            # the one being written in the background was dropped: the holders write it
            retried = True
            coord.bulk.expect(stop.step, stop.gen, coord.now() + job.checkpoint_deadline_s())
            for worker, layers in _primaries(stop).items():
                _ask(coord, stop, asked, worker, layers)
            continue
        if entry is not None:
            _ask_more(coord, stop, set(entry.layers), asked, tried)
        if time.monotonic() > deadline:
            raise WorkerFailure(f"the final checkpoint after {stop.step} steps was not "
                                "written in time")
        time.sleep(0.005)


def _primaries(stop: m.Stop) -> dict[int, list[int]]:
    """Each final holder's share of the final checkpoint (replicas take turns by layer)."""
    out: dict[int, list[int]] = {}
    for layer, holders in stop.final.items():
        if holders:
            out.setdefault(writer_of(holders, layer), []).append(layer)
    return out


def _ask(coord: Coordinator, stop: m.Stop, asked: dict[int, set[int]], worker: int,
         layers: list[int]) -> None:
    asked.setdefault(worker, set()).update(layers)
    coord.cs.final_more(stop.gen, worker, sorted(asked[worker]))


def _ask_more(coord: Coordinator, stop: m.Stop, have: set[int], asked: dict[int, set[int]],
              tried: dict[int, set[int]]) -> None:
    """Layers whose writer exited go to their next live holder (once per holder).

    Raises:
        WorkerFailure: when every holder of a missing layer is gone.
    """
    from chameleon_ft.runtime.coordinator.shell import WorkerFailure

    gone = coord.launcher.gone
    for layer, holders in stop.final.items():
        if layer in have or not holders:
            continue
        first = writer_of(holders, layer)
        if not gone(first):
            continue
        seen = tried.setdefault(layer, {first})
        if all(gone(w) for w in holders):
            raise WorkerFailure(f"layer {layer}: every holder of its final state is gone "
                                f"(holders {list(holders)})")
        live = [w for w in holders if w not in seen and not gone(w)]
        if live:
            seen.add(live[0])
            _ask(coord, stop, asked, live[0], [layer])


def _export(coord: Coordinator, folder: Any) -> tuple[str | None, bool]:
    """``params.pt`` and the model's own format, from the final checkpoint, by a child
    process (its memory, not the coordinator's, holds the parameters)."""
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
    """Workers exit once the final checkpoint is complete; a death after the last commit
    is reported."""
    alive = sorted(coord.state.alive)
    coord.launcher.join(alive, max(5.0, 2 * coord.job.hang_s))
    for w, code in sorted(coord.launcher.exits().items()):
        if w not in alive or code == 0:
            continue
        now = coord.now()
        fault_at = coord.book.fault_time(coord.cs, [w], now)
        coord.report.events.append(Event(
            workers=[w], cause=f"w{w}: exit (status {code}) after the last step committed",
            gen=coord.state.gen, step=coord.state.next_step, fault_at_s=fault_at,
            detected_at_s=now, detected_after_s=None if fault_at is None else now - fault_at,
            strategy="none", reason="training had finished; its replicas supplied the "
            "final parameters"))
        coord.log(f"worker {w} died after the last step; its replicas supplied the final "
                  "parameters")

