"""Chameleon: adaptive fault tolerance for data x pipeline parallel LLM training.

The planning core (``spec``, ``profile``, ``plan``, ``perf``, ``recovery``, ``policy``,
``sim``) is pure Python and never imports torch; only ``runtime`` does.
"""

__version__ = "0.1.0"


def train(*args: object, **kwargs: object) -> dict[str, object]:
    """Train on worker processes and survive their failures: see
    :func:`chameleon_ft.runtime.workload.api.train` (imported here only when called: torch)."""
    from chameleon_ft.runtime.workload.api import train as run

    return run(*args, **kwargs)  # type: ignore[arg-type]
