"""Recovery strategies, the restorer and transition costs.

Each strategy module has one entry point, ``candidates(state, failed) -> list[Candidate]``:
``reroute``, ``dynamic``, ``restart``, ``shrink``; ``reroute_then_dynamic.combine`` builds
the two-phase candidate from the reroute and dynamic ones.
"""

from __future__ import annotations

from chameleon_ft.recovery.restorer import Matching, match_workers, schedule_migration
from chameleon_ft.recovery.types import (
    Candidate,
    Migration,
    RecoveryState,
    Strategy,
    Transfer,
)

__all__ = ["Candidate", "Matching", "Migration", "RecoveryState", "Strategy", "Transfer",
           "match_workers", "schedule_migration"]
