"""Qwen 3 decoder, dense and MoE: GQA attention with per-head q/k RMSNorm, RoPE (theta 1e6),
and in each block either a SwiGLU FFN (`num_experts == 0`) or a dropless top-k MoE."""

from models.common.attention import Attention
from models.common.decoder import Decoder, TransformerBlock
from models.common.feed_forward import FeedForward
from models.common.moe import MoE
from models.common.rope import RopeConfig
from models.qwen3.args import Qwen3Args


class Transformer(Decoder):
    """Qwen 3 model; `forward(tokens [B, T]) -> logits [B, T, vocab]`, `init_weights()` (see `Decoder`).

    MoE models return the load-balancing loss of the last forward from `pop_aux_loss()`.
    """

    def __init__(self, args: Qwen3Args):
        blocks = [
            TransformerBlock(
                layer_id=layer_id,
                dim=args.dim,
                norm_eps=args.norm_eps,
                attention=Attention(
                    dim=args.dim,
                    n_heads=args.n_heads,
                    n_kv_heads=args.n_kv_heads,
                    head_dim=args.head_dim,
                    qk_norm=True,
                    norm_eps=args.norm_eps,
                ),
                feed_forward=None if args.is_moe else FeedForward(dim=args.dim, hidden_dim=args.hidden_dim),
                moe=(
                    MoE(
                        dim=args.dim,
                        hidden_dim=args.moe_hidden_dim,
                        num_experts=args.num_experts,
                        top_k=args.num_experts_per_tok,
                        norm_topk_prob=args.norm_topk_prob,
                        expert_bias=args.moe_expert_bias,
                    )
                    if args.is_moe
                    else None
                ),
            )
            for layer_id in range(args.n_layers)
        ]
        super().__init__(
            vocab_size=args.vocab_size,
            dim=args.dim,
            norm_eps=args.norm_eps,
            blocks=blocks,
            tie_embeddings=args.tie_embeddings,
            rope=RopeConfig(head_dim=args.head_dim, max_seq_len=args.max_seq_len, theta=args.rope_theta),
        )
        self.args = args
