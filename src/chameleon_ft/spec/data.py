"""Where training samples come from (section ``[data]``): used by the runtime only.

Every sample is fixed by its global position ``g = step * global_batch + i`` (``i`` the
sample's index in the step's global batch), whatever the plan, so a step trains on the
same samples under every layout and after every recovery.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from chameleon_ft.spec._fields import check_choice, check_int, fail
from chameleon_ft.spec.model_source import check_factory


class DataKind(StrEnum):
    """Data sources."""

    BYTES = "bytes"
    TOKENS = "tokens"
    PYTHON = "python"


TOKEN_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """The ``[data]`` table."""

    kind: str = DataKind.BYTES.value
    """``bytes`` (the Python standard library's sources as byte tokens), ``tokens`` (a flat
    binary file of token ids) or ``python`` (a factory)."""
    path: str = ""
    """For ``tokens``: the token file, relative to the config file's folder."""
    dtype: str = "uint16"
    """For ``tokens``: ``uint16`` or ``uint32``, native byte order, no header."""
    shuffle: bool = False
    """For ``tokens``: visit the windows of each pass over the file in a seeded random
    order instead of file order."""
    seed: int | None = None
    """Seed of the sample order (``bytes``: the window offsets; ``tokens``: the shuffle);
    default: ``[train] seed``."""
    factory: str = ""
    """For ``python``: ``package.module:function``, called with the job's ``Config``,
    returning a data source; the config file's folder is on ``sys.path``."""

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, [k.value for k in DataKind])
        check_choice("dtype", self.dtype, TOKEN_DTYPES)
        if self.seed is not None:
            check_int("seed", self.seed, minimum=0)
        if self.kind == DataKind.TOKENS:
            if not self.path:
                fail("path", 'is required for kind = "tokens": the token file to read')
        elif self.path:
            fail("path", f'is only read for kind = "tokens" (kind is {self.kind!r})')
        if self.kind == DataKind.PYTHON:
            check_factory("factory", self.factory)
        elif self.factory:
            fail("factory", f'is only read for kind = "python" (kind is {self.kind!r})')
        if self.shuffle and self.kind != DataKind.TOKENS:
            fail("shuffle", f'is only read for kind = "tokens" (kind is {self.kind!r})')
