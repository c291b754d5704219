"""What `[quantize]` adds to a device's memory: the low-precision copies and scales of one linear.

What the code does (parallelisms/quantize.py, models/common/quantize.py, titan_kernels/tpu/
qmatmul.py): SimpleFSDP gathers each weight in bf16 (with `[quantize] fsdp_float8_all_gather`,
float8_tensorwise weights as e4m3 bytes, handed to the op as float8: `fsdp_gather_bytes`), and the
op `quantized_linear` quantizes the gathered bf16 weight (not a float8-gathered one) and the bf16
activation inside each call.
So, per quantized linear call:

- the bf16 weight copy the planner already counts (the block's gather) exists as before, and its
  quantized copy (1 byte per element) exists beside it for the call;
- every quantized operand of a matmul is a new 1-byte copy, with one fp32 scale per group
  (tensor: 1; row: one per row; 1x128 tile: one per row and 128 columns; 128x128 block);
- saved for backward: x and w in the compute dtype, exactly what a bf16 linear saves (both
  implementations' autograd saves them and re-quantizes in the backward): nothing is added to
  the saved activations, and with activation checkpointing nothing is kept between calls.

The backward program of one linear (`qlinear_bwd`: dx = dy w and dw = dy^T x) holds the most:
dy [M, N] and w^T [K, N] quantized along N, dy^T [N, M] and x^T [K, M] along M (int8's weight
gradient is not quantized). The forward's x [M, K] and w [N, K] are fewer bytes than that for
any shape. One call runs at a time, so the term is the largest linear's backward, a transient
of the block backward. Not counted: the fp32 outputs of the low-precision dots before their
scale-and-cast (per 128-wide K group for `float8_blockwise`): which of them XLA materializes is
the compiler's choice, and the block compiles of docs/low_precision.md report bytes accessed, not
buffers; nor is any fusion that avoids a copy taken off (the count is the copies the program names).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from models.common.quantize import BLOCK, RECIPE_SPECS, Operand
from parallelisms.quantize import QuantizePlan, is_chosen

__all__ = [
    "operand_bytes",
    "linear_backward_bytes",
    "quantize_transient_bytes",
    "experts_transient_bytes",
    "quantized_linear_shapes",
    "fsdp_gather_bytes",
    "block_gather_ratio",
]


def operand_bytes(rows: int, cols: int, op: Operand) -> int:
    """Bytes of one matmul operand [rows, cols] quantized along cols: 1 byte per element plus
    4 per fp32 scale; 0 for an operand left in the compute dtype."""
    if op.dtype is None:
        return 0
    groups = {
        "tensor": 1,
        "axis": rows,
        "tile": rows * math.ceil(cols / BLOCK),
        "block": math.ceil(rows / BLOCK) * math.ceil(cols / BLOCK),
    }[op.granularity]
    return rows * cols + 4 * groups


def linear_backward_bytes(
    out_features: int, in_features: int, tokens: int, recipe: str, *, float8_weight: bool = False
) -> int:
    """The quantized operands of one linear's backward (module docstring): w [N, K], M tokens.
    `float8_weight`: the weight arrives quantized (the float8 all-gather) and the op reads it as
    it is: no copy of w^T."""
    n, k, m = out_features, in_features, tokens
    spec = RECIPE_SPECS[recipe]
    gi, gw = spec.grad_input, spec.grad_weight
    return (
        operand_bytes(m, n, gi.a)  # dy along N
        + (0 if float8_weight else operand_bytes(k, n, gi.b))  # w^T along N
        + operand_bytes(n, m, gw.a)  # dy^T along M
        + operand_bytes(k, m, gw.b)  # x^T along M
    )


def quantize_transient_bytes(
    linears: Iterable[tuple[int, int]], *, tokens: int, recipe: str, float8_weights: bool = False
) -> int:
    """The largest of `linears`' ((out, in) gathered shapes, the quantized ones) backward copies
    at `tokens` per call; 0 for `none` or no quantized linear. `float8_weights`: gathered in
    float8 (`[quantize] fsdp_float8_all_gather`), so no weight copy."""
    if recipe == "none":
        return 0
    return max(
        (linear_backward_bytes(n, k, tokens, recipe, float8_weight=float8_weights) for n, k in linears), default=0
    )


def experts_transient_bytes(shape, quantize: QuantizePlan, *, rows: int, ep: int) -> int:
    """The routed experts' counterpart of `quantize_transient_bytes` when the recipe quantizes them
    (the linear rule on (dim, moe_hidden); "experts" in `filter_fqns` leaves them bf16): one
    expert matmul's backward at `rows` rows on the device, its weight operand the local experts'
    weights (num_experts / ep of them), the larger of w1 / w3 ([hidden, dim]) and w2 ([dim,
    hidden])."""
    if quantize.recipe == "none" or not is_chosen(
        "moe.experts", (shape.dim, shape.moe_hidden), quantize.filter_fqns, quantize.min_dim
    ):
        return 0
    spec = RECIPE_SPECS[quantize.recipe]
    local = max(shape.num_experts // max(ep, 1), 1)
    best = 0
    for n, k in ((shape.moe_hidden, shape.dim), (shape.dim, shape.moe_hidden)):
        gi, gw = spec.grad_input, spec.grad_weight
        best = max(
            best,
            operand_bytes(rows, n, gi.a)  # dy along N
            + local * operand_bytes(k, n, gi.b)  # each local expert's w^T along N
            + operand_bytes(n, rows, gw.a)  # dy^T along the rows
            + operand_bytes(k, rows, gw.b),  # x^T along the rows
        )
    return best


def quantized_linear_shapes(
    linear_shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]], plan: QuantizePlan
) -> list[tuple[int, int]]:
    """The (out, in) gathered shapes of the linears `plan` quantizes, from `ShardStats.linear_shapes`
    (parallelisms/quantize.py's rule on the whole features, as it runs before TP)."""
    if plan.recipe == "none":
        return []
    return [
        gathered
        for fqn, (whole, gathered) in linear_shapes.items()
        if is_chosen(fqn, whole[::-1], plan.filter_fqns, plan.min_dim)
    ]


def fsdp_gather_bytes(gathered_numel: int, quantized: Iterable[tuple[int, int]], *, float8_all_gather: bool) -> int:
    """Bytes SimpleFSDP's all-gathers of `gathered_numel` parameter elements produce (a device
    receives (dp - 1) / dp of them): 2 per element (bf16); with `fsdp_float8_all_gather` the
    weights of `quantized` ((out, in) gathered shapes, float8_tensorwise linears among them) 1 per
    element (e4m3). Their scales travel in a 4-byte all-reduce each, not in the gather."""
    total = 2 * gathered_numel
    if float8_all_gather:
        total -= sum(n * k for n, k in quantized)
    return total


def block_gather_ratio(
    linear_shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]], block_gathered_numel: int, plan: QuantizePlan
) -> float:
    """A block's all-gather bytes with `plan` over its bf16 bytes: 1 without the float8 all-gather,
    down to 1/2 when every block parameter is a quantized weight. The block's linears are those of
    `linear_shapes` under a stack's first block (`<stack>.0.`); with several stacks (DeepSeek-V3's
    dense and MoE layers) the quantized linears of all first blocks count against the largest
    block, and the ratio is floored at 1/2."""
    if not (plan.fsdp_float8_all_gather and plan.recipe == "float8_tensorwise") or block_gathered_numel == 0:
        return 1.0
    in_block = {fqn: v for fqn, v in linear_shapes.items() if fqn.split(".")[1:2] == ["0"]}
    quantized = quantized_linear_shapes(in_block, plan)
    gathered = fsdp_gather_bytes(block_gathered_numel, quantized, float8_all_gather=True)
    return max(0.5, gathered / (2 * block_gathered_numel))
