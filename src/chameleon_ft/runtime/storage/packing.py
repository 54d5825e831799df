"""A layer's state (parameters, optimizer state) as bytes, for migration and checkpoints.

``pack`` turns a tree of dicts, lists, tuples, tensors and JSON scalars (what a module's
and an optimizer's ``state_dict`` are made of) into one byte string::

    b"CHL1" | u64 header length | header JSON | tensor bytes, back to back

The header holds the tree with each tensor replaced by its index, and each tensor's dtype,
shape and byte range. No pickle is involved, so loading a file runs no code. Packing is
deterministic: replicas of a layer hold bit-identical state, so their packed bytes are
identical and a migration may take different slices of the bytes from different replicas.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import torch

MAGIC = b"CHL1"

_DTYPES = {str(d): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class PackError(ValueError):
    """Bytes that are not a packed state, or a tree that cannot be packed."""


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"__t": len(tensors) - 1}
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise PackError(f"cannot pack a dict key of type {type(k).__name__}")
            items.append([k, _encode(v, tensors)])
        return {"__d": items}
    if isinstance(value, tuple):
        return {"__tuple": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise PackError(f"cannot pack a value of type {type(value).__name__}")


def pack_parts(tree: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The header (magic, length and JSON) and the flat CPU tensors of ``tree``: the packed
    bytes are the header then each tensor's bytes. A contiguous CPU tensor's flat form is a
    view of its own memory (no copy)."""
    tensors: list[torch.Tensor] = []
    encoded = _encode(tree, tensors)
    specs, flats, offset = [], [], 0
    for t in tensors:
        if str(t.dtype) not in _DTYPES:
            raise PackError(f"cannot pack a tensor of dtype {t.dtype}")
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        specs.append({"dtype": str(t.dtype), "shape": list(t.shape), "offset": offset,
                      "nbytes": nbytes})
        flats.append(flat)
        offset += nbytes
    header = json.dumps({"tree": encoded, "tensors": specs}, separators=(",", ":"),
                        sort_keys=True).encode()
    return b"".join([MAGIC, struct.pack(">Q", len(header)), header]), flats


def _raw(flat: torch.Tensor) -> memoryview:
    """The bytes of a flat CPU tensor, without a copy."""
    if not flat.numel():
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def pack(tree: Any) -> bytes:
    """Serialise ``tree`` (tensors are copied to the CPU).

    Raises:
        PackError: for values other than tensors, containers and JSON scalars.
    """
    return b"".join(pack_pieces(tree))


def pack_pieces(tree: Any) -> list[bytes | memoryview]:
    """The bytes of :func:`pack` in pieces: the header, then each tensor's bytes viewed in
    its own memory (for a CPU tree, no copy: keep the tree unchanged while they are used).

    Raises:
        PackError: for values other than tensors, containers and JSON scalars.
    """
    head, flats = pack_parts(tree)
    return [head, *(_raw(f) for f in flats)]


def pack_to(tree: Any, write: Callable[[memoryview | bytes], Any]) -> int:
    """Serialise ``tree`` piece by piece into ``write`` (the same bytes as :func:`pack`,
    never held whole: a tensor's bytes are written from its own memory).

    Returns:
        The number of bytes written.

    Raises:
        PackError: for values other than tensors, containers and JSON scalars.
    """
    head, flats = pack_parts(tree)
    write(head)
    size = len(head)
    for flat in flats:
        raw = _raw(flat)
        if len(raw):
            write(raw)
        size += len(raw)
    return size


def _decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if "__t" in value:
            return tensors[int(value["__t"])]
        if "__d" in value:
            return {k: _decode(v, tensors) for k, v in value["__d"]}
        if "__tuple" in value:
            return tuple(_decode(v, tensors) for v in value["__tuple"])
        raise PackError("unknown tagged value in a packed state")
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    return value


def unpack(data: bytes | bytearray | memoryview, device: torch.device | str = "cpu") -> Any:
    """The tree :func:`pack` serialised, with tensors on ``device``.

    Raises:
        PackError: for bytes that are not a complete packed state.
    """
    buf = memoryview(data)
    if len(buf) < 12 or bytes(buf[:4]) != MAGIC:
        raise PackError("not a packed layer state")
    (length,) = struct.unpack(">Q", buf[4:12])
    if 12 + length > len(buf):
        raise PackError("packed layer state truncated in its header")
    try:
        header = json.loads(bytes(buf[12:12 + length]))
    except ValueError:
        raise PackError("packed layer state with a malformed header") from None
    base = 12 + length
    storage = torch.frombuffer(bytearray(buf[base:]), dtype=torch.uint8) \
        if len(buf) > base else torch.empty(0, dtype=torch.uint8)
    tensors = []
    try:
        for spec in header["tensors"]:
            dtype = _DTYPES[spec["dtype"]]
            start, size = int(spec["offset"]), int(spec["nbytes"])
            if start + size > storage.numel():
                raise PackError("packed layer state truncated in its tensors")
            # a fresh copy starts its own storage, so any dtype can view it (alignment)
            raw = storage[start:start + size].clone()
            t = raw.view(dtype) if size else torch.empty(0, dtype=dtype)
            tensors.append(t.reshape(spec["shape"]).to(device))
        return _decode(header["tree"], tensors)
    except (KeyError, TypeError, RuntimeError) as exc:
        raise PackError(f"packed layer state does not decode: {exc}") from None
