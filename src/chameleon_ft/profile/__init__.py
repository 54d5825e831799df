"""Per-layer cost profiles: analytic (FLOPs and bytes), uniform (tests) and measured (file)."""

from __future__ import annotations

from chameleon_ft.profile.analytic import analytic_profile
from chameleon_ft.profile.profile import (
    LayerCost,
    Profile,
    UniformTP,
    chunk_sums,
    fold_profile,
    stage_sums,
    unfold_profile,
    uniform_profile,
)
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.profile_source import ProfileKind


def build_profile(config: Config, *, runtime: bool = False) -> Profile:
    """The profile a job file asks for (its ``[profile]`` table), folded into columns when
    the job interleaves ``virtual_stages`` chunks per worker (:func:`fold_profile`; for a
    model whose blocks split evenly into the chunks, the embedding and the head ride with
    the first and last blocks).

    ``runtime``: price the bytes the runtime holds for ``[train] dtype`` (an analytic
    profile; otherwise the planner's mixed-precision bytes, as published runs train).

    Raises:
        ValueError: when the profile cannot be built (missing file, layer count mismatch).
    """
    profile = _model_profile(config, runtime)
    v = config.job.virtual_stages
    if v > 1:
        # A model's first and last layers are the embedding and the head: when the blocks
        # split evenly into v rounds they ride in the first and last chunks (Megatron's
        # placement); otherwise they are chunks of their own (Llama 3's).
        attach = (config.profile.kind != ProfileKind.UNIFORM
                  and (profile.num_layers - 2) % v == 0)
        profile = fold_profile(profile, v, attach_ends=attach)
        if profile.num_layers < config.job.pp:
            raise ValueError(f"job.pp: {config.job.pp} stages need at least as many columns, "
                             f"{config.job.virtual_stages} chunks per stage leave "
                             f"{profile.num_layers}")
    return profile


def _uniform_tp(config: Config) -> UniformTP:
    """A uniform profile's layers over a worker of ``[job] tp`` devices: its collectives
    (``[profile] tp_collectives``) over the intra-node link at ``tp_collective_latency_s``
    a hop when set, free on an ideal network, and the framework's host time per sharded
    layer (``tp_host_fwd_s``, ``tp_host_bwd_s``), which no network makes free."""
    cluster, source = config.cluster, config.profile
    return UniformTP(degree=config.job.tp, collectives=source.tp_collectives,
                     collective_bytes=source.tp_collective_bytes,
                     link=None if cluster.ideal_network else cluster.link(same_node=True),
                     collective_latency_s=source.tp_collective_latency_s,
                     host_fwd_s=source.tp_host_fwd_s, host_bwd_s=source.tp_host_bwd_s)


def _model_profile(config: Config, runtime: bool = False) -> Profile:
    source = config.profile
    if source.kind == ProfileKind.UNIFORM:
        return uniform_profile(
            source.num_layers,
            fwd_s=source.fwd_s,
            bwd_input_s=source.bwd_input_s,
            bwd_weight_s=source.bwd_weight_s,
            param_bytes=source.param_bytes,
            optimizer_bytes=source.optimizer_bytes,
            activation_bytes=source.activation_bytes,
            output_bytes=source.output_bytes,
            optimizer_step_s=source.optimizer_step_s,
            tokens_per_sample=config.model.seq_len if config.model else 0,
            tp=_uniform_tp(config) if config.job.tp > 1 else None,
        )
    if source.kind == ProfileKind.FILE:
        profile = Profile.load(config.resolve(source.path))
        if profile.num_layers < config.job.pp:
            raise ValueError(f"profile.path: the profile has {profile.num_layers} layers, fewer "
                             f"than job.pp = {config.job.pp} stages")
        if config.model is not None and profile.num_layers != config.model.num_layers:
            raise ValueError(f"profile.path: the profile has {profile.num_layers} layers but the "
                             f"model has {config.model.num_layers}; re-profile this model")
        return profile
    assert config.model is not None and config.cluster.device is not None  # Config checks it
    return analytic_profile(config.model, config.cluster.device, micro_batch=config.job.micro_batch,
                            tp=config.job.tp, cluster=config.cluster, recompute=source.recompute,
                            optimizer_shards=config.job.dp if source.shard_optimizer else 1,
                            fused_attention=source.fused_attention,
                            train_dtype=config.train.dtype if runtime else None)


__all__ = [
    "LayerCost",
    "Profile",
    "UniformTP",
    "analytic_profile",
    "build_profile",
    "chunk_sums",
    "fold_profile",
    "stage_sums",
    "unfold_profile",
    "uniform_profile",
]
