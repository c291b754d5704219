"""Qwen 3 model arguments (dense and MoE) and the published flavors.

Dense and MoE share one dataclass: `num_experts == 0` means every block has a dense SwiGLU FFN
of width `hidden_dim`; `num_experts > 0` means every block has a dropless top-k MoE
(`num_experts_per_tok` of `num_experts` experts of width `moe_hidden_dim`, no shared expert).
Shapes are those of the Hugging Face `config.json` of each Qwen/Qwen3-* checkpoint.
"""

from dataclasses import dataclass

from models.common.param_count import ParamCounts, decoder_param_counts
from models.contract import ModelShape


@dataclass
class Qwen3Args:
    dim: int = 4096
    """Model (residual stream) width (HF hidden_size)."""
    n_layers: int = 36
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads."""
    n_kv_heads: int = 8
    """Number of key/value heads (grouped-query attention); must divide n_heads."""
    head_dim: int = 128
    """Per-head width; Qwen 3 uses 128 regardless of dim (so n_heads * head_dim may differ from dim)."""
    vocab_size: int = 151936
    """Vocabulary size of the embedding and output projection."""
    hidden_dim: int = 12288
    """Dense FFN width (HF intermediate_size); unused by MoE blocks but kept for the HF config."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (also used by the per-head q/k norms)."""
    rope_theta: float = 1000000.0
    """RoPE base frequency."""
    max_seq_len: int = 40960
    """Length of the RoPE tables, i.e. the longest sequence the model accepts; the trainer sets it to the training seq_len."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection (0.6B, 1.7B, 4B)."""
    num_experts: int = 0
    """Routed experts per MoE block; 0 makes the model dense."""
    num_experts_per_tok: int = 8
    """Experts each token is routed to (top-k); MoE only."""
    moe_hidden_dim: int = 768
    """Width of each expert's SwiGLU MLP (HF moe_intermediate_size); MoE only."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1 (True for all released Qwen 3 MoE models)."""
    moe_expert_bias: bool = False
    """Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias `moe.router.expert_bias`,
    zeros at start and saved in checkpoints, added to the router scores for the selection of the
    experts only (models/common/moe.py); MoE only. Off for the released models (HF Qwen 3 MoE has
    no such bias: export refuses a nonzero one)."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "hidden_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}; allowed: >= 1")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_kv_heads: must divide n_heads {self.n_heads}, got {self.n_kv_heads}; allowed: a divisor of n_heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim: must be even for RoPE, got {self.head_dim}; allowed: an even head_dim")
        if self.num_experts < 0:
            raise ValueError(f"num_experts: must be >= 0 (0 = dense), got {self.num_experts}; allowed: >= 0")
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok: must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}; "
                    f"allowed: 1 .. {self.num_experts}"
                )
            if self.moe_hidden_dim <= 0:
                raise ValueError(
                    f"moe_hidden_dim: must be a positive integer, got {self.moe_hidden_dim}; allowed: >= 1"
                )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def shape(self) -> ModelShape:
        moe = dict(num_experts=self.num_experts, top_k=self.num_experts_per_tok, moe_hidden=self.moe_hidden_dim)
        return ModelShape(
            n_layers=self.n_layers,
            dim=self.dim,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            qk_norm=True,
            **(moe if self.is_moe else dict(ffn_hidden=self.hidden_dim)),
        )

    def param_counts(self) -> ParamCounts:
        return decoder_param_counts(
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            qk_norm=True,
            ffn_hidden_dim=self.hidden_dim,
            tie_embeddings=self.tie_embeddings,
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok if self.is_moe else 0,
            moe_hidden_dim=self.moe_hidden_dim if self.is_moe else 0,
        )

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Distinct parameters; `exclude_embedding` drops the token-embedding table (see param_count.py)."""
        counts = self.param_counts()
        return counts.total - (counts.embedding if exclude_embedding else 0)

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters used per token: MoE blocks count top-k experts (and the router)."""
        counts = self.param_counts()
        return counts.active - (counts.embedding if exclude_embedding else 0)


_QWEN3 = dict(head_dim=128, vocab_size=151936, rope_theta=1000000.0, max_seq_len=40960, norm_eps=1e-6)

FLAVORS: dict[str, Qwen3Args] = {
    # Tiny dense model for CPU runs and tests; vocab 4096 matches the bundled tokenizer.
    "debugmodel": Qwen3Args(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        vocab_size=4096,
        hidden_dim=768,
        rope_theta=1000000.0,
        max_seq_len=2048,
    ),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_embeddings=True, **_QWEN3),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_embeddings=True, **_QWEN3),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_embeddings=True, **_QWEN3),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288, **_QWEN3),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408, **_QWEN3),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600, **_QWEN3),
    # Tiny MoE model: 8 experts, top-2.
    "debugmodel_moe": Qwen3Args(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        vocab_size=4096,
        hidden_dim=768,
        rope_theta=1000000.0,
        max_seq_len=2048,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=256,
        norm_topk_prob=True,
    ),
    "30B-A3B": Qwen3Args(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        hidden_dim=6144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_hidden_dim=768,
        **_QWEN3,
    ),
    "235B-A22B": Qwen3Args(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        hidden_dim=12288,
        num_experts=128,
        num_experts_per_tok=8,
        moe_hidden_dim=1536,
        **_QWEN3,
    ),
}
