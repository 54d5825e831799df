"""The run's numerics: the dtype names a job file uses, and mixed precision.

``[train] dtype`` is one of:

- ``float32`` / ``float64``: one dtype for everything (parameters, activations,
  gradients, optimizer state); float64 makes runs under any plan comparable to 1e-9.
- ``bfloat16``: mixed precision, the usual recipe of LLM training (Megatron-LM's bf16
  with fp32 ``main_grad``, torchtitan's FSDP mixed precision with an fp32 reduction):
  the layers compute in bf16 (their parameters, the activations and the gradients sent
  between stages are bf16), while each layer keeps fp32 *master* weights that the
  optimizer steps, so the optimizer state and checkpoints are fp32 too. Each parameter's
  bf16 gradient is added into its master's fp32 gradient as soon as autograd has
  accumulated it for a micro-batch (a post-accumulate hook), so the micro-batches of a
  step sum in fp32; the data-parallel all-reduce, the tied sum, the norm and the clipping
  all run on those fp32 gradients (a bf16 reduction would round every partial sum to 8
  bits of mantissa, and the bytes saved are the master gradient's, not the step's). The
  loss is computed in fp32 from the bf16 logits, as transformers' own loss upcasts them.
  After each optimizer step the masters are copied (rounded) into the bf16 layer.

Why not ``torch.autocast``: autocast keeps fp32 parameters and casts them to bf16 on every
use, so every layer holds fp32 weights *and* makes bf16 copies per forward, and which ops
run in bf16 is autocast's list, not the model's; with explicit bf16 layers the memory is
the recipe's (bf16 weights + fp32 masters, gradients and moments: 18 bytes a parameter)
and what a stage sends is bf16 by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from chameleon_ft.runtime.workload.models import to_run

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MASTER_DTYPE = torch.float32
"""The master weights' dtype under mixed precision."""


def torch_dtype(name: str) -> torch.dtype:
    """``float32`` / ``float64`` / ``bfloat16`` -> the torch dtype the layers compute in
    (and what a stage's boundary carries)."""
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The ``[train] dtype`` name of a torch dtype.

    Raises:
        ValueError: for a dtype that is not a run dtype.
    """
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype: {dtype} is not one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class Precision:
    """The dtypes of one run."""

    compute: torch.dtype
    """What the layers compute in: their parameters, activations, stage boundaries."""
    master: torch.dtype
    """What the optimizer steps: master weights, gradients, reductions, optimizer state,
    checkpoints, the loss."""

    @classmethod
    def of(cls, name: str) -> Precision:
        """The precision of ``[train] dtype = name``.

        Raises:
            KeyError: for a name that is not a run dtype (the config refuses it first).
        """
        compute = DTYPES[name]
        return cls(compute, MASTER_DTYPE if compute == torch.bfloat16 else compute)

    @property
    def mixed(self) -> bool:
        """Whether the layers compute in another dtype than their master weights."""
        return self.compute != self.master

    @property
    def compute_if_mixed(self) -> torch.dtype | None:
        """The compute dtype when it differs from the masters' (else ``None``)."""
        return self.compute if self.mixed else None

    def inputs(self, x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """A micro-batch's inputs on the device (floating point in the compute dtype)."""
        return to_run(x, self.compute, device)

    def targets(self, y: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """A micro-batch's targets on the device (floating point in the master dtype)."""
        return to_run(y, self.master, device)

    def for_loss(self, output: torch.Tensor) -> torch.Tensor:
        """The last layer's output as the loss takes it: upcast to the master dtype under
        mixed precision (the same tensor otherwise)."""
        if self.mixed and output.is_floating_point():
            return output.to(self.master)
        return output


def for_export(model: Any, params: dict[str, torch.Tensor],
               precision: Precision) -> dict[str, torch.Tensor]:
    """The parameters the model's own format (``hf/``) is written with: as trained, and
    under mixed precision the fp32 masters cast to the model's own dtype (``model.dtype``,
    e.g. the dtype its ``save_pretrained`` directory was stored in), as a bf16 run that
    started from a bf16 checkpoint gives one back."""
    own = getattr(model, "dtype", None)
    if not precision.mixed or not isinstance(own, torch.dtype):
        return params
    return {k: v.to(own) if v.is_floating_point() else v for k, v in params.items()}
