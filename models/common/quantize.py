"""Low-precision matmul recipes and their exact emulation, the reference every kernel is tested against.

A recipe (`RECIPES`, `[quantize] recipe`) says how each of a linear layer's three matmuls is
quantized: the forward `y = x w^T`, the input gradient `dx = dy w` and the weight gradient
`dw = dy^T x`. Every matmul is written in one layout here, `a @ b^T` with a [R, K] and b [C, K]
contracting their last dim K, and each operand is quantized along that contraction dim:

- `tensor`: one scale for the whole operand (TorchTitan / torchao "tensorwise");
- `axis`: one scale per row, over all of K ("rowwise"; int8's per-token activations and
  per-channel weights, as AQT);
- `tile`: one scale per row and 128 consecutive K (DeepSeek-V3's 1x128 activation tiles);
- `block`: one scale per 128 rows x 128 K (DeepSeek-V3's 128x128 weight blocks).

Scales are dynamic (from this call's amax; nothing is carried between steps) and divisors:
q = round(t / s) with s = amax / qmax (fp32), dequantized t ~ q * s. A group whose amax is 0 gets
the smallest normal fp32 as its scale (its q are 0, no NaN). A group with a non-finite element
gets a NaN scale: every output it touches is NaN, so a non-finite activation or gradient
is never hidden as a finite number; the trainer's non-finite checks then see it
(`[training] skip_nonfinite_updates`). Values are clamped to +-qmax before the cast (torch
saturates float8 casts, XLA does not: the clamp makes both the same).

The recipes (docs/low_precision.md has the table and the sources):
- `float8_tensorwise`: e4m3 forward operands, e5m2 gradient `dy`, e4m3 `x` and `w` in the backward
  (torchao's tensorwise recipe, TorchTitan's default float8).
- `float8_rowwise`: e4m3 everywhere, `axis` scales rounded up to powers of two (torchao's rowwise
  recipe: each matmul's operands are scaled along its own contraction dim).
- `float8_blockwise`: e4m3 everywhere, `tile` activations and gradients, `block` weights
  (DeepSeek-V3's fine-grained recipe).
- `int8`: symmetric int8 with round-to-nearest, per-token `x` and per-channel `w` in the forward,
  per-row `dy` and per-input-channel `w` for the input gradient; the weight gradient stays in the
  compute dtype (it contracts over tokens, where per-row int8 of gradients loses the most).

The emulation (`emulated_linear`) quantizes (round to the format's grid, exactly what torch's
float8 / int8 casts give, kept in fp32), dequantizes, and multiplies in float32 in the order
hardware does: integer (int8) or fp32 (float8) sums per scale group, then
times the two scales, then the groups summed. This module imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

RECIPES = ("none", "float8_tensorwise", "float8_rowwise", "float8_blockwise", "int8")
"""`[quantize] recipe` values; `none` runs every linear in the compute dtype."""

BLOCK = 128
"""Width of a `tile` and side of a `block` (DeepSeek-V3's 1x128 / 128x128)."""

E4M3, E5M2, INT8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
QMAX = {E4M3: 448.0, E5M2: 57344.0, INT8: 127.0}
"""The largest magnitude of each quantized dtype (int8 symmetric: -127..127)."""
TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Operand:
    """How one matmul operand is quantized along its contraction (last) dim."""

    dtype: torch.dtype | None
    """float8_e4m3fn | float8_e5m2 | int8; None: not quantized (the compute dtype, fp32 sums)."""
    granularity: str = "tensor"
    """tensor | axis | tile | block (module docstring)."""
    pow2: bool = False
    """Scales rounded up to a power of two (exact rescaling; torchao's rowwise default)."""


@dataclass(frozen=True)
class MatmulSpec:
    """The two operands of `a @ b^T`."""

    a: Operand
    b: Operand


@dataclass(frozen=True)
class Recipe:
    """A linear layer's three matmuls: forward (x, w), input gradient (dy, w^T), weight
    gradient (dy^T, x^T), each as `a @ b^T` (module docstring)."""

    name: str
    forward: MatmulSpec
    grad_input: MatmulSpec
    grad_weight: MatmulSpec

    @property
    def dtypes(self) -> set:
        """The quantized dtypes the recipe's matmuls use."""
        ops = (self.forward, self.grad_input, self.grad_weight)
        return {o.dtype for m in ops for o in (m.a, m.b) if o.dtype is not None}


def _same(op: Operand) -> MatmulSpec:
    return MatmulSpec(op, op)


HP = Operand(None)
RECIPE_SPECS: dict[str, Recipe] = {
    "float8_tensorwise": Recipe(
        "float8_tensorwise",
        forward=_same(Operand(E4M3)),
        grad_input=MatmulSpec(Operand(E5M2), Operand(E4M3)),
        grad_weight=MatmulSpec(Operand(E5M2), Operand(E4M3)),
    ),
    "float8_rowwise": Recipe(
        "float8_rowwise",
        forward=_same(Operand(E4M3, "axis", pow2=True)),
        grad_input=_same(Operand(E4M3, "axis", pow2=True)),
        grad_weight=_same(Operand(E4M3, "axis", pow2=True)),
    ),
    "float8_blockwise": Recipe(
        "float8_blockwise",
        forward=MatmulSpec(Operand(E4M3, "tile"), Operand(E4M3, "block")),
        grad_input=MatmulSpec(Operand(E4M3, "tile"), Operand(E4M3, "block")),
        grad_weight=MatmulSpec(Operand(E4M3, "tile"), Operand(E4M3, "tile")),
    ),
    "int8": Recipe(
        "int8",
        forward=_same(Operand(INT8, "axis")),
        grad_input=_same(Operand(INT8, "axis")),
        grad_weight=_same(HP),
    ),
}


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    missing = (-t.shape[dim]) % multiple
    if missing == 0:
        return t
    pad = [0, 0] * (t.ndim - 1 - dim) + [0, missing]
    return F.pad(t, pad)


def group_view(t: torch.Tensor, granularity: str) -> torch.Tensor:
    """[R, K] -> [R', T, r, k]: scale groups (R' x T of them) of r rows x k columns each, padded
    with zeros to whole tiles/blocks (zeros change no amax and no sum)."""
    rows, cols = t.shape
    if granularity == "tensor":
        return t.reshape(1, 1, rows, cols)
    if granularity == "axis":
        return t.reshape(rows, 1, 1, cols)
    t = _pad_to(t, 1, BLOCK)
    if granularity == "tile":
        return t.reshape(rows, -1, 1, BLOCK)
    assert granularity == "block", granularity
    t = _pad_to(t, 0, BLOCK)
    return t.reshape(-1, BLOCK, t.shape[1] // BLOCK, BLOCK).transpose(1, 2)


def scales(t: torch.Tensor, op: Operand) -> torch.Tensor:
    """The divisor scale of each group of `t` [R, K]: shape [R', T] (see `group_view`), fp32."""
    amax = group_view(t.detach().float(), op.granularity).abs().amax(dim=(-2, -1))
    return scale_of_amax(amax, op)


def scale_of_amax(amax: torch.Tensor, op: Operand) -> torch.Tensor:
    """The divisor scale of groups whose largest magnitudes are `amax` (fp32); SimpleFSDP's
    float8 all-gather calls it on the all-reduced amax of a weight's shards."""
    s = amax / QMAX[op.dtype]
    if op.pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    s = torch.clamp(s, min=TINY)  # an all-zero group: q = 0, no 0/0
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


MANTISSA_BITS = {E4M3: 3, E5M2: 2}
MIN_NORMAL_EXPONENT = {E4M3: -6, E5M2: -14}


def round_to_float8(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 `v` (|v| <= the format's max) to the nearest value of float8 `dtype`, ties to
    even, as fp32: what `v.to(dtype).float()` gives (tests/unit/test_quantize.py checks every
    value), without a float8 tensor. The spacing of the grid around v is 2^(exponent - mantissa
    bits), the exponent no lower than the smallest normal's (subnormals are evenly spaced); v /
    spacing and back are exact, and `torch.round` rounds half to even. Float8 tensors cannot be
    the saved values of a layer scan on the CPU (torch 2.13 scatters them), so the emulation keeps
    its quantized values in fp32."""
    _, exponent = torch.frexp(v)  # v = m 2^exponent, 0.5 <= |m| < 1
    exponent = torch.clamp(exponent - 1, min=MIN_NORMAL_EXPONENT[dtype]) - MANTISSA_BITS[dtype]
    spacing = torch.ldexp(torch.ones_like(v), exponent)
    return torch.round(v / spacing) * spacing


def quantize(t: torch.Tensor, op: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, K] -> (q [R', T, r, k], scales [R', T] fp32); t ~ q * s per group. q holds the
    quantized values (integers for int8, float8 grid values) in fp32 (`round_to_float8`)."""
    s = scales(t, op)
    g = group_view(t.detach().float(), op.granularity) / s[:, :, None, None]
    qmax = QMAX[op.dtype]
    g = g.clamp(-qmax, qmax)  # NaN stays NaN; torch saturates float8 casts, XLA does not
    if op.dtype == INT8:
        # torch.round is half-to-even, as XLA's round_nearest_even; the NaN of a non-finite
        # group lives in its scale (q is 0 there, as an int8 cast of NaN is undefined).
        q = torch.nan_to_num(torch.round(g), nan=0.0)
    else:
        q = round_to_float8(g, op.dtype)
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The fp32 values q * s in `t`'s layout [R, K] (the inverse of `group_view`, padding cut)."""
    g = q.float() * s[:, :, None, None]  # [R', T, r, k]
    rows, cols = shape
    return g.transpose(1, 2).reshape(g.shape[0] * g.shape[2], -1)[:rows, :cols]


def qdq(t: torch.Tensor, op: Operand) -> torch.Tensor:
    """Quantize then dequantize `t` [R, K] (fp32 result); the identity (as fp32) for `HP`."""
    if op.dtype is None:
        return t.float()
    q, s = quantize(t, op)
    return dequantize(q, s, tuple(t.shape))


def _tile_sums(qa: torch.Tensor, qb: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Per-K-group partial sums [R, C, T] of a @ b^T, from q of `tile`/`axis`/`tensor`/`block`
    groups expanded to one [rows, T, k] layout each."""
    return torch.einsum("rtk,ctk->rct", qa.to(acc), qb.to(acc))


def _per_row(q: torch.Tensor, s: torch.Tensor, rows: int, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R', T, r, k], s [R', T] -> q [rows, T, k], s [rows, T] (each row's own K-groups)."""
    if granularity == "block":
        q = q.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3])
        s = s.repeat_interleave(BLOCK, dim=0)
    elif granularity == "tensor":
        q = q.reshape(q.shape[2], 1, q.shape[3])
        s = s.expand(q.shape[0], 1)
    else:  # axis, tile: one row per group row already
        q = q.reshape(q.shape[0], q.shape[1], q.shape[3])
    return q[:rows], s[:rows]


def scaled_matmul(
    a: torch.Tensor, b: torch.Tensor, spec: MatmulSpec, out_dtype: torch.dtype, b_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """a [R, K] @ b [C, K]^T as the recipe's hardware computes it (module docstring), -> out_dtype.

    Quantized operands: exact products summed per K-group (int8 in float64, which holds every
    int32 sum exactly; float8 in float32, as the MXU / tensor cores accumulate), times both
    groups' scales, groups summed in float32. Unquantized (`HP`): a plain float32 matmul of the
    operands as given (the compute dtype's values). `b_scale`: b is already quantized, its values
    on the format's grid with this one (tensorwise) scale (SimpleFSDP's float8 all-gather)."""
    if spec.a.dtype is None or spec.b.dtype is None:
        assert spec.a.dtype is None and spec.b.dtype is None, "mixed quantized / high-precision matmul"
        return (a.float() @ b.float().t()).to(out_dtype)
    # Both operands split K the same way: one group (tensor, axis) or 128-wide groups (tile, block).
    tiled = spec.a.granularity in ("tile", "block")
    assert tiled == (spec.b.granularity in ("tile", "block")), "operands must split K alike"
    qa, sa = quantize(a, spec.a)
    if b_scale is None:
        qb, sb = quantize(b, spec.b)
    else:
        assert spec.b.granularity == "tensor" and not spec.b.pow2, "a pre-quantized operand has one scale"
        qb, sb = group_view(b.float(), "tensor"), b_scale.float().reshape(1, 1)
    qa, sa = _per_row(qa, sa, a.shape[0], spec.a.granularity)
    qb, sb = _per_row(qb, sb, b.shape[0], spec.b.granularity)
    acc = torch.float64 if spec.a.dtype == INT8 else torch.float32
    partial = _tile_sums(qa, qb, acc).float()  # [R, C, T]
    out = (partial * sa[:, None, :] * sb[None, :, :]).sum(dim=-1)
    return out.to(out_dtype)


class _QuantizedLinear(torch.autograd.Function):
    """y = x w^T with the recipe's three quantized matmuls. Saves x and w in the compute dtype
    and quantizes each again along the backward matmuls' own contraction dims; the scales are
    constants to autograd (straight-through: the gradient of round() is taken as 1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: str, w_scale: torch.Tensor | None) -> torch.Tensor:
        spec = RECIPE_SPECS[recipe]
        ctx.save_for_backward(x, w, w_scale)
        ctx.recipe = recipe
        return scaled_matmul(x, w, spec.forward, x.dtype, w_scale)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, w_scale = ctx.saved_tensors
        spec = RECIPE_SPECS[ctx.recipe]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_matmul(dy, w.t(), spec.grad_input, x.dtype, w_scale)
        if ctx.needs_input_grad[1]:
            dw = scaled_matmul(dy.t(), x.t(), spec.grad_weight, w.dtype)
        return dx, dw, None, None


def emulated_linear(x: torch.Tensor, w: torch.Tensor, recipe: str, w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of the op `quantized_linear`: x [..., K] @ w [N, K]^T under `recipe`, exact
    emulation on any device (module docstring), in x's dtype. With `w_scale` (float8_tensorwise
    only), w is already quantized: e4m3 grid values whose scale is `w_scale` (SimpleFSDP's float8
    all-gather); the forward and the input gradient use them as they are, and the weight gradient
    is the one of the dequantized weight (straight-through, as for a weight quantized here)."""
    assert recipe in RECIPE_SPECS, f"unknown recipe {recipe!r}; recipes: {RECIPES}"
    assert w_scale is None or recipe == "float8_tensorwise", "a pre-quantized weight is float8_tensorwise's"
    lead = x.shape[:-1]
    y = _QuantizedLinear.apply(x.reshape(-1, x.shape[-1]), w, recipe, w_scale)
    return y.reshape(*lead, w.shape[0])


def held_float8_weight(w_q: torch.Tensor, w_grad: torch.Tensor) -> torch.Tensor:
    """A weight gathered in float8 held in its carrier's dtype (exact), differentiable into the
    carrier `w_grad` (zeros: adding it changes no value)."""
    return w_q.to(w_grad.dtype) + w_grad


def emulated_float8_weight_linear(
    x: torch.Tensor, w_q: torch.Tensor, recipe: str, w_scale: torch.Tensor, w_grad: torch.Tensor
) -> torch.Tensor:
    """`emulated_linear` of a weight already quantized (SimpleFSDP's float8 all-gather), its
    gradient sent to the carrier `w_grad` (`held_float8_weight`)."""
    return emulated_linear(x, held_float8_weight(w_q, w_grad), recipe, w_scale)


def float8_weight_linear_function(fwd: Callable, bwd: Callable) -> type[torch.autograd.Function]:
    """An autograd Function over a device's two float8-weight ops (SimpleFSDP's float8 all-gather):
    `apply(x [M, K], carrier, w_q [N, K], w_scale, recipe)` = `fwd(x, w_q, w_scale, recipe)`, with w_q
    and its scale not differentiable; the backward's `bwd(x, w_q, w_scale, dy, recipe) -> (dx, dw)`
    sends dw to the carrier (as `held_float8_weight` does in the emulation). The TPU run's kernels
    (titan_kernels/tpu/qlinear.py) and the deviceless capture's ops (titan_kernels/tpu/capture.py)
    each build theirs from this one."""

    class Float8WeightLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, carrier, w_q, w_scale, recipe):
            ctx.save_for_backward(x, w_q, w_scale)
            ctx.recipe = recipe
            return fwd(x, w_q, w_scale, recipe)

        @staticmethod
        def backward(ctx, dy):
            dx, dw = bwd(*ctx.saved_tensors, dy.contiguous(), ctx.recipe)
            return dx, dw, None, None, None

    return Float8WeightLinear


def emulated_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, recipe: str) -> torch.Tensor:
    """The reference of the op `quantized_grouped_mm`: x [M, K] (rows sorted by group) @ w[g]
    [K, N] for each group g of `group_sizes` [G], under `recipe`, -> [M, N] in x's dtype.

    Each group is one `emulated_linear` of its own rows: the rows of the other groups are masked
    to zero (zeros change no amax and no sum), so every scale group holds one expert's values only
    (rowwise: per token row of x / dy and per output channel of w[g], the weight gradient per
    channel over that expert's tokens; tensorwise: one scale per expert weight and one per expert's
    slice of the activation / gradient; blockwise: 128-wide tiles of the expert's rows, 128 x 128
    blocks of w[g]). One expert's values never move another's scale. Rows past sum(group_sizes)
    are zero here (unspecified, as for `grouped_mm`). Cost: G dense matmuls (a reference)."""
    ends = torch.cumsum(group_sizes, dim=0)
    row_group = torch.searchsorted(ends, torch.arange(x.shape[0], device=x.device), right=True)  # G: past the sum
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for g in range(w.shape[0]):
        mask = (row_group == g).to(x.dtype)[:, None]
        out = out + mask * emulated_linear(x * mask, w[g].transpose(0, 1), recipe)
    return out


def emulated_batched_mm(x: torch.Tensor, w: torch.Tensor, recipe: str) -> torch.Tensor:
    """x [E, R, K] @ w [E, K, N] under `recipe`, each expert its own `emulated_linear` (the capacity
    layout's batched matmul: no scale is shared between experts)."""
    return torch.stack([emulated_linear(x[e], w[e].transpose(0, 1), recipe) for e in range(w.shape[0])])


def batched_as_grouped(grouped, x: torch.Tensor, w: torch.Tensor, recipe: str) -> torch.Tensor:
    """x [E, R, K] @ w [E, K, N] through a `quantized_grouped_mm` implementation `grouped(x2
    [E R, K], w, group_sizes [E], recipe)` with every group R rows: expert e's rows are the e-th
    block, as the capacity buffer lays them out (how the TPU serves `quantized_batched_mm`). Each
    expert's scale groups then hold its own rows, as in `emulated_batched_mm`; for 1 x 128 token
    tiles (float8_blockwise's weight gradient) the grouped op cuts global 128-row tiles at the
    groups' boundaries, so R is first padded with zero rows to a multiple of 128 (zeros change no
    amax and no sum): each expert's tiles then start at its first row, as in its own linear."""
    e, r, k = x.shape
    rows = -(-r // BLOCK) * BLOCK if RECIPE_SPECS[recipe].grad_weight.a.granularity == "tile" else r
    if rows != r:
        x = torch.cat([x, x.new_zeros(e, rows - r, k)], dim=1)
    sizes = torch.full((e,), rows, dtype=torch.int32, device=x.device)
    return grouped(x.reshape(e * rows, k), w, sizes, recipe).reshape(e, rows, w.shape[-1])[:, :r]
