"""Injected faults: armed through the store, and when each fired (for the report).

Faults never steer the coordinator: a fault that fires kills, stops or breaks a worker,
and the control plane sees that like any other failure.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from chameleon_ft.runtime.coordinator.store import ControlStore
from chameleon_ft.spec.train import Fault


class FaultBook:
    """The run's injected faults and the kill times of replayed failures."""

    def __init__(self, faults: Iterable[Fault]) -> None:
        self.faults: list[Fault] = list(faults)
        self.retracted: set[int] = set()
        self.used: set[int] = set()
        """Faults whose firing time explained a failure already."""
        self.killed_at: dict[int, float] = {}
        """Run clock when a replayed failure signalled a worker (its fault time)."""

    def publish(self, store: ControlStore) -> None:
        """Arm the faults (workers re-read the list when it changes)."""
        store.publish_faults([[f.rank, f.step, f.kind, f.phase] for f in self.faults])

    def inject(self, store: ControlStore, fault: Fault) -> int:
        """Arm one more fault while the run goes on; returns its index."""
        self.faults.append(fault)
        self.publish(store)
        return len(self.faults) - 1

    def retract(self, store: ControlStore, index: int) -> bool:
        """Disarm fault ``index`` unless it fired already."""
        if not store.claim_fault(index):
            return False
        self.retracted.add(index)
        return True

    def fault_time(self, store: ControlStore, failed: Iterable[int], now_s: float) -> float | None:
        """When an injected fault fired on one of ``failed`` (worker wall clock -> run
        clock), or when a replayed failure killed one."""
        failed = set(failed)
        times = []
        for index, fault in enumerate(self.faults):
            # a glitch does not take its worker out: it explains no death
            if fault.rank not in failed or index in self.used or fault.kind == "glitch":
                continue
            doc = store.fired(index)
            if doc is not None:
                times.append(now_s - (time.time() - float(doc["time"])))
                self.used.add(index)
        times += [self.killed_at.pop(w) for w in sorted(failed) if w in self.killed_at]
        return min(times) if times else None

    def report(self, store: ControlStore) -> list[dict[str, Any]]:
        """Every injected fault, whether and where it fired."""
        out = []
        for index, fault in enumerate(self.faults):
            fired = store.fired(index)
            out.append({"fault": fault.to_text(), "fired": fired is not None,
                        "retracted": index in self.retracted,
                        **({"fired_step": fired["step"], "fired_gen": fired["gen"],
                            "fired_pid": fired["pid"]} if fired else {})})
        return out
