"""Qwen 3.5 decoder (dense and MoE): Gated DeltaNet linear attention in most blocks, gated full
attention in every `full_attention_interval`-th one, as transformers' `Qwen3_5ForCausalLM` /
`Qwen3_5MoeForCausalLM` compute them.

- Norms are zero-centred: `x / rms(x) * (1 + weight)` with the weight initialised to zeros
  (`ZeroCenteredRMSNorm`, HF `Qwen3_5RMSNorm`), for the block norms, the final norm and the
  full attention's q/k norms.
- Gated full attention (`GatedAttention`): `wq` gives per head [query | gate] (HF `q_proj`, 2 x
  head_dim per head), per-head q/k norms, RoPE on the first `rotary_dim` dims of each head
  (partial rotary), the op `causal_attention`, then `out * sigmoid(gate)` before `wo`.
- Gated DeltaNet (`GatedDeltaNet`): `in_proj_qkv` -> causal depthwise conv (width 4) + SiLU ->
  q, k, v; `beta = sigmoid(in_proj_b x)`, `g = -exp(A_log) softplus(in_proj_a x + dt_bias)`; the
  chunked gated delta rule (the op `gated_delta_rule`, reference `models/common/gated_delta.py`,
  q/k l2-normalised inside); a per-head
  RMSNorm gated by `silu(in_proj_z x)`; `out_proj`. No RoPE.

The blocks are `TransformerBlock`s with zero-centred norms, in one `BlockStack` (the repeated
block for FSDP and activation checkpointing); linear and full blocks have different parameters,
so a layer scan (which needs identical blocks) refuses this stack. The model is a `Decoder` with a
zero-centred final norm and RoPE tables of the rotary width.

Multi-token prediction (`mtp_depth` 1; the hub checkpoints' `mtp.*`): `mtp` (`MTPModule`) after
the main model, outside `layers` (so FSDP's block wrapping, activation checkpointing and the
block plans never take its blocks for main ones); `mtp_hidden(tokens)` returns the main model's
final-normed hidden states and the module's normed output, which the loss projects with the
shared `output` (trainer/step/loss.py `MTPLoss`). The module reads the main model's
*final-normed* hidden state, as Qwen's serving code (vLLM / SGLang, Qwen3-Next's MTP) runs the
released weights; DeepSeek-V3's reads the last block's output before that norm.
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.common import ops
from models.common.decoder import Decoder, TransformerBlock
from models.common.feed_forward import FeedForward
from models.common.init import trunc_normal_
from models.common.moe import MoE
from models.common.mtp import QWEN_NAMES, MTPModule, add_mtp_aux_loss, mtp_forward
from models.common.rope import RopeConfig, apply_rope, rope_rows
from models.qwen3_5.args import Qwen3_5Args


class ZeroCenteredRMSNorm(nn.Module):
    """`x / sqrt(mean(x^2) + eps) * (1 + weight)` in float32, cast back (HF `Qwen3_5RMSNorm`)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        out = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def init_weights(self) -> None:
        """Zeros (the scale 1 + weight starts at 1)."""
        nn.init.zeros_(self.weight)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """`weight * x / rms(x) * silu(gate)` over the last dim (HF `Qwen3_5RMSNormGated`, norm before gate)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x_fp32.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class GatedAttention(nn.Module):
    """Qwen 3.5 full attention: GQA with an output gate, zero-centred q/k norms, partial RoPE."""

    def __init__(self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float):
        super().__init__()
        assert n_heads % n_kv_heads == 0, f"n_heads {n_heads} not a multiple of n_kv_heads {n_kv_heads}"
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim * 2, bias=False)  # per head: [query | gate]
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps=norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps=norm_eps)

    def forward(
        self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, segment_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [bs, seq, dim]; RoPE tables [seq, rotary_dim] (or per token [bs, seq, rotary_dim])."""
        bs, seqlen, _ = x.shape
        # Heads from local shapes, so a head-sharded wq (TP) runs unchanged.
        q, gate = self.wq(x).view(bs, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(bs, seqlen, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        rot = rope_cos.shape[-1]
        q_rot, k_rot = apply_rope(q[..., :rot], k[..., :rot], rope_cos, rope_sin)
        q = torch.cat([q_rot, q[..., rot:]], dim=-1)
        k = torch.cat([k_rot, k[..., rot:]], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = ops.causal_attention(q, k, v, segment_ids)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1) * torch.sigmoid(gate)
        return self.wo(out)

    def init_weights(self, init_std: float) -> None:
        """q (with the gate rows)/k/v: truncated normal std 0.02; wo: `init_std`; q/k norms: zeros."""
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)
        self.q_norm.init_weights()
        self.k_norm.init_weights()


class GatedDeltaNet(nn.Module):
    """Qwen 3.5 linear attention (HF `Qwen3_5GatedDeltaNet`, names and layouts kept).

    `in_proj_qkv` rows are [q (all key heads) | k | v (all value heads)] as the HF checkpoint
    stores them; `conv1d` is the depthwise causal convolution over those channels (kernel
    `conv_kernel`, no bias). With `segment_ids` the convolution reads no token of another
    segment and the delta rule's state restarts at each segment (`reset`). The three places that
    read earlier tokens are ops (`causal_conv1d`, `segment_starts`, `gated_delta_rule`), which
    context parallelism serves with the preceding chunks' tokens and state
    (parallelisms/context_parallel_linear.py); the module itself is single-device.
    """

    def __init__(
        self,
        *,
        dim: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        norm_eps: float,
        chunk_size: int,
    ):
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.chunk_size = chunk_size
        self.in_proj_qkv = nn.Linear(dim, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False, padding=conv_kernel - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(0.01, 16).log_())
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)

    def forward(
        self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, segment_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [bs, seq, dim] -> [bs, seq, dim]; the RoPE tables are unused (no positions here)."""
        bs, seqlen, _ = x.shape
        # The short causal convolution (+ SiLU) reads the kernel - 1 tokens before each one: the op
        # `causal_conv1d`, which context parallelism serves with the preceding rank's tokens.
        mixed = F.silu(ops.causal_conv1d(self.in_proj_qkv(x), self.conv1d.weight, segment_ids))
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(bs, seqlen, -1, self.head_k_dim)
        k = k.reshape(bs, seqlen, -1, self.head_k_dim)
        v = v.reshape(bs, seqlen, -1, self.head_v_dim)
        z = self.in_proj_z(x).reshape(bs, seqlen, -1, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()
        # float32: exp(A_log) in a low precision could overflow (HF's note).
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out, _ = ops.gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            chunk_size=self.chunk_size,
            qk_l2norm=True,
            reset=None if segment_ids is None else ops.segment_starts(segment_ids),
        )
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        """in_proj_*: truncated normal std 0.02; out_proj: `init_std` (depth-scaled); conv1d: uniform
        +-1/sqrt(kernel) (PyTorch's Conv1d default bound for a depthwise kernel); dt_bias: ones;
        A_log: log of uniform(0.01, 16) (as transformers); the gated norm: ones."""
        for linear in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.out_proj.weight, std=init_std)
        bound = self.conv1d.weight.shape[-1] ** -0.5
        nn.init.uniform_(self.conv1d.weight, -bound, bound)
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            nn.init.uniform_(self.A_log, 0.01, 16.0)
            self.A_log.log_()
        self.norm.init_weights()


class Qwen3_5Block(TransformerBlock):
    """`TransformerBlock` (pre-norm mixer + FFN/MoE) with Qwen 3.5's zero-centred norms."""

    def __init__(self, *, layer_id: int, dim: int, norm_eps: float, **mixer_and_mlp):
        super().__init__(layer_id=layer_id, dim=dim, norm_eps=norm_eps, **mixer_and_mlp)
        self.attention_norm = ZeroCenteredRMSNorm(dim, eps=norm_eps)
        self.ffn_norm = ZeroCenteredRMSNorm(dim, eps=norm_eps)


class Qwen3_5Transformer(Decoder):
    """Qwen 3.5; `forward(tokens [B, T], segment_ids=None, positions=None) -> logits [B, T, vocab]`,
    `init_weights()`, `pop_aux_loss()` (MoE flavors), see `Decoder`.

    `init_weights` is `Decoder.init_weights` (embedding, output, depth-scaled residual outputs) with
    Qwen 3.5's own parts: every zero-centred norm zeros, the Gated DeltaNet parameters as
    `GatedDeltaNet.init_weights`, the shared-expert gate truncated normal std 0.02.
    """

    tp_refusal = (
        "the Gated DeltaNet blocks have no tensor-parallel plan (in_proj_qkv's rows are [q | k | v] of all "
        "heads, not head-major)"
    )
    """Why tensor parallelism cannot apply to this family: the step request's `tp_refusal`, which the
    TP rule of trainer/step/plan.py refuses TP > 1 with (the hf backend's rule)."""

    non_matrix_params = ("conv1d", "shared_gate")
    """Tensors of 2+ dims that are no linear map to orthogonalise (the depthwise conv taps
    [C, 1, K], the shared expert's [1, dim] gate): Muon leaves them to AdamW
    (trainer/optim/muon.py `split_muon_params`)."""

    def __init__(self, args: Qwen3_5Args):
        blocks = [
            self._block(args, layer_id, full=args.is_full_attention(layer_id)) for layer_id in range(args.n_layers)
        ]
        super().__init__(
            vocab_size=args.vocab_size,
            dim=args.dim,
            norm_eps=args.norm_eps,
            blocks=blocks,
            tie_embeddings=args.tie_embeddings,
            rope=RopeConfig(head_dim=args.rotary_dim, max_seq_len=args.max_seq_len, theta=args.rope_theta),
        )
        self.norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        self.args = args
        if args.mtp_depth:  # registered last, and only when on: the main model's names are unchanged
            # zero-centred norms and the hub's names (`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`)
            self.mtp = MTPModule(
                dim=args.dim,
                blocks=[self._block(args, args.n_layers + j, full=True) for j in range(args.mtp_layers)],
                norm=lambda: ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps),
                names=QWEN_NAMES,
            )

    @staticmethod
    def _block(args: Qwen3_5Args, layer_id: int, *, full: bool) -> "Qwen3_5Block":
        """Block `layer_id`: gated full attention (`full`) or Gated DeltaNet, then the MLP or MoE."""
        if full:
            mixer: nn.Module = GatedAttention(
                dim=args.dim,
                n_heads=args.n_heads,
                n_kv_heads=args.n_kv_heads,
                head_dim=args.head_dim,
                norm_eps=args.norm_eps,
            )
        else:
            mixer = GatedDeltaNet(
                dim=args.dim,
                num_k_heads=args.linear_num_key_heads,
                num_v_heads=args.linear_num_value_heads,
                head_k_dim=args.linear_key_head_dim,
                head_v_dim=args.linear_value_head_dim,
                conv_kernel=args.linear_conv_kernel_dim,
                norm_eps=args.norm_eps,
                chunk_size=args.delta_chunk_size,
            )
        mlp = (
            dict(
                moe=MoE(
                    dim=args.dim,
                    hidden_dim=args.moe_hidden_dim,
                    num_experts=args.num_experts,
                    top_k=args.num_experts_per_tok,
                    norm_topk_prob=True,
                    shared_hidden_dim=args.shared_expert_hidden_dim,
                    shared_gate=True,
                )
            )
            if args.is_moe
            else dict(feed_forward=FeedForward(dim=args.dim, hidden_dim=args.hidden_dim))
        )
        return Qwen3_5Block(layer_id=layer_id, dim=args.dim, norm_eps=args.norm_eps, attention=mixer, **mlp)

    def mtp_hidden(
        self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """tokens [batch, seq] -> `[hidden(tokens), normed MTP output]`, each [batch, seq, dim].

        Position i of the MTP output combines the main hidden state at i with the embedding of
        token i + 1 and, through `output`, predicts token i + 2. The last position has no next
        token and gets a zero embedding (its prediction has no target). Positions and segment ids
        are those of position i."""
        assert self.args.mtp_depth > 0, "mtp_hidden needs mtp_depth > 0"
        seqlen = tokens.shape[1]
        emb = self.tok_embeddings(tokens)
        cos, sin = rope_rows(self.rope_cos, self.rope_sin, seqlen, positions)
        args = (cos, sin) if segment_ids is None else (cos, sin, segment_ids)
        hidden = self.norm(self.layers(emb, *args))
        # Depth 1 reads the main model's final-normed hidden state (the serving engines' h^0).
        return [hidden, *mtp_forward([self.mtp], emb, hidden, args)]

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """`Decoder.init_weights`, then the MTP module's (`MTPModule.init_weights`)."""
        super().init_weights(buffer_device)
        if hasattr(self, "mtp"):
            self.mtp.init_weights()

    def pop_aux_loss(self) -> torch.Tensor | None:
        """The main blocks' auxiliary loss (`Decoder.pop_aux_loss`) plus the MTP module's MoE
        block's when the forward ran it (`mtp_hidden`)."""
        total = super().pop_aux_loss()
        return add_mtp_aux_loss(total, [self.mtp]) if hasattr(self, "mtp") else total
