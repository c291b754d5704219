"""Causal self-attention with grouped-query heads and optional per-head q/k RMSNorm (Qwen 3).

Heads are recovered with `view(batch, seq, -1, head_dim)`, so a tensor-parallel shard of
`wq`/`wk`/`wv` (fewer local heads) runs unchanged; the GQA group size is likewise read from the
local shapes. The attention product itself has two backends (`ATTN_BACKENDS`):
`F.scaled_dot_product_attention(is_causal=True)` and, on the CPU, the kernel in
`models/common/cpu_attention` (native GQA, much faster at small head dims).
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.common import cpu_attention
from models.common.init import trunc_normal_
from models.common.norm import RMSNorm
from models.common.rope import apply_rope


ATTN_BACKENDS = ("auto", "sdpa", "cpu_kernel")
"""auto: the CPU kernel where `cpu_attention.supports` the inputs and it builds, else SDPA.
sdpa: always `F.scaled_dot_product_attention`. cpu_kernel: always the CPU kernel (builds it)."""


def check_attn_backend(backend: str) -> None:
    """ValueError naming the `attn_backend` field unless `backend` is one of ATTN_BACKENDS (model args use it)."""
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"attn_backend: {backend!r} is not supported; allowed: {', '.join(ATTN_BACKENDS)}")


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, kv_heads, s, d] -> [b, kv_heads * n_rep, s, d]; kv head j serves q heads j*n_rep.. ."""
    if n_rep == 1:
        return x
    b, kv_heads, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv_heads, n_rep, s, d).reshape(b, kv_heads * n_rep, s, d)


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
        backend: str = "auto",
    ):
        super().__init__()
        assert n_heads % n_kv_heads == 0, f"n_heads {n_heads} not a multiple of n_kv_heads {n_kv_heads}"
        assert backend in ATTN_BACKENDS, f"attention backend {backend!r} not in {ATTN_BACKENDS}"
        self.head_dim = head_dim
        self.backend = backend
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        # Qwen 3 normalises each head of q and k (weights shared across heads) before RoPE.
        self.q_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = apply_rope(q, k, rope_cos, rope_sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [bs, heads, seq, head_dim]
        if self._use_cpu_kernel(q, k):
            out = cpu_attention.causal_attention(q, k, v)
        else:
            n_rep = q.shape[1] // k.shape[1]
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)
        return self.wo(out)

    def _use_cpu_kernel(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        if self.backend == "sdpa":
            return False
        if self.backend == "cpu_kernel":
            if not (cpu_attention.load() and cpu_attention.supports(q, k)):
                raise ValueError(
                    f"attn_backend: 'cpu_kernel' cannot run {q.dtype} head_dim {q.shape[-1]} on {q.device} "
                    f"({cpu_attention.load_error() or 'see cpu_attention.supports'}); allowed: auto, sdpa"
                )
            return True
        if not cpu_attention.supports(q, k):
            return False
        # The first eager call builds the kernel (the trainer does it before any step); a Dynamo
        # trace cannot run the compiler, so one that starts before any build stays on SDPA.
        if torch.compiler.is_compiling() and not cpu_attention.loaded():
            return False
        return cpu_attention.load()

    def init_weights(self, init_std: float) -> None:
        """q/k/v: truncated normal std 0.02; wo: truncated normal `init_std` (depth-scaled)."""
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)
        if self.q_norm is not None:
            self.q_norm.init_weights()
            self.k_norm.init_weights()

