"""A user's model from a Python factory (``[model] source = "python"``).

``factory = "package.module:function"``: the function is called with the job's ``Config``
and returns a layered model (``num_layers``, ``build_layer(index)`` and optionally
``loss``, ``export``, ``describe``). The module is imported with the config file's folder
on ``sys.path`` (after the existing entries), so a model file next to the job file works.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from chameleon_ft.runtime.workload.models.base import LayeredModel, check_model
from chameleon_ft.spec.config import Config


def import_factory(reference: str, field: str, search_dir: str | None = None) -> Callable[..., Any]:
    """The function named by ``package.module:function``.

    Args:
        reference: ``package.module:function``.
        field: the config field named in errors (``model.factory``, ``data.factory``).
        search_dir: a folder appended to ``sys.path`` first (the config file's).

    Raises:
        ValueError: one line naming ``field`` when the module does not import or has no
            such callable.
    """
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f'{field}: {reference!r} is not of the form "package.module:function"')
    if search_dir is not None and search_dir not in sys.path:
        sys.path.append(search_dir)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any error while importing user code is the user's input
        raise ValueError(f"{field}: cannot import {module_name!r}: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"{field}: module {module_name!r} has no callable {attr!r}")
    result: Callable[..., Any] = fn
    return result


def call_factory(reference: str, field: str, config: Config) -> Any:
    """Import and call a factory with ``config``.

    Raises:
        ValueError: naming ``field`` when it does not import or raises.
    """
    fn = import_factory(reference, field, str(config.resolve(".")))
    try:
        return fn(config)
    except ValueError as exc:
        text = str(exc)
        raise ValueError(text if text.startswith(f"{field}") else f"{field}: {text}") from None
    except Exception as exc:
        raise ValueError(f"{field}: {reference} raised {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def load_factory_model(config: Config) -> LayeredModel:
    """The model that ``[model] factory`` builds.

    Raises:
        ValueError: naming ``model.factory``.
    """
    obj = call_factory(config.model_source.factory, "model.factory", config)
    return check_model(obj, "model.factory")
