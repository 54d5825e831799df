"""Models the runtime trains, behind one protocol (:class:`LayeredModel`).

- ``base``: the protocol, the stage module, names, the default loss;
- ``gpt``: the built-in tiny GPT (``[model] source = "gpt"``, the default);
- ``hf``: decoder-only causal LMs of the supported Hugging Face families (``"hf"``);
- ``factory``: a user's model from ``package.module:function`` (``"python"``).

:func:`load_model` picks the adapter for a config; the runtime never special-cases one.
"""

from __future__ import annotations

from chameleon_ft.runtime.workload.models.base import (
    LayeredModel,
    StageModel,
    TiedPair,
    build_stage,
    check_model,
    check_tied_parameters,
    drop_tied_copies,
    export_model,
    initial_params,
    param_name,
    probe_outputs,
    split_param_name,
    targets_per_sample,
    tied_copies,
    tied_end_elements,
    tied_parameters,
    to_run,
    token_cross_entropy_sum,
    with_tied_copies,
)
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.model_source import ModelSourceKind

__all__ = [
    "LayeredModel",
    "StageModel",
    "TiedPair",
    "build_stage",
    "check_model",
    "check_tied_parameters",
    "drop_tied_copies",
    "export_model",
    "initial_params",
    "load_model",
    "param_name",
    "probe_outputs",
    "split_param_name",
    "targets_per_sample",
    "tied_copies",
    "tied_end_elements",
    "tied_parameters",
    "to_run",
    "token_cross_entropy_sum",
    "with_tied_copies",
]


def load_model(config: Config) -> LayeredModel:
    """The layered model of ``[model] source``.

    Raises:
        ValueError: one line naming the ``[model]`` field at fault (a missing or
            unsupported ``path``, a factory that does not import...).
    """
    source = config.model_source.source
    if source == ModelSourceKind.HF:
        from chameleon_ft.runtime.workload.models.hf import HFCausalLM

        return HFCausalLM.from_config(config)
    if source == ModelSourceKind.PYTHON:
        from chameleon_ft.runtime.workload.models.factory import load_factory_model

        return load_factory_model(config)
    from chameleon_ft.runtime.workload.models.gpt import GPTModel

    return GPTModel.from_config(config)
