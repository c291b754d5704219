"""DeepSeek-V3 model arguments and the published flavors.

The model: Multi-head Latent Attention (MLA: queries through an optional low-rank `q_lora_rank`
bottleneck, keys and values from one `kv_lora_rank` latent shared by all heads, plus a decoupled
RoPE part of `qk_rope_head_dim` per head whose key is shared by all heads), YaRN-scaled RoPE, and
decoder blocks whose first `n_dense_layers` have a dense SwiGLU FFN and the rest a DeepSeek MoE
(`num_shared_experts` shared experts, `num_experts` routed ones, top `num_experts_per_tok`, sigmoid
scores restricted to the best `num_limited_groups` of `num_expert_groups` groups, scaled by
`route_scale`, auxiliary-loss-free bias). Shapes are those of the Hugging Face `config.json` of
deepseek-ai/DeepSeek-V3 (671B), deepseek-ai/DeepSeek-V2-Lite (16B; here with V3's routing, so it
is a `DeepseekV3ForCausalLM`) and moonshotai/Kimi-K2-Base (1T). Multi-token prediction
(DeepSeek-V3 section 2.2; the V3 checkpoint's layer 61) is an option, `mtp_depth` sequential MTP
modules (off in every flavor: `mtp_depth = 0`; V3's release has 1), trained with the weight
`mtp_loss_weight` (docs/models.md#multi-token-prediction).
"""

import math
from dataclasses import dataclass

from models.common.mtp import check_mtp_args
from models.common.rope import YarnArgs
from models.contract import ModelShape

AUX_LOSSES = ("sequence", "load_balance", "none")


@dataclass
class DeepSeekV3Args(YarnArgs):
    dim: int = 7168
    """Model (residual stream) width (HF hidden_size)."""
    n_layers: int = 61
    """Number of transformer blocks, dense and MoE together."""
    n_dense_layers: int = 3
    """The first blocks that have a dense FFN instead of a MoE (HF first_k_dense_replace); at least 1
    and fewer than n_layers (the two kinds are two block stacks)."""
    n_heads: int = 128
    """Attention heads."""
    vocab_size: int = 129280
    """Vocabulary size of the embedding and output projection."""
    hidden_dim: int = 18432
    """Dense FFN width of the first n_dense_layers blocks (HF intermediate_size)."""
    q_lora_rank: int = 1536
    """Rank of the query bottleneck (wq_a -> q_norm -> wq_b); 0: one full-rank wq (16B)."""
    kv_lora_rank: int = 512
    """Rank of the key/value latent (wkv_a -> kv_norm -> wkv_b)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key width without position encoding."""
    qk_rope_head_dim: int = 64
    """Per-head query/key width with RoPE (the key part is shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value width."""
    num_experts: int = 256
    """Routed experts per MoE block (HF n_routed_experts)."""
    num_experts_per_tok: int = 8
    """Routed experts each token goes to (top-k)."""
    num_shared_experts: int = 1
    """Shared experts every token goes through (one SwiGLU of num_shared_experts * moe_hidden_dim)."""
    moe_hidden_dim: int = 2048
    """Width of each expert's SwiGLU (HF moe_intermediate_size)."""
    num_expert_groups: int = 8
    """Groups the routed experts are split into for group-limited routing (HF n_group); 1: off."""
    num_limited_groups: int = 4
    """Groups a token may route to (HF topk_group)."""
    route_scale: float = 2.5
    """Factor on the routing weights (HF routed_scaling_factor)."""
    score_func: str = "sigmoid"
    """Expert affinities: "sigmoid" (DeepSeek-V3) or "softmax" (V2; no HF DeepseekV3 equivalent)."""
    norm_topk_prob: bool = True
    """Renormalise the k selected scores to sum to 1 (before route_scale)."""
    aux_loss: str = "sequence"
    """Auxiliary loss returned to the trainer (scaled by training.aux_loss_coef): "sequence"
    (DeepSeek-V3's sequence-wise balance loss; they use a coefficient of 1e-4), "load_balance"
    (the global-batch Switch loss of Qwen 3 MoE) or "none"."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (all norms, including the q and kv latent norms)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_factor: float = 40.0  # YarnArgs (beta_fast 32, beta_slow 1, original context 4096)
    rope_mscale: float = 1.0
    """YaRN mscale: the cos/sin tables are scaled by mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim)."""
    rope_mscale_all_dim: float = 1.0
    """YaRN mscale_all_dim: the softmax scale is multiplied by mscale(factor, rope_mscale_all_dim) ** 2."""
    max_seq_len: int = 163840
    """Length of the RoPE tables, i.e. the longest sequence the model accepts; the trainer sets it to the training seq_len."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection (no released flavor does)."""
    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3 section 2.2): the number D of sequential MTP modules
    (each one MLA + MoE block, sharing the embedding and the output head); module k predicts, at
    position i, token t[i + k + 1] (k places after the next token), and training adds `mtp_loss_weight / D` times their
    cross entropies to the loss. 0: off (every flavor); DeepSeek-V3's release has 1 (HF
    num_nextn_predict_layers)."""
    mtp_loss_weight: float = 0.3
    """The MTP loss weight lambda: loss = L_main + lambda / mtp_depth * sum of the depths' losses
    (DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1); read only when mtp_depth > 0."""

    def __post_init__(self) -> None:
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "vocab_size",
            "hidden_dim",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "num_experts",
            "num_experts_per_tok",
            "moe_hidden_dim",
            "num_expert_groups",
            "num_limited_groups",
            "max_seq_len",
            "rope_original_max_seq_len",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}; allowed: >= 1")
        for name in ("q_lora_rank", "num_shared_experts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}; allowed: >= 0")
        if not 1 <= self.n_dense_layers < self.n_layers:
            raise ValueError(
                f"n_dense_layers: must be in [1, n_layers - 1 = {self.n_layers - 1}], got {self.n_dense_layers}; "
                f"allowed: 1 .. {self.n_layers - 1}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim: must be even for RoPE, got {self.qk_rope_head_dim}; allowed: an even size"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}; "
                f"allowed: 1 .. {self.num_experts}"
            )
        if self.num_experts % self.num_expert_groups:
            raise ValueError(
                f"num_expert_groups: must divide num_experts {self.num_experts}, got {self.num_expert_groups}; "
                "allowed: a divisor of num_experts"
            )
        if self.num_expert_groups > 1 and self.num_experts // self.num_expert_groups < 2:
            raise ValueError(
                "num_expert_groups: each group needs at least 2 experts (a group scores by its "
                f"two best), got {self.num_expert_groups} groups of {self.num_experts}; allowed: 1, or a divisor of "
                "num_experts that leaves >= 2 experts per group"
            )
        if not 1 <= self.num_limited_groups <= self.num_expert_groups:
            raise ValueError(
                f"num_limited_groups: must be in [1, num_expert_groups={self.num_expert_groups}], "
                f"got {self.num_limited_groups}; allowed: 1 .. {self.num_expert_groups}"
            )
        if self.num_limited_groups * (self.num_experts // self.num_expert_groups) < self.num_experts_per_tok:
            raise ValueError(
                "num_limited_groups: the groups it keeps hold fewer experts than num_experts_per_tok; allowed: "
                "enough groups that num_limited_groups x experts per group >= num_experts_per_tok"
            )
        if self.score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"score_func: {self.score_func!r} unknown; allowed: 'sigmoid', 'softmax'")
        if self.aux_loss not in AUX_LOSSES:
            raise ValueError(f"aux_loss: {self.aux_loss!r} unknown; allowed: {', '.join(map(repr, AUX_LOSSES))}")
        self.check_yarn()
        check_mtp_args(self.mtp_depth, self.mtp_loss_weight, max_depth=None, example="DeepSeek-V3: 1")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim ** -0.5`, times YaRN's `mscale(factor, mscale_all_dim) ** 2`."""
        m = yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
        return self.qk_head_dim**-0.5 * m * m

    def shape(self) -> ModelShape:
        # head_dim: the mean of the q.k and the value widths, so that the attention FLOPs
        # 12 * L * H * head_dim * T equal MLA's 6 * L * H * (qk_head_dim + v_head_dim) * T.
        return ModelShape(
            n_layers=self.n_layers,
            dim=self.dim,
            n_heads=self.n_heads,
            n_kv_heads=self.n_heads,
            head_dim=(self.qk_head_dim + self.v_head_dim) // 2,
            vocab_size=self.vocab_size,
            ffn_hidden=self.hidden_dim,
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            moe_hidden=self.moe_hidden_dim,
        )

    def _counts(self) -> tuple[int, int, int]:
        """(total, active, embedding) parameter counts, as the modules hold them."""
        d, h = self.dim, self.n_heads
        if self.q_lora_rank:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        else:
            q = d * h * self.qk_head_dim
        kv = (
            d * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        )
        attention = q + kv + h * self.v_head_dim * d + 2 * d  # + wo, the two block norms
        dense = attention + 3 * d * self.hidden_dim
        expert = 3 * d * self.moe_hidden_dim
        shared = self.num_shared_experts * expert
        router = d * self.num_experts
        moe_total = attention + router + shared + self.num_experts * expert
        moe_active = attention + router + shared + self.num_experts_per_tok * expert
        table = self.vocab_size * d
        outer = table + d + (0 if self.tie_embeddings else table)
        dense_all = self.n_dense_layers * dense
        # Each MTP module: enorm, hnorm, eh_proj (2d -> d), one MoE block and its head norm (the
        # embedding and the output head are the main model's).
        mtp_outer = 3 * d + 2 * d * d
        return (
            outer + dense_all + self.n_moe_layers * moe_total + self.mtp_depth * (mtp_outer + moe_total),
            outer + dense_all + self.n_moe_layers * moe_active + self.mtp_depth * (mtp_outer + moe_active),
            0 if self.tie_embeddings else table,
        )

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Distinct parameters (the MTP modules included); `exclude_embedding` drops the token-embedding table."""
        total, _, embedding = self._counts()
        return total - (embedding if exclude_embedding else 0)

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters used per token: MoE blocks count the top-k routed experts, the shared experts and the
        router; the MTP modules are included (the output head they reuse is counted once)."""
        _, active, embedding = self._counts()
        return active - (embedding if exclude_embedding else 0)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


_V3 = dict(
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    moe_hidden_dim=2048,
    hidden_dim=18432,
    dim=7168,
    n_layers=61,
    norm_eps=1e-6,
    rope_original_max_seq_len=4096,
    rope_beta_slow=1.0,
)

FLAVORS: dict[str, DeepSeekV3Args] = {
    # Tiny model for CPU runs and tests: 2 dense + 3 MoE blocks, q and kv low rank, 8 experts in
    # 4 groups of which 2 are eligible, one shared expert, YaRN on; vocab 4096 matches the
    # bundled tokenizer.
    "debugmodel": DeepSeekV3Args(
        dim=256,
        n_layers=5,
        n_dense_layers=2,
        n_heads=8,
        vocab_size=4096,
        hidden_dim=512,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        moe_hidden_dim=128,
        num_expert_groups=4,
        num_limited_groups=2,
        route_scale=2.5,
        rope_theta=10000.0,
        rope_factor=4.0,
        rope_original_max_seq_len=256,
        rope_beta_fast=32.0,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        max_seq_len=2048,
    ),
    # DeepSeek-V2-Lite's sizes (15.7B total, 2.4B active) with V3 routing (sigmoid, normalised top-k).
    "16B": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        vocab_size=102400,
        hidden_dim=10944,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=64,
        num_experts_per_tok=6,
        num_shared_experts=2,
        moe_hidden_dim=1408,
        num_expert_groups=1,
        num_limited_groups=1,
        route_scale=1.0,
        rope_theta=10000.0,
        rope_factor=40.0,
        rope_original_max_seq_len=4096,
        rope_beta_fast=32.0,
        rope_mscale=0.707,
        rope_mscale_all_dim=0.707,
        max_seq_len=163840,
    ),
    # DeepSeek-V3 / V3.1 / R1: 671B total, 37B active.
    "671B": DeepSeekV3Args(
        n_dense_layers=3,
        n_heads=128,
        vocab_size=129280,
        num_experts=256,
        num_experts_per_tok=8,
        num_shared_experts=1,
        num_expert_groups=8,
        num_limited_groups=4,
        route_scale=2.5,
        rope_theta=10000.0,
        rope_factor=40.0,
        rope_beta_fast=32.0,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        max_seq_len=163840,
        **_V3,
    ),
    # Kimi K2: 1.04T total, 32B active; 384 experts, one dense block, 64 heads.
    "kimi_k2": DeepSeekV3Args(
        n_dense_layers=1,
        n_heads=64,
        vocab_size=163840,
        num_experts=384,
        num_experts_per_tok=8,
        num_shared_experts=1,
        num_expert_groups=1,
        num_limited_groups=1,
        route_scale=2.827,
        rope_theta=50000.0,
        rope_factor=32.0,
        rope_beta_fast=1.0,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        max_seq_len=131072,
        **_V3,
    ),
}
