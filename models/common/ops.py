"""The device-dependent ops that models call: one function per op, implementations from `kernels/`.

A model calls `causal_attention(q, k, v)`; it never picks an implementation. Which one serves
the op on this run (SDPA, the CPU C++ kernel, a Pallas kernel on TPU) is registered once at
start-up by `kernels.select(...)`, which the trainer calls before building the model. With
nothing registered the torch reference below runs; every kernel also falls back to it for
inputs it does not handle. This module imports torch only and reads no environment.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

OPS = ("causal_attention",)

_impls: dict[str, Callable] = {}


def register(op: str, fn: Callable | None) -> Callable | None:
    """Serve `op` with `fn` from now on (None: the torch reference); return the previous one."""
    assert op in OPS, f"unknown op {op!r}; ops: {OPS}"
    previous = _impls.pop(op, None)
    if fn is not None:
        _impls[op] = fn
    return previous


def implementation(op: str) -> Callable:
    """The function that serves `op` now."""
    return _impls.get(op, _REFERENCES[op])


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, kv_heads, s, d] -> [b, kv_heads * n_rep, s, d]; kv head j serves q heads j*n_rep.. ."""
    if n_rep == 1:
        return x
    b, kv_heads, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv_heads, n_rep, s, d).reshape(b, kv_heads * n_rep, s, d)


def sdpa_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: `F.scaled_dot_product_attention(is_causal=True)` with k/v heads repeated."""
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim), causal) v.

    q [batch, q_heads, seq, head_dim], k and v [batch, kv_heads, seq, head_dim] with q_heads a
    multiple of kv_heads (grouped-query attention) -> [batch, q_heads, seq, head_dim] (possibly a
    transposed view).
    """
    return _impls.get("causal_attention", sdpa_causal_attention)(q, k, v)


_REFERENCES: dict[str, Callable] = {"causal_attention": sdpa_causal_attention}
