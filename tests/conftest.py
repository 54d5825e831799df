"""What every test folder shares: ``tests/shared`` (jobs, plans and helpers more than one
folder's tests use) on the import path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "shared"))
