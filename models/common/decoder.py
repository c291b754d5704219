"""The decoder-only transformer shared by Llama 3 and Qwen 3 (dense and MoE).

`TransformerBlock` is pre-norm attention + (SwiGLU FFN | MoE). `Decoder` is token embedding ->
`BlockStack` -> RMSNorm -> output projection, holding the RoPE tables as non-persistent
buffers. A family's `Transformer(args)` subclasses `Decoder` and only builds its blocks and
`RopeConfig` from its args; the forward pass and the initialisation scheme are shared.
"""

import torch
from torch import nn

from models.common.attention import Attention
from models.common.feed_forward import FeedForward
from models.common.init import depth_scaled_std, trunc_normal_
from models.common.moe import MoE
from models.common.norm import RMSNorm
from models.common.rope import RopeConfig, rope_rows
from models.common.stack import BlockStack


class TransformerBlock(nn.Module):
    """`h + attention(attention_norm(h))`, then `+ feed_forward(ffn_norm(.))` or `+ moe(ffn_norm(.))`."""

    def __init__(
        self,
        *,
        layer_id: int,
        dim: int,
        norm_eps: float,
        attention: Attention,
        feed_forward: FeedForward | None = None,
        moe: MoE | None = None,
    ):
        super().__init__()
        assert (feed_forward is None) != (moe is None), "a block has either a feed_forward or a moe"
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        # Only the present one is registered, so parameter names are `feed_forward.*` or `moe.*`.
        self.is_moe = moe is not None
        if self.is_moe:
            self.moe = moe
        else:
            self.feed_forward = feed_forward

    def forward(
        self, h: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, segment_ids: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """-> the new h; an MoE block returns `(h, aux_loss, load)` (the `BlockStack` sums the aux
        terms and stacks the expert loads).
        `segment_ids` [batch, seq]: document masking (see `Attention`)."""
        if self.is_moe and (chunks := self.moe.block_chunks(h.shape[0])) > 1:
            # The capacity dispatch in sequence chunks (`[moe] dispatch_chunks`): attention and MoE
            # per chunk, so one chunk's expert all-to-alls can run beside another's attention.
            segments = segment_ids.chunk(chunks) if segment_ids is not None else [None] * chunks
            hs = [
                x + self.attention(self.attention_norm(x), rope_cos, rope_sin, seg)
                for x, seg in zip(h.chunk(chunks), segments)
            ]
            outs, aux_loss, load = self.moe.forward_chunks([self.ffn_norm(x) for x in hs])
            return torch.cat([x + out for x, out in zip(hs, outs)]), aux_loss, load
        h = h + self.attention(self.attention_norm(h), rope_cos, rope_sin, segment_ids)
        if self.is_moe:
            out, aux_loss, load = self.moe(self.ffn_norm(h))
            return h + out, aux_loss, load
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        init_std = depth_scaled_std(self.layer_id)
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(init_std)
        mlp = self.moe if self.is_moe else self.feed_forward
        mlp.init_weights(init_std)


class Decoder(nn.Module):
    """Embedding -> blocks -> final norm -> vocabulary projection.
    `forward(tokens, segment_ids=None, positions=None) -> logits`."""

    def __init__(
        self,
        *,
        vocab_size: int,
        dim: int,
        norm_eps: float,
        blocks: list[TransformerBlock],
        tie_embeddings: bool,
        rope: RopeConfig,
    ):
        super().__init__()
        self.tie_embeddings = tie_embeddings
        self.rope_config = rope
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = BlockStack(blocks)
        self.norm = RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.tie_weights()
        cos, sin = self._rope_cache()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope_cache(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 RoPE `(cos, sin)` tables [max_seq_len, head_dim] on `device` (default: current)."""
        return self.rope_config.cos_sin(device)

    def tie_weights(self) -> None:
        """With `tie_embeddings`, make `output.weight` the very Parameter `tok_embeddings.weight`.

        One Parameter under two names: state_dict() lists both keys, parameters() yields it once.
        `to_empty()` from the meta device (and any per-module parameter swap) creates separate
        Parameters, so `init_weights` re-ties first; call this after such a swap otherwise.
        """
        if self.tok_embeddings is None or self.output is None:  # a pipeline stage holds one of them
            return
        if self.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [batch, seq] (int64) -> logits [batch, seq, vocab_size]. Packed documents
        (`[training] document_mask`): `segment_ids` [batch, seq] keeps attention inside each
        document, `positions` [batch, seq] (integers < max_seq_len) are the RoPE positions of the
        tokens (default 0..seq-1 in every row)."""
        h = self.hidden(tokens, segment_ids, positions)
        return self.output(h) if self.output is not None else h

    def hidden(
        self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [batch, seq] -> the final-normed hidden states [batch, seq, dim] that `output`
        projects to logits (a fused linear + cross-entropy loss starts from these); the optional
        inputs as in `forward`.

        A pipeline stage (parallelisms/pipeline_parallel.py) is this model with parts set to None:
        without `tok_embeddings` it takes hidden states [batch, seq, dim] for `tokens`, without
        `norm` (and `output`) it returns the last block's hidden states."""
        seqlen = tokens.shape[1]
        assert seqlen <= self.rope_cos.shape[0], (
            f"sequence length {seqlen} exceeds max_seq_len {self.rope_cos.shape[0]}"
        )
        # (checked before the embedding: the captured graph's inputs keep their order, which
        # tests/support/golden/graph_step_llama3_scan.txt pins)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = rope_rows(self.rope_cos, self.rope_sin, seqlen, positions)
        # The blocks get segment ids only when given, so an unmasked model traces as before.
        args = (cos, sin) if segment_ids is None else (cos, sin, segment_ids)
        h = self.layers(h, *args)
        return self.norm(h) if self.norm is not None else h

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter in place and rebuild the RoPE buffers.

        - `tok_embeddings`: normal, std 0.02.
        - per block `i`: `attention.wq/wk/wv`, `feed_forward.w1/w3`, `moe.experts.w1`: truncated
          normal (at +-3 std), std 0.02; the residual-branch outputs `attention.wo`,
          `feed_forward.w2`, `moe.experts.w2/w3` and the router `moe.router.gate`: truncated normal,
          std `0.02 / sqrt(2 * (i + 1))` (TorchTitan's depth init).
        - every RMSNorm weight (`attention_norm`, `ffn_norm`, `q_norm`, `k_norm`, `norm`): ones.
        - `output`: truncated normal, std `dim ** -0.5`; when tied to the embedding it keeps the
          embedding's init (the shared matrix is initialised once; re-tied first, see `tie_weights`).
        - buffers `rope_cos`/`rope_sin`: recomputed in float32 on `buffer_device` (default: where
          the buffers are now), so this works after `to_empty()`.

        All initialisers act in place (`nn.init.*`), so parameters may be DTensors.
        """
        self.tie_weights()
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = self._rope_cache(device)
        if self.tok_embeddings is not None:  # (a pipeline stage may hold no embedding, norm or head)
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for block in self.layers.values():
            block.init_weights()
        if self.norm is not None:
            self.norm.init_weights()
        if not self.tie_embeddings and self.output is not None:
            dim = self.output.weight.shape[1]
            trunc_normal_(self.output.weight, std=dim**-0.5)

    def pop_aux_loss(self) -> torch.Tensor | None:
        """Sum over MoE layers of the load-balancing loss of the last forward (0-dim float32), or
        None for a model without MoE layers. Clears the layers' copies (see `models/contract.py`)."""
        if not any(block.is_moe for block in self.layers.values()):
            return None
        total = self.layers.pop_aux_loss()
        assert total is not None, "the aux loss is available once after each forward"
        return total
