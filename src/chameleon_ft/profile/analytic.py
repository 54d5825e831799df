"""Analytic per-layer profile from the model's operations, priced by the device's roofline.

docs/design.md section 3.6. Each transformer block is its matrix products (QKV, output
projection, the MLP's one or two input projections and its output projection), the
attention core and the elementwise work (norms, residual adds, the activation function),
each priced by :meth:`~chameleon_ft.spec.device.DeviceSpec.op_seconds`: the larger of its
FLOPs at the achievable peak and its bytes at the achievable bandwidth. A product's input
gradient and weight gradient each cost what its forward costs; the attention core follows
the causal mask (half the score matrix) and its backward recomputes the scores as fused
attention kernels do (2.5 forwards). Tensor parallelism divides the products and, with
sequence parallelism, the elementwise work by ``t``, and adds two collectives of the
block's output per direction (Narayanan et al. 2021; Korthikanti et al. 2022).
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_ft.profile.profile import LayerCost, Profile, ring_half_s
from chameleon_ft.spec.cluster import ClusterSpec
from chameleon_ft.spec.device import DeviceSpec
from chameleon_ft.spec.model import ModelSpec
from chameleon_ft.spec.profile_source import Recompute

BF16_BYTES = 2
OPTIMIZER_BYTES_PER_PARAM = 12
"""fp32 master weights plus Adam's two moments."""
TRAIN_DTYPE_BYTES: dict[str, tuple[int, int, int]] = {
    "bfloat16": (2, 4, 12),  # bf16 compute copy; fp32 gradients; fp32 masters + 2 moments
    "float32": (4, 4, 8),
    "float64": (8, 8, 16),
}
"""Per parameter, the runtime's (weights, gradients, optimizer state) bytes for each
``[train] dtype``; activations and boundaries scale with the weights' element size."""
MIXED_BYTES = (BF16_BYTES, BF16_BYTES, OPTIMIZER_BYTES_PER_PARAM)
"""The planner's default: bf16 weights and gradients, fp32 masters and moments."""
OPTIMIZER_TRAFFIC_BYTES_PER_PARAM = 32
"""Memory traffic of one mixed-precision AdamW update per parameter (reads and writes)."""
CAUSAL_SHARE = 0.5
"""Share of the score matrix a causal attention kernel computes (the masked half is skipped)."""
ATTENTION_BACKWARD_RATIO = 2.5
"""Backward over forward FLOPs of fused attention: the scores are recomputed (5 products
against the forward's 2; Dao 2023)."""
UNFUSED_SCORE_BYTES = 13
"""Forward memory traffic per score element of unfused attention (see the block below)."""


def _ring_allreduce_s(num_bytes: float, ranks: int, latency_s: float, bw_bytes_s: float) -> float:
    """A ring all-reduce: one reduce-scatter and one all-gather."""
    return 2 * ring_half_s(num_bytes, ranks, latency_s, bw_bytes_s)


def _gemm(device: DeviceSpec, m: float, k: float, n: float) -> float:
    """Seconds of an ``(m x k) @ (k x n)`` bf16 product: read both operands, write the result."""
    return device.op_seconds(2 * m * k * n, BF16_BYTES * (m * k + k * n + m * n))


def activation_bytes_per_token(model: ModelSpec) -> float:
    """Bytes one block keeps per token for its backward when nothing is recomputed, with a
    fused attention kernel that keeps no score matrix and sequence parallelism (divide by
    ``t``).

    Norm inputs (2 x 2h), the QKV input (2h), Q (2ad: 2h unless ``head_dim`` differs),
    K and V (4 kv d), the attention output (2ad), the MLP input (2h) and the MLP's
    activations: GELU's input and output (4f), or a gated MLP's gate, up and their product
    (6f; the activation is recomputed by the fused kernel). GELU models add two dropout masks (2h). For GPT-3 shapes this is Korthikanti
    et al.'s ``34 s b h / t`` (their Eq. 6).
    """
    h, f = model.hidden_size, model.ffn
    q, kv = _attention_widths(model)
    attention = 4 * h + 2 * h + 2 * q + 4 * kv + 2 * q
    if model.gated:
        return attention + 2 * h + 6 * f
    return attention + 2 * h + 4 * f + 2 * h


def _attention_widths(model: ModelSpec) -> tuple[float, float]:
    """Widths of the queries (and the attention output) and of the keys (and the values):
    ``a d`` and ``kv d``; ``h`` and ``h kv / a`` when ``head_dim`` is ``h / a``."""
    if model.head_dim:
        return float(model.num_heads * model.head_dim), float(model.kv_heads * model.head_dim)
    h = model.hidden_size
    return float(h), h * (model.kv_heads / model.num_heads)


@dataclass(frozen=True)
class _Shape:
    """One micro-batch through one block on one of ``t`` tensor-parallel devices."""

    model: ModelSpec
    device: DeviceSpec
    b: int
    t: int

    @property
    def tokens(self) -> int:
        return self.b * self.model.seq_len

    @property
    def widths(self) -> tuple[float, float]:
        """The queries' and the keys' widths (:func:`_attention_widths`)."""
        return _attention_widths(self.model)

    @property
    def gated(self) -> bool:
        return self.model.gated

    @property
    def mlp_in(self) -> int:
        """The MLP's input projections' width: gate and up for SwiGLU."""
        return (2 if self.gated else 1) * self.model.ffn

    @property
    def scores(self) -> float:
        """Score-matrix elements on this device."""
        s = self.model.seq_len
        return self.b * s * s * self.model.num_heads / self.t


def _tp_comm_s(shape: _Shape, cluster: ClusterSpec | None) -> float:
    """A block's tensor-parallel collectives, per direction: two all-reduces (or all-gather
    + reduce-scatter) of its output over the intra-node link; free on an ideal network."""
    if cluster is None or cluster.ideal_network or shape.t <= 1:
        return 0.0
    latency_s, bw = cluster.link(same_node=True)
    return 2 * _ring_allreduce_s(BF16_BYTES * shape.tokens * shape.model.hidden_size,
                                 shape.t, latency_s, bw)


def _products_s(shape: _Shape) -> float:
    """A block's four products, forward (its input gradient and weight gradient each cost
    the same)."""
    device, tokens, t = shape.device, shape.tokens, shape.t
    h, f = shape.model.hidden_size, shape.model.ffn
    q_width, kv_width = shape.widths
    qkv_out = q_width + 2 * kv_width
    return (
        _gemm(device, tokens, h, qkv_out / t)
        + _gemm(device, tokens, q_width / t, h)
        + _gemm(device, tokens, h, shape.mlp_in / t)
        + _gemm(device, tokens, f / t, h)
    )


def _attention_s(shape: _Shape, fused: bool) -> tuple[float, float]:
    """The attention core (``Q K^T`` and ``P V`` over this device's heads), forward and
    backward."""
    device, t = shape.device, shape.t
    b, s = shape.b, shape.model.seq_len
    q_width, kv_width = shape.widths
    attention_flops = 4 * b * s * s * q_width / t
    qkvo_bytes = BF16_BYTES * shape.tokens * (2 * q_width + 2 * kv_width) / t
    if fused:
        # The causal half only; the backward recomputes the scores.
        return (device.op_seconds(CAUSAL_SHARE * attention_flops, qkvo_bytes),
                device.op_seconds(ATTENTION_BACKWARD_RATIO * CAUSAL_SHARE * attention_flops,
                                  2 * qkvo_bytes))
    # Two batched products over the whole square, and the score matrix through memory:
    # written (2 bytes), scale-mask-softmax read and written (4), dropout read, written
    # and its mask (5), read by P V (2); about twice that backward.
    scores = shape.scores
    return (device.op_seconds(attention_flops, qkvo_bytes)
            + device.op_seconds(0.0, UNFUSED_SCORE_BYTES * scores),
            device.op_seconds(2 * attention_flops, 2 * qkvo_bytes)
            + device.op_seconds(0.0, 2 * UNFUSED_SCORE_BYTES * scores))


def _elementwise_s(shape: _Shape) -> tuple[float, float]:
    """Elementwise work, memory-bound, forward and backward: two norms (read + write), two
    residual adds (two reads + one write) on this device's 1/t of the tokens (sequence
    parallelism), and the activation function on its 1/t of the MLP width. The backward
    moves about twice as much."""
    t, h, f = shape.t, shape.model.hidden_size, shape.model.ffn
    elementwise_bytes = BF16_BYTES * shape.tokens * ((2 * 2 * h + 2 * 3 * h) / t
                                                     + (3 if shape.gated else 2) * f / t)
    return (shape.device.op_seconds(0.0, elementwise_bytes),
            shape.device.op_seconds(0.0, 2 * elementwise_bytes))


@dataclass(frozen=True)
class _BlockCosts:
    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    activation_bytes: float
    workspace_bytes: float
    """Full recomputation runs one block's forward again inside its backward: its
    activations live, for one micro-batch, while that backward runs."""


def _block(shape: _Shape, recompute: str, fused_attention: bool) -> _BlockCosts:
    """One transformer block's seconds and the activation bytes it keeps per micro-batch."""
    products = _products_s(shape)
    attention_s, attention_bwd_s = _attention_s(shape, fused_attention)
    elementwise_s, elementwise_bwd_s = _elementwise_s(shape)
    block_fwd_s = products + attention_s + elementwise_s
    recompute_s = {
        Recompute.NONE.value: 0.0,
        Recompute.SELECTIVE.value: attention_s,
        Recompute.FULL.value: block_fwd_s,
    }[recompute]
    tokens, t, h = shape.tokens, shape.t, shape.model.hidden_size
    kept = activation_bytes_per_token(shape.model) * tokens / t
    # Unfused attention keeps the softmax output (2 bytes), its dropout mask (1) and the
    # dropped-out scores (2) per element: Korthikanti et al.'s 5 a s^2 b / t.
    score_bytes = 0.0 if fused_attention else 5 * shape.scores
    activation = {
        Recompute.NONE.value: kept + score_bytes,
        Recompute.SELECTIVE.value: kept,
        # Only the block input is kept; with sequence parallelism each device keeps 1/t.
        Recompute.FULL.value: BF16_BYTES * tokens * h / t,
    }[recompute]
    recomputed = kept + score_bytes - activation if recompute == Recompute.FULL.value else 0.0
    return _BlockCosts(fwd_s=block_fwd_s,
                       bwd_input_s=products + attention_bwd_s + elementwise_bwd_s + recompute_s,
                       bwd_weight_s=products, activation_bytes=activation,
                       workspace_bytes=recomputed)


def _layer(name: str, fwd_s: float, bwd_input_s: float, bwd_weight_s: float, params: float,
           act: float, out: float, *, t: int, optimizer_shards: int,
           dtype_bytes: tuple[int, int, int] = MIXED_BYTES, comm_s: float = 0.0,
           workspace: float = 0.0) -> LayerCost:
    """A layer's costs per device: ``params`` split over ``t`` devices, the optimizer
    state and the gradients over ``optimizer_shards``, at ``dtype_bytes`` (weights,
    gradients, optimizer state) a parameter; activations in the weights' dtype."""
    weight_b, grad_b, optimizer_b = dtype_bytes
    act_scale = weight_b / BF16_BYTES
    per_device = params / t
    return LayerCost(
        name=name,
        fwd_s=fwd_s + comm_s,
        bwd_input_s=bwd_input_s + comm_s,
        bwd_weight_s=bwd_weight_s,
        param_bytes=weight_b * per_device,
        optimizer_bytes=optimizer_b * per_device / optimizer_shards,
        grad_bytes=(None if optimizer_shards == 1 and grad_b == weight_b
                    else grad_b * per_device / optimizer_shards),
        activation_bytes=act * act_scale,
        output_bytes=out * act_scale,
        workspace_bytes=workspace * act_scale,
    )


def layer_parameters(model: ModelSpec) -> list[int]:
    """Parameters of each planner layer: the embedding (``V h``), each block
    (:meth:`~chameleon_ft.spec.model.ModelSpec.block_params`) and the head (its ``V h``
    matrix, its own copy when tied, and the final norm's ``h``)."""
    v, h = model.vocab_size, model.hidden_size
    return [v * h, *[model.block_params()] * model.num_blocks, v * h + h]


def _head(shape: _Shape, params: int, optimizer_shards: int,
          dtype_bytes: tuple[int, int, int] = MIXED_BYTES) -> LayerCost:
    """The final norm, the logits product and a softmax cross-entropy over fp32 logits.

    A tied head still keeps its own copy on the last stage (Megatron does the same and
    all-reduces the two copies' gradients), so its bytes count there, as the embedding's
    count on the first; the profile's ``tied_bytes`` prices the copies' reduction.
    """
    device, tokens, t = shape.device, shape.tokens, shape.t
    h, v = shape.model.hidden_size, shape.model.vocab_size
    logits_s = _gemm(device, tokens, h, v / t)
    loss_bytes = 3 * 4 * tokens * v / t
    norm_s = device.op_seconds(0.0, 2 * BF16_BYTES * tokens * h / t)
    head_fwd_s = logits_s + device.op_seconds(0.0, loss_bytes) + norm_s
    head_bwd_s = logits_s + device.op_seconds(0.0, loss_bytes) + 2 * norm_s
    head_act = BF16_BYTES * tokens * h / t + 4 * tokens * v / t  # input + fp32 logits
    return _layer("head", head_fwd_s, head_bwd_s, logits_s, params, head_act, 0.0, t=t,
                  optimizer_shards=optimizer_shards, dtype_bytes=dtype_bytes)


def _optimizer_step_s(layers: list[LayerCost], device: DeviceSpec, optimizer_shards: int,
                      weight_bytes: int = BF16_BYTES) -> float:
    """The optimizer step over every layer's parameters on one device, memory-bound."""
    total_params_per_device = sum(layer.param_bytes for layer in layers) / weight_bytes
    if device.mfu is not None:  # the flat model prices memory traffic at the datasheet rate
        return (total_params_per_device * OPTIMIZER_TRAFFIC_BYTES_PER_PARAM
                / optimizer_shards / (device.memory_gb_per_s * 1e9))
    return device.op_seconds(
        0.0, total_params_per_device * OPTIMIZER_TRAFFIC_BYTES_PER_PARAM / optimizer_shards)


def _dtype_bytes(recompute: str, optimizer_shards: int,
                 train_dtype: str | None) -> tuple[int, int, int]:
    """The bytes per parameter of weights, gradients and optimizer state
    (:func:`analytic_profile`'s arguments checked).

    Raises:
        ValueError: for an unknown recomputation or dtype or a non-positive shard count.
    """
    if recompute not in {r.value for r in Recompute}:
        raise ValueError(f"profile.recompute: unknown value {recompute!r}")
    if optimizer_shards < 1:
        raise ValueError(f"optimizer_shards: must be >= 1, got {optimizer_shards}")
    if train_dtype is not None and train_dtype not in TRAIN_DTYPE_BYTES:
        raise ValueError(f"train.dtype: unknown value {train_dtype!r}")
    return TRAIN_DTYPE_BYTES.get(train_dtype or "", MIXED_BYTES)


def _layers(shape: _Shape, cluster: ClusterSpec | None, recompute: str,
            fused_attention: bool, optimizer_shards: int,
            dtype_bytes: tuple[int, int, int]) -> list[LayerCost]:
    """The embedding, every transformer block and the head, per device."""
    model, device = shape.model, shape.device
    tokens, t, h = shape.tokens, shape.t, model.hidden_size
    block = _block(shape, recompute, fused_attention)
    boundary_bytes = BF16_BYTES * tokens * h / t  # scatter-gather: each device sends 1/t
    # Embedding: a gather forward, a scatter-add into its gradient backward.
    lookup_s = device.op_seconds(0.0, 2 * BF16_BYTES * tokens * h / t)
    params = layer_parameters(model)
    layers = [_layer("embedding", lookup_s, 0.0, lookup_s, params[0],
                     BF16_BYTES * tokens * h / t, boundary_bytes, t=t,
                     optimizer_shards=optimizer_shards, dtype_bytes=dtype_bytes)]
    tp_comm_s = _tp_comm_s(shape, cluster)
    for i in range(model.num_blocks):
        layers.append(_layer(f"block{i}", block.fwd_s, block.bwd_input_s, block.bwd_weight_s,
                             params[1 + i], block.activation_bytes, boundary_bytes, t=t,
                             optimizer_shards=optimizer_shards, dtype_bytes=dtype_bytes,
                             comm_s=tp_comm_s, workspace=block.workspace_bytes))
    layers.append(_head(shape, params[-1], optimizer_shards, dtype_bytes))
    return layers


def analytic_profile(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    micro_batch: int = 1,
    tp: int = 1,
    cluster: ClusterSpec | None = None,
    recompute: str = Recompute.SELECTIVE.value,
    optimizer_shards: int = 1,
    fused_attention: bool = True,
    train_dtype: str | None = None,
) -> Profile:
    """Per-layer costs of ``model`` on ``device`` with tensor parallelism ``tp``.

    Args:
        model: the transformer.
        device: the accelerator and its roofline (or flat ``mfu``).
        micro_batch: samples per micro-batch.
        tp: tensor-parallel degree (devices per worker).
        cluster: gives the intra-node link for tensor-parallel collectives; ``None`` or an
            ideal network makes them free.
        recompute: ``none``, ``selective`` (the attention core is recomputed) or ``full``
            (the whole block).
        optimizer_shards: devices the optimizer state and the gradients are sharded over
            (ZeRO-2, FSDP as Llama 3 runs it; 1 for replicated ones).
        fused_attention: a fused attention kernel (FlashAttention: causal half, no score
            matrix in memory); otherwise the scores are written, softmaxed, dropped out and
            read back, and kept for the backward unless recomputed.
        train_dtype: the runtime's numerics (``[train] dtype``), whose bytes replace the
            default mixed-precision ones (bf16 weights and gradients, fp32 masters and
            moments: 16 bytes a parameter, bf16 activations): ``bfloat16`` (the runtime's
            fp32 gradients: 18), ``float32`` (16, activations twice as large), ``float64``
            (32, four times). Timings are unchanged.

    Returns:
        A profile with ``model.num_layers`` layers, figures per device; for a tied head,
        ``tied_bytes`` is the shared ``V x h`` weight's bytes per device (the embedding
        and the head each count their own copy in their layer's bytes).

    Raises:
        ValueError: for an unknown recomputation or a non-positive shard count.
    """
    dtype_bytes = _dtype_bytes(recompute, optimizer_shards, train_dtype)
    shape = _Shape(model=model, device=device, b=micro_batch, t=tp)
    layers = _layers(shape, cluster, recompute, fused_attention, optimizer_shards,
                     dtype_bytes)
    t, h, v = tp, model.hidden_size, model.vocab_size
    return Profile(
        layers=tuple(layers),
        # a tied head: the V x h weight whose two copies' gradients every step sums
        tied_bytes=dtype_bytes[0] * v * h / t if model.tied_embeddings else 0.0,
        optimizer_step_s=_optimizer_step_s(layers, device, optimizer_shards, dtype_bytes[0]),
        tokens_per_sample=model.seq_len,
        micro_batch=micro_batch,
        source="analytic",
        meta={"model": model.name, "device": device.name, "tp": tp, "recompute": recompute,
              "optimizer_shards": optimizer_shards, "fused_attention": fused_attention,
              **({"train_dtype": train_dtype} if train_dtype else {})},
    )
