"""Qwen 3.5 model arguments (dense and MoE) and the flavors.

A hybrid stack: block i is a Gated DeltaNet linear-attention block, except every
`full_attention_interval`-th one (i = 3, 7, 11, ... for the interval 4 of every release), which is
gated full attention (transformers' `layer_types`). Every block has a dense SwiGLU FFN
(`num_experts == 0`) or a top-k MoE with one gated shared expert (`num_experts > 0`).

Published sizes: the two non-debug flavors are the shapes transformers' `Qwen3_5TextConfig` and
`Qwen3_5MoeTextConfig` defaults describe ("Qwen3.5-9B style", "Qwen3.5-35B-A3B style"), the only
ones derivable offline; their `rope_theta` and `max_seq_len` are those defaults too (10000, 32768)
and may differ from the hub `config.json` (load a real checkpoint's config with
`hf_adapter.args_from_hf_config`, which reads them).
"""

from dataclasses import dataclass

from models.common.mtp import check_mtp_args
from models.contract import ModelShape


@dataclass
class Qwen3_5Args:
    dim: int = 4096
    """Model (residual stream) width (HF hidden_size)."""
    n_layers: int = 32
    """Number of blocks (linear-attention and full-attention together)."""
    n_heads: int = 16
    """Query heads of the full-attention blocks."""
    n_kv_heads: int = 4
    """Key/value heads of the full-attention blocks; must divide n_heads."""
    head_dim: int = 256
    """Per-head width of the full-attention blocks."""
    partial_rotary_factor: float = 0.25
    """Fraction of head_dim that RoPE rotates (the first head_dim * factor dims; the rest pass)."""
    vocab_size: int = 248320
    """Vocabulary size of the embedding and output projection."""
    hidden_dim: int = 12288
    """Dense FFN width (HF intermediate_size); dense flavors only (MoE flavors keep the default)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (every norm, the gated norm of the linear attention included)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    max_seq_len: int = 32768
    """Length of the RoPE tables, i.e. the longest sequence the model accepts; the trainer sets it to the training seq_len."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""
    full_attention_interval: int = 4
    """Every this-many-th block is full attention, the others Gated DeltaNet (HF layer_types)."""
    linear_num_key_heads: int = 16
    """Gated DeltaNet query/key heads."""
    linear_num_value_heads: int = 32
    """Gated DeltaNet value heads (a multiple of linear_num_key_heads; each has its own state)."""
    linear_key_head_dim: int = 128
    """Gated DeltaNet query/key head width."""
    linear_value_head_dim: int = 128
    """Gated DeltaNet value head width."""
    linear_conv_kernel_dim: int = 4
    """Width of the causal depthwise convolution on q, k and v."""
    delta_chunk_size: int = 64
    """Tokens per chunk of the chunked delta rule (an implementation choice, not in the HF config)."""
    num_experts: int = 0
    """Routed experts per MoE block; 0 makes the model dense."""
    num_experts_per_tok: int = 8
    """Experts each token is routed to (top-k, weights renormalised over the k); MoE only."""
    moe_hidden_dim: int = 512
    """Width of each routed expert's SwiGLU (HF moe_intermediate_size); MoE only."""
    shared_expert_hidden_dim: int = 512
    """Width of the shared expert's SwiGLU, gated per token by sigmoid(shared_gate(x)) (HF
    shared_expert_intermediate_size); MoE only."""
    mtp_depth: int = 0
    """Multi-token prediction: 1 adds Qwen 3.5's MTP module (the hub checkpoints' `mtp.*`, which
    transformers does not load): the shared embedding of token i + 1 and the main model's
    final-normed hidden state at i, each normed, concatenated [embedding | hidden] and projected
    2 dim -> dim (`fc`), `mtp_layers` full-attention blocks, a final norm; the shared output head
    then predicts token i + 2, trained with `mtp_loss_weight` (trainer/step/loss.py `MTPLoss`).
    0 (every flavor): none. Only 0 or 1: the checkpoints hold one module, which inference applies
    recursively for further tokens."""
    mtp_layers: int = 1
    """Blocks of the MTP module (the hub config's `mtp_num_hidden_layers`: 1 in every release); 1
    when mtp_depth is 1 (vLLM runs `mtp.layers.J` at draft step J, not the J blocks in a row)."""
    mtp_loss_weight: float = 0.3
    """The MTP loss weight lambda: loss = L_main + lambda x L_mtp (DeepSeek-V3's value; Qwen has
    not published its own); read only when mtp_depth = 1."""

    def __post_init__(self) -> None:
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "vocab_size",
            "hidden_dim",
            "max_seq_len",
            "full_attention_interval",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "delta_chunk_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}; allowed: >= 1")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_kv_heads: must divide n_heads {self.n_heads}, got {self.n_kv_heads}; allowed: a divisor of n_heads"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads != 0:
            raise ValueError(
                f"linear_num_key_heads: must divide linear_num_value_heads {self.linear_num_value_heads}, got "
                f"{self.linear_num_key_heads}; allowed: a divisor of linear_num_value_heads"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 != 0:
            raise ValueError(
                f"partial_rotary_factor: head_dim * factor must be an even width in (0, head_dim], got "
                f"{self.partial_rotary_factor} (width {self.rotary_dim}); allowed: e.g. 0.25, 0.5, 1.0"
            )
        # One module, as the checkpoints hold (the serving engines apply it again for further tokens).
        check_mtp_args(self.mtp_depth, self.mtp_loss_weight, max_depth=1, example="Qwen 3.5's checkpoints: 1")
        if self.mtp_layers <= 0 or (self.mtp_depth and self.mtp_layers != 1):
            raise ValueError(
                f"mtp_layers: {self.mtp_layers} with mtp_depth {self.mtp_depth}; allowed: 1 with mtp_depth 1 (every "
                "released checkpoint has mtp_num_hidden_layers = 1; vLLM runs mtp.layers.J at draft step J, "
                "which one module of stacked blocks would not match), >= 1 with mtp_depth 0"
            )
        if self.num_experts < 0:
            raise ValueError(f"num_experts: must be >= 0 (0 = dense), got {self.num_experts}; allowed: >= 0")
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok: must be in [1, num_experts={self.num_experts}], got "
                    f"{self.num_experts_per_tok}; allowed: 1 .. {self.num_experts}"
                )
            for name in ("moe_hidden_dim", "shared_expert_hidden_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}; allowed: >= 1")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """Head dims RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_full_attention(self, layer_id: int) -> bool:
        """Block `layer_id` is gated full attention (else Gated DeltaNet), as HF's default layer_types."""
        return (layer_id + 1) % self.full_attention_interval == 0

    def layer_types(self) -> list[str]:
        """HF `layer_types`: "full_attention" / "linear_attention" per block."""
        return ["full_attention" if self.is_full_attention(i) else "linear_attention" for i in range(self.n_layers)]

    def mixing_flops_per_token(self, seq_len: int) -> dict[str, float]:
        """Training FLOPs per token of the blocks' token mixing (trainer/runtime/flops.py
        `model_flops_per_token`). Full-attention blocks: 12 / 6 x H x Q x T (palm / causal), as
        any decoder. Gated DeltaNet blocks: the delta rule's recurrence per value head and token,
        k^T S, the rank-1 update of the [d_k, d_v] state and q^T S, 2 d_k d_v FLOPs each, x 3 for
        training = 18 d_k d_v per head (one count in both conventions: nothing is masked; the
        chunked form's extra intra-chunk products are the algorithm's, not the model's). The MTP
        module's blocks (`mtp_depth` 1) are full attention."""
        full = sum(self.is_full_attention(i) for i in range(self.n_layers))
        delta = 18.0 * (self.n_layers - full) * self.linear_num_value_heads
        full += self.mtp_depth * self.mtp_layers  # the MTP module's blocks: full attention
        attention = float(full * self.n_heads * self.head_dim * seq_len)
        delta *= self.linear_key_head_dim * self.linear_value_head_dim
        return {"palm": 12.0 * attention + delta, "causal": 6.0 * attention + delta}

    def shape(self) -> ModelShape:
        moe = dict(
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            moe_hidden=self.moe_hidden_dim,
            shared_hidden=self.shared_expert_hidden_dim,
            shared_gate=True,
        )
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

    def _counts(self) -> tuple[int, int, int]:
        """(total, active, embedding) parameters, conventions of models/common/param_count.py."""
        d, hd = self.dim, self.head_dim
        full = d * hd * 2 * self.n_heads + 2 * d * hd * self.n_kv_heads + self.n_heads * hd * d + 2 * hd
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        nv = self.linear_num_value_heads
        linear = (
            d * conv_dim  # in_proj_qkv
            + d * value_dim  # in_proj_z
            + 2 * d * nv  # in_proj_b, in_proj_a
            + conv_dim * self.linear_conv_kernel_dim  # conv1d
            + 2 * nv  # dt_bias, A_log
            + self.linear_value_head_dim  # gated norm
            + value_dim * d  # out_proj
        )
        if self.is_moe:
            per_expert = 3 * d * self.moe_hidden_dim
            shared = 3 * d * self.shared_expert_hidden_dim + d  # the shared expert and its gate
            router = d * self.num_experts
            mlp_total = self.num_experts * per_expert + shared + router
            mlp_active = self.num_experts_per_tok * per_expert + shared + router
        else:
            mlp_total = mlp_active = 3 * d * self.hidden_dim
        n_full = sum(self.is_full_attention(i) for i in range(self.n_layers))
        mixers = n_full * full + (self.n_layers - n_full) * linear
        table = self.vocab_size * d
        outer = table + d + (0 if self.tie_embeddings else table)
        norms = 2 * d * self.n_layers
        total = outer + mixers + norms + self.n_layers * mlp_total
        active = outer + mixers + norms + self.n_layers * mlp_active
        if self.mtp_depth:  # fc, its two input norms and the final norm; its full-attention blocks
            blocks = self.mtp_layers * (full + 2 * d)
            total += 2 * d * d + 3 * d + blocks + self.mtp_layers * mlp_total
            active += 2 * d * d + 3 * d + blocks + self.mtp_layers * mlp_active
        return total, active, 0 if self.tie_embeddings else table

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Distinct parameters; `exclude_embedding` drops the token-embedding table."""
        total, _, embedding = self._counts()
        return total - (embedding if exclude_embedding else 0)

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters used per token: MoE blocks count top-k experts, the shared expert and the router."""
        _, active, embedding = self._counts()
        return active - (embedding if exclude_embedding else 0)


_DEBUG = dict(
    dim=256,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    vocab_size=4096,
    hidden_dim=768,
    max_seq_len=2048,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)

FLAVORS: dict[str, Qwen3_5Args] = {
    # Tiny dense model for CPU runs and tests: 4 blocks (3 Gated DeltaNet, 1 full attention);
    # vocab 4096 matches the bundled tokenizer.
    "debugmodel": Qwen3_5Args(**_DEBUG),
    # transformers' Qwen3_5TextConfig defaults ("Qwen3.5-9B style"; see the module docstring).
    "9B": Qwen3_5Args(),
    # Tiny MoE model: 8 experts, top-2, a shared expert.
    # (hidden_dim, unused by MoE blocks, stays the default: the HF MoE config has no such key.)
    "debugmodel_moe": Qwen3_5Args(
        **{**_DEBUG, "hidden_dim": 12288},
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=256,
        shared_expert_hidden_dim=256,
    ),
    # transformers' Qwen3_5MoeTextConfig defaults ("Qwen3.5-35B-A3B style").
    "35B-A3B": Qwen3_5Args(
        dim=2048,
        n_layers=40,
        n_heads=16,
        n_kv_heads=2,
        num_experts=256,
        num_experts_per_tok=8,
        moe_hidden_dim=512,
        shared_expert_hidden_dim=512,
    ),
}
