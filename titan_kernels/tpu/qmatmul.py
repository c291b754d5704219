"""Low-precision linear layers in JAX for the op `quantized_linear` (`[quantize]`): XLA's float8 and
int8 dots.

Pure JAX (no torch): `linear(x, w, recipe)` is x [M, K] @ w [N, K]^T with the recipe's three
matmuls (forward, input gradient, weight gradient) quantized exactly as the torch emulation
does (models/common/quantize.py: the same recipes, scale groups, power-of-two rounding, clamp,
round-half-to-even and non-finite handling), as a `jax.custom_vjp`; `forward` and `backward` are
the two halves torch-tpu's `jax_op` wraps (titan_kernels/tpu/qlinear.py). Each quantized matmul
is one `lax.dot_general` of float8_e4m3fn / float8_e5m2 operands with float32 accumulation
(`preferred_element_type`), or int8 operands with int32 accumulation: the low-precision dots
XLA:TPU runs on the MXU (v7x: float8; v5e/v5p/v6e: int8). Tile and block scales (float8_blockwise)
make it a dot batched over the 128-wide K groups, each group's product scaled and the groups
summed in float32 (DeepSeek-V3's promotion of partial sums).

`RECIPES` must equal models/common/quantize.py's `RECIPE_SPECS` (tests/xla/test_quantize_xla.py
checks it, and that XLA:CPU runs of `linear` equal the torch emulation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 128
QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}
DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2, "int8": jnp.int8}
TINY = float(jnp.finfo(jnp.float32).tiny)

# (dtype, granularity, pow2) of a and b for (forward, grad_input, grad_weight); None: not quantized.
_E4 = ("e4m3", "tensor", False)
_E5 = ("e5m2", "tensor", False)
_ROW = ("e4m3", "axis", True)
_TILE = ("e4m3", "tile", False)
_BLK = ("e4m3", "block", False)
_I8 = ("int8", "axis", False)
RECIPES = {
    "float8_tensorwise": ((_E4, _E4), (_E5, _E4), (_E5, _E4)),
    "float8_rowwise": ((_ROW, _ROW), (_ROW, _ROW), (_ROW, _ROW)),
    "float8_blockwise": ((_TILE, _BLK), (_TILE, _BLK), (_TILE, _TILE)),
    "int8": ((_I8, _I8), (_I8, _I8), (None, None)),
}


def _groups(t: jax.Array, granularity: str) -> jax.Array:
    """[R, K] -> [R', T, r, k] scale groups, zero-padded to whole tiles / blocks."""
    rows, cols = t.shape
    if granularity == "tensor":
        return t.reshape(1, 1, rows, cols)
    if granularity == "axis":
        return t.reshape(rows, 1, 1, cols)
    t = jnp.pad(t, ((0, 0), (0, (-cols) % BLOCK)))
    if granularity == "tile":
        return t.reshape(rows, -1, 1, BLOCK)
    t = jnp.pad(t, ((0, (-rows) % BLOCK), (0, 0)))
    return t.reshape(-1, BLOCK, t.shape[1] // BLOCK, BLOCK).transpose(0, 2, 1, 3)


def scale_of_amax(amax: jax.Array, op: tuple[str, str, bool]) -> jax.Array:
    """The divisor scale (float32) of scale groups whose largest magnitudes are `amax`."""
    name, _, pow2 = op
    s = amax / QMAX[name]
    if pow2:
        s = jnp.exp2(jnp.ceil(jnp.log2(s)))
    s = jnp.maximum(s, TINY)
    return jnp.where(jnp.isfinite(amax), s, jnp.nan)


def cast(v: jax.Array, name: str) -> jax.Array:
    """Values already divided by their scale -> the quantized dtype (clamped, rounded to nearest even)."""
    v = jnp.clip(v, -QMAX[name], QMAX[name])
    if name == "int8":
        return jnp.nan_to_num(jnp.round(v), nan=0.0).astype(jnp.int8)  # jnp.round: half to even
    return v.astype(DTYPES[name])  # round to nearest even; in range after the clip


def quantize(t: jax.Array, op: tuple[str, str, bool]) -> tuple[jax.Array, jax.Array]:
    """t [R, K] -> (q [R', T, r, k] in the quantized dtype, scales [R', T] float32)."""
    g = _groups(t.astype(jnp.float32), op[1])
    s = scale_of_amax(jnp.max(jnp.abs(g), axis=(-2, -1)), op)
    return cast(g / s[:, :, None, None], op[0]), s


def _per_row(q: jax.Array, s: jax.Array, rows: int, granularity: str) -> tuple[jax.Array, jax.Array]:
    """q [R', T, r, k], s [R', T] -> q [rows, T, k], s [rows, T]."""
    if granularity == "block":
        q = q.transpose(0, 2, 1, 3).reshape(-1, q.shape[1], q.shape[3])
        s = jnp.repeat(s, BLOCK, axis=0)
    elif granularity == "tensor":
        q = q.reshape(q.shape[2], 1, q.shape[3])
        s = jnp.broadcast_to(s, (q.shape[0], 1))
    else:
        q = q.reshape(q.shape[0], q.shape[1], q.shape[3])
    return q[:rows], s[:rows]


def scaled_matmul(a: jax.Array, b: jax.Array, spec, out_dtype, b_scale: jax.Array | None = None) -> jax.Array:
    """a [R, K] @ b [C, K]^T as the recipe's matmul `spec` ((a op, b op) or (None, None)).
    `b_scale`: b is already quantized (grid values of b's format, float8 or held wider) with this
    one tensorwise scale, and is used as it is."""
    op_a, op_b = spec
    if op_a is None:
        out = lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return out.astype(out_dtype)
    qa, sa = quantize(a, op_a)
    if b_scale is None:
        qb, sb = quantize(b, op_b)
    else:
        assert op_b[1] == "tensor" and not op_b[2], "a pre-quantized operand has one scale"
        qb, sb = b.astype(DTYPES[op_b[0]]).reshape(1, 1, *b.shape), b_scale.astype(jnp.float32).reshape(1, 1)
    qa, sa = _per_row(qa, sa, a.shape[0], op_a[1])
    qb, sb = _per_row(qb, sb, b.shape[0], op_b[1])
    acc = jnp.int32 if op_a[0] == "int8" else jnp.float32
    # [T, R, C]: one low-precision dot per K group (T = 1 for tensor / axis scales).
    partial = lax.dot_general(qa, qb, (((2,), (2,)), ((1,), (1,))), preferred_element_type=acc)
    out = jnp.sum(partial.astype(jnp.float32) * sa.T[:, :, None] * sb.T[:, None, :], axis=0)
    return out.astype(out_dtype)


def forward(x: jax.Array, w: jax.Array, recipe: str) -> jax.Array:
    """y = x w^T, x [M, K], w [N, K] -> [M, N] in x.dtype."""
    return scaled_matmul(x, w, RECIPES[recipe][0], x.dtype)


def backward(x: jax.Array, w: jax.Array, dy: jax.Array, recipe: str) -> tuple[jax.Array, jax.Array]:
    """(dx, dw) of `forward` for the output gradient dy [M, N], each the recipe's matmul."""
    _, grad_input, grad_weight = RECIPES[recipe]
    dx = scaled_matmul(dy, w.T, grad_input, x.dtype)
    dw = scaled_matmul(dy.T, x.T, grad_weight, w.dtype)
    return dx, dw


def forward_w8(x: jax.Array, w_q: jax.Array, w_scale: jax.Array, recipe: str) -> jax.Array:
    """`forward` with the weight already quantized (SimpleFSDP's float8 all-gather): w_q [N, K]
    float8_e4m3fn, w_scale its tensorwise scale (float8_tensorwise); only x is quantized here."""
    return scaled_matmul(x, w_q, RECIPES[recipe][0], x.dtype, w_scale)


def backward_w8(
    x: jax.Array, w_q: jax.Array, w_scale: jax.Array, dy: jax.Array, recipe: str
) -> tuple[jax.Array, jax.Array]:
    """(dx, dw) of `forward_w8`: dx from the same float8 weight (w^T has its one scale), dw (in
    x.dtype, the gradient of the dequantized weight) as `backward`'s."""
    _, grad_input, grad_weight = RECIPES[recipe]
    dx = scaled_matmul(dy, w_q.T, grad_input, x.dtype, w_scale)
    dw = scaled_matmul(dy.T, x.T, grad_weight, x.dtype)
    return dx, dw


def _linear(x, w, recipe):
    return forward(x, w, recipe)


def _linear_fwd(x, w, recipe):
    return forward(x, w, recipe), (x, w)


def _linear_bwd(recipe, saved, dy):
    x, w = saved
    return backward(x, w, dy, recipe)


linear = jax.custom_vjp(_linear, nondiff_argnums=(2,))
linear.defvjp(_linear_fwd, _linear_bwd)
