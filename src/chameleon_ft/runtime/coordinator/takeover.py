"""Taking a run over, as the coordinator does it (the decisions are the control plane's:
``control.reattach``).

While the control plane waits for the workers' reports, each worker id's report key is
read (sealed for this coordinator's term: nothing written for an earlier coordinator
counts) and what changed is fed, its plans parsed and bounded; once the control plane
took the run over, the re-attached processes of this host are held by pid file descriptor
(their exits are seen at once, as a launched worker's) and recorded in the report.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control.reports import Held, Report
from chameleon_ft.runtime.documents import HeldState, ReattachReport
from chameleon_ft.runtime.protocol import reattach_key

if TYPE_CHECKING:
    from chameleon_ft.runtime.coordinator.shell import Coordinator

READ_EVERY_S = 0.02
"""How often the report keys are read while the control plane waits for them."""


def held(state: HeldState | None, num_layers: int) -> Held | None:
    """A report's state as the control plane takes it.

    Raises:
        ValueError: for a plan that does not validate or layers the model does not have.
    """
    if state is None:
        return None
    plan = ExecutionPlan.from_dict(state.plan)
    layers = frozenset(state.layers)
    if plan.num_layers != num_layers or not all(0 <= i < num_layers for i in layers):
        raise ValueError("a state of another model")
    return Held(step=state.step, gen=state.gen, plan=plan, layers=layers)


def report_of(doc: ReattachReport, num_layers: int, host: str) -> Report:
    """A worker's report as the control plane takes it (``host``: this coordinator's).

    Raises:
        ValueError: for a state of another model.
    """
    return Report(worker=doc.worker, incarnation=doc.incarnation, seen_gen=doc.seen_gen,
                  gen=doc.gen, members={int(w): inc for w, inc in doc.members.items()},
                  held=held(doc.held, num_layers), pending=held(doc.pending, num_layers),
                  local=doc.host == host, pid=doc.pid, host=doc.host)


class Takeover:
    """The reports read so far (each id's last, to feed only what changed)."""

    def __init__(self) -> None:
        self.seen: dict[int, ReattachReport] = {}
        self.due_s = 0.0
        self.host = socket.gethostname()

    def observe(self, coord: Coordinator) -> None:
        """Read every worker id's report (at most every ``READ_EVERY_S``); feed the new."""
        now = coord.now()
        if now < self.due_s:
            return
        self.due_s = now + READ_EVERY_S
        found: list[Report] = []
        for w in range(coord.job.num_workers):
            doc = coord.cs.reattach_report(w)
            if doc is None or self.seen.get(w) == doc:
                continue
            self.seen[w] = doc
            try:
                found.append(report_of(doc, coord.job.num_layers, self.host))
            except (ValueError, KeyError, TypeError) as exc:
                coord.cs.refusals.refuse(reattach_key(w), doc.to_json().encode(), str(exc),
                                         source=f"worker {w}")
        if found:
            coord.feed(m.Reports(coord.now(), tuple(found)))

    def reattached(self, coord: Coordinator, e: m.Reattached) -> None:
        """The run was taken over: hold this host's re-attached processes, record them."""
        records: list[dict[str, Any]] = []
        for worker, incarnation, pid, host in e.workers:
            doc = self.seen.get(worker)
            local = host == self.host and doc is not None and \
                doc.incarnation == incarnation and \
                coord.launcher.adopt(worker, incarnation, pid, doc.started)
            records.append({"worker": worker, "pid": pid, "host": host, "local": local})
        coord.report.took_over(e.step, records)
        coord.cs.forget_reports(coord.job.num_workers)
        self.seen.clear()
