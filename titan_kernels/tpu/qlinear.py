"""The ops `quantized_linear` and `quantized_grouped_mm` on TPU: titan_kernels/tpu/qmatmul.py (XLA's
float8 / int8 dots) and qgmm.py (float8 / int8 ragged dots) as torch ops through torch-tpu's `jax_op`.

`build()` defines, once per process, `titan_tpu::qlinear_fwd(x, w, recipe) -> y` and
`titan_tpu::qlinear_bwd(x, w, dy, recipe) -> (dx, dw)` (x [M, K], w [N, K]; the recipe a static
string, so each recipe is its own exported program), ties them with `register_autograd` (jax_op
registers none; the forward saves x and w, as the torch emulation does) and returns the op's
implementation: it flattens x's leading dims, and hands tensors that are not on the TPU to the
emulation (models/common/quantize.py). With SimpleFSDP's float8 all-gather (float8_tensorwise)
the weight arrives as the gathered float8_e4m3fn tensor and its scale: `titan_tpu::qlinear_w8_fwd
(x, w_q, w_scale, recipe)` and `qlinear_w8_bwd(x, w_q, w_scale, dy, recipe) -> (dx, dw)` read it as
it is (no wider copy, no second quantization: only x and dy are quantized), tied by an
autograd.Function that sends dw to the gather's carrier (ops.quantized_linear); the
implementation is marked `takes_float8_weight`. Imported only on a TPU run (`titan_kernels.
quantized_linear_for`): it imports jax and needs torch-tpu.

`build_grouped()` does the same for the MoE experts: `titan_tpu::qgmm_fwd(x, w, group_sizes, recipe)
-> y` and `titan_tpu::qgmm_bwd(x, w, group_sizes, dy, recipe) -> (dx, dw)` (x [M, K] rows sorted
by expert, w [G, N, K]: the experts' nn.Linear layout, which their transposed view passes without
a copy; group_sizes int32 on the device, never read on the host), the forward saving x, w and the
group sizes; tensors not on the TPU go to `emulated_grouped_mm`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import torch

from models.common.quantize import (
    batched_as_grouped,
    emulated_float8_weight_linear,
    emulated_grouped_mm,
    emulated_linear,
    float8_weight_linear_function,
)
from titan_kernels.tpu import qgmm, qmatmul

NAMESPACE = "titan_tpu"
_BUILT: dict[str, Callable] = {}


def build() -> Callable:
    """Register the two ops (idempotent); return `quantized_linear(x, w, recipe)`."""
    if "fn" in _BUILT:
        return _BUILT["fn"]
    jax_op = torch.tpu.pallas.jax_op

    @jax_op(f"{NAMESPACE}::qlinear_fwd")
    def qlinear_fwd(x: jax.Array, w: jax.Array, recipe: str) -> jax.Array:
        return qmatmul.forward(x, w, recipe)

    @jax_op(f"{NAMESPACE}::qlinear_bwd")
    def qlinear_bwd(x: jax.Array, w: jax.Array, dy: jax.Array, recipe: str) -> tuple[jax.Array, jax.Array]:
        return qmatmul.backward(x, w, dy, recipe)

    def setup(ctx, inputs, output):
        x, w, recipe = inputs
        ctx.save_for_backward(x, w)
        ctx.recipe = recipe

    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw = qlinear_bwd(x, w, dy.contiguous(), ctx.recipe)
        return dx, dw, None

    qlinear_fwd.register_autograd(backward, setup_context=setup)

    @jax_op(f"{NAMESPACE}::qlinear_w8_fwd")
    def qlinear_w8_fwd(x: jax.Array, w_q: jax.Array, w_scale: jax.Array, recipe: str) -> jax.Array:
        return qmatmul.forward_w8(x, w_q, w_scale, recipe)

    @jax_op(f"{NAMESPACE}::qlinear_w8_bwd")
    def qlinear_w8_bwd(
        x: jax.Array, w_q: jax.Array, w_scale: jax.Array, dy: jax.Array, recipe: str
    ) -> tuple[jax.Array, jax.Array]:
        return qmatmul.backward_w8(x, w_q, w_scale, dy, recipe)

    W8Linear = float8_weight_linear_function(qlinear_w8_fwd, qlinear_w8_bwd)

    def quantized_linear(
        x: torch.Tensor,
        w: torch.Tensor,
        recipe: str,
        w_scale: torch.Tensor | None = None,
        w_grad: torch.Tensor | None = None,
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        if w_scale is not None:  # SimpleFSDP's float8 all-gather: w is the gathered float8 weight
            if x.device.type != "tpu" or w.device.type != "tpu":
                return emulated_float8_weight_linear(x, w, recipe, w_scale, w_grad)
            x2 = x.reshape(-1, x.shape[-1]).contiguous()
            y = W8Linear.apply(x2, w_grad, w.contiguous(), w_scale.reshape(()).float(), recipe)
            return y.reshape(*lead, w.shape[0])
        if x.device.type != "tpu" or w.device.type != "tpu":
            return emulated_linear(x, w, recipe)
        y = qlinear_fwd(x.reshape(-1, x.shape[-1]).contiguous(), w.contiguous(), recipe)
        return y.reshape(*lead, w.shape[0])

    quantized_linear.takes_float8_weight = True
    _BUILT["fn"], _BUILT["w8"] = quantized_linear, W8Linear
    return quantized_linear


def build_grouped() -> Callable:
    """Register the two grouped ops (idempotent); return `quantized_grouped_mm(x, w, group_sizes,
    recipe)` with w [G, K, N] as the op takes it."""
    if "grouped" in _BUILT:
        return _BUILT["grouped"]
    jax_op = torch.tpu.pallas.jax_op

    @jax_op(f"{NAMESPACE}::qgmm_fwd")
    def qgmm_fwd(x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: str) -> jax.Array:
        return qgmm.forward(x, w, group_sizes, recipe)

    @jax_op(f"{NAMESPACE}::qgmm_bwd")
    def qgmm_bwd(
        x: jax.Array, w: jax.Array, group_sizes: jax.Array, dy: jax.Array, recipe: str
    ) -> tuple[jax.Array, jax.Array]:
        return qgmm.backward(x, w, group_sizes, dy, recipe)

    def setup(ctx, inputs, output):
        x, w, group_sizes, recipe = inputs
        ctx.save_for_backward(x, w, group_sizes)
        ctx.recipe = recipe

    def backward(ctx, dy):
        x, w, group_sizes = ctx.saved_tensors
        dx, dw = qgmm_bwd(x, w, group_sizes, dy.contiguous(), ctx.recipe)
        return dx, dw, None, None

    qgmm_fwd.register_autograd(backward, setup_context=setup)

    def quantized_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, recipe: str) -> torch.Tensor:
        if x.device.type != "tpu" or w.device.type != "tpu":
            return emulated_grouped_mm(x, w, group_sizes, recipe)
        w_nk = w.transpose(-2, -1).contiguous()  # a view of the experts' [G, N, K] weight: no copy
        return qgmm_fwd(x.contiguous(), w_nk, group_sizes.to(torch.int32), recipe)

    _BUILT["grouped"] = quantized_grouped_mm
    return quantized_grouped_mm


def build_batched() -> Callable:
    """`quantized_batched_mm(x [E, R, K], w [E, K, N], recipe)` (the capacity layout's experts):
    the grouped ops on the flattened rows with every group R rows, the same scale groups as one
    linear per expert (`batched_as_grouped`)."""
    if "batched" in _BUILT:
        return _BUILT["batched"]
    _BUILT["batched"] = functools.partial(batched_as_grouped, build_grouped())
    return _BUILT["batched"]
