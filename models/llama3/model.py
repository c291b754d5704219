"""Llama 3 decoder: pre-norm blocks of GQA attention (RoPE, Llama 3.1 scaling) + SwiGLU FFN."""

from models.common.attention import Attention
from models.common.decoder import Decoder, TransformerBlock
from models.common.feed_forward import FeedForward
from models.common.rope import RopeConfig
from models.llama3.args import Llama3Args


class Transformer(Decoder):
    """Llama 3 model; `forward(tokens [B, T]) -> logits [B, T, vocab]`, `init_weights()` (see `Decoder`)."""

    def __init__(self, args: Llama3Args):
        blocks = [
            TransformerBlock(
                layer_id=layer_id,
                dim=args.dim,
                norm_eps=args.norm_eps,
                attention=Attention(
                    dim=args.dim,
                    n_heads=args.n_heads,
                    n_kv_heads=args.num_kv_heads,
                    head_dim=args.head_dim,
                ),
                feed_forward=FeedForward(dim=args.dim, hidden_dim=args.ffn_hidden_dim),
            )
            for layer_id in range(args.n_layers)
        ]
        rope = RopeConfig(
            head_dim=args.head_dim,
            max_seq_len=args.max_seq_len,
            theta=args.rope_theta,
            scaling_factor=args.rope_scaling_factor,
            low_freq_factor=args.rope_low_freq_factor,
            high_freq_factor=args.rope_high_freq_factor,
            original_max_seq_len=args.rope_original_max_seq_len,
        )
        super().__init__(
            vocab_size=args.vocab_size,
            dim=args.dim,
            norm_eps=args.norm_eps,
            blocks=blocks,
            tie_embeddings=args.tie_embeddings,
            rope=rope,
        )
        self.args = args
