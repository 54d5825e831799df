"""The final parameters from a checkpoint's files: ``params.pt`` (every parameter by its
runtime name, one tensor per tied pair) and the model's own format (``hf/`` for a Hugging
Face model), written by a process of their own.

The coordinator never holds the model: at the end of a run it runs :func:`export_workload`
in a child process that reads the final checkpoint layer by layer (each verified against
the manifest; a layer written as tensor-parallel shards joined whole,
``tp_layout.join_state_trees``), writes the files atomically, and sends back the
parameters' digest. The
same function re-exports any complete checkpoint of a run directory.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import torch

from chameleon_ft.runtime.storage.checkpoint import CheckpointError, Manifest, write_atomic
from chameleon_ft.runtime.storage.packing import PackError, unpack


class ExportError(RuntimeError):
    """A checkpoint that cannot be exported (a layer does not decode)."""


def param_hash(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the parameters' names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def params_of(manifest: Manifest) -> dict[str, torch.Tensor]:
    """Every layer's parameters by runtime name, read and verified layer by layer.

    Raises:
        CheckpointError: when a file does not match the manifest.
        ExportError: when a layer's state does not decode.
    """
    from chameleon_ft.runtime.workload.models import param_name
    from chameleon_ft.runtime.workload.tp_layout import join_state_trees

    params: dict[str, torch.Tensor] = {}
    for i in range(manifest.num_layers):
        try:  # a layer written as shards (tensor parallelism) is joined: the whole model
            trees = [unpack(data) for data in manifest.read_parts(i)]
            module_state = join_state_trees(trees)["module"]
        except CheckpointError:
            raise
        except (PackError, KeyError, TypeError, ValueError) as exc:
            raise ExportError(f"layer {i}: the final state does not decode: {exc}") from None
        for name, tensor in module_state.items():
            params[param_name(i, name)] = tensor
    return params


def export(folder: Path, model: Any, out_dir: Path, dtype: str) -> tuple[str, bool]:
    """Write ``params.pt`` (and the model's own format) from the checkpoint in ``folder``.

    Args:
        folder: a complete checkpoint.
        model: the layered model.
        out_dir: the run directory.
        dtype: the run's ``[train] dtype`` (under mixed precision the checkpoint holds fp32
            masters; the model's own format gets them in the model's own dtype).

    Returns:
        The parameters' digest and whether the model wrote its own format.
    """
    from chameleon_ft.runtime.workload.models import drop_tied_copies, export_model
    from chameleon_ft.runtime.workload.precision import Precision, for_export

    params = drop_tied_copies(model, params_of(Manifest.read(folder)))  # a tied pair once
    buf = io.BytesIO()
    torch.save(params, buf)
    write_atomic(out_dir / "params.pt", buf.getvalue())
    exported = export_model(model, for_export(model, params, Precision.of(dtype)), out_dir)
    return param_hash(params), exported


def export_workload(folder: Path, workload: Any, out_dir: Path,
                    dtype: str) -> tuple[str, bool]:
    """:func:`export` of the model ``workload`` builds: what the coordinator's export
    process runs."""
    return export(folder, workload.model(), out_dir, dtype)
