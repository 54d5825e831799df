"""Model specifications: the shape of a decoder-only transformer, with named presets."""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_ft.spec._fields import check_choice, check_int, fail


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
    """``gelu`` (two matrices) or ``swiglu`` (three matrices)."""
    tied_embeddings: bool = False
    """Whether the head reuses the embedding matrix (parameters counted once)."""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "hidden_size", "num_heads", "vocab_size", "seq_len"):
            check_int(name, getattr(self, name))
        check_int("num_kv_heads", self.num_kv_heads, minimum=0)
        check_int("ffn_size", self.ffn_size, minimum=0)
        check_choice("mlp", self.mlp, ("gelu", "swiglu"))
        if self.hidden_size % self.num_heads:
            fail("hidden_size", f"{self.hidden_size} is not divisible by num_heads {self.num_heads}")
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
