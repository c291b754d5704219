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


def quantized_linear(x: torch.Tensor, w: torch.Tensor, recipe: str) -> torch.Tensor:
    """The CUDA implementation of the op (tensors elsewhere take the emulation)."""
    if x.device.type != "cuda":
        return q.emulated_linear(x, w, recipe)
    lead = x.shape[:-1]
    y = _CudaQuantizedLinear.apply(x.reshape(-1, x.shape[-1]), w, recipe)
    return y.reshape(*lead, w.shape[0])
