"""The run's record in its folder: what a coordinator that takes the run over needs and
cannot learn from the workers (docs/design.md 4.5).

``coordinator.json`` holds the job's id and token (the seal's key is derived from the
token, so it is a secret: the file is created readable by its owner only, 0600, and never
with wider permissions, even for a moment), the address its workers look for a
coordinator at, the coordinator's term (one more for each coordinator that takes the run
over: every control value is sealed for it, so nothing an earlier one wrote passes
later), the digest of the model and numerics, and whether the run ended (a run that ended
has no live workers to wait for).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

RECORD_FILE = "coordinator.json"
"""The record's name in the run folder."""


@dataclass(frozen=True)
class RunRecord:
    """What the coordinator of a run records for the next one."""

    job_id: str
    token: str
    host: str
    port: int
    term: int
    digest: str
    """The model and numerics (``setup.config_digest``): a takeover must not change them."""
    ended: bool = False
    """The run ended (finished, stopped, or failed with its workers told to stop)."""
    boundaries: list[list[Any]] | None = None
    """Every layer's output shape and dtype (``JobInfo.boundaries``): a coordinator that
    takes the run over publishes the job without learning them again."""

    def ending(self) -> RunRecord:
        """This record, with the run ended."""
        return replace(self, ended=True)


def read(out_dir: Path) -> RunRecord | None:
    """The run's record (None: there is none, or it is not a record of this version).

    Raises:
        ValueError: when the record exists but others than its owner may read it (the
            token in it is the job's secret).
    """
    path = out_dir / RECORD_FILE
    try:
        mode = path.stat().st_mode & 0o777
        text = path.read_text()
    except OSError:
        return None
    if mode & 0o077:
        raise ValueError(f"--resume: {path} holds the job's token but others may read it "
                         f"(permissions {mode:o}); make it 600 (chmod 600) if you trust it")
    try:
        doc = json.loads(text)
        boundaries = doc.get("boundaries")
        return RunRecord(job_id=str(doc["job_id"]), token=str(doc["token"]),
                         host=str(doc["host"]), port=int(doc["port"]), term=int(doc["term"]),
                         digest=str(doc["digest"]), ended=bool(doc.get("ended", False)),
                         boundaries=list(boundaries) if isinstance(boundaries, list) else None)
    except (ValueError, KeyError, TypeError):
        return None


def write(out_dir: Path, record: RunRecord) -> None:
    """Write the record atomically, readable by its owner only from its first byte.

    Raises:
        OSError: when the run folder refuses it.
    """
    path = out_dir / RECORD_FILE
    tmp = path.with_name(f".{RECORD_FILE}.tmp-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an earlier temporary file of the same name kept its mode
        os.write(fd, json.dumps(asdict(record), indent=1).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
