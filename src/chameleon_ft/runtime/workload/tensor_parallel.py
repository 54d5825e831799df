"""Tensor parallelism inside a worker: a stage's layers sharded over the worker's devices
with PyTorch's own tensor-parallel API (DTensor, ``torch.distributed.tensor.parallel``).

A worker of ``[job] tp = k`` is k processes on one host, one per device, that form a
tensor-parallel group (design 4.11). Each builds its stage's layers whole
(``model.build_layer(i)``: deterministic, the same values on every rank) and keeps its
shard (:func:`shard_layer`; no communication: every rank cuts its own chunk). Megatron-LM's
layout with sequence parallelism, as torchtitan writes it:

- attention: the query, key and value projections column-parallel (each rank computes
  ``heads / k`` query heads and ``kv_heads / k`` key/value heads, so a rank's query heads
  find their key/value heads on the same rank), the output projection row-parallel;
- MLP: the input projection(s) column-parallel, the output projection row-parallel;
- between them (norms, residual adds) the hidden states are split along the sequence
  (``Shard(1)``): the norms run on ``T / k`` tokens, a column-parallel input all-gathers
  the sequence, a row-parallel output reduce-scatters it (two all-gathers and two
  reduce-scatters per block and direction: the two all-reduces the estimator prices);
- the embedding vocabulary-parallel (each rank looks up the ids in its ``V / k`` rows);
  the head column-parallel over the vocabulary with its logits gathered, so the model's
  own loss runs on whole logits on every rank;
- fused projections (the GPT's ``qkv``, Phi-3's ``qkv_proj`` and ``gate_up_proj``) split
  part by part (``tp_layout``); biases follow their output dimension (a column-parallel
  bias is split, a row-parallel one replicated); norm weights, q/k norms and position
  embeddings are replicated, their gradients summed over the group by DTensor.

A stage's boundary (what the pipeline sends and receives) is each rank's sequence shard
``(B, T / k, H)``: :class:`TensorParallelStage` takes and returns plain local tensors, so
rank ``r`` of one stage's group sends to rank ``r`` of the next (design 4.11).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from chameleon_ft.runtime.workload.models.gpt import GPTModel
from chameleon_ft.runtime.workload.models.gpt_layers import Block as GPTBlock
from chameleon_ft.runtime.workload.tp_check import (
    check_tensor_parallel as check_tensor_parallel,  # kept importable from here
)
from chameleon_ft.runtime.workload.tp_check import hf_model_class, user_plan
from chameleon_ft.runtime.workload.tp_layout import (
    LayerLayout,
    TensorLayout,
    local_tensor,
    split_tensor,
)

SEQUENCE_DIM = 1
"""The hidden states' sequence dimension: (B, T, H)."""

_COLUMN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj")
"""A Hugging Face decoder layer's column-parallel linears (by attribute name)."""
_ROW = ("o_proj", "down_proj")
"""Its row-parallel linears."""
_HEAD_NORMS = ("q_norm", "k_norm")
"""Norms over each head's width (Qwen3): they run on the rank's own heads."""


def tensor_parallel_mesh(group: Any, device_type: str, generation: int) -> DeviceMesh:
    """The device mesh of a worker's tensor-parallel group for one generation.

    Named for its generation: DTensor's caches compare meshes by their ranks and names,
    not by their process group, so an unnamed mesh over a rebuilt group equals the old
    one and DTensor hands the old mesh (and its aborted group) back to the new layers
    (measured on torch 2.13: every parameter of a layer sharded on the new mesh reported
    the old group).

    Args:
        group: the generation's process group over the worker's ranks, in rank order.
        device_type: ``cpu`` or ``cuda``.
        generation: the generation the group belongs to.
    """
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"tp_g{generation}",))


def boundary_shape(shape: tuple[int, ...], degree: int) -> tuple[int, ...]:
    """The local shape a rank sends or receives for a stage boundary of whole ``shape``
    (B, T, H): its ``T / degree`` tokens."""
    if degree == 1 or len(shape) < 2:
        return shape
    return (shape[0], shape[1] // degree, *shape[2:])


# ---------------------------------------------------------------------------- plans
def _fuse(module: nn.Linear, parts: tuple[int, ...], degree: int) -> TensorLayout:
    """Reorder a fused column-parallel linear's output rows so that DTensor's contiguous
    ``Shard(0)`` gives rank ``r`` part ``r`` of every fused tensor (``[q_r; k_r; v_r]``).
    Returns the layout that undoes it (``tp_layout.join_tensor``)."""
    spec = TensorLayout(dim=0, parts=parts)
    with torch.no_grad():
        for param in (module.weight, module.bias):
            if param is not None:
                local = [split_tensor(param.data, spec, degree, r) for r in range(degree)]
                param.data = torch.cat(local, dim=0)
    return spec


def _gpt_plan(index: int, layer: nn.Module, num_layers: int, degree: int
              ) -> tuple[dict[str, ParallelStyle], ParallelStyle | None,
                         dict[str, TensorLayout]]:
    """The GPT's layers: the embedding, a block, the head."""
    sharded = Shard(SEQUENCE_DIM)
    if index == 0:
        # the token table vocabulary-parallel; the position table (T x H) replicated and
        # added to whole hidden states, which the layer's output then splits by sequence
        return ({"tok": RowwiseParallel(input_layouts=Replicate(),
                                        output_layouts=Replicate())},
                PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=sharded,
                                    use_local_output=False), {})
    if index == num_layers - 1:
        return ({"ln": SequenceParallel(),
                 "lm_head": ColwiseParallel(input_layouts=sharded,
                                            output_layouts=Replicate())}, None, {})
    assert isinstance(layer, GPTBlock)
    h = layer.proj.in_features
    fused = {"qkv.weight": _fuse(layer.qkv, (h, h, h), degree)}
    return ({"ln1": SequenceParallel(), "ln2": SequenceParallel(),
             "qkv": ColwiseParallel(input_layouts=sharded),
             "proj": RowwiseParallel(output_layouts=sharded, use_local_output=False),
             "fc": ColwiseParallel(input_layouts=sharded),
             "out": RowwiseParallel(output_layouts=sharded, use_local_output=False)},
            None, fused)


def _hf_attention(prefix: str, attention: Any, config: Any, degree: int,
                  plan: dict[str, ParallelStyle], fused: dict[str, TensorLayout]) -> None:
    """A Hugging Face attention's projections, q/k norms and, for a fused projection,
    the local head counts its forward reads."""
    plan[prefix] = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(SEQUENCE_DIM)},
        desired_input_kwarg_layouts={"hidden_states": Replicate()})
    head_dim = attention.head_dim
    q_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    qkv = getattr(attention, "qkv_proj", None)
    if isinstance(qkv, nn.Linear):  # Phi-3: [q; k; v] in one matrix, split by name
        fused[f"{prefix}.qkv_proj.weight"] = _fuse(qkv, (q_width, kv_width, kv_width), degree)
        local = copy.copy(attention.config)
        local.num_attention_heads = config.num_attention_heads // degree
        local.num_key_value_heads = config.num_key_value_heads // degree
        attention.config = local
        attention.num_key_value_heads = local.num_key_value_heads
    for name in _HEAD_NORMS:
        if hasattr(attention, name):
            # (B, T, heads / k, head_dim): the rank's heads; their weight's gradient summed
            plan[f"{prefix}.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)


def _is_norm(module: nn.Module) -> bool:
    """A norm: no linear or embedding, only one-dimensional parameters of its own."""
    own = list(module.parameters(recurse=False))
    return (bool(own) and not isinstance(module, nn.Linear | nn.Embedding)
            and all(p.dim() == 1 for p in own))


def _hf_block_plan(layer: nn.Module, config: Any, degree: int
                   ) -> tuple[dict[str, ParallelStyle], dict[str, TensorLayout]]:
    """A Hugging Face decoder layer: every linear by its role, every norm of the layer on
    the rank's tokens; a module of another kind holding parameters is refused before
    anything changes."""
    sharded = Shard(SEQUENCE_DIM)
    plan: dict[str, ParallelStyle] = {}
    for name, module in layer.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in _COLUMN:
            plan[name] = ColwiseParallel()
        elif isinstance(module, nn.Linear) and leaf in _ROW:
            plan[name] = RowwiseParallel(output_layouts=sharded, use_local_output=False)
        elif "." not in name and _is_norm(module):
            plan[name] = SequenceParallel()  # the layer's own norms
        elif leaf in _HEAD_NORMS and name.count(".") == 1 and _is_norm(module):
            pass  # the attention's, below
        elif list(module.parameters(recurse=False)):
            raise ValueError(f"job.tp: no tensor-parallel rule for {type(module).__name__} "
                             f"{name!r} of {type(layer).__name__}; set job.tp = 1")
    fused: dict[str, TensorLayout] = {}
    _hf_attention("self_attn", layer.get_submodule("self_attn"), config, degree, plan, fused)
    plan["mlp"] = PrepareModuleInput(input_layouts=(sharded,), desired_input_layouts=(Replicate(),))
    gate_up = getattr(layer.get_submodule("mlp"), "gate_up_proj", None)
    if isinstance(gate_up, nn.Linear):  # Phi-3: [gate; up], chunked in two by the forward
        half = gate_up.out_features // 2
        fused["mlp.gate_up_proj.weight"] = _fuse(gate_up, (half, half), degree)
    return plan, fused


def _hf_plan(index: int, layer: nn.Module, num_layers: int, config: Any, degree: int
             ) -> tuple[dict[str, ParallelStyle], ParallelStyle | None,
                        dict[str, TensorLayout]]:
    """A Hugging Face layer: the embedding, a decoder layer, the head."""
    sharded = Shard(SEQUENCE_DIM)
    if index == 0:
        return ({"embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Replicate())},
                PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=sharded,
                                    use_local_output=False), {})
    if index == num_layers - 1:
        return ({"norm": SequenceParallel(),
                 "lm_head": ColwiseParallel(input_layouts=sharded,
                                            output_layouts=Replicate())}, None, {})
    plan, fused = _hf_block_plan(layer, config, degree)
    return plan, None, fused


def shard_layer(model: Any, index: int, layer: nn.Module, mesh: DeviceMesh) -> LayerLayout:
    """Shard layer ``index`` of ``model`` (what ``model.build_layer(index)`` returned, on
    this rank's device, in its dtype) in place over ``mesh``, the worker's tensor-parallel
    group. No communication: every rank holds the same whole layer and keeps its chunk.

    Args:
        model: the layered model (checked by :func:`check_tensor_parallel`).
        index: the layer's index in the model.
        layer: the layer, whole.
        mesh: a one-dimensional device mesh over the worker's ranks.

    Returns:
        How the layer's tensors are held (the shard files' and the migration's layout).

    Raises:
        ValueError: one line naming ``job.tp`` for a model or module without a plan.
    """
    degree = mesh.size()
    hf_cls = hf_model_class()
    frozen = {n for n, p in layer.named_parameters() if not p.requires_grad}
    if isinstance(model, GPTModel):
        plan, root, fused = _gpt_plan(index, layer, model.num_layers, degree)
    elif hf_cls is not None and isinstance(model, hf_cls):
        plan, root, fused = _hf_plan(index, layer, model.num_layers, model.config, degree)
    elif user_plan(model):  # a user's model: its own plan (tp_check.PLAN_METHOD)
        plan, root, fused = dict(model.tensor_parallel_plan(index, layer, degree)), None, {}
    else:
        raise ValueError(f"job.tp: {type(model).__name__} has no tensor-parallel plan; "
                         "set job.tp = 1")
    parallelize_module(layer, mesh, plan, src_data_rank=None)
    if root is not None:
        parallelize_module(layer, mesh, root, src_data_rank=None)
    for name, param in layer.named_parameters():  # SequenceParallel makes every copy trainable
        param.requires_grad_(name not in frozen)
    keep_grads_sharded(layer)
    return layer_layout(layer, fused)


def _keep_shard(param: DTensor) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        if (isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements)
                and all(p.is_replicate() for p in grad.placements)):
            return grad.redistribute(param.device_mesh, param.placements)  # a local slice
        return None

    return hook


def keep_grads_sharded(layer: nn.Module) -> None:
    """Have each sharded parameter's gradient keep only this rank's shard as it arrives.

    DTensor's backward of a vocabulary-parallel lookup gives the embedding a whole
    (replicated) ``V x H`` gradient on every rank; accumulated as it comes, every rank
    would hold the whole matrix's gradient until the step. The hook keeps the rank's rows
    before accumulation (a slice: no communication). :func:`shard_layer` sets it on the
    layer; a copy of the layer (the compute copy under mixed precision, which ``deepcopy``
    makes without tensor hooks) needs it again (``tp_state.create_state`` does it).
    """
    for param in layer.parameters():
        if (isinstance(param, DTensor) and param.requires_grad
                and any(p.is_shard() for p in param.placements)):
            param.register_hook(_keep_shard(param))  # type: ignore[no-untyped-call]


def layer_layout(layer: nn.Module, fused: Mapping[str, TensorLayout] | None = None
                 ) -> LayerLayout:
    """The layout of a sharded layer, read from its DTensor placements (``fused`` gives
    the parts of fused tensors); only sharded tensors are listed."""
    fused = fused or {}
    tensors: dict[str, TensorLayout] = {}
    for name, value in layer.state_dict().items():
        dims = ([p.dim for p in value.placements if isinstance(p, Shard)]
                if isinstance(value, DTensor) else [])
        if dims:  # a one-dimensional mesh: one placement
            tensors[name] = fused.get(name, TensorLayout(dim=dims[0]))
    return LayerLayout(tensors=tensors, params=tuple(n for n, _ in layer.named_parameters()))


# ---------------------------------------------------------------------------- the stage
class TensorParallelStage(nn.Module):
    """A stage of sharded layers as the pipeline sees it: plain local tensors in and out.

    Input: the model's inputs (token ids, the same on every rank) when the stage holds
    layer 0, else this rank's sequence shard of the previous stage's output, (B, T/k, H).
    Output: this rank's sequence shard, or the last layer's whole logits. The backward
    takes and gives the same local shapes.
    """

    def __init__(self, stage: nn.Module, mesh: DeviceMesh, *, holds_input: bool) -> None:
        """Args:
            stage: the layers (a ``StageModel`` of layers sharded by :func:`shard_layer`).
            mesh: the worker's tensor-parallel mesh.
            holds_input: whether the stage holds layer 0 (its input is not a shard).
        """
        super().__init__()
        self.stage = stage
        self.mesh = mesh
        self.holds_input = holds_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local tensor in, local tensor out (see the class)."""
        if not self.holds_input:
            x = DTensor.from_local(x, self.mesh, (Shard(SEQUENCE_DIM),), run_check=False)
        y = self.stage(x)
        return y.to_local() if isinstance(y, DTensor) else y


def local_grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's local gradient (the data-parallel all-reduce runs on these: rank
    ``r`` of every replica holds the same shard)."""
    return [local_tensor(p.grad) for p in params if p.grad is not None]
