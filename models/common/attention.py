"""Causal self-attention with grouped-query heads and optional per-head q/k RMSNorm (Qwen 3).

Heads are recovered with `view(batch, seq, -1, head_dim)`, so a tensor-parallel shard of
`wq`/`wk`/`wv` (fewer local heads) runs unchanged; the GQA group size is likewise read from the
local shapes. With `segment_ids` (packed documents, `[training] document_mask`) attention never
crosses a segment boundary. The attention product is the op `models.common.ops.causal_attention`, whose
implementation (SDPA, the CPU kernel, a TPU kernel) `titan_kernels/` chooses at start-up.
"""

import torch
from torch import nn

from models.common import ops
from models.common.init import trunc_normal_
from models.common.norm import RMSNorm
from models.common.rope import apply_rope


class Attention(nn.Module):
    """Multi-head causal attention: wq/wk/wv/wo projections without bias, RoPE on q and k."""

    def __init__(
        self,
        *,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        assert n_heads % n_kv_heads == 0, f"n_heads {n_heads} not a multiple of n_kv_heads {n_kv_heads}"
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        # Qwen 3 normalises each head of q and k (weights shared across heads) before RoPE.
        self.q_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        # MuonClip (trainer/optim/qk_clip.py) turns this on to read each head's largest pre-softmax
        # logit of the step: `max_logit` [local heads], a running max over the forwards since
        # the trainer last reset it to None. Off: no extra work.
        self.track_max_logit = False
        self.max_logit: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, segment_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [bs, seq, dim]; RoPE tables [seq, head_dim] or per token [bs, seq, head_dim];
        `segment_ids` [bs, seq] (document masking): a token attends only within its segment."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = apply_rope(q, k, rope_cos, rope_sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [bs, heads, seq, head_dim]
        if self.track_max_logit:
            step_max = max_causal_logit(q.detach(), k.detach(), segment_ids)
            self.max_logit = step_max if self.max_logit is None else torch.maximum(self.max_logit, step_max)
        out = ops.causal_attention(q, k, v, segment_ids)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)
        return self.wo(out)

    def init_weights(self, init_std: float) -> None:
        """q/k/v: truncated normal std 0.02; wo: truncated normal `init_std` (depth-scaled)."""
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)
        if self.q_norm is not None:
            self.q_norm.init_weights()
            self.k_norm.init_weights()


def max_causal_logit(
    q: torch.Tensor, k: torch.Tensor, segment_ids: torch.Tensor | None = None, *, chunk: int = 1024
) -> torch.Tensor:
    """Largest pre-softmax logit q.k / sqrt(head_dim) per query head over the batch and the
    causal (and same-document) pairs: q [b, q_heads, s, d], k [b, kv_heads, s, d] -> fp32 [q_heads].

    Computed in query chunks of `chunk` rows (memory b x heads x chunk x s), in fp32 from the
    compute-dtype q and k: one extra QK^T matmul over the causal half, about half of the
    attention forward's FLOPs; only MuonClip runs it.
    """
    b, heads, s, d = q.shape
    n_rep = heads // k.shape[1]
    kf = k.float().repeat_interleave(n_rep, dim=1) if n_rep > 1 else k.float()
    best = torch.full((heads,), float("-inf"), dtype=torch.float32, device=q.device)
    positions = torch.arange(s, device=q.device)
    for start in range(0, s, chunk):
        stop = min(s, start + chunk)
        scores = q[:, :, start:stop].float() @ kf[:, :, :stop].transpose(-2, -1) / d**0.5
        visible = positions[:stop][None, :] <= positions[start:stop][:, None]  # [chunk, keys]
        if segment_ids is not None:
            same = segment_ids[:, start:stop, None] == segment_ids[:, None, :stop]
            visible = (visible[None] & same)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best
