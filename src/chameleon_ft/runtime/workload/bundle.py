"""What a job trains, as the workers receive it: the config and the user's own objects.

The coordinator puts one :class:`Workload` in the job description: the config, and the
model, data source, optimizer factory and learning-rate schedule given through the
Python API (``chameleon_ft.train``), if any. Objects not given are built from the config
(``[model]``, ``[data]``, ``[optimizer]``) on each worker. The workload is pickled, because
the user's objects are arbitrary Python, and sealed with an HMAC under the job's secret:
a worker checks the seal before it unpickles anything, so nobody without the token can
make a worker run code through the store.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chameleon_ft.runtime.workload.data import DataSource, check_data, data_digest, load_data
from chameleon_ft.runtime.workload.models import LayeredModel, check_model, load_model
from chameleon_ft.runtime.workload.optim import (
    OptimizerFactory,
    optimizer_from_config,
    schedule_from_config,
)
from chameleon_ft.runtime.workload.schedules import TorchLRSchedule, is_scheduler_instance
from chameleon_ft.spec.config import Config


@dataclass(frozen=True)
class Workload:
    """The config and the API's objects (``None``: built from the config)."""

    config: Config
    model_obj: Any = None
    data_obj: Any = None
    optimizer_obj: Any = None
    lr_schedule_obj: Any = None

    def __post_init__(self) -> None:
        # a scheduler instance is read here, once, for the run's steps: a live scheduler
        # (its optimizer's wrapped step) does not pickle for the workers
        if is_scheduler_instance(self.lr_schedule_obj):
            object.__setattr__(self, "lr_schedule_obj", TorchLRSchedule(
                self.lr_schedule_obj, steps=self.config.train.steps))

    def model(self) -> LayeredModel:
        """The layered model.

        Raises:
            ValueError: naming the ``[model]`` field or ``model`` argument at fault.
        """
        if self.model_obj is not None:
            return check_model(self.model_obj, "model")
        return load_model(self.config)

    def data(self, model: LayeredModel | None = None) -> DataSource:
        """The data source.

        Raises:
            ValueError: naming the ``[data]`` field or ``data`` argument at fault.
        """
        if self.data_obj is not None:
            return check_data(self.data_obj, "data")
        vocab = getattr(model, "vocab_size", None) if model is not None else None
        return load_data(self.config, vocab_size=vocab if isinstance(vocab, int) else None)

    def optimizer(self) -> OptimizerFactory:
        """The optimizer factory (one optimizer per layer).

        Raises:
            ValueError: naming the ``[optimizer]`` field at fault.
        """
        if self.optimizer_obj is not None:
            if not callable(self.optimizer_obj):
                raise ValueError("optimizer: give a callable params -> torch.optim.Optimizer")
            factory: OptimizerFactory = self.optimizer_obj
            return factory
        return optimizer_from_config(self.config)

    def lr_schedule(self) -> Callable[[int], float] | None:
        """The learning rate of each 0-based step, or None (the optimizer's own rate).

        With an optimizer object, only an explicit schedule applies (``[optimizer]``'s
        schedule is built for ``[optimizer]``'s rate). A ``torch.optim.lr_scheduler``
        scheduler (class, factory or instance) is taken as a :class:`TorchLRSchedule`
        starting from the optimizer factory's rate.

        Raises:
            ValueError: naming ``lr_schedule`` for what is no schedule of the step.
        """
        if self.lr_schedule_obj is not None:
            schedule = TorchLRSchedule.wrap(self.lr_schedule_obj, self.optimizer(),
                                            self.config.train.steps)
            if not callable(schedule):
                raise ValueError("lr_schedule: give a callable step -> learning rate, or a "
                                 "torch.optim.lr_scheduler class, factory or instance")
            fn: Callable[[int], float] = schedule
            return fn
        if self.optimizer_obj is not None:
            return None
        return schedule_from_config(self.config)

    @staticmethod
    def data_digest(data: DataSource) -> str:
        """The data's digest, checked across hosts."""
        return data_digest(data)


def _mac(secret: bytes, raw: bytes) -> bytes:
    return hmac.new(secret, b"chameleon-workload|" + raw, hashlib.sha256).digest()


def seal_workload(workload: Workload, secret: bytes) -> str:
    """Pickle and seal ``workload`` (text for the store).

    Raises:
        ValueError: when an object cannot be pickled (a lambda, a local class).
    """
    try:
        raw = pickle.dumps(workload)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(f"model/data/optimizer: the objects given must be picklable to reach "
                         f"the workers (module-level classes and functions, "
                         f"functools.partial; not lambdas or local classes): {exc}") from None
    return base64.b64encode(_mac(secret, raw) + raw).decode()


def open_workload(text: str, secret: bytes) -> Workload:
    """Check the seal, then unpickle.

    Raises:
        ValueError: for a workload not sealed with ``secret``, or objects this host cannot
            load.
    """
    try:
        blob = base64.b64decode(text.encode(), validate=True)
    except ValueError:
        raise ValueError("job: the workload is not readable") from None
    mac, raw = blob[:32], blob[32:]
    if not hmac.compare_digest(mac, _mac(secret, raw)):
        raise ValueError("job: the workload is not sealed with this job's secret (wrong "
                         "token?)")
    try:
        workload = pickle.loads(raw)  # sealed by the coordinator: checked above
    except Exception as exc:
        raise ValueError(f"model/data/optimizer: the job's objects cannot be loaded on this "
                         f"host ({type(exc).__name__}: {exc}); install the same code here, "
                         "or name importable factories in the job file") from None
    if not isinstance(workload, Workload):
        raise ValueError("job: the workload is not a chameleon workload")
    return workload
