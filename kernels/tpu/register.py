"""The Pallas kernels as torch ops on TPU, through torch-tpu's `torch.tpu.pallas.jax_op`.

Imported only by `kernels.tpu.load()` on a TPU run (it imports jax and needs torch-tpu).
`build()` defines, once per process:
- `titan_tpu::splash_fwd / splash_bwd` and `splash_seg_fwd / splash_seg_bwd` (with segment ids);
- `titan_tpu::gmm / gmm_bwd` (w as [G, K, N]) and `gmm_t / gmm_t_bwd` (w in nn.Linear layout
  [G, N, K], what the MoE experts hold: their transposed view is passed without a copy);
- `titan_tpu::linear_ce_fwd / linear_ce_bwd` (per-row loss and lse; gradients).
Each forward op gets autograd through `register_autograd` with its backward op (jax_op registers
none). The splash and gmm backward ops take the JAX VJP of the forward: splash re-runs its
forward kernel inside the backward op to get its residuals (out, lse), one extra attention
forward per step; gmm's unused forward is dead code that XLA drops. The fused loss saves its
lse, so its backward does not recompute the forward.

`build()` returns {op name: torch function} for `models.common.ops.register`; each function
falls back to the op's torch reference for tensors that are not on the TPU.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import torch

from kernels.tpu import fused_ce, gmm, splash
from models.common import ops

NAMESPACE = "titan_tpu"
_BUILT: dict[str, Callable] = {}


def build() -> dict[str, Callable]:
    """Register the ops (idempotent) and return the implementations of the model's ops."""
    if not _BUILT:
        jax_op = torch.tpu.pallas.jax_op
        _BUILT.update(causal_attention=_build_splash(jax_op), grouped_mm=_build_gmm(jax_op),
                      linear_cross_entropy=_build_linear_ce(jax_op))
    return dict(_BUILT)


def saved_ops() -> list:
    """The forward ops that selective AC saves, like SDPA and `_grouped_mm` (after `build()`)."""
    names = ("splash_fwd", "splash_seg_fwd", "gmm", "gmm_t")
    return [getattr(torch.ops.titan_tpu, name).default for name in names]


def _on_tpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "tpu" for t in tensors)


def _build_splash(jax_op) -> Callable:
    @jax_op(f"{NAMESPACE}::splash_fwd")
    def splash_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return splash.splash_attention(q, k, v)

    @jax_op(f"{NAMESPACE}::splash_bwd")
    def splash_bwd(q: jax.Array, k: jax.Array, v: jax.Array, dout: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(jax.vjp(splash.splash_attention, q, k, v)[1](dout))

    @jax_op(f"{NAMESPACE}::splash_seg_fwd")
    def splash_seg_fwd(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
        return splash.splash_attention(q, k, v, segment_ids)

    @jax_op(f"{NAMESPACE}::splash_seg_bwd")
    def splash_seg_bwd(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                       dout: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(jax.vjp(lambda q, k, v: splash.splash_attention(q, k, v, segment_ids), q, k, v)[1](dout))

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, dout):
        return splash_bwd(*ctx.saved_tensors, dout.contiguous())

    def backward_seg(ctx, dout):
        q, k, v, seg = ctx.saved_tensors
        return (*splash_seg_bwd(q, k, v, seg, dout.contiguous()), None)

    splash_fwd.register_autograd(backward, setup_context=setup)
    splash_seg_fwd.register_autograd(backward_seg, setup_context=setup)

    def causal_attention(q, k, v, segment_ids=None):
        if not _on_tpu(q, k, v):
            return ops.sdpa_causal_attention(q, k, v, segment_ids)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if segment_ids is None:
            return splash_fwd(q, k, v)
        return splash_seg_fwd(q, k, v, segment_ids.to(torch.int32).contiguous())

    return causal_attention


def _build_gmm(jax_op) -> Callable:
    @jax_op(f"{NAMESPACE}::gmm")
    def gmm_kn(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return gmm.grouped_mm(x, w, group_sizes)

    @jax_op(f"{NAMESPACE}::gmm_bwd")
    def gmm_kn_bwd(x: jax.Array, w: jax.Array, group_sizes: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
        return tuple(jax.vjp(lambda x, w: gmm.grouped_mm(x, w, group_sizes), x, w)[1](dy))

    @jax_op(f"{NAMESPACE}::gmm_t")
    def gmm_nk(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return gmm.grouped_mm(x, w, group_sizes, transpose_rhs=True)

    @jax_op(f"{NAMESPACE}::gmm_t_bwd")
    def gmm_nk_bwd(x: jax.Array, w: jax.Array, group_sizes: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
        return tuple(jax.vjp(lambda x, w: gmm.grouped_mm(x, w, group_sizes, transpose_rhs=True), x, w)[1](dy))

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward_kn(ctx, dy):
        return (*gmm_kn_bwd(*ctx.saved_tensors, dy.contiguous()), None)

    def backward_nk(ctx, dy):
        return (*gmm_nk_bwd(*ctx.saved_tensors, dy.contiguous()), None)

    gmm_kn.register_autograd(backward_kn, setup_context=setup)
    gmm_nk.register_autograd(backward_nk, setup_context=setup)

    def grouped_mm(x, w, group_sizes):
        if not _on_tpu(x, w):
            return ops.torch_grouped_mm(x, w, group_sizes)
        sizes = group_sizes.to(torch.int32)  # stays on the device: no host read
        w_nk = w.transpose(-2, -1)
        if w_nk.is_contiguous():  # the experts' nn.Linear-layout weight: no copy
            return gmm_nk(x.contiguous(), w_nk, sizes)
        return gmm_kn(x.contiguous(), w.contiguous(), sizes)

    return grouped_mm


def _build_linear_ce(jax_op) -> Callable:
    @jax_op(f"{NAMESPACE}::linear_ce_fwd")
    def ce_fwd(h: jax.Array, w: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
        return fused_ce.forward_rows(h, w, labels)

    @jax_op(f"{NAMESPACE}::linear_ce_bwd")
    def ce_bwd(h: jax.Array, w: jax.Array, labels: jax.Array, lse: jax.Array,
               g: jax.Array) -> tuple[jax.Array, jax.Array]:
        return fused_ce.backward_rows(h, w, labels, lse, g)

    def setup(ctx, inputs, output):
        h, w, labels = inputs
        ctx.save_for_backward(h, w, labels, output[1])

    def backward(ctx, d_rows, d_lse):
        del d_lse  # an auxiliary output; nothing differentiates through it
        return (*ce_bwd(*ctx.saved_tensors, d_rows.float().contiguous()), None)

    ce_fwd.register_autograd(backward, setup_context=setup)

    def linear_cross_entropy(h, w, labels):
        if not _on_tpu(h, w):
            return ops.chunked_linear_cross_entropy(h, w, labels)
        rows, _ = ce_fwd(h.contiguous(), w.contiguous(), labels.to(torch.int32))
        valid = labels != ops.IGNORE_INDEX
        return torch.where(valid, rows, 0.0).sum() / valid.sum()

    return linear_cross_entropy
