"""Small helpers shared by the specification dataclasses: validation and TOML mapping.

Every user-facing error is a ``ValueError`` whose message starts with the dotted name of
the offending field (``cluster.num_nodes: ...``) and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def fail(field: str, message: str) -> typing.NoReturn:
    """Raise the project's standard configuration error for ``field``."""
    raise ValueError(f"{field}: {message}")


def check_positive(field: str, value: float, *, allow_zero: bool = False) -> None:
    """Reject NaN, infinities and negative (or zero, unless allowed) numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(field, f"must be a number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        fail(field, f"must be finite, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        fail(field, f"must be {bound}, got {value!r}")


def check_int(field: str, value: int, *, minimum: int = 1) -> None:
    """Reject non-integers and integers below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(field, f"must be an integer, got {value!r}")
    if value < minimum:
        fail(field, f"must be >= {minimum}, got {value}")


def check_choice(field: str, value: str, choices: typing.Iterable[str]) -> None:
    """Reject a string that is not one of ``choices``."""
    options = sorted(choices)
    if value not in options:
        fail(field, f"unknown value {value!r}; choose one of {', '.join(options)}")


def _coerce(field: str, annotation: Any, value: Any) -> Any:
    """Check a TOML value against a dataclass field annotation (simple types only)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return _coerce(field, args[0], value)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(field, f"must be a number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(field, f"must be an integer, got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            fail(field, f"must be true or false, got {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            fail(field, f"must be a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            fail(field, f"must be a list, got {value!r}")
        inner = typing.get_args(annotation)[0]
        return tuple(_coerce(f"{field}[{i}]", inner, v) for i, v in enumerate(value))
    return value


def from_mapping(cls: type[T], data: Mapping[str, Any], section: str) -> T:
    """Build the frozen dataclass ``cls`` from a TOML table, rejecting unknown keys.

    Raises:
        ValueError: naming ``section.key`` for an unknown key or a value of the wrong type.
    """
    if not isinstance(data, Mapping):
        fail(section, f"must be a table, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields or not fields[key].init:
            known = ", ".join(sorted(n for n, f in fields.items() if f.init))
            fail(f"{section}.{key}", f"unknown key; known keys are: {known}")
        kwargs[key] = _coerce(f"{section}.{key}", hints[key], value)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required key is missing
        missing = [
            n
            for n, f in fields.items()
            if f.init
            and n not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            fail(f"{section}.{missing[0]}", "is required")
        raise ValueError(f"{section}: {exc}") from exc


def prefixed(section: str, exc: ValueError) -> ValueError:
    """Prefix an error raised by a nested dataclass's ``__post_init__`` with ``section``."""
    text = str(exc)
    if text.startswith(section + "."):
        return exc
    return ValueError(f"{section}.{text}")
