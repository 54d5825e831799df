"""How a tensor-parallel layer's state is split over its group, and how shards join again.

A layer sharded over a group of ``degree`` ranks (``runtime.workload.tensor_parallel``)
holds each of its tensors either whole on every rank (*replicated*: norms, biases of
row-parallel linears, position embeddings) or split along one dimension (*sharded*:
column- and row-parallel weights, the vocabulary of an embedding or a head). A fused
tensor (the GPT's ``qkv``, Phi-3's ``qkv_proj`` and ``gate_up_proj``) is several tensors
stacked along its sharded dimension; each part is split on its own, so rank ``r`` holds
``[q_r; k_r; v_r]``, the heads its attention needs, not a slice across the parts.

A split is ``torch.chunk``'s (what DTensor's ``Shard`` placement holds): ``ceil(n / degree)``
rows per rank, the last ranks shorter or empty when ``degree`` does not divide ``n``.

Everything here is pure tensor arithmetic (no process group): re-sharding a checkpoint
written at one degree for another is :func:`join_state_trees` then
:func:`split_state_tree`, exactly, in any process. A layer's state *tree* is what
``LayerTrainState.state_tree`` returns (``format``, ``module``, ``optimizer``); a shard's
tree carries a ``shard`` entry (:class:`LayerLayout` as JSON, its rank and the degree), so
a shard file says by itself how it joins its siblings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

SHARD_KEY = "shard"
"""The entry of a shard's state tree that says which shard it is and how shards join."""


@dataclass(frozen=True)
class TensorLayout:
    """How one tensor of a layer is held by the ranks of its group."""

    dim: int | None = None
    """The dimension it is split along; ``None``: every rank holds it whole."""
    parts: tuple[int, ...] = ()
    """For a fused tensor, the sizes along ``dim`` of the tensors stacked in it, each split
    on its own (each a multiple of the degree); ``()``: one tensor."""

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole tensor."""
        return self.dim is None

    def to_json(self) -> dict[str, Any]:
        """A JSON value (for a shard's header and a checkpoint's manifest)."""
        return {"dim": self.dim, "parts": list(self.parts)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> TensorLayout:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: for a value that is not a layout.
        """
        dim, parts = value.get("dim"), value.get("parts", [])
        if ((dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 0))
                or not isinstance(parts, list)
                or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in parts)):
            raise ValueError(f"layer layout: not a tensor layout: {value!r}")
        return cls(dim=dim, parts=tuple(parts))


REPLICATED = TensorLayout()


@dataclass(frozen=True)
class LayerLayout:
    """Every tensor of one layer's ``state_dict`` and how its group holds it."""

    tensors: Mapping[str, TensorLayout] = field(default_factory=dict)
    """The sharded tensors by their name in the layer's ``state_dict``; a name not listed
    is replicated."""
    params: tuple[str, ...] = ()
    """The layer's parameter names in ``named_parameters`` order: the optimizer's state
    names parameters by this position."""

    def of(self, name: str) -> TensorLayout:
        """The layout of tensor ``name`` (replicated when not listed)."""
        return self.tensors.get(name, REPLICATED)

    def to_json(self) -> dict[str, Any]:
        """A JSON value."""
        return {"tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())},
                "params": list(self.params)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> LayerLayout:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: for a value that is not a layer layout.
        """
        tensors, params = value.get("tensors"), value.get("params")
        if (not isinstance(tensors, dict) or not isinstance(params, list)
                or not all(isinstance(p, str) for p in params)):
            raise ValueError("layer layout: expected {'tensors': {...}, 'params': [...]}")
        layouts = {str(k): TensorLayout.from_json(v) for k, v in tensors.items()}
        return cls(tensors={k: v for k, v in layouts.items() if not v.replicated},
                   params=tuple(params))


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly distributed) tensor: what it sends, reduces over
    data parallelism and packs. A DTensor is recognised by its ``to_local`` (the runtime's
    shared code stays free of DTensor's modules: the coordinator imports it)."""
    to_local = getattr(value, "to_local", None)
    local: torch.Tensor = value if to_local is None else to_local()
    return local


def chunk_bounds(size: int, degree: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s chunk of ``size`` rows split ``torch.chunk``'s
    way over ``degree`` ranks (what DTensor's ``Shard`` holds)."""
    step = -(-size // degree)  # ceil
    return min(rank * step, size), min((rank + 1) * step, size)


def _check_parts(shape: Sequence[int], spec: TensorLayout, degree: int) -> None:
    assert spec.dim is not None
    if spec.dim >= len(shape):
        raise ValueError(f"layer layout: dimension {spec.dim} of a {len(shape)}-d tensor")
    if spec.parts and (sum(spec.parts) != shape[spec.dim]
                       or any(p % degree for p in spec.parts)):
        raise ValueError(f"layer layout: fused parts {list(spec.parts)} do not split "
                         f"{shape[spec.dim]} rows over {degree} ranks")


def split_tensor(full: torch.Tensor, spec: TensorLayout, degree: int,
                 rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a copy; the tensor itself when replicated).

    Raises:
        ValueError: when the layout does not fit the tensor.
    """
    if spec.dim is None or degree == 1:
        return full
    _check_parts(full.shape, spec, degree)
    dim = spec.dim
    if not spec.parts:
        start, end = chunk_bounds(full.shape[dim], degree, rank)
        return full.narrow(dim, start, end - start).clone()
    pieces = []
    for part in torch.split(full, list(spec.parts), dim=dim):
        start, end = chunk_bounds(part.shape[dim], degree, rank)
        pieces.append(part.narrow(dim, start, end - start))
    return torch.cat(pieces, dim=dim)


def join_tensor(shards: Sequence[torch.Tensor], spec: TensorLayout) -> torch.Tensor:
    """The whole tensor from every rank's shard, in rank order (inverse of
    :func:`split_tensor`; a replicated tensor is rank 0's).

    Raises:
        ValueError: when the layout does not fit the shards.
    """
    if spec.dim is None or len(shards) == 1:
        return shards[0]
    dim, degree = spec.dim, len(shards)
    if not spec.parts:
        return torch.cat(list(shards), dim=dim)
    per_rank = [p // degree for p in spec.parts]
    if any(s.shape[dim] != sum(per_rank) for s in shards):
        raise ValueError(f"layer layout: shards of {[s.shape[dim] for s in shards]} rows "
                         f"are not fused parts {list(spec.parts)} over {degree} ranks")
    split = [torch.split(s, per_rank, dim=dim) for s in shards]  # [rank][part]
    return torch.cat([torch.cat([split[r][k] for r in range(degree)], dim=dim)
                      for k in range(len(spec.parts))], dim=dim)


@dataclass(frozen=True)
class _Slot:
    """One tensor of a state tree: where it sits, how it is held, whose it is."""

    container: dict[Any, Any]
    key: Any
    spec: TensorLayout
    param: str | None
    """The parameter an optimizer state tensor belongs to (``None``: a module tensor)."""

    @property
    def what(self) -> str:
        return (f"module {self.key}" if self.param is None
                else f"optimizer {self.key} of {self.param}")


def _copy_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a state tree whose tensor containers can be written (tensors shared)."""
    out = {k: v for k, v in tree.items() if k != SHARD_KEY}
    out["module"] = dict(tree["module"])
    out["optimizer"] = {**tree["optimizer"],
                        "state": {k: dict(v) for k, v in
                                  tree["optimizer"].get("state", {}).items()}}
    return out


def _slots(tree: Mapping[str, Any], layout: LayerLayout) -> list[_Slot]:
    """Every tensor slot of a state tree: the module's tensors by name, then each
    parameter's optimizer state; a state tensor of its parameter's shape shares its
    layout, a scalar (a step count) is replicated."""
    module: dict[str, Any] = tree["module"]
    slots = [_Slot(module, name, layout.of(name), None) for name in module]
    states: dict[Any, Any] = tree["optimizer"].get("state", {})
    for index, entries in states.items():
        if not 0 <= int(index) < len(layout.params):
            raise ValueError(f"layer state: optimizer state for parameter {index} of "
                             f"{len(layout.params)}")
        name = layout.params[int(index)]
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                spec = layout.of(name) if value.dim() else REPLICATED
                slots.append(_Slot(entries, key, spec, name))
    return slots


def split_state_tree(tree: Mapping[str, Any], layout: LayerLayout, degree: int,
                     rank: int) -> dict[str, Any]:
    """Rank ``rank``'s shard of a whole layer's state tree, with its ``shard`` entry.

    Raises:
        ValueError: when the tree does not fit the layout (e.g. an optimizer whose state
            is not element-wise: its state tensors differ from their parameter's shape).
    """
    out = _copy_tree(tree)
    whole: dict[str, Any] = tree["module"]
    for slot in _slots(out, layout):
        value = slot.container[slot.key]
        if (slot.param is not None and not slot.spec.replicated
                and value.shape != whole[slot.param].shape):
            raise ValueError(f"layer state: {slot.what} has shape {tuple(value.shape)}, not "
                             "its parameter's: tensor parallelism needs an element-wise "
                             "optimizer (SGD, Adam, AdamW, RMSprop...)")
        slot.container[slot.key] = split_tensor(value, slot.spec, degree, rank)
    out[SHARD_KEY] = {"rank": rank, "degree": degree, "layout": layout.to_json()}
    return out


def shard_header(tree: Mapping[str, Any]) -> tuple[int, int, LayerLayout] | None:
    """``(rank, degree, layout)`` of a shard's tree; ``None`` for a whole layer's.

    Raises:
        ValueError: for a malformed ``shard`` entry.
    """
    entry = tree.get(SHARD_KEY)
    if entry is None:
        return None
    try:
        rank, degree = int(entry["rank"]), int(entry["degree"])
        layout = LayerLayout.from_json(entry["layout"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("layer state: malformed shard entry") from None
    if not 0 <= rank < degree:
        raise ValueError(f"layer state: shard {rank} of {degree}")
    return rank, degree, layout


def join_state_trees(trees: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The whole layer's state tree from its shards' (any order; a whole tree alone is
    returned as it is): what ``LayerTrainState.state_tree`` of the unsharded layer holds.

    Raises:
        ValueError: when the shards are not exactly ranks ``0..degree-1`` of one layout.
    """
    headers = [shard_header(t) for t in trees]
    if len(trees) == 1 and headers[0] is None:
        return dict(trees[0])
    known = [h for h in headers if h is not None]
    if len(known) != len(headers):
        raise ValueError("layer state: a whole layer mixed with shards")
    degree, layout = known[0][1], known[0][2]
    ranks = [h[0] for h in known]
    if sorted(ranks) != list(range(degree)) or any(h[1:] != (degree, layout) for h in known):
        raise ValueError(f"layer state: shards {sorted(ranks)} do not make ranks "
                         f"0..{degree - 1} of one layout")
    by_rank = [trees[ranks.index(r)] for r in range(degree)]
    out = _copy_tree(by_rank[0])
    shard_slots = [_slots(t, layout) for t in by_rank]
    for i, slot in enumerate(_slots(out, layout)):
        shards = [s[i].container[s[i].key] for s in shard_slots]
        slot.container[slot.key] = join_tensor(shards, slot.spec)
    return out


def reshard_state_trees(trees: Sequence[Mapping[str, Any]], degree: int,
                        rank: int) -> dict[str, Any]:
    """Rank ``rank``'s shard at ``degree`` of a layer stored as ``trees`` (its shards at
    any degree, or one whole tree): the load of a checkpoint written at another degree.

    Raises:
        ValueError: as :func:`join_state_trees`, or when a whole tree has no layout.
    """
    header = shard_header(trees[0])
    if header is None:
        raise ValueError("layer state: a whole layer needs its layout to be sharded "
                         "(split_state_tree)")
    return split_state_tree(join_state_trees(trees), header[2], degree, rank)
