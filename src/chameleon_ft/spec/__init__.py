"""Typed, frozen, validated specifications of model, device, cluster, job and settings."""

from chameleon_ft.spec.cluster import ClusterSpec
from chameleon_ft.spec.config import Config, config_from_mapping, load_config
from chameleon_ft.spec.data import DataKind, DataSpec
from chameleon_ft.spec.device import DEVICE_PRESETS, DeviceSpec, device_preset
from chameleon_ft.spec.job import RUNTIME_SCHEDULES, JobSpec, Placement, Schedule
from chameleon_ft.spec.model import MODEL_PRESETS, ModelSpec, model_preset
from chameleon_ft.spec.model_source import ModelSource, ModelSourceKind
from chameleon_ft.spec.optimizer import OptimizerSpec, ScheduleKind
from chameleon_ft.spec.profile_source import ProfileKind, ProfileSource, Recompute
from chameleon_ft.spec.recovery import LLAMA3_NODE_MTBF_HOURS, PolicySpec, RecoverySpec
from chameleon_ft.spec.train import TrainSpec

__all__ = [
    "DEVICE_PRESETS",
    "LLAMA3_NODE_MTBF_HOURS",
    "MODEL_PRESETS",
    "RUNTIME_SCHEDULES",
    "ClusterSpec",
    "Config",
    "DataKind",
    "DataSpec",
    "DeviceSpec",
    "JobSpec",
    "ModelSource",
    "ModelSourceKind",
    "ModelSpec",
    "OptimizerSpec",
    "Placement",
    "PolicySpec",
    "ProfileKind",
    "ProfileSource",
    "Recompute",
    "RecoverySpec",
    "Schedule",
    "ScheduleKind",
    "TrainSpec",
    "config_from_mapping",
    "device_preset",
    "load_config",
    "model_preset",
]
