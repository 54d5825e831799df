"""The end of a run: the final state gathered and written (checkpoint, ``params.pt``, the
model's own format), the report, or, when training could not go on, the reason."""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, Any

import torch

from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.coordinator.bulk import FinalStateMissing
from chameleon_ft.runtime.report.records import Event
from chameleon_ft.runtime.storage.checkpoint import write_atomic
from chameleon_ft.runtime.storage.packing import PackError, unpack
from chameleon_ft.runtime.workload.models import drop_tied_copies, export_model, param_name
from chameleon_ft.runtime.workload.precision import Precision, for_export

if TYPE_CHECKING:
    from chameleon_ft.runtime.coordinator.shell import Coordinator


def param_hash(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the parameters' names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


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
        "faults": coord.fault_report(),
        "initial_plan": job.plan0.to_dict(),
        "final_plan": coord.state.plan.to_dict(),
        "dtype": coord.train.dtype,
        "num_workers": job.num_workers,
        "total_s": coord.now(),
        "run_dir": str(job.out_dir),
        "resumed_from_step": None if job.resumed_from is None else job.resumed_from.step,
        "committed_steps": stop.step,
        "interrupted": stop.reason if stop.interrupted else None,
        "failed": stop.reason if stop.failed else None,
        "checkpoints": job.ckpt.steps(),
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
    for event in coord.report.events:
        if event.resumed_at_s is None and not event.idle and not event.strategy:
            event.strategy = "none"
    coord.report.write(_base_report(coord, stop) | {"param_hash": None})
    if stop.bad_input:
        raise ValueError(stop.reason)
    raise WorkerFailure(stop.reason)


def finish(coord: Coordinator, stop: m.Stop) -> dict[str, Any]:
    """Write the final state and the report (or, for a failed run, the reason)."""
    from chameleon_ft.runtime.coordinator.shell import WorkerFailure

    if stop.failed:
        return _failed(coord, stop)
    job = coord.job
    for event in coord.report.events:  # an event whose recovery never committed a step
        if event.resumed_at_s is None and not event.idle and not event.strategy:
            event.strategy = "none"

    def gone(w: int) -> bool:
        p = coord.launcher.procs.get(w)
        return p is not None and p.process is not None and \
            p.process.exitcode not in (None, 0)

    try:
        layers = coord.bulk.gather_finals(stop.final, gone, max(10.0, 5 * job.hang_s))
    except FinalStateMissing as exc:
        raise WorkerFailure(str(exc)) from None
    for step, gen in coord.bulk.done():
        coord.feed(m.CheckpointDone(coord.now(), step, gen))
    if stop.step not in job.ckpt.steps():
        assembly = job.ckpt.begin(stop.step, stop.gen, job.num_layers)
        for i, data in layers.items():
            assembly.add(i, data)
        manifest = job.ckpt.commit(assembly, plan=coord.state.state_plan.to_dict(),
                                   meta={"config": job.digest, "job": job.job_name,
                                         "dtype": coord.train.dtype,
                                         "num_layers": job.num_layers})
        coord.log(f"checkpoint after {stop.step} steps written to {manifest.folder}")
    params = drop_tied_copies(job.model, _params_of(layers))  # a tied pair once
    _wait_exits(coord)
    buf = io.BytesIO()
    torch.save(params, buf)
    write_atomic(job.out_dir / "params.pt", buf.getvalue())
    exported = for_export(job.model, params, Precision.of(coord.train.dtype))
    if export_model(job.model, exported, job.out_dir):
        coord.log(f"model exported in its own format under {job.out_dir}")
    coord.params = params
    return coord.report.write(_base_report(coord, stop) | {"param_hash": param_hash(params)})


def _params_of(layers: dict[int, bytes]) -> dict[str, torch.Tensor]:
    from chameleon_ft.runtime.coordinator.shell import WorkerFailure

    params: dict[str, torch.Tensor] = {}
    for i, data in sorted(layers.items()):
        try:
            module_state = unpack(data)["module"]
        except (PackError, KeyError, TypeError) as exc:
            raise WorkerFailure(f"layer {i}: the final state does not decode: {exc}") from None
        for name, tensor in module_state.items():
            params[param_name(i, name)] = tensor
    return params


def _wait_exits(coord: Coordinator) -> None:
    """Workers exit once they uploaded; a death after the last commit is reported."""
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
