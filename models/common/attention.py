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

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
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

