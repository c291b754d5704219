"""Low-precision grouped matmul in JAX for the op `quantized_grouped_mm` (`[quantize]` on MoE
experts): `lax.ragged_dot` on float8 / int8 operands.

Pure JAX (no torch): `grouped_mm(x, w, group_sizes, recipe)` is, for each group g of
`group_sizes` [G] (int32, a traced array: one program serves every routing), the rows of x [M, K]
(sorted by group) times w[g]^T, w [G, N, K] in the experts' nn.Linear layout, -> [M, N], with the
recipe's three matmuls quantized exactly as the torch reference does (models/common/quantize.py
`emulated_grouped_mm`: each expert its own `emulated_linear`; titan_kernels/tpu/qmatmul.py's
recipes, scales, clamp and rounding). No scale group spans two experts:
- x and dy (quantized along K, resp. N, in the forward and the input gradient): per-row and
  per-tile scales are row-local already; a tensorwise scale is the max over the expert's rows
  only (a segment max).
- w[g]: quantized per expert (`qmatmul.quantize` under `vmap`): one tensor scale, per-channel or
  128 x 128 block scales of that expert's weight.
- the weight gradient dy_g^T x_g contracts over the expert's tokens: its scales are segment
  maxima over those tokens (tensor: one per expert; axis: one per channel per expert; tile: the
  1 x 128 token tiles of the reference, which are the global 128-row tiles of x cut at the
  experts' boundaries, so each (tile, expert) piece is its own segment).
Each quantized matmul is one `lax.ragged_dot_general` of float8_e4m3fn / float8_e5m2 operands
with float32 accumulation, or int8 operands with int32 accumulation (`preferred_element_type`),
then the two scales (float8_rowwise's power-of-two scales: the dot writes bf16 and the scales
apply in bf16, exactly; the scales reach the rows by selects, not a gather: `row_lookup`, so no
float32 [M, C] value is written); 128-wide K tiles (float8_blockwise) are one ragged dot each (XLA:TPU's
ragged-dot takes no batch dims), each tile's product scaled and the tiles summed in float32. The weight gradient is the ragged dot's
contracting mode (-> [segments, N, K]), scaled per segment and, for tiles, summed per expert:
with float8_blockwise that materialises [M / 128 + G, N, K] float32 partials (the dense op's
blockwise weight gradient holds [M / 128, N, K] likewise; a fused kernel is issue 41's left-over).
Rows past sum(group_sizes) give zeros (the reference's) and no gradient. XLA:TPU lowers
`ragged_dot` to its ragged-dot instruction; XLA:CPU computes it as a masked dense dot per group
(G times the flops: tests only).

`forward` and `backward` are the two halves torch-tpu's `jax_op` wraps (titan_kernels/tpu/qlinear.py);
tests/xla/test_quantize_xla.py checks XLA:CPU runs against the torch reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

try:  # a package import, or a plain module next to qmatmul.py (the XLA-tier probes)
    from titan_kernels.tpu import qmatmul
except ImportError:  # pragma: no cover - the probes put titan_kernels/tpu on sys.path
    import qmatmul

BLOCK = qmatmul.BLOCK
RECIPES = qmatmul.RECIPES

# Ragged non-contracting: a [M, k] (rows ragged), b [G, C, k] -> [M, C]. No batch dims: XLA:TPU's
# ragged-dot refuses them ("number of batch dimensions should be 0"), so K tiles are separate dots.
_NONCONTRACTING = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
# Ragged contracting: a [M, C], b [M, K] (rows ragged and contracted) -> [S, C, K].
_CONTRACTING = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each row [rows] (int32); G for the rows past sum(group_sizes)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right").astype(jnp.int32)


def _segment_amax(t: jax.Array, segment: jax.Array, num: int) -> jax.Array:
    """max |t| over the rows of each segment: t [M, C] -> [num, C] (0 for an empty segment; NaN
    stays NaN, so a non-finite value still gives its segment a NaN scale)."""
    amax = jax.ops.segment_max(jnp.abs(t), segment, num_segments=num, indices_are_sorted=True)
    return jnp.maximum(amax, 0.0)


LOOKUP_SELECTS = 32
"""Most table rows `row_lookup` reads by a chain of selects rather than a gather (below)."""


def row_lookup(table: jax.Array, index: jax.Array) -> jax.Array:
    """table[index] for table [S, ...] and index [M] (int, in [0, S)) -> [M, ...], exactly.

    Up to LOOKUP_SELECTS rows it is a chain of S - 1 selects on the broadcast rows: an elementwise
    expression XLA:TPU fuses into the one consumer (the scaling of a matmul's operand or output),
    where a gather is a kernel of its own that writes the whole [M, C] of scales to memory and the
    consumer reads it back (at the 235B's expert shapes, 81,920 rows: 1.25 GiB of float32 per
    weight-scale gather, 0.6 GiB per token-scale one, live beside the matmul). The scale tables here
    have one row per local expert (+1 for the rows past the groups), so S is small; more rows (the
    1 x 128 token tiles of float8_blockwise) take the gather."""
    if table.shape[0] > LOOKUP_SELECTS:
        return table[index]
    pick = index.reshape(index.shape + (1,) * (table.ndim - 1))
    out = jnp.broadcast_to(table[0], index.shape + table.shape[1:])
    for s in range(1, table.shape[0]):
        out = jnp.where(pick == s, table[s], out)
    return out


def _quantize_rows(t: jax.Array, op, group: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array]:
    """Row-grouped t [M, K] along K -> (q [M, T, k], s [M, T]); tensorwise: one scale per group."""
    if op[1] != "tensor":
        q, s = qmatmul.quantize(t, op)
        return qmatmul._per_row(q, s, t.shape[0], op[1])
    amax = _segment_amax(jnp.max(jnp.abs(t), axis=1, keepdims=True), group, num_groups + 1)
    s = qmatmul.scale_of_amax(amax, op)[group]  # [M, 1]
    return qmatmul.cast(t / s, op[0])[:, None, :], s


def _quantize_weight(w: jax.Array, op) -> tuple[jax.Array, jax.Array]:
    """w [G, C, K] along K, each expert alone -> (q [G, C, T, k], s [G, C, T])."""

    def one(wg):
        q, s = qmatmul.quantize(wg, op)
        return qmatmul._per_row(q, s, wg.shape[0], op[1])

    return jax.vmap(one)(w)


def _accumulator(op_a, op_b, tiles: int, out_dtype):
    """The dtype a quantized ragged dot writes: int32 for int8 operands; for float8, float32, or
    `out_dtype` itself when one dot gives the result and both scales are powers of two
    (float8_rowwise). Scaling by a power of two is exact, so rounding the float32 accumulator to
    out_dtype before the scales equals rounding after them (bfloat16 has float32's exponent range),
    and the [M, C] float32 product never reaches memory (1.25 GiB at the 235B's expert shapes)."""
    if op_a[0] == "int8":
        return jnp.int32
    return out_dtype if tiles == 1 and op_a[2] and op_b[2] else jnp.float32


def _scaled(partial: jax.Array, sa: jax.Array, sb: jax.Array) -> jax.Array:
    """A quantized dot's output times its operands' scales: in the output's own dtype when the dot
    wrote a narrow float (exact: the scales are powers of two, `_accumulator`), else in float32."""
    if partial.dtype in (jnp.int32, jnp.float32):
        return partial.astype(jnp.float32) * sa * sb
    return partial * sa.astype(partial.dtype) * sb.astype(partial.dtype)


def ragged_matmul(a: jax.Array, b: jax.Array, group_sizes: jax.Array, spec, out_dtype) -> jax.Array:
    """Rows of group g of a [M, K] @ b[g]^T (b [G, C, K]) -> [M, C] as the recipe's matmul `spec`."""
    rows = a.shape[0]
    group = row_groups(group_sizes, rows)
    valid = (group < b.shape[0])[:, None]
    op_a, op_b = spec
    if op_a is None:
        out = lax.ragged_dot(a, b.swapaxes(1, 2), group_sizes, preferred_element_type=jnp.float32)
        return jnp.where(valid, out, 0.0).astype(out_dtype)
    a = jnp.where(valid, a, jnp.zeros((), a.dtype))  # rows past the sum: out of every scale
    qa, sa = _quantize_rows(a, op_a, group, b.shape[0])
    qb, sb = _quantize_weight(b, op_b)
    acc = _accumulator(op_a, op_b, qa.shape[1], out_dtype)
    sb_rows = row_lookup(sb, jnp.minimum(group, b.shape[0] - 1))  # [M, C, T]: each row's expert's weight scales
    out = None
    for t in range(qa.shape[1]):  # one ragged dot per K tile (1 for tensor / axis scales)
        partial = lax.ragged_dot_general(
            qa[:, t], qb[:, :, t], group_sizes, _NONCONTRACTING, preferred_element_type=acc
        )
        scaled = _scaled(partial, sa[:, t, None], sb_rows[:, :, t])
        out = scaled if out is None else out + scaled
    return jnp.where(valid, out, jnp.zeros((), out.dtype)).astype(out_dtype)


def _weight_grad_segments(group: jax.Array, num_groups: int, granularity: str) -> tuple[jax.Array, int]:
    """The scale segments of the weight gradient's token contraction: the experts (tensor, axis),
    or each expert's piece of every 128-row tile (tile). Rows are sorted by group and tile, so a
    row's segment `tile + group` never decreases; -> (segment of each row, number of segments)."""
    if granularity in ("tensor", "axis"):
        return group, num_groups + 1
    assert granularity == "tile", granularity
    rows = group.shape[0]
    tiles = -(-rows // BLOCK)
    return jnp.arange(rows, dtype=jnp.int32) // BLOCK + group, tiles + num_groups


def _quantize_tokens(t: jax.Array, op, segment: jax.Array, num: int) -> tuple[jax.Array, jax.Array]:
    """t [M, C] along the (segmented) rows -> (q [M, C], s [num, C]) with one scale per segment
    (tensor) or per segment and column (axis, tile)."""
    amax = _segment_amax(t, segment, num)
    if op[1] == "tensor":
        amax = jnp.max(amax, axis=1, keepdims=True)
    s = qmatmul.scale_of_amax(amax, op)
    return qmatmul.cast(t / row_lookup(s, segment), op[0]), s


def ragged_weight_grad(dy: jax.Array, x: jax.Array, group_sizes: jax.Array, spec, out_dtype) -> jax.Array:
    """dw[g] = dy_g^T x_g for dy [M, N], x [M, K] -> [G, N, K] as the recipe's matmul `spec`."""
    num_groups = group_sizes.shape[0]
    group = row_groups(group_sizes, dy.shape[0])
    valid = (group < num_groups)[:, None]
    op_a, op_b = spec
    if op_a is None:
        return lax.ragged_dot_general(dy, x, group_sizes, _CONTRACTING, preferred_element_type=jnp.float32).astype(
            out_dtype
        )
    assert op_a[1] == op_b[1] or {op_a[1], op_b[1]} <= {"tensor", "axis"}, "operands must split tokens alike"
    segment, num = _weight_grad_segments(group, num_groups, op_a[1])
    dy = jnp.where(valid, dy, jnp.zeros((), dy.dtype))
    x = jnp.where(valid, x, jnp.zeros((), x.dtype))
    qa, sa = _quantize_tokens(dy, op_a, segment, num)
    qb, sb = _quantize_tokens(x, op_b, segment, num)
    sizes = jax.ops.segment_sum(valid[:, 0].astype(jnp.int32), segment, num_segments=num, indices_are_sorted=True)
    acc = _accumulator(op_a, op_b, 1, out_dtype) if op_a[1] != "tile" else jnp.float32
    partial = lax.ragged_dot_general(qa, qb, sizes, _CONTRACTING, preferred_element_type=acc)  # [S, N, K]
    scaled = _scaled(partial, sa[:, :, None], sb[:, None, :])
    if op_a[1] != "tile":
        return scaled[:num_groups].astype(out_dtype)
    # Each segment's expert (an empty segment's partial is exactly 0: any expert will do).
    owner = jnp.clip(jax.ops.segment_max(group, segment, num_segments=num, indices_are_sorted=True), 0, num_groups - 1)
    return jax.ops.segment_sum(scaled, owner, num_segments=num_groups).astype(out_dtype)


def forward(x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: str) -> jax.Array:
    """y [M, N] in x.dtype: rows of group g of x [M, K] times w[g]^T, w [G, N, K]."""
    return ragged_matmul(x, w, group_sizes, RECIPES[recipe][0], x.dtype)


def backward(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, dy: jax.Array, recipe: str
) -> tuple[jax.Array, jax.Array]:
    """(dx, dw) of `forward` for the output gradient dy [M, N], each the recipe's matmul; x and w
    are quantized again along the backward matmuls' own contraction dims (as the reference)."""
    _, grad_input, grad_weight = RECIPES[recipe]
    dx = ragged_matmul(dy, w.swapaxes(1, 2), group_sizes, grad_input, x.dtype)
    dw = ragged_weight_grad(dy, x, group_sizes, grad_weight, w.dtype)
    return dx, dw


def _grouped_mm(x, w, group_sizes, recipe):
    return forward(x, w, group_sizes, recipe)


def _grouped_mm_fwd(x, w, group_sizes, recipe):
    return forward(x, w, group_sizes, recipe), (x, w, group_sizes)


def _grouped_mm_bwd(recipe, saved, dy):
    x, w, group_sizes = saved
    return (*backward(x, w, group_sizes, dy, recipe), None)


grouped_mm = jax.custom_vjp(_grouped_mm, nondiff_argnums=(3,))
grouped_mm.defvjp(_grouped_mm_fwd, _grouped_mm_bwd)
