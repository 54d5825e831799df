"""Transition costs: what a recovery costs before training resumes (docs/design.md section 3.3).

Every term is named and comes from :class:`~chameleon_ft.spec.recovery.RecoverySpec`
(whose docstrings cite the published figures), except the two that are computed per
decision: the un-hidden search time and the migration time.

- reroute: ``detect_s + rebuild_s`` (the in-flight step is redone; that is part of
  detection's cost in every strategy, so it is not charged twice);
- dynamic: ``detect_s + rebuild_s + search_s + migrate_s``;
- shrink: ``detect_s + rebuild_s``;
- restart: ``detect_s + restart_s + load_s + lost_s`` with ``lost_s`` the exact progress
  since the last checkpoint when known, else half the checkpoint interval.
"""

from __future__ import annotations

from chameleon_ft.spec.recovery import RecoverySpec


def reroute_terms(spec: RecoverySpec) -> dict[str, float]:
    """Terms of a reroute: detection and a communicator rebuild; no state moves."""
    return {"detect_s": spec.detect_s, "rebuild_s": spec.rebuild_s}


def shrink_terms(spec: RecoverySpec) -> dict[str, float]:
    """Terms of a shrink: detection and a communicator rebuild; no state moves."""
    return {"detect_s": spec.detect_s, "rebuild_s": spec.rebuild_s}


def dynamic_terms(spec: RecoverySpec, *, search_s: float, migrate_s: float) -> dict[str, float]:
    """Terms of a dynamic re-plan.

    Args:
        spec: the recovery settings.
        search_s: plan-search seconds not hidden behind training (0 on a cache hit).
        migrate_s: migration time at the full migration bandwidth.

    Returns:
        ``detect_s``, ``rebuild_s``, ``search_s``, ``migrate_s``.
    """
    return {"detect_s": spec.detect_s, "rebuild_s": spec.rebuild_s, "search_s": search_s,
            "migrate_s": migrate_s}


def lost_progress_s(spec: RecoverySpec, since_checkpoint_s: float | None) -> float:
    """Work lost by a restart: the exact time since the checkpoint, or half the interval.

    Raises:
        ValueError: for a negative ``since_checkpoint_s``.
    """
    if since_checkpoint_s is None:
        return spec.checkpoint_interval_s / 2
    if since_checkpoint_s < 0:
        raise ValueError(f"since_checkpoint_s: must be >= 0, got {since_checkpoint_s}")
    return float(since_checkpoint_s)


def restart_terms(spec: RecoverySpec, since_checkpoint_s: float | None) -> dict[str, float]:
    """Terms of a checkpoint restart: detection, process restart, load and lost work."""
    return {"detect_s": spec.detect_s, "restart_s": spec.restart_s,
            "load_s": spec.checkpoint_load_s,
            "lost_s": lost_progress_s(spec, since_checkpoint_s)}


def migration_s(time_at_full_bandwidth_s: float, spec: RecoverySpec, *,
                background: bool = False) -> float:
    """Migration seconds given the schedule's time at the links' full bandwidth.

    The schedule's time is divided by ``migration_efficiency`` (what migration achieves of
    the link) and, in the background, also by ``background_share`` (what training leaves).
    """
    share = spec.migration_efficiency * (spec.background_share if background else 1.0)
    return time_at_full_bandwidth_s / share
