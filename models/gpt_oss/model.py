"""gpt-oss decoder: sink attention with alternating sliding-window / full layers, YaRN RoPE, and
the biased top-k MoE with clamped SwiGLU experts.

The blocks are `models.common.decoder.TransformerBlock`s (pre-norm attention + MoE) in one
`BlockStack`, and the model is a `models.common.decoder.Decoder` (embedding, blocks, norm,
output): only the attention, the experts and the RoPE tables are gpt-oss's own. Sliding and full
blocks have the same parameters; a block's window is the int64 buffer `attention.window` (0:
full), data rather than a Python attribute, so that a layer scan, which runs block 0's code on
every layer's row of stacked tensors, gives each layer its own window.

Attention is the op `models.common.ops.sink_attention` (`softmax([q k^T / sqrt(d) masked | sink])
v` with the sink column dropped, HF's formulation): its reference is SDPA over one extra key per
head (the sink) with a boolean causal/window mask, so the memory-efficient SDPA kernels serve it
on the CPU and CUDA; on TPU splash with the kernel's own sinks and a local (window) or causal mask
serves it (titan_kernels/tpu/splash.py), skipping the blocks outside the window.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.common import ops
from models.common.decoder import Decoder, TransformerBlock
from models.common.init import trunc_normal_
from models.common.moe import MoE
from models.common.rope import apply_rope
from models.gpt_oss.args import GptOssArgs


@dataclass(frozen=True)
class YarnRope:
    """gpt-oss's RoPE tables (what `Decoder` calls `rope_config.cos_sin(device)` on), as transformers'
    `_compute_yarn_parameters` with `truncate: false` computes them."""

    head_dim: int
    max_seq_len: int
    theta: float
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_seq_len: int

    def inv_freq_and_scale(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
        """YaRN inverse frequencies [head_dim // 2] (float32) and the table scale (attention factor)."""
        dim, base, factor = self.head_dim, self.theta, self.factor
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
        if factor == 1.0:
            return 1.0 / pos_freqs, 1.0

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        # Not floored/ceiled: gpt-oss's config says truncate = false.
        low = max(correction_dim(self.beta_fast), 0)
        high = min(correction_dim(self.beta_slow), dim - 1)
        if low == high:
            high += 0.001  # a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
        inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
        return inv_freq, 0.1 * math.log(factor) + 1.0

    def cos_sin(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 `(cos, sin)` [max_seq_len, head_dim] ("rotate_half" layout), scaled by the YaRN factor."""
        inv_freq, scale = self.inv_freq_and_scale(device)
        positions = torch.arange(self.max_seq_len, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scale, emb.sin() * scale


class SinkAttention(nn.Module):
    """gpt-oss attention: wq/wk/wv/wo with biases, RoPE on q and k, `sink_attention`.

    The sinks are the weight [n_heads, 1] of the linear `sinks`, read by calling it on a one: a
    parameter split by heads like wq's rows, so the plan shards it "colwise" and a tensor-parallel
    rank gets its own heads' sinks (and their gradients) with no TP style of its own; the product
    with 1 is exact. Heads come from local shapes (`view(bs, seq, -1, head_dim)`), as `Attention`.
    """

    def __init__(self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, window: int, window_size: int = 0):
        super().__init__()
        assert n_heads % n_kv_heads == 0, f"n_heads {n_heads} not a multiple of n_kv_heads {n_kv_heads}"
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=True)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=True)
        self.sinks = nn.Linear(1, n_heads, bias=False)
        self.sliding_window = window
        # The family's window, the same in every block (scan-safe as an attribute): the one value > 0
        # that the `window` buffer holds, which a kernel builds its mask from (`ops.sink_attention`).
        self.window_size = window_size or window
        # Not saved (the args say it); rebuilt by init_weights after materialization.
        self.register_buffer("window", torch.tensor(window, dtype=torch.int64), persistent=False)

    def forward(
        self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, segment_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [bs, seq, dim]; RoPE tables [seq, head_dim] or per token [bs, seq, head_dim]."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, k, rope_cos, rope_sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [bs, heads, seq, head_dim]
        sinks = self.sinks(q.new_ones(1, 1)).view(-1)  # [local heads]
        out = ops.sink_attention(q, k, v, sinks, self.window, segment_ids, sliding_window=self.window_size)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        """q/k/v: truncated normal std 0.02; wo: std `init_std` (depth-scaled); biases: zeros;
        sinks: normal std 0.02 (as transformers initialises them); the window buffer from the args."""
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            nn.init.zeros_(linear.bias)
        nn.init.normal_(self.sinks.weight, std=0.02)
        with torch.no_grad():
            self.window.fill_(self.sliding_window)


class GptOssExperts(nn.Module):
    """gpt-oss's experts: per expert `down^T glu + down_bias`, `[gate | up] = gate_up^T x + gate_up_bias`
    with gate and up interleaved (columns 0, 2, 4, ... and 1, 3, 5, ...), and the clamped SwiGLU
    `glu = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)`, `g = clamp(gate, max=limit)`.

    The parameters are transformers' `GptOssExperts`, names and layout (`gate_up_proj` [E, dim,
    2 hidden], `gate_up_proj_bias` [E, 2 hidden], `down_proj` [E, hidden, dim], `down_proj_bias`
    [E, dim]), so the HF adapter is a rename and HF weights load per rank as boxes. It has the
    experts' contract of `models.common.moe.GroupedExperts` (`num_experts`, `forward(x sorted by
    expert, num_tokens_per_expert)`, `forward_capacity`, `init_weights`, every parameter with the
    expert on dim 0), so the MoE layer, expert parallelism and layer scan take it as they take
    `GroupedExperts`. It is not one (its weights are not w1/w2/w3): `[quantize]` leaves it in the
    compute dtype.
    """

    recipe: str = "none"
    """No low-precision recipe applies to these experts (see the class docstring)."""

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int, alpha: float, limit: float):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, dim))
        for w in (self.gate_up_proj, self.down_proj):  # never uninitialised memory (as GroupedExperts)
            nn.init.normal_(w, std=0.02)
        self.alpha = alpha
        self.limit = limit

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """As `GroupedExperts.forward`: x [N, dim] sorted by expert -> [N, dim]; rows past the counts'
        sum are padding (unspecified outputs, as the contract says). Two grouped matmuls through
        the op `grouped_mm`, each followed by its expert's bias row."""
        n = num_tokens_per_expert
        # Each row's expert (E for padding rows, whose bias row is zero); on the device, no host read.
        group = ops.group_of_rows(n, x.shape[0])
        gate_up = ops.grouped_mm(x, self.gate_up_proj, n) + F.pad(self.gate_up_proj_bias, (0, 0, 0, 1))[group]
        out = ops.grouped_mm(self._glu(gate_up), self.down_proj, n)
        return out + F.pad(self.down_proj_bias, (0, 0, 0, 1))[group]

    def forward_capacity(self, x: torch.Tensor) -> torch.Tensor:
        """As `GroupedExperts.forward_capacity`: x [E, rows, dim] -> [E, rows, dim]. Unused (zero) rows
        give the biases' output, not zeros; the combine reads only the kept copies' rows."""
        gate_up = torch.bmm(x, self.gate_up_proj) + self.gate_up_proj_bias.unsqueeze(1)
        return torch.bmm(self._glu(gate_up), self.down_proj) + self.down_proj_bias.unsqueeze(1)

    def init_weights(self, init_std: float) -> None:
        """`gate_up_proj`: truncated normal std 0.02; `down_proj`: std `init_std` (depth-scaled, the
        residual-branch output, as TorchTitan's w2); biases: zeros."""
        trunc_normal_(self.gate_up_proj, std=0.02)
        trunc_normal_(self.down_proj, std=init_std)
        for b in (self.gate_up_proj_bias, self.down_proj_bias):
            nn.init.zeros_(b)


class GptOssTransformer(Decoder):
    """gpt-oss; `forward(tokens [B, T]) -> logits [B, T, vocab]`, `init_weights()`, `pop_aux_loss()`
    (the MoE blocks' load-balancing loss of the last forward), see `Decoder`.

    `init_weights` is `Decoder.init_weights` (embedding, norms, output, depth-scaled residual
    outputs) plus: attention and expert biases zeros, router bias zeros, sinks normal std 0.02,
    and each block's window buffer from the args.
    """

    attn_backends = ("auto", "sdpa", "splash")
    """The `[model] attn_backend` values this model's attention (the op `sink_attention`) honours:
    the SDPA reference on every device, splash with sinks on TPU; the CPU kernel takes no sinks."""

    non_matrix_params = ("sinks", "gate_up_proj_bias", "down_proj_bias")
    """Tensors of 2+ dims that are no linear map (the sinks [H, 1], the experts' bias tables
    [E, n]): Muon leaves them to AdamW (trainer/optim/muon.py `split_muon_params`)."""

    def __init__(self, args: GptOssArgs):
        blocks = [
            TransformerBlock(
                layer_id=layer_id,
                dim=args.dim,
                norm_eps=args.norm_eps,
                attention=SinkAttention(
                    dim=args.dim,
                    n_heads=args.n_heads,
                    n_kv_heads=args.n_kv_heads,
                    head_dim=args.head_dim,
                    window=args.layer_window(layer_id),
                    window_size=args.sliding_window,
                ),
                moe=MoE(
                    dim=args.dim,
                    hidden_dim=args.moe_hidden_dim,
                    num_experts=args.num_experts,
                    top_k=args.num_experts_per_tok,
                    # softmax over all experts renormalised over the top k = softmax over the top-k logits
                    norm_topk_prob=True,
                    gate_bias=True,
                    experts=GptOssExperts(
                        dim=args.dim,
                        hidden_dim=args.moe_hidden_dim,
                        num_experts=args.num_experts,
                        alpha=args.swiglu_alpha,
                        limit=args.swiglu_limit,
                    ),
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
            rope=YarnRope(
                head_dim=args.head_dim,
                max_seq_len=args.max_seq_len,
                theta=args.rope_theta,
                factor=args.rope_factor,
                beta_fast=args.rope_beta_fast,
                beta_slow=args.rope_beta_slow,
                original_max_seq_len=args.rope_original_max_seq_len,
            ),
        )
        self.args = args
