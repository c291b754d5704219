"""DeepSeek-V3 decoder: Multi-head Latent Attention with YaRN RoPE, dense blocks then MoE blocks.

The blocks are `models.common.decoder.TransformerBlock`s (pre-norm attention + FFN or MoE) held in
two `BlockStack`s run in order, `dense_layers` (the first `n_dense_layers` blocks, dense SwiGLU)
and `moe_layers` (the rest, `models.common.moe.MoE` with DeepSeek's routing options), so each
stack is uniform and layer scan runs each as one scan. Parameter names follow TorchTitan's
DeepSeek-V3 (`attention.wq_a`, `wkv_a`, `kv_norm`, `wkv_b`, ...); `hf_adapter.py` maps them to Hugging
Face's `model.layers.N.*` (block N of `moe_layers` is HF layer `n_dense_layers + N`).

Multi-token prediction (`mtp_depth` > 0; DeepSeek-V3 section 2.2): `mtp` holds D
`models.common.mtp.MTPModule`s (RMSNorms, V3's names `enorm`, `hnorm`, `eh_proj`, one MLA + MoE
block each) after the main model, outside the two block stacks (so layer scan and the stacks' plans never
take them for main layers). `mtp_hidden(tokens)` returns the main model's final-normed hidden
states and, for each depth k, the normed output of module k, all [batch, seq, dim]; the loss
projects them with the shared `output` (trainer/step/loss.py `MTPLoss`).
"""

import math

import torch
from torch import nn

from models.common import ops
from models.common.attention import max_causal_logit
from models.common.decoder import TransformerBlock
from models.common.feed_forward import FeedForward
from models.common.init import trunc_normal_
from models.common.moe import MoE
from models.common.mtp import DEEPSEEK_NAMES, MTPModule, add_mtp_aux_loss, mtp_forward
from models.common.norm import RMSNorm
from models.common.rope import apply_rope, rope_rows
from models.common.stack import BlockStack
from models.deepseek_v3.args import DeepSeekV3Args, yarn_mscale


def yarn_cos_sin(args: DeepSeekV3Args, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 RoPE tables [max_seq_len, qk_rope_head_dim] ("rotate_half" layout) with YaRN.

    YaRN (Peng et al. 2023, as DeepSeek-V3 uses it): frequencies that turn more than
    `rope_beta_fast` times over the original context are kept, those that turn fewer than
    `rope_beta_slow` times are divided by `rope_factor`, with a linear ramp over the rotary
    dims in between (bounds floored/ceiled); the tables are scaled by
    `mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim)`. `rope_factor == 1`
    gives plain RoPE.
    """
    dim, base, factor = args.qk_rope_head_dim, args.rope_theta, args.rope_factor
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    inv_freq = 1.0 / pos_freqs
    scale = 1.0
    if factor > 1.0:

        def correction_dim(rotations: float) -> float:
            return dim * math.log(args.rope_original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(args.rope_beta_fast)), 0)
        high = min(math.ceil(correction_dim(args.rope_beta_slow)), dim - 1)
        if low == high:
            high += 0.001  # a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
        scale = yarn_mscale(factor, args.rope_mscale) / yarn_mscale(factor, args.rope_mscale_all_dim)
    positions = torch.arange(args.max_seq_len, dtype=torch.int64, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class HeadShared(nn.Module):
    """Identity on a tensor that every attention head uses (MLA's RoPE key, one for all heads).

    It exists for tensor parallelism: each rank computes only its heads, so the gradient that
    reaches this tensor is the rank's part of the sum over heads; the plan's "head_shared" style
    sums it over the TP ranks here. Without TP it does nothing.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class MLA(nn.Module):
    """Multi-head Latent Attention (DeepSeek-V2/V3), causal.

    q = wq(x), or wq_b(q_norm(wq_a(x))) with a low-rank query (`q_lora_rank > 0`); per head
    [qk_nope | qk_rope]. kv latent: wkv_a(x) = [c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)];
    wkv_b(kv_norm(c_kv)) gives per head [k_nope | v]; k_rope (one head) is shared by all heads.
    RoPE acts on the rope parts only. Scores are scaled by `softmax_scale` (YaRN's mscale**2
    included). Heads come from local shapes (`view(bs, seq, -1, ...)`), so a tensor-parallel shard
    of wq/wq_b/wkv_b/wo runs unchanged. The product goes through `ops.causal_attention` with q/k
    at `qk_head_dim` and v at `v_head_dim`, unpadded (the op takes two widths; splash runs them
    as they are, the SDPA reference pads inside for ATen's one-width kernels): q is pre-scaled so
    that the op's `1/sqrt(qk_head_dim)` gives `softmax_scale`.
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        dim, n_heads = args.dim, args.n_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        self.softmax_scale = args.softmax_scale
        if self.q_lora_rank > 0:
            self.wq_a = nn.Linear(dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * self.v_head_dim, dim, bias=False)
        self.k_rope = HeadShared()
        # MuonClip (trainer/optim/qk_clip.py) turns this on to read each head's largest pre-softmax
        # logit of the step (softmax_scale * q.k, YaRN's mscale included: what the softmax sees):
        # `max_logit` [local heads], a running max over the forwards since the trainer last reset
        # it to None. Off: no extra work.
        self.track_max_logit = False
        self.max_logit: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, segment_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [bs, seq, dim]; RoPE tables [seq, qk_rope_head_dim] or per token [bs, seq, ...];
        `segment_ids` [bs, seq]: a token attends only within its segment."""
        bs, seqlen, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora_rank > 0 else self.wq(x)
        q = q.view(bs, seqlen, -1, self.qk_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = self.k_rope(k_rope)
        kv = self.wkv_b(self.kv_norm(c_kv)).view(bs, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q_rope, k_rope = apply_rope(q_rope, k_rope.unsqueeze(2), rope_cos, rope_sin)
        n_local_heads = q.shape[2]
        q = torch.cat([q_nope, q_rope], dim=-1) * (self.softmax_scale * math.sqrt(self.qk_head_dim))
        k = torch.cat([k_nope, k_rope.expand(-1, -1, n_local_heads, -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [bs, heads, seq, qk_head_dim | v_head_dim]
        if self.track_max_logit:
            # q carries softmax_scale * sqrt(qk_head_dim) and the tracker divides by sqrt(q's
            # width): its value is the logit the attention op's softmax sees.
            step_max = max_causal_logit(q.detach(), k.detach(), segment_ids)
            self.max_logit = step_max if self.max_logit is None else torch.maximum(self.max_logit, step_max)
        out = ops.causal_attention(q, k, v, segment_ids)  # [bs, heads, seq, v_head_dim]
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)
        return self.wo(out)

    def init_weights(self, init_std: float) -> None:
        """Input projections (wq or wq_a/wq_b, wkv_a, wkv_b): truncated normal std 0.02; wo: std
        `init_std` (depth-scaled); the latent norms: ones."""
        inputs = [self.wq_a, self.wq_b] if self.q_lora_rank > 0 else [self.wq]
        for linear in (*inputs, self.wkv_a, self.wkv_b):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)
        if self.q_lora_rank > 0:
            self.q_norm.init_weights()
        self.kv_norm.init_weights()


class DeepSeekV3(nn.Module):
    """Embedding -> dense_layers -> moe_layers -> norm -> output. `forward(tokens, segment_ids=None,
    positions=None) -> logits`; `pop_aux_loss()` returns the MoE blocks' auxiliary loss (`args.aux_loss`).
    With `args.mtp_depth` > 0, `mtp` holds the multi-token-prediction modules (`mtp_hidden`)."""

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.args = args

        def block(layer_id: int) -> TransformerBlock:
            moe = None
            if layer_id >= args.n_dense_layers:
                moe = MoE(
                    dim=args.dim,
                    hidden_dim=args.moe_hidden_dim,
                    num_experts=args.num_experts,
                    top_k=args.num_experts_per_tok,
                    norm_topk_prob=args.norm_topk_prob,
                    score_func=args.score_func,
                    num_groups=args.num_expert_groups,
                    top_groups=args.num_limited_groups,
                    route_scale=args.route_scale,
                    expert_bias=True,
                    shared_hidden_dim=args.num_shared_experts * args.moe_hidden_dim,
                    aux_loss=args.aux_loss,
                )
            return TransformerBlock(
                layer_id=layer_id,
                dim=args.dim,
                norm_eps=args.norm_eps,
                attention=MLA(args),
                feed_forward=None if moe is not None else FeedForward(dim=args.dim, hidden_dim=args.hidden_dim),
                moe=moe,
            )

        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.dense_layers = BlockStack(block(i) for i in range(args.n_dense_layers))
        self.moe_layers = BlockStack(block(i) for i in range(args.n_dense_layers, args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.mtp_depth > 0:  # registered last, and only when on: the main model's names are unchanged
            # Module k's block is an MoE block, as V3's MTP layer (HF layer n_layers + k - 1); its
            # depth-scaled init counts it after the main blocks.
            # The module's norms are RMSNorms and its names V3's (`enorm`, `hnorm`, `eh_proj`).
            self.mtp = nn.ModuleList(
                MTPModule(
                    dim=args.dim,
                    blocks=[block(args.n_layers + k)],
                    norm=lambda: RMSNorm(args.dim, eps=args.norm_eps),
                    names=DEEPSEEK_NAMES,
                )
                for k in range(args.mtp_depth)
            )
        self.tie_weights()
        cos, sin = yarn_cos_sin(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """With `tie_embeddings`, make `output.weight` the Parameter `tok_embeddings.weight` (see `Decoder`)."""
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [batch, seq] (int64) -> logits [batch, seq, vocab_size]; packed documents as in
        `models.common.decoder.Decoder.forward`."""
        return self.output(self.hidden(tokens, segment_ids, positions))

    def hidden(
        self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [batch, seq] -> final-normed hidden states [batch, seq, dim] (what `output` projects)."""
        _, h, _ = self._trunk(tokens, segment_ids, positions)
        return self.norm(h)

    def _trunk(
        self, tokens: torch.Tensor, segment_ids: torch.Tensor | None, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """(token embeddings, the last block's output before the final norm, the blocks' extra inputs)."""
        emb = self.tok_embeddings(tokens)
        cos, sin = rope_rows(self.rope_cos, self.rope_sin, tokens.shape[1], positions)
        args = (cos, sin) if segment_ids is None else (cos, sin, segment_ids)
        h = self.dense_layers(emb, *args)
        h = self.moe_layers(h, *args)
        return emb, h, args

    def mtp_hidden(
        self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """tokens [batch, seq] -> `[hidden(tokens), normed h^1, ..., normed h^D]`, each [batch, seq, dim].

        Depth k at position i combines h^{k-1}_i with the embedding of token i + k (the shared
        `tok_embeddings`) and, through `output`, predicts token i + k + 1. The sequence keeps its
        length: the embeddings are shifted left by k and the last k positions, which have no token
        k ahead, get a zero embedding (their predictions have no target; causal attention keeps
        them from every earlier position). Positions and segment ids are those of position i."""
        assert self.args.mtp_depth > 0, "mtp_hidden needs mtp_depth > 0"
        emb, h, args = self._trunk(tokens, segment_ids, positions)
        # Depth 1 reads the last block's output before the final norm (V3's h^0).
        return [self.norm(h), *mtp_forward(self.mtp, emb, h, args)]

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter in place and rebuild the buffers.

        - `tok_embeddings`: normal, std 0.02.
        - block `i` (counted over both stacks): attention input projections (`wq` or `wq_a`/`wq_b`,
          `wkv_a`, `wkv_b`), `feed_forward.w1/w3`, `moe.experts.w1`, `moe.shared_experts.w1/w3`:
          truncated normal (at +-3 std), std 0.02; `attention.wo`, `feed_forward.w2`,
          `moe.experts.w2/w3`, `moe.shared_experts.w2` and the router `moe.router.gate`: std
          `0.02 / sqrt(2 * (i + 1))` (TorchTitan's depth init).
        - every RMSNorm weight (block norms, `q_norm`, `kv_norm`, `norm`): ones.
        - `moe.router.expert_bias`: zeros.
        - `output`: truncated normal, std `dim ** -0.5` (keeps the embedding's init when tied).
        - MTP module k (`mtp_depth` > 0): `enorm`, `hnorm`, `norm` ones, `eh_proj` truncated normal
          std 0.02, its block as block `n_layers + k - 1` above.
        - `rope_cos`/`rope_sin`: the YaRN tables, recomputed in float32 on `buffer_device`
          (default: where they are now), so this works after `to_empty()`.
        """
        self.tie_weights()
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = yarn_cos_sin(self.args, device)
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for stack in (self.dense_layers, self.moe_layers):
            for block in stack.values():
                block.init_weights()
        self.norm.init_weights()
        if not self.args.tie_embeddings:
            trunc_normal_(self.output.weight, std=self.args.dim**-0.5)
        for module in getattr(self, "mtp", ()):
            module.init_weights()

    def pop_aux_loss(self) -> torch.Tensor | None:
        """Sum over the MoE blocks of their auxiliary loss of the last forward (0-dim float32); clears it.
        The MTP modules' blocks add theirs when the forward ran them (`mtp_hidden`)."""
        self.dense_layers.pop_aux_loss()
        total = self.moe_layers.pop_aux_loss()
        assert total is not None, "the aux loss is available once after each forward"
        return add_mtp_aux_loss(total, getattr(self, "mtp", ()))
