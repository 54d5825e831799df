"""Model specifications: the shape of a decoder-only transformer, with named presets."""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_ft.spec._fields import check_choice, check_int, fail

MLP_KINDS = ("gelu", "swiglu", "geglu")
"""``[model] mlp``: a plain GELU MLP, or a gated one with SiLU (SwiGLU) or GELU (GeGLU)."""
ATTENTION_BIASES = ("none", "qkv", "all")
"""``[model] attention_bias``."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, as the planner sees it.

    The planner splits it into ``num_blocks + 2`` layers: the embedding (layer 0), each
    transformer block (layers 1..num_blocks) and the final norm + head (the last layer).
    """

    name: str = "custom"
    """A label for reports."""
    num_blocks: int
    """Number of transformer blocks."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention heads a."""
    num_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means equal to ``num_heads``."""
    ffn_size: int = 0
    """Hidden size of the MLP; 0 means ``4 * hidden_size``."""
    vocab_size: int
    """Vocabulary size V."""
    seq_len: int
    """Tokens per sample (sequence length s)."""
    mlp: str = "gelu"
    """``gelu`` (two matrices), ``swiglu`` or ``geglu`` (gated: three matrices, SiLU or GELU
    on the gate)."""
    tied_embeddings: bool = False
    """Whether the head reuses the embedding matrix. The model then holds it once, but the
    last stage still keeps its own copy (Megatron-LM's embedding group; so does the
    runtime), so the head's parameters count on the last stage either way."""
    head_dim: int = 0
    """Width of one attention head; 0 means ``hidden_size / num_heads``. Some families
    differ (Gemma 7B: 16 heads of 256 on a hidden size of 3072)."""
    attention_bias: str = "none"
    """Biases of the attention projections: ``none``, ``qkv`` (Qwen2) or ``all`` (q, k, v
    and the output projection: Llama's ``attention_bias = true``)."""
    mlp_bias: bool = False
    """Biases on the MLP's projections (Llama's ``mlp_bias = true``)."""
    qk_norm: bool = False
    """An RMSNorm over each head's query and key (Qwen3): ``2 head_dim`` parameters."""
    block_norms: int = 2
    """Norms of ``hidden_size`` per block: 2 (before attention and MLP), 4 for Gemma 2
    (also after each)."""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "hidden_size", "num_heads", "vocab_size", "seq_len"):
            check_int(name, getattr(self, name))
        check_int("num_kv_heads", self.num_kv_heads, minimum=0)
        check_int("ffn_size", self.ffn_size, minimum=0)
        check_choice("mlp", self.mlp, MLP_KINDS)
        check_int("head_dim", self.head_dim, minimum=0)
        check_choice("attention_bias", self.attention_bias, ATTENTION_BIASES)
        check_int("block_norms", self.block_norms, minimum=0)
        if not self.head_dim and self.hidden_size % self.num_heads:
            fail("hidden_size", f"{self.hidden_size} is not divisible by num_heads "
                 f"{self.num_heads}; set head_dim")
        if self.kv_heads > self.num_heads or self.num_heads % self.kv_heads:
            fail("num_kv_heads", f"{self.kv_heads} must divide num_heads {self.num_heads}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads, resolving the 0 default."""
        return self.num_kv_heads or self.num_heads

    @property
    def ffn(self) -> int:
        """MLP hidden size, resolving the 0 default."""
        return self.ffn_size or 4 * self.hidden_size

    @property
    def head_size(self) -> int:
        """Width of one attention head, resolving the 0 default."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (three matrices)."""
        return self.mlp in ("swiglu", "geglu")

    def block_params(self) -> int:
        """Parameters of one transformer block: the four attention projections (with their
        biases), the MLP's matrices (and biases), q/k norms and the block's norms."""
        h, f, d = self.hidden_size, self.ffn, self.head_size
        q, kv = self.num_heads * d, self.kv_heads * d
        attention = h * q + 2 * h * kv + q * h
        if self.attention_bias != "none":
            attention += q + 2 * kv + (h if self.attention_bias == "all" else 0)
        inputs = 2 if self.gated else 1
        mlp = (inputs + 1) * h * f + ((inputs * f + h) if self.mlp_bias else 0)
        return attention + mlp + (2 * d if self.qk_norm else 0) + self.block_norms * h

    @property
    def num_layers(self) -> int:
        """Layers as the planner counts them: embedding + blocks + head."""
        return self.num_blocks + 2


def _preset(**kwargs: object) -> ModelSpec:
    return ModelSpec(**kwargs)  # type: ignore[arg-type]


MODEL_PRESETS: dict[str, ModelSpec] = {
    # GPT-3 family (Brown et al. 2020, Table 2.1), GELU MLP of 4h, 2048-token context.
    "gpt3-1.3b": _preset(name="gpt3-1.3b", num_blocks=24, hidden_size=2048, num_heads=16,
                         vocab_size=50257, seq_len=2048, tied_embeddings=True),
    "gpt3-2.7b": _preset(name="gpt3-2.7b", num_blocks=32, hidden_size=2560, num_heads=32,
                         vocab_size=50257, seq_len=2048, tied_embeddings=True),
    "gpt3-6.7b": _preset(name="gpt3-6.7b", num_blocks=32, hidden_size=4096, num_heads=32,
                         vocab_size=50257, seq_len=2048, tied_embeddings=True),
    "gpt3-13b": _preset(name="gpt3-13b", num_blocks=40, hidden_size=5120, num_heads=40,
                        vocab_size=50257, seq_len=2048, tied_embeddings=True),
    # Llama 2 (Touvron et al. 2023): SwiGLU, untied embeddings, 4096-token context.
    "llama2-7b": _preset(name="llama2-7b", num_blocks=32, hidden_size=4096, num_heads=32,
                         ffn_size=11008, vocab_size=32000, seq_len=4096, mlp="swiglu"),
    "llama2-13b": _preset(name="llama2-13b", num_blocks=40, hidden_size=5120, num_heads=40,
                          ffn_size=13824, vocab_size=32000, seq_len=4096, mlp="swiglu"),
    # Llama 3 (Dubey et al. 2024, Table 3): GQA with 8 KV heads, 8192-token context.
    "llama3-8b": _preset(name="llama3-8b", num_blocks=32, hidden_size=4096, num_heads=32,
                         num_kv_heads=8, ffn_size=14336, vocab_size=128256, seq_len=8192,
                         mlp="swiglu"),
    "llama3-70b": _preset(name="llama3-70b", num_blocks=80, hidden_size=8192, num_heads=64,
                          num_kv_heads=8, ffn_size=28672, vocab_size=128256, seq_len=8192,
                          mlp="swiglu"),
    "llama3-405b": _preset(name="llama3-405b", num_blocks=126, hidden_size=16384,
                           num_heads=128, num_kv_heads=8, ffn_size=53248, vocab_size=128256,
                           seq_len=8192, mlp="swiglu"),
}


def model_preset(name: str) -> ModelSpec:
    """Return the named model preset.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name not in MODEL_PRESETS:
        fail("model.preset", f"unknown model {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]
