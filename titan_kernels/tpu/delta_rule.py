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

Backward kernels (`gated_delta_rule`, a `jax.custom_vjp` around the padded inputs; JAX
differentiates the padding, the q scale and the in-chunk cumsum around it). Nothing of the forward
is saved but its inputs: the forward kernel runs again writing the state at each chunk's start
([b, h, n dk, dv]), then `_bwd_kernel` walks the chunks in reverse (index maps n - 1 - c) with the
state's gradient dS [dk, dv] in a VMEM scratch (from the final state's cotangent; the initial
state's gradient at the end). Per chunk it recomputes the chunk's quantities as the forward
(`_chunk_terms`: decays, T, T (v beta), T (k beta exp(cum)), q k^T) and applies the chain rule
to them, float32: through the readout and the intra-chunk attention, the state update, the
UT transform (dT from T (v beta) and T X, dA = -T^T dT T^T on the strictly lower part), k beta
and v beta, and the decays (d cum from the pairwise decays' row and column sums and the
from-start, to-end and chunk decays). `reference` is the same algorithm in plain JAX (vectorised
per-chunk quantities, `solve_triangular`, a `lax.scan` over checkpointed chunk steps); its VJP
(`backward_reference`) is the tests' second opinion.

Blocks and VMEM (per grid step, double-buffered inputs and outputs, float32, layouts padded to
(8, 128) tiles): q, k, v, out [64, d]; beta and the cumulative decay as [64, 1] columns; the
decay and segment rows [n, 64] of the whole sequence (n chunks, read at an aligned 8-row
window); h0 and the final state [dk, dv]; scratch: the state. The backward adds the chunk's
start state and dout as inputs and dq, dk, dv, dbeta, dcum as outputs. `vmem_bytes` is that
arithmetic (the larger of the two kernels).
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
    """VMEM of one grid step of the larger kernel (module docstring), float32, (8, 128) tiles."""

    def tile(r: int, c: int) -> int:
        return _round_up(r, 8) * _round_up(c, 128) * 4

    n8 = _round_up(-(-seq_len // chunk), 8)
    blocks = 2 * tile(chunk, dk) + tile(chunk, dv) + 3 * tile(chunk, 1) + 2 * tile(n8, chunk) + tile(dk, dv)
    forward = 2 * (blocks + tile(chunk, dv) + 2 * tile(dk, dv)) + tile(dk, dv)  # + the chunk states out
    bwd_in = blocks + tile(dk, dv) + tile(chunk, dv)  # + the chunk's state, dout
    bwd_out = 2 * tile(chunk, dk) + tile(chunk, dv) + 2 * tile(chunk, 1) + tile(dk, dv)
    return max(forward, 2 * (bwd_in + bwd_out) + tile(dk, dv))


def _chunk_terms(q, k, v, beta, cum_c, seg_c, cum_r, seg_r, chunk):
    """One chunk's quantities of the forward (module docstring), float32, the state aside."""
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    seen = (row >= col) & (seg_c == seg_r)  # j <= i, same segment
    pairwise = jnp.where(seen, jnp.exp(jnp.where(row >= col, cum_c - cum_r, 0.0)), 0.0)

    k_beta, v_beta = k * beta, v * beta
    kk = _dot(k_beta, k, _NT)
    a = jnp.where(row > col, kk * pairwise, 0.0)  # strictly lower

    def substitute(i, t):  # row i of T = e_i - A[i, :] T (rows < i of T are final)
        a_i = jnp.sum(jnp.where(row == i, a, 0.0), axis=0, keepdims=True)  # [1, C]
        e_i = (col[:1] == i).astype(jnp.float32)
        return jnp.where(row == i, e_i - _dot(a_i, t), t)

    t = jax.lax.fori_loop(1, chunk, substitute, (row == col).astype(jnp.float32))

    sees_prev = (seg_c == 0.0).astype(jnp.float32)  # no reset in [chunk start, token]
    from_start = jnp.exp(cum_c) * sees_prev
    x = k_beta * from_start
    cum_last, seg_last = cum_r[:, chunk - 1 :], seg_r[:, chunk - 1 :]  # [1, 1]
    to_end = jnp.exp(cum_last - cum_c) * (seg_c == seg_last).astype(jnp.float32)
    chunk_decay = jnp.exp(cum_last) * (seg_last == 0.0).astype(jnp.float32)
    return dict(
        row=row,
        col=col,
        pairwise=pairwise,
        k_beta=k_beta,
        v_beta=v_beta,
        kk=kk,
        t=t,
        from_start=from_start,
        x=x,
        new_values=_dot(t, v_beta),
        k_cumdecay=_dot(t, x),
        qk=_dot(q, k, _NT),
        to_end=to_end,
        chunk_decay=chunk_decay,
    )


def _rows(cumr_ref, segr_ref, c, chunk):
    """Row c of the [n8, chunk] decay / segment rows: an aligned 8-row window, then a masked sum
    (exact: one nonzero term per column). lax.div / lax.rem, not // and %: c >= 0, and jnp's floor
    forms lower through `sign`, whose Mosaic rule asks JAX's device for the TPU generation (a CPU
    under torch-tpu's jax_op)."""
    base = pl.multiple_of(jax.lax.div(c, 8) * 8, 8)
    pick = jax.lax.broadcasted_iota(jnp.int32, (8, chunk), 0) == jax.lax.rem(c, 8)
    cum_r = jnp.sum(jnp.where(pick, cumr_ref[pl.ds(base, 8), :], 0.0), axis=0, keepdims=True)  # [1, C]
    seg_r = jnp.sum(jnp.where(pick, segr_ref[pl.ds(base, 8), :], 0.0), axis=0, keepdims=True)
    return cum_r, seg_r


def _fwd_kernel(
    q_ref, k_ref, v_ref, beta_ref, cumc_ref, segc_ref, cumr_ref, segr_ref, h0_ref, o_ref, ht_ref, *rest, chunk
):
    states_ref, state = rest if len(rest) == 2 else (None, rest[0])
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _init():
        state[...] = h0_ref[...]

    cum_r, seg_r = _rows(cumr_ref, segr_ref, c, chunk)
    q, k = q_ref[...], k_ref[...]
    f = _chunk_terms(q, k, v_ref[...], beta_ref[...], cumc_ref[...], segc_ref[...], cum_r, seg_r, chunk)
    s = state[...]
    if states_ref is not None:
        states_ref[...] = s
    v_new = f["new_values"] - _dot(f["k_cumdecay"], s)
    o_ref[...] = _dot(q * f["from_start"], s) + _dot(f["qk"] * f["pairwise"], v_new)
    state[...] = s * f["chunk_decay"] + _dot(k * f["to_end"], v_new, _TN)

    @pl.when(c == pl.num_programs(2) - 1)
    def _done():
        ht_ref[...] = state[...]


def _padded(q, k, v, g, beta, reset, chunk):
    """The kernel's inputs, differentiable JAX ops: the sequence padded to whole chunks, float32,
    q scaled by dk^-0.5, beta as a column [b, h, S, 1], the in-chunk cumulative log decay
    `cum` [b, h, S] and the in-chunk document index `seg` [b, S] (float32; no gradient)."""
    b, h, s, dk = q.shape
    f32 = jnp.float32
    padded = _round_up(s, chunk)
    pad = ((0, 0), (0, 0), (0, padded - s), (0, 0))
    qs = jnp.pad(q.astype(f32) * dk**-0.5, pad)
    k, v = jnp.pad(k.astype(f32), pad), jnp.pad(v.astype(f32), pad)
    beta = jnp.pad(beta.astype(f32), pad[:3]).reshape(b, h, padded, 1)
    cum = jnp.pad(g.astype(f32), pad[:3]).reshape(b, h, padded // chunk, chunk).cumsum(-1).reshape(b, h, padded)
    seg = jnp.pad(reset.astype(jnp.int32), pad[:1] + pad[2:3]).reshape(b, padded // chunk, chunk).cumsum(-1)
    return qs, k, v, beta, cum, jax.lax.stop_gradient(seg.astype(f32).reshape(b, padded))


def _layouts(cum, seg, chunk):
    """cum [b, h, S], seg [b, S] as columns ([b, h, S, 1], [b, S, 1]) and rows ([b, h, n8, C],
    [b, n8, C]; n8 = the chunk count rounded up to 8, the rows' aligned window)."""
    b, h, padded = cum.shape
    n = padded // chunk
    n8 = _round_up(n, 8)
    rows = ((0, 0), (0, n8 - n), (0, 0))
    cum_row = jnp.pad(cum.reshape(b, h, n, chunk), ((0, 0), *rows))
    seg_row = jnp.pad(seg.reshape(b, n, chunk), rows)
    return cum.reshape(b, h, padded, 1), seg.reshape(b, padded, 1), cum_row, seg_row


def _specs(n, n8, chunk, dk, dv, reverse=False):
    """(tokens(width), per_head(rows, width), the in_specs both kernels share): qs, k, v, beta,
    the cumulative decays and the segments by column, the decays and the segments by row. The
    chunk axis runs from the last chunk with `reverse` (the backward kernel)."""

    def at(c):
        return n - 1 - c if reverse else c

    def tokens(width):
        return pl.BlockSpec((None, None, chunk, width), lambda i, j, c: (i, j, at(c), 0))

    def per_head(r, w):
        return pl.BlockSpec((None, None, r, w), lambda i, j, c: (i, j, 0, 0))

    seg_col = pl.BlockSpec((None, chunk, 1), lambda i, j, c: (i, at(c), 0))
    seg_row = pl.BlockSpec((None, n8, chunk), lambda i, j, c: (i, 0, 0))
    shared = [tokens(dk), tokens(dk), tokens(dv), tokens(1), tokens(1), seg_col, per_head(n8, chunk), seg_row]
    return tokens, per_head, shared


def _params(interpret):
    return dict(
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )


def _pallas_forward(qs, k, v, beta, cum, seg, h0, *, chunk, interpret, with_states=False):
    """The forward kernel on padded inputs -> (out [b, h, S, dv], final state[, the state at each
    chunk's start [b, h, n * dk, dv] (the backward's recomputation)])."""
    b, h, padded, dk = qs.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    cum_col, seg_col, cum_row, seg_row = _layouts(cum, seg, chunk)
    n, n8 = padded // chunk, cum_row.shape[2]
    tokens, per_head, shared = _specs(n, n8, chunk, dk, dv)
    out_specs = [tokens(dv), per_head(dk, dv)]
    out_shape = [jax.ShapeDtypeStruct((b, h, padded, dv), f32), jax.ShapeDtypeStruct((b, h, dk, dv), f32)]
    if with_states:
        out_specs.append(pl.BlockSpec((None, None, dk, dv), lambda i, j, c: (i, j, c, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, h, n * dk, dv), f32))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, chunk=chunk),
        grid=(b, h, n),
        in_specs=[*shared, per_head(dk, dv)],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), f32)],
        **_params(interpret),
    )(qs, k, v, beta, cum_col, seg_col, cum_row, seg_row, h0.astype(f32))


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def forward(q, k, v, g, beta, h0, reset, *, chunk: int = CHUNK, interpret: bool = False):
    """The Pallas forward (module docstring): q, k [b, h, s, dk], v [b, h, s, dv], g, beta [b, h, s],
    h0 [b, h, dk, dv], reset [b, s] (int; nonzero: the state is zeroed before that token) ->
    (out [b, h, s, dv] float32, final state [b, h, dk, dv] float32)."""
    s = q.shape[2]
    out, ht = _pallas_forward(*_padded(q, k, v, g, beta, reset, chunk), h0, chunk=chunk, interpret=interpret)
    return out[:, :, :s], ht


def _bwd_kernel(
    q_ref, k_ref, v_ref, beta_ref, cumc_ref, segc_ref, cumr_ref, segr_ref, s_ref, do_ref, dht_ref,
    dq_ref, dk_ref, dv_ref, dbeta_ref, dcum_ref, dh0_ref, ds_scr, *, chunk, n
):  # fmt: skip
    """One chunk of the backward, chunks in reverse; the state's gradient dS carried in VMEM."""
    step = pl.program_id(2)
    c = n - 1 - step

    @pl.when(step == 0)
    def _init():
        ds_scr[...] = dht_ref[...]

    cum_r, seg_r = _rows(cumr_ref, segr_ref, c, chunk)
    q, k, v, beta, cum_c = q_ref[...], k_ref[...], v_ref[...], beta_ref[...], cumc_ref[...]
    f = _chunk_terms(q, k, v, beta, cum_c, segc_ref[...], cum_r, seg_r, chunk)
    row, col, p, t, fs, te = f["row"], f["col"], f["pairwise"], f["t"], f["from_start"], f["to_end"]
    s, ds, do = s_ref[...], ds_scr[...], do_ref[...]
    v_new = f["new_values"] - _dot(f["k_cumdecay"], s)
    m = f["qk"] * p  # the intra-chunk attention
    ke = k * te

    d_vnew = _dot(m, do, _TN) + _dot(ke, ds)
    d_m = _dot(do, v_new, _NT)
    d_qk = d_m * p
    d_qfs = _dot(do, s, _NT)  # d(q * from_start)
    dq = d_qfs * fs + _dot(d_qk, k)
    dk = _dot(d_qk, q, _TN)
    d_ke = _dot(v_new, ds, _NT)
    dk = dk + d_ke * te
    d_cd = jnp.sum(s * ds, keepdims=True).reshape(1, 1)
    d_w = -_dot(d_vnew, s, _NT)  # W = k_cumdecay; U = new_values gets d_vnew
    d_t = _dot(d_vnew, f["v_beta"], _NT) + _dot(d_w, f["x"], _NT)
    d_vb = _dot(t, d_vnew, _TN)
    d_x = _dot(t, d_w, _TN)
    d_a = -_dot(_dot(t, d_t, _TN), t, _NT)  # T = (I + A)^-1
    d_a = jnp.where(row > col, d_a, 0.0)
    d_kk = d_a * p
    d_kb = d_x * fs + _dot(d_kk, k)
    dk = dk + _dot(d_kk, f["k_beta"], _TN) + d_kb * beta
    dv = d_vb * beta
    dbeta = jnp.sum(d_kb * k, axis=1, keepdims=True) + jnp.sum(d_vb * v, axis=1, keepdims=True)

    # The log decays: pairwise exp(cum_i - cum_j), from_start exp(cum), to_end exp(cum_last - cum),
    # chunk_decay exp(cum_last); cum_last is cum at the chunk's last row.
    d_pp = (d_m * f["qk"] + d_a * f["kk"]) * p  # d pairwise * pairwise (zero off its support)
    ones = jnp.ones((chunk, 1), jnp.float32)
    d_fs = jnp.sum(d_qfs * q, axis=1, keepdims=True) + jnp.sum(d_x * f["k_beta"], axis=1, keepdims=True)
    d_te = jnp.sum(d_ke * k, axis=1, keepdims=True)
    d_last = jnp.sum(d_te * te, keepdims=True).reshape(1, 1) + d_cd * f["chunk_decay"]
    d_cum = jnp.sum(d_pp, axis=1, keepdims=True) - _dot(d_pp, ones, _TN) + d_fs * fs - d_te * te
    d_cum = d_cum + jnp.where(row[:, :1] == chunk - 1, d_last, 0.0)

    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = dv
    dbeta_ref[...] = dbeta
    dcum_ref[...] = d_cum
    ds_scr[...] = _dot(q * fs, do, _TN) - _dot(f["k_cumdecay"], d_vnew, _TN) + f["chunk_decay"] * ds

    @pl.when(step == n - 1)
    def _done():
        dh0_ref[...] = ds_scr[...]


def _pallas_backward(qs, k, v, beta, cum, seg, h0, d_out, d_state, *, chunk, interpret):
    """Gradients of the padded inputs (qs, k, v, beta, cum, h0): the states at each chunk's start
    recomputed by the forward kernel, then the backward kernel over the chunks in reverse."""
    b, h, padded, dk = qs.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    _, _, states = _pallas_forward(qs, k, v, beta, cum, seg, h0, chunk=chunk, interpret=interpret, with_states=True)
    cum_col, seg_col, cum_row, seg_row = _layouts(cum, seg, chunk)
    n, n8 = padded // chunk, cum_row.shape[2]
    tokens, per_head, shared = _specs(n, n8, chunk, dk, dv, reverse=True)
    state_spec = pl.BlockSpec((None, None, dk, dv), lambda i, j, c: (i, j, n - 1 - c, 0))
    dq, dk_, dv_, dbeta, dcum, dh0 = pl.pallas_call(
        functools.partial(_bwd_kernel, chunk=chunk, n=n),
        grid=(b, h, n),
        in_specs=[*shared, state_spec, tokens(dv), per_head(dk, dv)],
        out_specs=[tokens(dk), tokens(dk), tokens(dv), tokens(1), tokens(1), per_head(dk, dv)],
        out_shape=[
            jax.ShapeDtypeStruct((b, h, padded, dk), f32),
            jax.ShapeDtypeStruct((b, h, padded, dk), f32),
            jax.ShapeDtypeStruct((b, h, padded, dv), f32),
            jax.ShapeDtypeStruct((b, h, padded, 1), f32),
            jax.ShapeDtypeStruct((b, h, padded, 1), f32),
            jax.ShapeDtypeStruct((b, h, dk, dv), f32),
        ],
        scratch_shapes=[pltpu.VMEM((dk, dv), f32)],
        **_params(interpret),
    )(qs, k, v, beta, cum_col, seg_col, cum_row, seg_row, states, d_out.astype(f32), d_state.astype(f32))
    return dq, dk_, dv_, dbeta, dcum.reshape(b, h, padded), dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _core(qs, k, v, beta, cum, seg, h0, chunk, interpret):
    return tuple(_pallas_forward(qs, k, v, beta, cum, seg, h0, chunk=chunk, interpret=interpret))


def _core_fwd(qs, k, v, beta, cum, seg, h0, chunk, interpret):
    return _core(qs, k, v, beta, cum, seg, h0, chunk, interpret), (qs, k, v, beta, cum, seg, h0)


def _core_bwd(chunk, interpret, res, cot):
    dq, dk, dv, dbeta, dcum, dh0 = _pallas_backward(*res, *cot, chunk=chunk, interpret=interpret)
    return dq, dk, dv, dbeta, dcum, jnp.zeros_like(res[5]), dh0


_core.defvjp(_core_fwd, _core_bwd)


def fused_delta_rule(q, k, v, g, beta, h0, reset, chunk: int = CHUNK, interpret: bool = False):
    """(out, final state) as `forward`, differentiable with the Pallas backward kernel (`_bwd_kernel`;
    JAX differentiates the padding, the q scale and the in-chunk cumsum around it)."""
    s = q.shape[2]
    out, ht = _core(*_padded(q, k, v, g, beta, reset, chunk), h0.astype(jnp.float32), chunk, interpret)
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


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def backward(q, k, v, g, beta, h0, reset, d_out, d_state, *, chunk: int = CHUNK, interpret: bool = False):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of <d_out, out> + <d_state, final state>, float32: the
    Pallas backward (`gated_delta_rule`); XLA drops the forward's outputs, which nothing reads."""
    _, vjp = jax.vjp(lambda *a: gated_delta_rule(*a, reset, chunk, interpret), q, k, v, g, beta, h0)
    return vjp((d_out.astype(jnp.float32), d_state.astype(jnp.float32)))


@functools.partial(jax.jit, static_argnames=("chunk",))
def backward_reference(q, k, v, g, beta, h0, reset, d_out, d_state, *, chunk: int = CHUNK):
    """The same gradients as the VJP of `reference` (plain JAX; tests and comparisons)."""
    fn = functools.partial(reference, reset=reset, chunk=chunk)
    _, vjp = jax.vjp(lambda *a: fn(*a), q, k, v, g, beta, h0)
    return vjp((d_out.astype(jnp.float32), d_state.astype(jnp.float32)))


gated_delta_rule = fused_delta_rule
"""(out, final state), differentiable: the Pallas forward and the Pallas backward (module docstring)."""
