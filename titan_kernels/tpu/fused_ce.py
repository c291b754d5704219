"""Fused linear + cross-entropy (Pallas, TPU) for the op `linear_cross_entropy`.

Pure JAX. The loss of row i is `logsumexp_v(h_i . w_v) - h_i . w_{y_i}`; three Pallas kernels
compute it and its gradients over [block_n, block_v] tiles of the logits, so the [N, vocab]
logits never exist in HBM:
- forward: grid (row blocks, vocab blocks), the vocabulary innermost: an online log-sum-exp
  (running max and sum in VMEM, float32) plus the label's logit; writes per-row loss and lse.
- dh: same grid; recomputes each logits tile, p = softmax - onehot, scaled by the row's
  incoming gradient, accumulates p @ w_tile in float32.
- dw: grid (vocab blocks, row blocks), the rows innermost; accumulates p^T @ h_tile.
Matmuls take the inputs' dtype (bf16 on TPU) with float32 accumulation; p is cast to the
input dtype before the two backward matmuls (as autograd of `F.linear(...).float()` does).

Rows are padded to the row block with label `ignore_index` (zero gradient), the vocabulary to
the vocab block with zero weights masked to -inf; padding is sliced off. Labels equal to
`ignore_index` pick no logit; callers average over valid rows (`linear_cross_entropy`).

Public: `forward_rows(h, w, labels) -> (loss_rows [N], lse [N])`,
`backward_rows(h, w, labels, lse, g_rows) -> (dh, dw)` (the two halves the torch op binds),
and `linear_cross_entropy(h, w, labels)` (mean over valid rows, differentiable in JAX).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

try:  # a package import (titan_kernels.tpu.fused_ce) or a plain module next to tiles.py (the probes)
    from titan_kernels.tpu import tiles
except ImportError:  # pragma: no cover - the XLA-tier probes put titan_kernels/tpu on sys.path
    import tiles

IGNORE_INDEX = -100
_NT = (((1,), (1,)), ((), ()))  # a [n, d] x b [v, d] -> [n, v]
_TN = (((0,), (0,)), ((), ()))  # a [n, v] x b [n, d] -> [v, d]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _logits(h_ref, w_ref, j, vocab: int, block_v: int):
    s = jax.lax.dot_general(h_ref[...], w_ref[...], _NT, preferred_element_type=jnp.float32)
    cols = j * block_v + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return jnp.where(cols < vocab, s, -jnp.inf), cols


def _fwd_kernel(labels_ref, h_ref, w_ref, loss_ref, lse_ref, m_scr, l_scr, t_scr, *, vocab, block_v):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        t_scr[...] = jnp.zeros(t_scr.shape, jnp.float32)

    s, cols = _logits(h_ref, w_ref, j, vocab, block_v)
    m_prev = m_scr[...]
    m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
    l_scr[...] = l_scr[...] * jnp.exp(m_prev - m_next) + jnp.exp(s - m_next).sum(axis=-1, keepdims=True)
    m_scr[...] = m_next
    t_scr[...] += jnp.where(cols == labels_ref[...], s, 0.0).sum(axis=-1, keepdims=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _done():
        lse = m_scr[...] + jnp.log(l_scr[...])
        lse_ref[...] = lse
        loss_ref[...] = lse - t_scr[...]


def _grad_tile(labels_ref, lse_ref, g_ref, h_ref, w_ref, j, vocab, block_v):
    s, cols = _logits(h_ref, w_ref, j, vocab, block_v)
    p = jnp.exp(s - lse_ref[...])
    p = jnp.where(cols == labels_ref[...], p - 1.0, p) * g_ref[...]
    return p


def _dh_kernel(labels_ref, lse_ref, g_ref, h_ref, w_ref, dh_ref, acc, *, vocab, block_v):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    p = _grad_tile(labels_ref, lse_ref, g_ref, h_ref, w_ref, j, vocab, block_v)
    acc[...] += jnp.dot(p.astype(w_ref.dtype), w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _done():
        dh_ref[...] = acc[...].astype(dh_ref.dtype)


def _dw_kernel(labels_ref, lse_ref, g_ref, h_ref, w_ref, dw_ref, acc, *, vocab, block_v):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    p = _grad_tile(labels_ref, lse_ref, g_ref, h_ref, w_ref, j, vocab, block_v)
    acc[...] += jax.lax.dot_general(p.astype(h_ref.dtype), h_ref[...], _TN, preferred_element_type=jnp.float32)

    @pl.when(i == pl.num_programs(1) - 1)
    def _done():
        dw_ref[...] = acc[...].astype(dw_ref.dtype)


def _blocks(h, w, block_n, block_v, generation):
    """(block_n, block_v): the caller's, else the generation's from tiles.py."""
    n, vocab, dim = h.shape[0], w.shape[0], h.shape[1]
    if block_n is None or block_v is None:
        bn, bv = tiles.ce_blocks(generation, n, vocab, dim, itemsize=h.dtype.itemsize)
        block_n, block_v = block_n or bn, block_v or bv
    return min(block_n, _round_up(n, 8)), min(block_v, _round_up(vocab, 128))


def _pad(h, w, labels, block_n, block_v, ignore_index, generation):
    n, vocab = h.shape[0], w.shape[0]
    bn, bv = _blocks(h, w, block_n, block_v, generation)
    pn, pv = _round_up(n, bn) - n, _round_up(vocab, bv) - vocab
    h = jnp.pad(h, ((0, pn), (0, 0))) if pn else h
    w = jnp.pad(w, ((0, pv), (0, 0))) if pv else w
    labels = labels.astype(jnp.int32)
    labels = jnp.pad(labels, (0, pn), constant_values=ignore_index) if pn else labels
    return h, w, labels[:, None], bn, bv


def _params(interpret: bool, generation: str | None) -> dict:
    return dict(
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=tiles.ce_vmem_limit(generation)
        ),
    )


_STATIC = ("block_n", "block_v", "ignore_index", "generation", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def forward_rows(
    h: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    block_n: int | None = None,
    block_v: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    generation: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """h [N, D], w [V, D], labels [N] -> (loss per row [N] f32, logsumexp per row [N] f32).
    Blocks: `block_n`/`block_v` if given, else the `generation`'s (tiles.py)."""
    n, vocab, dim = h.shape[0], w.shape[0], h.shape[1]
    hp, wp, lab, bn, bv = _pad(h, w, labels, block_n, block_v, ignore_index, generation)
    rows = hp.shape[0]
    col = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
    loss, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, vocab=vocab, block_v=bv),
        grid=(rows // bn, wp.shape[0] // bv),
        in_specs=[col, pl.BlockSpec((bn, dim), lambda i, j: (i, 0)), pl.BlockSpec((bv, dim), lambda i, j: (j, 0))],
        out_specs=[col, col],
        out_shape=[jax.ShapeDtypeStruct((rows, 1), jnp.float32)] * 2,
        scratch_shapes=[pltpu.VMEM((bn, 1), jnp.float32)] * 3,
        **_params(interpret, generation),
    )(lab, hp, wp)
    return loss[:n, 0], lse[:n, 0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def backward_rows(
    h: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    lse: jax.Array,
    g: jax.Array,
    *,
    block_n: int | None = None,
    block_v: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    generation: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Gradients of sum_i g_i * loss_i: (dh [N, D] in h.dtype, dw [V, D] in w.dtype)."""
    n, vocab, dim = h.shape[0], w.shape[0], h.shape[1]
    hp, wp, lab, bn, bv = _pad(h, w, labels, block_n, block_v, ignore_index, generation)
    rows = hp.shape[0]
    pn = rows - n
    lse2 = jnp.pad(lse.astype(jnp.float32), (0, pn))[:, None]
    g2 = jnp.pad(g.astype(jnp.float32), (0, pn))[:, None]
    grid_rows, grid_vocab = rows // bn, wp.shape[0] // bv
    kernel_args = dict(vocab=vocab, block_v=bv)

    col = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
    dh = pl.pallas_call(
        functools.partial(_dh_kernel, **kernel_args),
        grid=(grid_rows, grid_vocab),
        in_specs=[
            col,
            col,
            col,
            pl.BlockSpec((bn, dim), lambda i, j: (i, 0)),
            pl.BlockSpec((bv, dim), lambda i, j: (j, 0)),
        ],
        out_specs=pl.BlockSpec((bn, dim), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(hp.shape, h.dtype),
        scratch_shapes=[pltpu.VMEM((bn, dim), jnp.float32)],
        **_params(interpret, generation),
    )(lab, lse2, g2, hp, wp)

    col_t = pl.BlockSpec((bn, 1), lambda j, i: (i, 0))
    dw = pl.pallas_call(
        functools.partial(_dw_kernel, **kernel_args),
        grid=(grid_vocab, grid_rows),
        in_specs=[
            col_t,
            col_t,
            col_t,
            pl.BlockSpec((bn, dim), lambda j, i: (i, 0)),
            pl.BlockSpec((bv, dim), lambda j, i: (j, 0)),
        ],
        out_specs=pl.BlockSpec((bv, dim), lambda j, i: (j, 0)),
        out_shape=jax.ShapeDtypeStruct(wp.shape, w.dtype),
        scratch_shapes=[pltpu.VMEM((bv, dim), jnp.float32)],
        **_params(interpret, generation),
    )(lab, lse2, g2, hp, wp)
    return dh[:n], dw[:vocab]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _loss_rows(h, w, labels, block_n, block_v, generation, interpret):
    return forward_rows(h, w, labels, block_n=block_n, block_v=block_v, generation=generation, interpret=interpret)[0]


def _loss_rows_fwd(h, w, labels, block_n, block_v, generation, interpret):
    loss, lse = forward_rows(h, w, labels, block_n=block_n, block_v=block_v, generation=generation, interpret=interpret)
    return loss, (h, w, labels, lse)


def _loss_rows_bwd(block_n, block_v, generation, interpret, res, g):
    h, w, labels, lse = res
    dh, dw = backward_rows(
        h, w, labels, lse, g, block_n=block_n, block_v=block_v, generation=generation, interpret=interpret
    )
    return dh, dw, None


_loss_rows.defvjp(_loss_rows_fwd, _loss_rows_bwd)


def linear_cross_entropy(
    h: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    block_n: int | None = None,
    block_v: int | None = None,
    generation: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """mean over labels != IGNORE_INDEX of CE(h w^T, labels), float32; differentiable."""
    valid = labels != IGNORE_INDEX
    rows = _loss_rows(h, w, labels, block_n, block_v, generation, interpret)
    return jnp.where(valid, rows, 0.0).sum() / valid.sum()


def reference(h: jax.Array, w: jax.Array, labels: jax.Array) -> jax.Array:
    """Full-logits float32 jnp cross-entropy (tests)."""
    logits = jnp.einsum("nd,vd->nv", h.astype(jnp.float32), w.astype(jnp.float32))
    valid = labels != IGNORE_INDEX
    picked = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[:, None], axis=-1)[:, 0]
    rows = jax.nn.logsumexp(logits, axis=-1) - picked
    return jnp.where(valid, rows, 0.0).sum() / valid.sum()
