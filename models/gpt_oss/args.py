"""gpt-oss model arguments and the published flavors (openai/gpt-oss-20b, openai/gpt-oss-120b).

Every block is pre-norm attention + a top-k MoE. Attention: grouped-query heads with biases on
q/k/v/o, a learned per-head sink logit in the softmax denominator, and alternating sliding-window
(block 0, 2, 4, ...: the last `sliding_window` keys, the query's own included) and full causal
layers. RoPE with YaRN (`rope_factor` over `rope_original_max_seq_len`, ramp bounds not rounded:
gpt-oss's `truncate: false`; the tables scaled by `0.1 ln(factor) + 1`). MoE: a router with a bias,
softmax over the top-k logits (= softmax over all experts renormalised over the k), experts with
biases and the clamped SwiGLU `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)`,
`g = clamp(gate, max=limit)`. Shapes are those of the Hugging Face `config.json` of each checkpoint
(and transformers' `GptOssConfig` defaults, which are the 120B's).
"""

from dataclasses import dataclass

from models.common.rope import YarnArgs
from models.contract import ModelShape, causal_keys


@dataclass
class GptOssArgs(YarnArgs):
    dim: int = 2880
    """Model (residual stream) width (HF hidden_size)."""
    n_layers: int = 36
    """Number of transformer blocks; block i is sliding-window when i is even, full otherwise."""
    n_heads: int = 64
    """Number of query heads (each has its own sink logit)."""
    n_kv_heads: int = 8
    """Number of key/value heads (grouped-query attention); must divide n_heads."""
    head_dim: int = 64
    """Per-head width (n_heads * head_dim may differ from dim)."""
    vocab_size: int = 201088
    """Vocabulary size of the embedding and output projection (o200k_harmony)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    sliding_window: int = 128
    """Keys a sliding-window layer sees: the query's own and the `sliding_window - 1` before it."""
    rope_theta: float = 150000.0
    """RoPE base frequency."""
    rope_factor: float = 32.0  # YarnArgs (beta_fast 32, beta_slow 1, original context 4096)
    max_seq_len: int = 131072
    """Length of the RoPE tables, i.e. the longest sequence the model accepts; the trainer sets it to the training seq_len."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection (False for both releases)."""
    num_experts: int = 128
    """Routed experts per block (HF num_local_experts)."""
    num_experts_per_tok: int = 4
    """Experts each token is routed to (top-k)."""
    moe_hidden_dim: int = 2880
    """Width of each expert's SwiGLU (HF intermediate_size)."""
    swiglu_alpha: float = 1.702
    """Sigmoid gain of the experts' clamped SwiGLU."""
    swiglu_limit: float = 7.0
    """Clamp of the gate (above) and of the up projection (both sides) before the SwiGLU."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}; allowed: >= 1")
        for name in ("num_experts", "moe_hidden_dim", "sliding_window", "rope_original_max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}; allowed: >= 1")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_kv_heads: must divide n_heads {self.n_heads}, got {self.n_kv_heads}; allowed: a divisor of n_heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim: must be even for RoPE, got {self.head_dim}; allowed: an even head_dim")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be in [1, num_experts={self.num_experts}], got "
                f"{self.num_experts_per_tok}; allowed: 1 .. {self.num_experts}"
            )
        self.check_yarn()
        if self.swiglu_limit <= 0:
            raise ValueError(f"swiglu_limit: must be > 0, got {self.swiglu_limit}; allowed: > 0")

    def layer_window(self, layer_id: int) -> int:
        """Keys block `layer_id` sees: `sliding_window` for even blocks, 0 (all: full causal) for odd ones."""
        return self.sliding_window if layer_id % 2 == 0 else 0

    def mixing_flops_per_token(self, seq_len: int) -> dict[str, float]:
        """Training FLOPs per token of the blocks' score and value products (trainer/runtime/flops.py
        `model_flops_per_token`): 12 x H x Q x keys per block, keys = the causal row's mean
        (`causal_keys`: T/2 for a full block, about `sliding_window` for a sliding one) for the
        "causal" convention and twice that for "palm" (the unmasked count, as for full attention)."""
        causal = sum(
            12.0 * self.n_heads * self.head_dim * causal_keys(seq_len, self.layer_window(i))
            for i in range(self.n_layers)
        )
        return {"palm": 2 * causal, "causal": causal}

    def shape(self) -> ModelShape:
        return ModelShape(
            n_layers=self.n_layers,
            dim=self.dim,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            moe_hidden=self.moe_hidden_dim,
            expert_act_tensors=7,  # the clamped SwiGLU's saved tensors (ModelShape)
        )

    def _counts(self) -> tuple[int, int, int]:
        """(total, active, embedding) parameters, conventions of models/common/param_count.py."""
        d, hd, h, kv = self.dim, self.head_dim, self.n_heads, self.n_kv_heads
        # q/k/v/o weights and biases, one sink per head.
        attention = d * hd * (2 * h + 2 * kv) + hd * (h + 2 * kv) + d + h
        norms = 2 * d
        per_expert = 3 * d * self.moe_hidden_dim + 2 * self.moe_hidden_dim + d  # gate_up, down and their biases
        router = d * self.num_experts + self.num_experts
        table = self.vocab_size * d
        outer = table + d + (0 if self.tie_embeddings else table)  # embedding, final norm, output
        total = outer + self.n_layers * (attention + norms + self.num_experts * per_expert + router)
        active = outer + self.n_layers * (attention + norms + self.num_experts_per_tok * per_expert + router)
        return total, active, 0 if self.tie_embeddings else table

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Distinct parameters; `exclude_embedding` drops the token-embedding table."""
        total, _, embedding = self._counts()
        return total - (embedding if exclude_embedding else 0)

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters used per token: top-k of the experts (and the router)."""
        _, active, embedding = self._counts()
        return active - (embedding if exclude_embedding else 0)


_GPT_OSS = dict(
    dim=2880,
    n_heads=64,
    n_kv_heads=8,
    head_dim=64,
    vocab_size=201088,
    num_experts_per_tok=4,
    moe_hidden_dim=2880,
    max_seq_len=131072,
)

FLAVORS: dict[str, GptOssArgs] = {
    # Tiny model for CPU runs and tests: 4 blocks (2 sliding, 2 full), a window of 32 so that the
    # debug recipe's sequences run past it, 8 experts top-2; vocab 4096 matches the bundled tokenizer.
    "debugmodel": GptOssArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=4096,
        sliding_window=32,
        max_seq_len=2048,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=256,
    ),
    # 20.9B parameters, 3.6B active per token without the embedding (published: 21B / 3.6B).
    "20B": GptOssArgs(n_layers=24, num_experts=32, **_GPT_OSS),
    # 116.8B parameters, 5.1B active per token without the embedding (published: 117B / 5.1B).
    "120B": GptOssArgs(n_layers=36, num_experts=128, **_GPT_OSS),
}
