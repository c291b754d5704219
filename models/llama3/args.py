"""Llama 3 / 3.1 / 3.2 model arguments and the published flavors.

Shapes follow Meta's reference configs: the FFN width is derived from `dim`,
`ffn_dim_multiplier` and `multiple_of` exactly as Meta's `llama/model.py` does (8B: 14336,
70B: 28672, 405B: 53248), unless `hidden_dim` sets it directly (as a Hugging Face config does).
"""

from dataclasses import dataclass

from models.common.param_count import ParamCounts, decoder_param_counts
from models.contract import ModelShape


@dataclass
class Llama3Args:
    dim: int = 4096
    """Model (residual stream) width."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads; head_dim = dim // n_heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); None means n_heads."""
    vocab_size: int = 128256
    """Vocabulary size of the embedding and output projection."""
    multiple_of: int = 256
    """The derived FFN width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the derived FFN width (int(8 * dim / 3)); None means 1."""
    hidden_dim: int | None = None
    """Explicit FFN width; when set it overrides the derivation from dim/ffn_dim_multiplier/multiple_of."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    rope_scaling_factor: float | None = None
    """Llama 3.1 RoPE frequency scaling factor (8 for 8B/70B/405B, 32 for 3.2 1B/3B); None disables scaling."""
    rope_low_freq_factor: float = 1.0
    """Llama 3.1 RoPE scaling: wavelengths above original_max_seq_len / this are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """Llama 3.1 RoPE scaling: wavelengths below original_max_seq_len / this are unchanged."""
    rope_original_max_seq_len: int = 8192
    """Llama 3.1 RoPE scaling: the context length of the original pre-training."""
    max_seq_len: int = 131072
    """Length of the RoPE tables, i.e. the longest sequence the model accepts; the trainer sets it to the training seq_len."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection (Llama 3.2 1B/3B)."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}; allowed: >= 1")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"n_heads: dim {self.dim} is not divisible by n_heads {self.n_heads}; allowed: a divisor of dim"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"n_heads: head_dim = dim // n_heads = {self.head_dim} must be even for RoPE; "
                "allowed: n_heads that leave an even head_dim"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads != 0):
            raise ValueError(
                f"n_kv_heads: must divide n_heads {self.n_heads}, got {self.n_kv_heads}; allowed: a divisor of n_heads"
            )
        if self.hidden_dim is not None and self.hidden_dim <= 0:
            raise ValueError(
                f"hidden_dim: must be a positive integer or None, got {self.hidden_dim}; "
                "allowed: >= 1, or unset (from dim, ffn_dim_multiplier and multiple_of)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """FFN width: `hidden_dim` if set, else Meta's rule from dim, ffn_dim_multiplier, multiple_of."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def shape(self) -> ModelShape:
        return ModelShape(
            n_layers=self.n_layers,
            dim=self.dim,
            n_heads=self.n_heads,
            n_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            ffn_hidden=self.ffn_hidden_dim,
        )

    def param_counts(self) -> ParamCounts:
        return decoder_param_counts(
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            qk_norm=False,
            ffn_hidden_dim=self.ffn_hidden_dim,
            tie_embeddings=self.tie_embeddings,
        )

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Distinct parameters; `exclude_embedding` drops the token-embedding table (see param_count.py)."""
        counts = self.param_counts()
        return counts.total - (counts.embedding if exclude_embedding else 0)

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters used per token; equal to num_params for a dense model."""
        return self.num_params(exclude_embedding=exclude_embedding)


_LLAMA31_ROPE = dict(rope_theta=500000.0, rope_scaling_factor=8.0, max_seq_len=131072)
_LLAMA32_ROPE = dict(rope_theta=500000.0, rope_scaling_factor=32.0, max_seq_len=131072)

FLAVORS: dict[str, Llama3Args] = {
    # Tiny model for CPU runs and tests; vocab 4096 matches the bundled tokenizer.
    "debugmodel": Llama3Args(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=4,
        vocab_size=4096,
        multiple_of=256,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        max_seq_len=2048,
    ),
    # Llama 3.2 1B / 3B (tied embeddings).
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        tie_embeddings=True,
        **_LLAMA32_ROPE,
    ),
    "3B": Llama3Args(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        tie_embeddings=True,
        **_LLAMA32_ROPE,
    ),
    # Llama 3.1 8B / 70B / 405B.
    "8B": Llama3Args(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        **_LLAMA31_ROPE,
    ),
    "70B": Llama3Args(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        **_LLAMA31_ROPE,
    ),
    "405B": Llama3Args(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        **_LLAMA31_ROPE,
    ),
}
