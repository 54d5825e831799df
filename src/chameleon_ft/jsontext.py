"""JSON text for reports: non-finite floats become ``null`` (JSON has no infinity)."""

from __future__ import annotations

import json
import math
from typing import Any


def json_ready(value: Any) -> Any:
    """A copy of ``value`` with infinities and NaNs replaced by ``None`` and dict keys as
    strings, ready for :func:`json.dumps`."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def dumps(doc: Any) -> str:
    """Indented JSON text of ``doc`` with non-finite floats as ``null``."""
    return json.dumps(json_ready(doc), indent=2)
