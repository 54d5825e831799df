"""Analytic per-layer profile from the model's FLOPs and bytes on a device.

Public formulas (docs/design.md section 3.6; Narayanan et al. 2021, Korthikanti et al. 2022):
forward FLOPs of a block ``2 b s (attn_proj h^2 + 2 h f_eff) + 4 b s^2 h``; backward is two
forwards (input gradient + weight gradient); tensor parallelism divides compute, parameters
and most activations by ``t`` and adds two all-reduces of ``2 s b h`` bytes per block in
each direction inside the node.
"""

from __future__ import annotations

from chameleon_ft.profile.profile import LayerCost, Profile
from chameleon_ft.spec.cluster import ClusterSpec
from chameleon_ft.spec.device import DeviceSpec
from chameleon_ft.spec.model import ModelSpec
from chameleon_ft.spec.profile_source import Recompute

BF16_BYTES = 2
OPTIMIZER_BYTES_PER_PARAM = 12
"""fp32 master weights plus Adam's two moments."""
OPTIMIZER_TRAFFIC_BYTES_PER_PARAM = 32
"""Memory traffic of one mixed-precision AdamW update per parameter (reads and writes)."""


def _ring_allreduce_s(num_bytes: float, ranks: int, latency_s: float, bw_bytes_s: float) -> float:
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * num_bytes / bw_bytes_s + 2 * (ranks - 1) * latency_s


def analytic_profile(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    micro_batch: int = 1,
    tp: int = 1,
    cluster: ClusterSpec | None = None,
    recompute: str = Recompute.SELECTIVE.value,
) -> Profile:
    """Per-layer costs of ``model`` on ``device`` with tensor parallelism ``tp``.

    Args:
        model: the transformer.
        device: the accelerator; its sustained FLOP/s is ``peak_flops * mfu``.
        micro_batch: samples per micro-batch.
        tp: tensor-parallel degree (devices per worker).
        cluster: gives the intra-node link for tensor-parallel all-reduces; ``None`` or an
            ideal network makes them free.
        recompute: ``none``, ``selective`` or ``full`` activation recomputation.

    Returns:
        A profile with ``model.num_layers`` layers, figures per device.
    """
    b, s, h, a = micro_batch, model.seq_len, model.hidden_size, model.num_heads
    v, f = model.vocab_size, model.ffn
    kv_ratio = model.kv_heads / a
    f_eff = 1.5 * f if model.mlp == "swiglu" else float(f)
    flops_s = device.flops
    mem_bw = device.memory_gb_per_s * 1e9

    tp_comm_s = 0.0
    if cluster is not None and not cluster.ideal_network and tp > 1:
        latency_s, bw = cluster.link(same_node=True)
        # Two all-reduces of the block's output activation per direction.
        tp_comm_s = 2 * _ring_allreduce_s(BF16_BYTES * s * b * h, tp, latency_s, bw)

    attn_proj = 2 + 2 * kv_ratio  # Q and O are h x h; K and V shrink with grouped-query attention
    block_params = attn_proj * h * h + 2 * h * f_eff + 2 * h  # + two norms
    block_matmul = 2 * b * s * block_params
    block_attn = 4 * b * s * s * h
    block_fwd_s = (block_matmul + block_attn) / tp / flops_s
    recompute_s = {
        Recompute.NONE.value: 0.0,
        Recompute.SELECTIVE.value: block_attn / tp / flops_s,
        Recompute.FULL.value: block_fwd_s,
    }[recompute]
    activation = {
        Recompute.NONE.value: s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)),
        Recompute.SELECTIVE.value: 34 * s * b * h / tp,
        # Only the block input is kept; with sequence parallelism each device keeps 1/t.
        Recompute.FULL.value: BF16_BYTES * s * b * h / tp,
    }[recompute]
    boundary_bytes = BF16_BYTES * s * b * h / tp  # scatter-gather: each device sends 1/t

    def layer(name: str, fwd_s: float, params: float, act: float, out: float,
              extra_bwd_s: float = 0.0, comm_s: float = 0.0) -> LayerCost:
        per_device = params / tp
        return LayerCost(
            name=name,
            fwd_s=fwd_s + comm_s,
            bwd_input_s=fwd_s + extra_bwd_s + comm_s,
            bwd_weight_s=fwd_s,
            param_bytes=BF16_BYTES * per_device,
            optimizer_bytes=OPTIMIZER_BYTES_PER_PARAM * per_device,
            activation_bytes=act,
            output_bytes=out,
        )

    layers = [layer("embedding", 0.0, v * h, BF16_BYTES * s * b * h / tp, boundary_bytes)]
    for i in range(model.num_blocks):
        layers.append(layer(f"block{i}", block_fwd_s, block_params, activation, boundary_bytes,
                            extra_bwd_s=recompute_s, comm_s=tp_comm_s))
    head_fwd_s = 2 * b * s * h * v / tp / flops_s
    head_act = BF16_BYTES * s * b * h / tp + 4 * s * b * v / tp  # input + fp32 logits
    # A tied head still keeps its own copy on the last stage (Megatron does the same and
    # all-reduces the two copies' gradients), so its bytes count there.
    layers.append(layer("head", head_fwd_s, v * h + h, head_act, 0.0))

    total_params_per_device = sum(layer.param_bytes for layer in layers) / BF16_BYTES
    optimizer_step_s = total_params_per_device * OPTIMIZER_TRAFFIC_BYTES_PER_PARAM / mem_bw
    return Profile(
        layers=tuple(layers),
        optimizer_step_s=optimizer_step_s,
        tokens_per_sample=s,
        micro_batch=micro_batch,
        source="analytic",
        meta={"model": model.name, "device": device.name, "tp": tp, "recompute": recompute},
    )
