"""The op `quantized_linear` on CUDA: `torch._scaled_mm` (float8, sm89+) and `torch._int_mm` (int8, sm80+).

Not run on this project's machines (no GPU in CI): written against torch 2.13's documented
signatures and checked only for the arithmetic it shares with the emulation. Each matmul quantizes
its operands with the emulation's own functions (models/common/quantize.py: same scales, clamp
and rounding), casts the quantized values to float8 / int8 (exact: they are grid values), and
runs the tensor-core kernel:
- float8, `tensor` / `axis` scales: `torch._scaled_mm(a_q, b_q.t(), scale_a, scale_b,
  out_dtype=float32)`; scale_a [R, 1] or a scalar, scale_b [1, C] or a scalar (rowwise scales
  need sm90; the emulation's scales are dequantizing multipliers, as `_scaled_mm` takes them);
- int8, `axis` scales: `torch._int_mm(a_q, b_q.t())` (int32), times the two scales;
- anything else (tile / block scales: float8_blockwise, which the rules refuse on CUDA; shapes the
  kernels do not take: rows or K not multiples of 16): the emulation.
The backward is the emulation's autograd with this module's matmul (`_CudaQuantizedLinear`).
A weight SimpleFSDP gathered in float8 (float8_tensorwise, `fsdp_float8_all_gather`) is taken as
it is (`_CudaW8Linear`): only x and dy are quantized.
"""

from __future__ import annotations

import torch

from models.common import quantize as q


def _kernels_take(a: torch.Tensor, b: torch.Tensor, spec: q.MatmulSpec, device_type: str = "cuda") -> bool:
    """Whether the tensor-core kernels take this matmul (on `device_type`: the CPU in a test)."""
    if a.device.type != device_type or spec.a.dtype is None:
        return False
    if spec.a.granularity not in ("tensor", "axis") or spec.b.granularity not in ("tensor", "axis"):
        return False
    return all(d % 16 == 0 for d in (a.shape[0], a.shape[1], b.shape[0]))


def _kernel_ok(a: torch.Tensor, b: torch.Tensor, spec: q.MatmulSpec) -> bool:
    return _kernels_take(a, b, spec)


def cuda_scaled_matmul(a: torch.Tensor, b: torch.Tensor, spec: q.MatmulSpec, out_dtype: torch.dtype) -> torch.Tensor:
    """`q.scaled_matmul` with the tensor-core kernels where they apply (module docstring)."""
    if not _kernel_ok(a, b, spec):
        return q.scaled_matmul(a, b, spec, out_dtype)
    qa, sa = q.quantize(a, spec.a)
    qb, sb = q.quantize(b, spec.b)
    qa = qa.reshape(a.shape)  # tensor / axis groups are whole rows: the layout is t's own
    qb = qb.reshape(b.shape)
    sa = sa.reshape(-1, 1) if spec.a.granularity == "axis" else sa.reshape(())
    sb = sb.reshape(1, -1) if spec.b.granularity == "axis" else sb.reshape(())
    if spec.a.dtype == q.INT8:
        acc = torch._int_mm(qa.to(torch.int8), qb.to(torch.int8).t())
        return (acc.float() * sa * sb).to(out_dtype)
    out = torch._scaled_mm(
        qa.to(spec.a.dtype).contiguous(),
        qb.to(spec.b.dtype).contiguous().t(),  # column-major, as _scaled_mm wants its second operand
        scale_a=sa.float(),
        scale_b=sb.float(),
        out_dtype=torch.float32,
    )
    return out.to(out_dtype)


class _CudaQuantizedLinear(torch.autograd.Function):
    """`q._QuantizedLinear` with `cuda_scaled_matmul` for each of the three matmuls."""

    @staticmethod
    def forward(ctx, x, w, recipe):
        ctx.save_for_backward(x, w)
        ctx.recipe = recipe
        return cuda_scaled_matmul(x, w, q.RECIPE_SPECS[recipe].forward, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        spec = q.RECIPE_SPECS[ctx.recipe]
        dx = cuda_scaled_matmul(dy, w.t(), spec.grad_input, x.dtype) if ctx.needs_input_grad[0] else None
        dw = cuda_scaled_matmul(dy.t(), x.t(), spec.grad_weight, w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def _w8_matmul(a: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, spec, out_dtype, *, transpose: bool):
    """a [R, K'] @ the float8 weight (w_q [N, K] as gathered, one scale): the forward (a x,
    `transpose` False: a @ w^T) or the input gradient (a dy, True: a @ w). Only a is quantized;
    `_scaled_mm` takes its second operand column-major, which w_q.t() is for the forward and a
    transposed copy (1 byte per element) for the input gradient."""
    b = w_q.t().contiguous() if transpose else w_q  # [C, K'] row-major: b^T is the operand
    if not _kernel_ok(a, b, spec):
        return q.scaled_matmul(a, b.float(), spec, out_dtype, w_scale)
    qa, sa = q.quantize(a, spec.a)
    sa = sa.reshape(-1, 1) if spec.a.granularity == "axis" else sa.reshape(())
    out = torch._scaled_mm(
        qa.reshape(a.shape).to(spec.a.dtype).contiguous(),
        b.t(),
        scale_a=sa.float(),
        scale_b=w_scale.reshape(()).float(),
        out_dtype=torch.float32,
    )
    return out.to(out_dtype)


class _CudaW8Linear(torch.autograd.Function):
    """float8_tensorwise with the weight gathered in float8 (SimpleFSDP's float8 all-gather): the
    forward and the input gradient read the float8 weight as it is; the weight gradient (of the
    dequantized weight) goes to the carrier, as `q._QuantizedLinear`'s goes to w."""

    @staticmethod
    def forward(ctx, x, carrier, w_q, w_scale, recipe):
        ctx.save_for_backward(x, w_q, w_scale)
        ctx.recipe, ctx.dtype = recipe, carrier.dtype
        return _w8_matmul(x, w_q, w_scale, q.RECIPE_SPECS[recipe].forward, x.dtype, transpose=False)

    @staticmethod
    def backward(ctx, dy):
        x, w_q, w_scale = ctx.saved_tensors
        spec = q.RECIPE_SPECS[ctx.recipe]
        dx = _w8_matmul(dy, w_q, w_scale, spec.grad_input, x.dtype, transpose=True)
        dw = cuda_scaled_matmul(dy.t(), x.t(), spec.grad_weight, ctx.dtype)
        return dx, dw, None, None, None


def quantized_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    recipe: str,
    w_scale: torch.Tensor | None = None,
    w_grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CUDA implementation of the op (tensors elsewhere take the emulation). With `w_scale`,
    w is the float8 weight SimpleFSDP gathered and `w_grad` its gradient's carrier
    (ops.quantized_linear)."""
    lead = x.shape[:-1]
    if w_scale is not None:
        if x.device.type != "cuda":
            return q.emulated_float8_weight_linear(x, w, recipe, w_scale, w_grad)
        y = _CudaW8Linear.apply(x.reshape(-1, x.shape[-1]), w_grad, w, w_scale, recipe)
        return y.reshape(*lead, w.shape[0])
    if x.device.type != "cuda":
        return q.emulated_linear(x, w, recipe)
    y = _CudaQuantizedLinear.apply(x.reshape(-1, x.shape[-1]), w, recipe)
    return y.reshape(*lead, w.shape[0])


quantized_linear.takes_float8_weight = True
