"""What a run's report says happened, as the tests that are not about slow workers read it.

A worker starved of the CPU by the host's other processes really runs slower, and the
fail-slow detector may say so (a ``slow`` event, then ``slow-end``; the update stays the
failure-free one). On a 2-core host running four workers beside a coordinator that
happens, so a test asserting that nothing failed reads the failures only."""

from __future__ import annotations

from typing import Any

from chameleon_ft.runtime.report.records import SLOW_CAUSES


def failures(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's events other than slow workers declared and cleared."""
    return [e for e in report["events"] if e["cause"] not in SLOW_CAUSES]
