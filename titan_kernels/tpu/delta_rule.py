"""The chunked gated delta rule (Gated DeltaNet; Qwen 3.5's linear attention) as a Pallas TPU kernel.

Pure JAX. Per value head a state S [dk, dv] runs over the sequence (models/common/gated_delta.py):
`S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T`, `o_t = S_t^T q_t`, q
scaled by dk^-0.5. The inputs arrive prepared as the torch reference prepares them (`_prepare`:
GQA heads repeated, [b, h, s, d] float32, q/k l2-normalised when asked): q, k [b, h, s, dk],
v [b, h, s, dv], g, beta [b, h, s], the initial state h0 [b, h, dk, dv], `reset` [b, s] int32
(1: the state is zeroed before that token, a packed document starts there; all zeros: none).

Forward kernel (`forward`): grid (batch, head, chunk), chunks of CHUNK = 64 tokens, the chunk
axis sequential ("arbitrary") with the [dk, dv] state carried in a VMEM scratch (loaded from h0
at chunk 0, written to the final-state output at the last chunk). Within a chunk, all float32
with float32 matmuls (`Precision.HIGHEST`), the operations of the torch reference
`chunk_gated_delta_rule` in its order:
- the gated decays: the in-chunk cumulative log decay `cum` (computed outside the kernel, a
  cumsum over [b, h, s]) as a column and as a row, pairwise `exp(cum_i - cum_j)` for j <= i in
  the same segment, 0 elsewhere;
- the WY / UT transform: A = strictly lower part of `(k beta) k^T * pairwise`, T = (I + A)^-1 by
  forward substitution (a fori_loop over the chunk's rows, row i of T = e_i - A[i, :] T; exact
  up to float32 rounding, as `solve_triangular` in the reference), then T (v beta) and
  T (k beta exp(cum)), the latter only for tokens that see the previous state;
- the intra-chunk attention `(q k^T) * pairwise` (diagonal included) and the inter-chunk part
  `(q exp(cum)) S`;
- the state update `S exp(cum_last) + (k exp(cum_last - cum))^T v_new` (decays masked by the
  segments: a reset in the chunk cuts what crosses it).
The sequence is padded to whole chunks with zeros (g = 0, beta = 0, k = q = 0: padded tokens
neither write the state nor decay it); the padding is sliced off.

Backward (`gated_delta_rule`, a `jax.custom_vjp`): the VJP of `reference`, the same chunked
algorithm in plain JAX (vectorised per-chunk quantities, `solve_triangular`, a `lax.scan` over
chunks whose step is `jax.checkpoint`ed so only the per-chunk states are kept), not a Pallas
kernel: gradients exact to float32 rounding, at XLA's speed, not a fused kernel's.

Blocks and VMEM (per grid step, double-buffered inputs and outputs, float32, layouts padded to
(8, 128) tiles): q, k, v, out [64, d]; beta and the cumulative decay as [64, 1] columns; the
decay and segment rows [n, 64] of the whole sequence (n chunks, read at an aligned 8-row
window); h0 and the final state [dk, dv]; scratch: the state. `vmem_bytes` is that arithmetic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

CHUNK = 64
"""Tokens per chunk (the torch reference's default and Qwen 3.5's)."""

_HI = jax.lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))  # a [m, d] x b [n, d] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # a [c, m] x b [c, n] -> [m, n]


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    return jax.lax.dot_general(a, b, dims, precision=_HI, preferred_element_type=jnp.float32)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def vmem_bytes(dk: int, dv: int, seq_len: int, chunk: int = CHUNK) -> int:
    """VMEM of one grid step of the forward kernel (module docstring), float32, (8, 128) tiles."""

    def tile(r: int, c: int) -> int:
        return _round_up(r, 8) * _round_up(c, 128) * 4

    n8 = _round_up(-(-seq_len // chunk), 8)
    blocks = 2 * tile(chunk, dk) + tile(chunk, dv) + 3 * tile(chunk, 1) + 2 * tile(n8, chunk) + tile(dk, dv)
    outs = tile(chunk, dv) + tile(dk, dv)
    return 2 * (blocks + outs) + tile(dk, dv)


def _fwd_kernel(
    q_ref, k_ref, v_ref, beta_ref, cumc_ref, segc_ref, cumr_ref, segr_ref, h0_ref, o_ref, ht_ref, state, *, chunk
):
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _init():
        state[...] = h0_ref[...]

    # Row c of the [n, chunk] decay / segment rows: an aligned 8-row window, then a masked sum
    # (exact: one nonzero term per column).
    # lax.div / lax.rem, not // and %: c >= 0, and jnp's floor forms lower through `sign`, whose
    # Mosaic rule asks JAX's device for the TPU generation (a CPU under torch-tpu's jax_op).
    base = pl.multiple_of(jax.lax.div(c, 8) * 8, 8)
    pick = jax.lax.broadcasted_iota(jnp.int32, (8, chunk), 0) == jax.lax.rem(c, 8)
    cum_r = jnp.sum(jnp.where(pick, cumr_ref[pl.ds(base, 8), :], 0.0), axis=0, keepdims=True)  # [1, C]
    seg_r = jnp.sum(jnp.where(pick, segr_ref[pl.ds(base, 8), :], 0.0), axis=0, keepdims=True)
    cum_c, seg_c = cumc_ref[...], segc_ref[...]  # [C, 1]

    q, k, v, beta = q_ref[...], k_ref[...], v_ref[...], beta_ref[...]
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    seen = (row >= col) & (seg_c == seg_r)  # j <= i, same segment
    pairwise = jnp.where(seen, jnp.exp(jnp.where(row >= col, cum_c - cum_r, 0.0)), 0.0)

    k_beta, v_beta = k * beta, v * beta
    a = jnp.where(row > col, _dot(k_beta, k, _NT) * pairwise, 0.0)  # strictly lower

    def substitute(i, t):  # row i of T = e_i - A[i, :] T (rows < i of T are final)
        a_i = jnp.sum(jnp.where(row == i, a, 0.0), axis=0, keepdims=True)  # [1, C]
        e_i = (col[:1] == i).astype(jnp.float32)
        return jnp.where(row == i, e_i - _dot(a_i, t), t)

    t = jax.lax.fori_loop(1, chunk, substitute, (row == col).astype(jnp.float32))

    sees_prev = (seg_c == 0.0).astype(jnp.float32)  # no reset in [chunk start, token]
    from_start = jnp.exp(cum_c) * sees_prev
    new_values = _dot(t, v_beta)
    k_cumdecay = _dot(t, k_beta * from_start)

    s = state[...]
    v_new = new_values - _dot(k_cumdecay, s)
    intra = _dot(q, k, _NT) * pairwise
    o_ref[...] = _dot(q * from_start, s) + _dot(intra, v_new)

    cum_last, seg_last = cum_r[:, chunk - 1 :], seg_r[:, chunk - 1 :]  # [1, 1]
    to_end = jnp.exp(cum_last - cum_c) * (seg_c == seg_last).astype(jnp.float32)
    chunk_decay = jnp.exp(cum_last) * (seg_last == 0.0).astype(jnp.float32)
    state[...] = s * chunk_decay + _dot(k * to_end, v_new, _TN)

    @pl.when(c == pl.num_programs(2) - 1)
    def _done():
        ht_ref[...] = state[...]


def _chunked_inputs(g, reset, chunk):
    """g [b, h, s], reset [b, s] -> padded length, the in-chunk cumulative decay and segment index
    as columns ([b, h, S, 1], [b, S, 1]) and rows ([b, h, n8, C], [b, n8, C]; n8 = n rounded up to 8)."""
    b, h, s = g.shape
    padded = _round_up(s, chunk)
    n = padded // chunk
    n8 = _round_up(n, 8)
    cum = jnp.pad(g.astype(jnp.float32), ((0, 0), (0, 0), (0, padded - s))).reshape(b, h, n, chunk).cumsum(-1)
    seg = jnp.pad(reset.astype(jnp.int32), ((0, 0), (0, padded - s))).reshape(b, n, chunk).cumsum(-1)
    seg = seg.astype(jnp.float32)
    rows = ((0, 0), (0, n8 - n), (0, 0))
    cum_row = jnp.pad(cum, ((0, 0), *rows))
    seg_row = jnp.pad(seg, rows)
    return padded, cum.reshape(b, h, padded, 1), seg.reshape(b, padded, 1), cum_row, seg_row


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def forward(q, k, v, g, beta, h0, reset, *, chunk: int = CHUNK, interpret: bool = False):
    """The Pallas forward (module docstring): q, k [b, h, s, dk], v [b, h, s, dv], g, beta [b, h, s],
    h0 [b, h, dk, dv], reset [b, s] (int; nonzero: the state is zeroed before that token) ->
    (out [b, h, s, dv] float32, final state [b, h, dk, dv] float32)."""
    b, h, s, dk = q.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    padded, cum_col, seg_col, cum_row, seg_row = _chunked_inputs(g, reset, chunk)
    pad = ((0, 0), (0, 0), (0, padded - s), (0, 0))
    q = jnp.pad(q.astype(f32) * dk**-0.5, pad)
    k, v = jnp.pad(k.astype(f32), pad), jnp.pad(v.astype(f32), pad)
    beta = jnp.pad(beta.astype(f32), pad[:3]).reshape(b, h, padded, 1)
    n, n8 = padded // chunk, cum_row.shape[2]

    def tokens(width):
        return pl.BlockSpec((None, None, chunk, width), lambda i, j, c: (i, j, c, 0))

    def per_head(r, w):
        return pl.BlockSpec((None, None, r, w), lambda i, j, c: (i, j, 0, 0))

    out, ht = pl.pallas_call(
        functools.partial(_fwd_kernel, chunk=chunk),
        grid=(b, h, n),
        in_specs=[
            tokens(dk),
            tokens(dk),
            tokens(dv),
            tokens(1),
            tokens(1),
            pl.BlockSpec((None, chunk, 1), lambda i, j, c: (i, c, 0)),
            per_head(n8, chunk),
            pl.BlockSpec((None, n8, chunk), lambda i, j, c: (i, 0, 0)),
            per_head(dk, dv),
        ],
        out_specs=[tokens(dv), per_head(dk, dv)],
        out_shape=[jax.ShapeDtypeStruct((b, h, padded, dv), f32), jax.ShapeDtypeStruct((b, h, dk, dv), f32)],
        scratch_shapes=[pltpu.VMEM((dk, dv), f32)],
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(q, k, v, beta, cum_col, seg_col, cum_row, seg_row, h0.astype(f32))
    del n
    return out[:, :, :s], ht


def reference(q, k, v, g, beta, h0, reset, *, chunk: int = CHUNK):
    """The same chunked algorithm in plain JAX (the torch reference's operations, float32 matmuls;
    a `lax.scan` over chunks with a checkpointed step): what the backward differentiates."""
    b, h, s, dk = q.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    padded = _round_up(s, chunk)
    n = padded // chunk
    pad = ((0, 0), (0, 0), (0, padded - s), (0, 0))
    q = jnp.pad(q.astype(f32) * dk**-0.5, pad).reshape(b, h, n, chunk, dk)
    k = jnp.pad(k.astype(f32), pad).reshape(b, h, n, chunk, dk)
    v = jnp.pad(v.astype(f32), pad).reshape(b, h, n, chunk, dv)
    beta = jnp.pad(beta.astype(f32), pad[:3]).reshape(b, h, n, chunk, 1)
    cum = jnp.pad(g.astype(f32), pad[:3]).reshape(b, h, n, chunk).cumsum(-1)
    seg = jnp.pad(reset.astype(jnp.int32), pad[:1] + pad[2:3]).reshape(b, 1, n, chunk).cumsum(-1)

    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    seen = causal & (seg[..., :, None] == seg[..., None, :])
    pairwise = jnp.where(seen, jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    mm = functools.partial(jnp.matmul, precision=_HI)
    k_beta, v_beta = k * beta, v * beta
    ut = mm(k_beta, jnp.swapaxes(k, -1, -2)) * pairwise
    ut = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool), -1), ut, 0.0) + jnp.eye(chunk, dtype=f32)
    sees_prev = (seg == 0).astype(f32)
    from_start = jnp.exp(cum) * sees_prev
    solve = functools.partial(jax.scipy.linalg.solve_triangular, lower=True, unit_diagonal=True)
    new_values = solve(ut, v_beta)
    k_cumdecay = solve(ut, k_beta * from_start[..., None])
    intra = mm(q, jnp.swapaxes(k, -1, -2)) * pairwise
    q = q * from_start[..., None]
    to_end = jnp.exp(cum[..., -1:] - cum) * (seg == seg[..., -1:]).astype(f32)
    chunk_decay = jnp.exp(cum[..., -1]) * sees_prev[..., -1]
    k = k * to_end[..., None]

    @jax.checkpoint
    def step(state, xs):
        qc, kc, intra_c, nv, kcd, decay = xs
        v_new = nv - mm(kcd, state)
        out = mm(qc, state) + mm(intra_c, v_new)
        state = state * decay[..., None, None] + mm(jnp.swapaxes(kc, -1, -2), v_new)
        return state, out

    xs = tuple(
        jnp.moveaxis(x, 2, 0) for x in (q, k, intra, new_values, k_cumdecay, jnp.broadcast_to(chunk_decay, (b, h, n)))
    )
    state, out = jax.lax.scan(step, h0.astype(f32), xs)
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, padded, dv)[:, :, :s]
    return out, state


@functools.partial(jax.jit, static_argnames=("chunk",))
def backward(q, k, v, g, beta, h0, reset, d_out, d_state, *, chunk: int = CHUNK):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of <d_out, out> + <d_state, final state>: the VJP of
    `reference` (module docstring), float32."""
    fn = functools.partial(reference, reset=reset, chunk=chunk)
    _, vjp = jax.vjp(lambda *a: fn(*a), q, k, v, g, beta, h0)
    return vjp((d_out.astype(jnp.float32), d_state.astype(jnp.float32)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def gated_delta_rule(q, k, v, g, beta, h0, reset, chunk=CHUNK, interpret=False):
    """(out, final state) by the Pallas forward, differentiable (the backward of `backward`)."""
    return forward(q, k, v, g, beta, h0, reset, chunk=chunk, interpret=interpret)


def _gdr_fwd(q, k, v, g, beta, h0, reset, chunk, interpret):
    out = forward(q, k, v, g, beta, h0, reset, chunk=chunk, interpret=interpret)
    return out, (q, k, v, g, beta, h0, reset)


def _gdr_bwd(chunk, interpret, res, cot):
    del interpret
    grads = backward(*res, *cot, chunk=chunk)
    return (*grads, None)


gated_delta_rule.defvjp(_gdr_fwd, _gdr_bwd)
