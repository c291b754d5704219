"""The Pallas kernels as opaque torch ops in a CPU capture, lowered for a compile-only TPU topology.

scripts/estimate_xla.py captures the graph step on the CPU and lowers it with torchax for a
deviceless XLA:TPU compile. With the model ops' torch references in that capture, the TPU program
would hold what a TPU run does not execute: attention as math SDPA (T x T scores materialised:
the compiler's HBM bytes and temporaries are then the math kernel's) and MoE experts as
`_grouped_mm`/dense fallbacks, and the fused loss as the chunked torch reference. `install()`
instead serves `causal_attention`, `attention` (full mask: `splash_full_*`), `grouped_mm` and
`linear_cross_entropy` (and Qwen 3.5's `gated_delta_rule`), on every device,
with `titan_capture::*` custom ops that have shape-only (fake) kernels and autograd,
so they stay single nodes of the captured ATen graph; `add_lowerings(env, mesh, axis,
generation=...)` then lowers each node to the kernel a TPU run calls (titan_kernels/tpu/splash.py,
gmm.py, fused_ce.py; Mosaic, not interpreted; the loss with the target generation's blocks),
inside `shard_map` over `axis`: XLA's SPMD partitioner cannot split a Mosaic custom call and
would otherwise replicate it on every device.

- splash: the batch is split over `axis` (the batch is the data-parallel dim of the step);
- gmm: the rows (tokens sorted by expert) are split over `axis`, the weight is gathered, and each
  shard's group sizes are its slice of the global groups (rows of group g that fall in the
  shard), so every row meets its own expert's weight once;
- the gated delta rule (Qwen 3.5): the batch is split over `axis` (titan_kernels/tpu/delta_rule.py:
  the forward kernel; the backward op runs it again for the chunk states, then the backward kernel);
- fused CE: the rows (tokens) are split over `axis`, the output projection's weight is gathered;
  the forward returns per-row losses and log-sum-exps (the op titan_kernels/tpu/register.py binds on
  a TPU, same mean over valid rows in torch), the backward's dw is summed over the shards.

Backward ops take the JAX VJP of the forward kernel, as titan_kernels/tpu/register.py does on a TPU.

libtpu's cost analysis counts a Mosaic custom call as zero FLOPs (splash forward, 1 x 8 heads x
2048 x 128 on v6e: 8.4e6 FLOPs, the q scaling only, for 8.6e9 of matmuls), so each lowered kernel
call also appends its own FLOPs and HBM bytes, from its per-device shapes, to `COSTS`
(`kernel_costs`); the compile worker adds them to the compiler's counts.
Only for the compile worker (jax, torchax): nothing in the trainer imports it.
"""

from __future__ import annotations

import torch

from models.common import ops
from models.common.quantize import float8_weight_linear_function

NAMESPACE = "titan_capture"
_LIB: list = []
COSTS: list[tuple[str, float, float]] = []
"""(kernel, FLOPs, HBM bytes) per device of every kernel call lowered since the last clear."""


_QKV = "Tensor q, Tensor k, Tensor v"
_SINK = f"{_QKV}, Tensor sinks, Tensor window"
_DELTA = f"{_QKV}, Tensor g, Tensor beta, Tensor h0, Tensor reset"
_GRADS3 = "(Tensor, Tensor, Tensor)"
_GRADS4 = "(Tensor, Tensor, Tensor, Tensor)"


def _like(*tensors):
    return tuple(torch.empty_like(t) for t in tensors)


def _out(q, v):  # the attention output has v's width (MLA: q/k 192, v 128), not q's
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _lse(q):  # [B, Hq, S padded to the splash tile] float32 (splash.forward)
    from titan_kernels.tpu.tiles import SPLASH_TILE

    s = q.shape[2]
    return q.new_empty(q.shape[0], q.shape[1], s + (-s) % SPLASH_TILE, dtype=torch.float32)


OPS: dict[str, tuple[str, object]] = {
    "splash_fwd": (f"({_QKV}) -> Tensor", lambda q, k, v: _out(q, v)),
    "splash_bwd": (f"({_QKV}, Tensor dout) -> {_GRADS3}", lambda q, k, v, d: _like(q, k, v)),
    "splash_seg_fwd": (f"({_QKV}, Tensor segment_ids) -> Tensor", lambda q, k, v, s: _out(q, v)),
    "splash_seg_bwd": (f"({_QKV}, Tensor segment_ids, Tensor dout) -> {_GRADS3}", lambda q, k, v, s, d: _like(q, k, v)),
    "splash_full_fwd": (f"({_QKV}) -> Tensor", lambda q, k, v: _out(q, v)),
    "splash_full_bwd": (f"({_QKV}, Tensor dout) -> {_GRADS3}", lambda q, k, v, d: _like(q, k, v)),
    "sink_fwd": (
        f"({_SINK}, int sliding_window) -> (Tensor, Tensor)",
        lambda q, k, v, sk, w, sw: (_out(q, v), _lse(q)),
    ),
    "sink_bwd": (
        f"({_SINK}, Tensor out, Tensor lse, Tensor dout, int sliding_window) -> {_GRADS4}",
        lambda q, k, v, sk, w, o, lse, d, sw: _like(q, k, v, sk),
    ),
    "sink_seg_fwd": (
        f"({_SINK}, Tensor segment_ids, int sliding_window) -> (Tensor, Tensor)",
        lambda q, k, v, sk, w, s, sw: (_out(q, v), _lse(q)),
    ),
    "sink_seg_bwd": (
        f"({_SINK}, Tensor segment_ids, Tensor out, Tensor lse, Tensor dout, int sliding_window) -> {_GRADS4}",
        lambda q, k, v, sk, w, s, o, lse, d, sw: _like(q, k, v, sk),
    ),
    "gmm": ("(Tensor x, Tensor w, Tensor group_sizes) -> Tensor", lambda x, w, s: x.new_empty(x.shape[0], w.shape[-1])),
    "gmm_bwd": (
        "(Tensor x, Tensor w, Tensor group_sizes, Tensor dy) -> (Tensor, Tensor)",
        lambda x, w, s, d: _like(x, w),
    ),
    "ce_fwd": (
        "(Tensor h, Tensor w, Tensor labels) -> (Tensor, Tensor)",
        lambda h, w, labels: tuple(h.new_empty(h.shape[0], dtype=torch.float32) for _ in range(2)),
    ),
    "ce_bwd": (
        "(Tensor h, Tensor w, Tensor labels, Tensor lse, Tensor g) -> (Tensor, Tensor)",
        lambda h, w, labels, lse, g: _like(h, w),
    ),
    "gated_delta_fwd": (f"({_DELTA}) -> (Tensor, Tensor)", lambda q, k, v, g, b, h0, r: _like(v, h0)),
    "gated_delta_bwd": (
        f"({_DELTA}, Tensor d_out, Tensor d_state) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        lambda q, k, v, g, b, h0, r, d, ds: _like(q, k, v, g, b, h0),
    ),
    # The low-precision matmuls (`[quantize]`): XLA float8 / int8 dots, not Pallas (`XLA_OPS`).
    "qlinear_fwd": ("(Tensor x, Tensor w, str recipe) -> Tensor", lambda x, w, r: x.new_empty(x.shape[0], w.shape[0])),
    "qlinear_bwd": ("(Tensor x, Tensor w, Tensor dy, str recipe) -> (Tensor, Tensor)", lambda x, w, d, r: _like(x, w)),
    "qlinear_w8_fwd": (
        "(Tensor x, Tensor w_q, Tensor w_scale, str recipe) -> Tensor",
        lambda x, w, s, r: x.new_empty(x.shape[0], w.shape[0]),
    ),
    "qlinear_w8_bwd": (
        "(Tensor x, Tensor w_q, Tensor w_scale, Tensor dy, str recipe) -> (Tensor, Tensor)",
        lambda x, w, s, d, r: (torch.empty_like(x), x.new_empty(w.shape)),
    ),
    "qgmm_fwd": (
        "(Tensor x, Tensor w, Tensor group_sizes, str recipe) -> Tensor",
        lambda x, w, s, r: x.new_empty(x.shape[0], w.shape[1]),
    ),
    "qgmm_bwd": (
        "(Tensor x, Tensor w, Tensor group_sizes, Tensor dy, str recipe) -> (Tensor, Tensor)",
        lambda x, w, s, d, r: _like(x, w),
    ),
}
"""Every `titan_capture` op: (schema after its name, shape-only kernel)."""

XLA_OPS = frozenset({"qlinear_fwd", "qlinear_bwd", "qlinear_w8_fwd", "qlinear_w8_bwd", "qgmm_fwd", "qgmm_bwd"})
"""The ops whose TPU implementation is plain XLA (titan_kernels/tpu/qmatmul.py, qgmm.py: float8 /
int8 dots and ragged dots), not a Mosaic call: they lower as they are (the SPMD partitioner splits
them, XLA's cost analysis counts them), with no `shard_map` and no `COSTS` entry. Without them the
capture held the op's CPU implementation, the torch emulation (float32 matmuls of dequantized
values, one per expert in the capacity layout), and a `[quantize]` recipe's compile measured that
program instead of the float8 dots a TPU run executes."""


def _op():
    return getattr(torch.ops, NAMESPACE)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _save_ce(ctx, inputs, output):
    h, w, labels = inputs
    ctx.save_for_backward(h, w, labels, output[1])


def _save_sink(ctx, inputs, output):  # the tensors and the outputs (out, lse); the window's int aside
    ctx.save_for_backward(*inputs[:-1], *output)
    ctx.sliding_window = inputs[-1]


def _splash_backward(ctx, dout):
    return _op().splash_bwd(*ctx.saved_tensors, dout.contiguous())


def _splash_full_backward(ctx, dout):
    return _op().splash_full_bwd(*ctx.saved_tensors, dout.contiguous())


def _splash_seg_backward(ctx, dout):
    q, k, v, seg = ctx.saved_tensors
    return (*_op().splash_seg_bwd(q, k, v, seg, dout.contiguous()), None)


def _sink_backward(ctx, dout, d_lse):
    del d_lse  # auxiliary output, never differentiated
    return (*_op().sink_bwd(*ctx.saved_tensors, dout.contiguous(), ctx.sliding_window), None, None)


def _sink_seg_backward(ctx, dout, d_lse):
    del d_lse
    return (*_op().sink_seg_bwd(*ctx.saved_tensors, dout.contiguous(), ctx.sliding_window), None, None, None)


def _gmm_backward(ctx, dy):
    return (*_op().gmm_bwd(*ctx.saved_tensors, dy.contiguous()), None)


def _ce_backward(ctx, d_rows, d_lse):
    del d_lse  # auxiliary output, never differentiated
    return (*_op().ce_bwd(*ctx.saved_tensors, d_rows.float().contiguous()), None)


def _save_quantized(ctx, inputs, output):  # the tensors; the recipe (a str) aside
    ctx.save_for_backward(*inputs[:-1])
    ctx.recipe = inputs[-1]


def _qlinear_backward(ctx, dy):
    return (*_op().qlinear_bwd(*ctx.saved_tensors, dy.contiguous(), ctx.recipe), None)


def _qgmm_backward(ctx, dy):
    return (*_op().qgmm_bwd(*ctx.saved_tensors, dy.contiguous(), ctx.recipe), None, None)


_Float8WeightLinear = float8_weight_linear_function(
    lambda *args: _op().qlinear_w8_fwd(*args), lambda *args: _op().qlinear_w8_bwd(*args)
)
"""x @ w_q^T with w_q SimpleFSDP's gathered float8 weight (models/common/quantize.py), over the
capture's two ops (defined at `install`, so looked up at call time)."""


def _gated_delta_backward(ctx, d_out, d_state):
    return (*_op().gated_delta_bwd(*ctx.saved_tensors, d_out.contiguous(), d_state.contiguous()), None)


AUTOGRAD = {
    "splash_fwd": (_splash_backward, _save_inputs),
    "splash_full_fwd": (_splash_full_backward, _save_inputs),
    "splash_seg_fwd": (_splash_seg_backward, _save_inputs),
    "sink_fwd": (_sink_backward, _save_sink),
    "sink_seg_fwd": (_sink_seg_backward, _save_sink),
    "gmm": (_gmm_backward, _save_inputs),
    "ce_fwd": (_ce_backward, _save_ce),
    "gated_delta_fwd": (_gated_delta_backward, _save_inputs),
    "qlinear_fwd": (_qlinear_backward, _save_quantized),
    "qgmm_fwd": (_qgmm_backward, _save_quantized),
}
"""The differentiable ops: (backward, setup_context); each backward calls its `*_bwd` op."""


def _define() -> None:
    """Define every op of `OPS` (once), its fake kernel and, for those of `AUTOGRAD`, its backward."""
    if _LIB:
        return
    lib = torch.library.Library(NAMESPACE, "DEF")  # noqa: TOR901 (kept alive in _LIB)
    _LIB.append(lib)
    for name, (schema, fake) in OPS.items():
        lib.define(name + schema)
        torch.library.register_fake(f"{NAMESPACE}::{name}", lib=lib)(fake)
    for name, (backward, setup) in AUTOGRAD.items():
        torch.library.register_autograd(f"{NAMESPACE}::{name}", backward, setup_context=setup, lib=lib)


def causal_attention(q, k, v, segment_ids=None):
    op = getattr(torch.ops, NAMESPACE)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if segment_ids is None:
        return op.splash_fwd(q, k, v)
    return op.splash_seg_fwd(q, k, v, segment_ids.to(torch.int32))


def attention(q, k, v):
    return getattr(torch.ops, NAMESPACE).splash_full_fwd(q.contiguous(), k.contiguous(), v.contiguous())


def grouped_mm(x, w, group_sizes):
    # w [G, K, N] (the experts' transposed nn.Linear weight): made contiguous in the capture;
    # XLA folds the transpose into the kernel's operand layout.
    return getattr(torch.ops, NAMESPACE).gmm(x.contiguous(), w.contiguous(), group_sizes.to(torch.int32))


def linear_cross_entropy(h, w, labels):
    # As titan_kernels/tpu/register.py's op on a TPU: per-row losses from the kernel, mean over valid rows.
    rows, _ = getattr(torch.ops, NAMESPACE).ce_fwd(h.contiguous(), w.contiguous(), labels.to(torch.int32))
    valid = labels != ops.IGNORE_INDEX
    return torch.where(valid, rows, 0.0).sum() / valid.sum()


def sink_attention(q, k, v, sinks, window, segment_ids=None, sliding_window=0):
    # As titan_kernels/tpu/register.py's op on a TPU: an int window is its own sliding window; a
    # tensor window (gpt-oss's per-layer buffer, 0 or `sliding_window`) picks the kernel on the
    # device; a tensor window without `sliding_window` takes the reference.
    if not isinstance(window, int) and not sliding_window:
        return ops.sdpa_sink_attention(q, k, v, sinks, window, segment_ids)
    if isinstance(window, int):
        sliding_window, window = window, torch.full((1,), window, dtype=torch.int32, device=q.device)
    op = getattr(torch.ops, NAMESPACE)
    q, k, v, sinks = q.contiguous(), k.contiguous(), v.contiguous(), sinks.contiguous()
    win, sliding_window = window.reshape(1).to(torch.int32), max(int(sliding_window), 0)
    if segment_ids is None:
        return op.sink_fwd(q, k, v, sinks, win, sliding_window)[0]
    return op.sink_seg_fwd(q, k, v, sinks, win, segment_ids.to(torch.int32).contiguous(), sliding_window)[0]


def gated_delta_rule(q, k, v, g, beta, *, chunk_size=64, **kwargs):
    # As titan_kernels/tpu/register.py's op on a TPU: the prepared inputs to the kernel's op.
    from models.common import gated_delta

    if chunk_size != 64:  # the kernel's chunk (delta_rule.CHUNK; jax is not imported here)
        return gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    return gated_delta.call_prepared(getattr(torch.ops, NAMESPACE).gated_delta_fwd, q, k, v, g, beta, **kwargs)


def quantized_linear(x, w, recipe, w_scale=None, w_grad=None):
    # As titan_kernels/tpu/qlinear.py's op on a TPU: x's leading dims flattened; with SimpleFSDP's
    # float8 all-gather (`w_scale`) the float8 weight as it is, its gradient to the carrier `w_grad`.
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if w_scale is not None:
        y = _Float8WeightLinear.apply(x2, w_grad, w.contiguous(), w_scale.reshape(()).float(), recipe)
    else:
        y = _op().qlinear_fwd(x2, w.contiguous(), recipe)
    return y.reshape(*lead, w.shape[0])


quantized_linear.takes_float8_weight = True


def quantized_grouped_mm(x, w, group_sizes, recipe):
    # w [G, K, N] as the op takes it; the TPU op reads the experts' [G, N, K] layout.
    w_nk = w.transpose(-2, -1).contiguous()
    return _op().qgmm_fwd(x.contiguous(), w_nk, group_sizes.to(torch.int32), recipe)


def quantized_batched_mm(x, w, recipe):
    # The capacity layout's experts, served as the TPU serves them: the grouped op on the flat rows.
    from models.common.quantize import batched_as_grouped

    return batched_as_grouped(quantized_grouped_mm, x, w, recipe)


def install() -> None:
    """Define the ops (once) and serve the model's attention (causal, full, with sinks), grouped
    matmul, fused loss, delta rule and low-precision matmuls with them."""
    _define()
    ops.register("causal_attention", causal_attention)
    ops.register("attention", attention)
    ops.register("sink_attention", sink_attention)
    ops.register("grouped_mm", grouped_mm)
    ops.register("linear_cross_entropy", linear_cross_entropy)
    ops.register("gated_delta_rule", gated_delta_rule)
    ops.register("quantized_linear", quantized_linear)
    ops.register("quantized_grouped_mm", quantized_grouped_mm)
    ops.register("quantized_batched_mm", quantized_batched_mm)


def shard_group_sizes(group_sizes, rows: int, shard):
    """Group sizes of rows [shard * rows, (shard + 1) * rows) of a matrix whose rows are sorted by
    group with `group_sizes` (jax): how many rows of each group fall in that slice."""
    import jax.numpy as jnp

    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    lo = shard * rows
    return (jnp.clip(ends - lo, 0, rows) - jnp.clip(starts - lo, 0, rows)).astype(jnp.int32)


def splash_cost(
    q_shape,
    kv_heads: int,
    itemsize: int,
    backward: bool,
    v_dim: int | None = None,
    causal: bool = True,
    forward_again: bool = True,
    window: int = 0,
) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one splash call on q [B, Hq, S, D] with `kv_heads` K/V heads of
    value width `v_dim` (Dv; default D: MLA's v is narrower, 128 beside 192).

    The kernel visits only the causal blocks: (n + 1) / 2n of the n x n grid of its blocks
    (`causal=False`, the full mask of the op `attention`: all n x n); with a sliding `window`
    (> 0: query i sees keys i - window < j <= i, splash's `LocalMask`) only the blocks that hold
    a visible key (`visited_blocks`: about window / block + 1 per query block row). A
    forward is two S x S matmuls per head over those blocks, q k^T (width D) and p v (Dv); the
    backward op re-runs the forward (for its residuals; `forward_again=False`: the op takes the
    forward's residuals, as the sink pair does) and does five: q k^T again, dS k and
    dS^T q at D, dO v^T and p^T dO at Dv. Bytes: q (D) and the output (Dv) once, K (D) and V (Dv)
    once per query block row of the grid; the backward reads and writes about three times the
    forward's (a model, not a measurement).
    """
    from titan_kernels.tpu import tiles

    b, hq, s, d = q_shape
    dv = d if v_dim is None else v_dim
    padded = s + (-s) % tiles.SPLASH_TILE
    block = tiles.splash_block_size(padded)
    n = padded // block
    visited = visited_blocks(n, block, window) / (n * n) if causal else 1.0
    per_width = 2.0 * b * hq * padded * padded * visited  # one S x S matmul's FLOPs per unit of width
    fwd_bytes = itemsize * (b * hq * padded * (d + dv) + b * kv_heads * padded * (d + dv) * n * visited)
    return _with_backward(per_width, fwd_bytes, d, dv, backward, forward_again)


def visited_blocks(n: int, block: int, window: int = 0) -> int:
    """(query block, kv block) pairs of an n x n grid of square `block`s that hold a key visible to
    a query of the block: causal, n (n + 1) / 2; within a sliding `window` (> 0, the query's own
    key included), query block i (rows i block .. (i + 1) block - 1) reaches back to key
    i block - window + 1, so its kv blocks are floor((i block - window + 1) / block) .. i (from 0),
    the blocks splash's mask info keeps (it skips a block with no visible key)."""
    if not window:
        return n * (n + 1) // 2
    return sum(i - max(0, (i * block - window + 1) // block) + 1 for i in range(n))


def sink_cost(
    q_shape, kv_heads: int, itemsize: int, backward: bool, v_dim: int, sliding_window: int, static: bool = False
) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one call of the sink pair (`sink_fwd` / `sink_bwd`: the backward takes
    the forward's residuals) whose kernel build has `sliding_window` (0: causal only). The window is
    a device value that picks the sliding or the causal kernel per call (splash.py `_pick`: gpt-oss's
    per-layer buffer, 0 or `sliding_window`): priced at the mean of the two, which is exact summed
    over a stack that alternates them as gpt-oss's does (even blocks sliding, an even number of
    blocks in both releases and the debug flavor). `static`: the window is known to be
    `sliding_window` on every call (an int window, DeepSeek-V4's): the sliding kernel's price."""
    kw = dict(backward=backward, v_dim=v_dim, forward_again=False)
    causal = splash_cost(q_shape, kv_heads, itemsize, **kw)
    if sliding_window <= 0:
        return causal
    sliding = splash_cost(q_shape, kv_heads, itemsize, window=sliding_window, **kw)
    if static:
        return sliding
    return tuple((a + b) / 2 for a, b in zip(sliding, causal, strict=True))


def _with_backward(per_width: float, fwd_bytes: float, d: int, dv: int, backward: bool, forward_again: bool):
    """(FLOPs, bytes) of an attention call from its forward's FLOPs per unit of width and bytes
    (`splash_cost`'s model of the backward)."""
    if not backward:
        return per_width * (d + dv), fwd_bytes
    again = 1 if forward_again else 0
    return per_width * (again * (d + dv) + (3 * d + 2 * dv)), (3 + again) * fwd_bytes


def splash_cp_cost(
    q_shape, seq: int, kv_heads: int, itemsize: int, backward: bool, *, v_dim: int, cp_rank: int, cp_size: int
) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one CP splash call of rank `cp_rank` of `cp_size`
    (titan_kernels/tpu/splash.py `cp_forward` / `cp_backward`): q [B, Hq, seq / cp, D] (the rank's
    early and late chunk of c = seq / 2cp queries) against the gathered keys, the early chunk's
    first seq / 2, the late chunk's all seq. Each chunk is one causal splash call whose query rows
    start at its global offset; the kernel visits the blocks that hold a visible key: in query
    block i (rows offset + i bq .. offset + (i + 1) bq - 1), the kv blocks up to the one holding key
    offset + (i + 1) bq - 1. FLOPs and bytes per visited block and the backward as `splash_cost`
    (the backward op re-runs the forward: the capture lowers it as the VJP of the forward)."""
    from titan_kernels.tpu.tiles import splash_block_size

    b, hq, s_local, d = q_shape
    chunk = s_local // 2
    blocks = 0.0  # visited (query block, kv block) pairs, each bq x bkv, times bkv
    for n_keys, offset in ((seq // 2, cp_rank * chunk), (seq, (2 * cp_size - 1 - cp_rank) * chunk)):
        bq, bkv = splash_block_size(chunk), splash_block_size(n_keys)
        kv_blocks = n_keys // bkv
        seen = sum(min(kv_blocks, (offset + (i + 1) * bq - 1) // bkv + 1) for i in range(chunk // bq))
        blocks += seen * bq * bkv
    per_width = 2.0 * b * hq * blocks
    bkv_rows = blocks / splash_block_size(chunk)  # keys read per query block row, summed over the rows
    fwd_bytes = itemsize * (b * hq * s_local * (d + v_dim) + b * kv_heads * bkv_rows * (d + v_dim))
    return _with_backward(per_width, fwd_bytes, d, v_dim, backward, True)


def gmm_cost(m: int, k: int, n: int, groups: int, itemsize: int, backward: bool) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one grouped matmul x [m, k] by w [groups, k, n]: each row meets one
    expert. Backward: dx and dw, each one matmul of the same size; bytes read x, w, write out
    (backward: read x, w, dy, write dx, dw)."""
    flops = 2.0 * m * k * n
    fwd_bytes = itemsize * (m * k + groups * k * n + m * n)
    return (2 * flops, 2 * fwd_bytes) if backward else (flops, fwd_bytes)


def ce_cost(
    n: int, d: int, vocab: int, itemsize: int, backward: bool, *, generation: str | None
) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of the fused linear + CE on h [n, d], w [vocab, d] (titan_kernels/tpu/fused_ce.py)
    with `generation`'s blocks (tiles.py; None: the conservative rule).

    Forward: one n x vocab x d matmul (the logits, tile by tile). Backward: the dh kernel and the
    dw kernel each recompute the logits tile and do one matmul: four. Bytes: h and the labels
    once, w once per row block (the vocabulary is the inner grid axis); the backward reads h and
    w once per block of the other operand in each of its two kernels and writes dh, dw (a model)."""
    from titan_kernels.tpu import tiles

    matmul = 2.0 * n * vocab * d
    block_n, block_v = tiles.ce_blocks(generation, n, vocab, d, itemsize=itemsize)
    row_blocks = max(1, -(-n // block_n))
    vocab_blocks = max(1, -(-vocab // block_v))
    fwd_bytes = itemsize * (n * d + vocab * d * row_blocks) + 12 * n
    bwd_bytes = itemsize * (n * d * (1 + vocab_blocks) + vocab * d * (1 + row_blocks) + n * d + vocab * d) + 24 * n
    return (4 * matmul, bwd_bytes) if backward else (matmul, fwd_bytes)


def gated_delta_cost(b: int, h: int, s: int, dk: int, dv: int, backward: bool, chunk: int = 64) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one call of the delta rule's kernels on [b, h, s, d] float32 inputs
    (titan_kernels/tpu/delta_rule.py), counted from their matmuls per chunk and head. Forward:
    (k beta) k^T, T (k beta decayed) and q k^T (2 C^2 dk each), the forward substitution (C rows
    of a [1, C] x [C, C] product: 2 C^3), T (v beta) and the intra-chunk product (2 C^2 dv each),
    three products with the state (6 C dk dv). The backward op: the forward again (the chunk
    states), then the backward kernel: the chunk's quantities again (6 C^2 dk + 2 C^2 dv + 2 C^3 +
    2 C dk dv) and the chain rule (12 C^2 dk + 8 C^2 dv + 4 C^3 + 12 C dk dv). Bytes: q, k, v read
    and the output written once, the state once per head; the backward about three times that
    (a model)."""
    n = -(-s // chunk) * b * h
    c = float(chunk)
    fwd = n * (6 * c * c * dk + 2 * c**3 + 4 * c * c * dv + 6 * c * dk * dv)
    fwd_bytes = 4.0 * (b * h * s * (2 * dk + 2 * dv + 2) + 2 * b * h * dk * dv)
    if not backward:
        return fwd, fwd_bytes
    bwd = n * (18 * c * c * dk + 10 * c * c * dv + 6 * c**3 + 14 * c * dk * dv)
    return fwd + bwd, 3 * fwd_bytes


def kernel_costs() -> dict[str, float]:
    """Sum of `COSTS`: {"flops", "bytes", "calls"}."""
    return {"flops": sum(c[1] for c in COSTS), "bytes": sum(c[2] for c in COSTS), "calls": len(COSTS)}


def kernel_functions(generation: str | None) -> dict:
    """{op name: the JAX function one device calls for it}, with the arguments of the op's schema
    in order (ints included) and the blocks of the target's `generation` (tiles.GENERATIONS):
    the Pallas kernels a TPU run calls (titan_kernels/tpu/register.py). tools/tpu_compile.py's
    per-device program lowers every op with them; `add_lowerings` wraps them in `shard_map`."""
    import functools

    import jax
    import jax.numpy as jnp

    from titan_kernels.tpu import delta_rule, fused_ce, gmm, qgmm, qmatmul, splash

    gen = dict(generation=generation)

    def splash_fwd(q, k, v, seg=None):
        return splash.splash_attention(q, k, v, seg, **gen)

    def splash_bwd(q, k, v, dout, seg=None):
        return tuple(jax.vjp(functools.partial(splash.splash_attention, segment_ids=seg, **gen), q, k, v)[1](dout))

    def splash_full(q, k, v):
        return splash.splash_attention(q, k, v, causal=False, **gen)

    def sink_fwd(q, k, v, sinks, win, sliding_window, seg=None):
        return splash.sink_forward(q, k, v, sinks, win, seg, sliding_window=sliding_window, **gen)

    def sink_bwd(q, k, v, sinks, win, seg, out, lse, dout, sliding_window):
        return splash.sink_backward(q, k, v, sinks, win, seg, out, lse, dout, sliding_window=sliding_window, **gen)

    def gmm_fwd(x, w, sizes):
        return gmm.grouped_mm(x, w, sizes.astype(jnp.int32), **gen)

    return {
        "splash_fwd": splash_fwd,
        "splash_seg_fwd": splash_fwd,
        "splash_bwd": splash_bwd,
        "splash_seg_bwd": lambda q, k, v, seg, dout: splash_bwd(q, k, v, dout, seg),
        "splash_full_fwd": splash_full,
        "splash_full_bwd": lambda q, k, v, dout: tuple(jax.vjp(splash_full, q, k, v)[1](dout)),
        "sink_fwd": sink_fwd,
        "sink_seg_fwd": lambda q, k, v, sinks, win, seg, sw: sink_fwd(q, k, v, sinks, win, sw, seg),
        "sink_bwd": lambda q, k, v, sinks, win, out, lse, dout, sw: sink_bwd(
            q, k, v, sinks, win, None, out, lse, dout, sw
        ),
        "sink_seg_bwd": sink_bwd,
        "gmm": gmm_fwd,
        "gmm_bwd": lambda x, w, sizes, dy: tuple(jax.vjp(lambda x, w: gmm_fwd(x, w, sizes), x, w)[1](dy)),
        "ce_fwd": functools.partial(fused_ce.forward_rows, **gen),
        "ce_bwd": functools.partial(fused_ce.backward_rows, **gen),
        "qlinear_fwd": qmatmul.forward,
        "qlinear_bwd": qmatmul.backward,
        "qlinear_w8_fwd": qmatmul.forward_w8,
        "qlinear_w8_bwd": qmatmul.backward_w8,
        "qgmm_fwd": qgmm.forward,
        "qgmm_bwd": qgmm.backward,
        "gated_delta_fwd": delta_rule.forward,
        "gated_delta_bwd": lambda *args: tuple(delta_rule.backward(*args)),
    }


SHARDING: dict[str, tuple[str, str, int]] = {
    "splash_fwd": ("bbb", "b", 0),
    "splash_bwd": ("bbbb", "bbb", 0),
    "splash_seg_fwd": ("bbbb", "b", 0),
    "splash_seg_bwd": ("bbbbb", "bbb", 0),
    "splash_full_fwd": ("bbb", "b", 0),
    "splash_full_bwd": ("bbbb", "bbb", 0),
    "sink_fwd": ("bbbrr", "bb", 1),
    "sink_bwd": ("bbbrrbbb", "bbbr", 1),
    "sink_seg_fwd": ("bbbrrb", "bb", 1),
    "sink_seg_bwd": ("bbbrrbbbb", "bbbr", 1),
    "gmm": ("brr", "b", 0),
    "gmm_bwd": ("brrb", "br", 0),
    "ce_fwd": ("brb", "bb", 0),
    "ce_bwd": ("brbbb", "br", 0),
    "gated_delta_fwd": ("b" * 7, "bb", 0),
    "gated_delta_bwd": ("b" * 9, "b" * 6, 0),
}
"""Per op, `add_lowerings`' `shard_map`: each tensor input's and output's spec (b: split over the
axis along dim 0, the batch or the rows; r: replicated; one output: the array, not a tuple) and
the number of trailing int arguments (static: one `shard_map` per value)."""


def _cost(name: str, shards: int, generation: str | None):
    """The `COSTS` entry of one call of op `name` from its (global) tensor arguments, or None."""
    backward = name.endswith("_bwd")

    def local(shape):  # the per-device shape of a tensor split over the axis along dim 0
        return (shape[0] // shards, *shape[1:])

    def attention(q, k, v, *rest):
        full, sink = name.startswith("splash_full"), name.startswith("sink")
        label = "splash_full" if full else "sink" if sink else "splash"
        if sink:  # rest ends with the kernel's int `sliding_window` (the trailing static)
            price = sink_cost(local(q.shape), k.shape[1], q.dtype.itemsize, backward, v.shape[-1], int(rest[-1]))
        else:
            price = splash_cost(local(q.shape), k.shape[1], q.dtype.itemsize, backward, v.shape[-1], not full)
        return (f"{label}_bwd" if backward else f"{label}_fwd", *price)

    def grouped(x, w, *rest):
        price = gmm_cost(x.shape[0] // shards, x.shape[1], w.shape[2], w.shape[0], x.dtype.itemsize, backward)
        return ("gmm_bwd" if backward else "gmm", *price)

    def loss(h, w, *rest):
        price = ce_cost(h.shape[0] // shards, h.shape[1], w.shape[0], h.dtype.itemsize, backward, generation=generation)
        return ("ce_bwd" if backward else "ce_fwd", *price)

    def delta(q, k, v, *rest):
        b, h, s, dk = local(q.shape)
        return (name, *gated_delta_cost(b, h, s, dk, v.shape[-1], backward=backward))

    family = name.split("_")[0]
    return {"splash": attention, "sink": attention, "gmm": grouped, "ce": loss, "gated": delta}[family]


def add_lowerings(env, mesh, axis: str, *, generation: str | None) -> None:
    """Lower the `titan_capture` ops on torchax environment `env` to the Pallas kernels, each in
    `shard_map` over mesh axis `axis` (module docstring; `SHARDING`), each call priced into `COSTS`.

    generation: the TPU generation the program is compiled for (a key of tiles.GENERATIONS, e.g.
    `tiles.generation_of(device.device_kind)` of the target topology): the fused loss takes its
    blocks and VMEM limit, as a run on that chip does (register.py). None is the conservative
    rule (v4's 16 MiB), which cannot hold a 70B-wide (8192) head: compiled for v6e that way, the
    loss' backward stopped at "17.90M of 16.00M" scoped VMEM (docs/tpu.md, fused-CE regression).
    Splash takes the generation's blocks too (tiles.splash_blocks); the grouped matmul the
    default ones."""
    import functools

    import jax
    from jax.sharding import PartitionSpec as P
    from torchax import interop

    op = getattr(torch.ops, NAMESPACE)
    fns = {**kernel_functions(generation), **_across_shards(axis, generation)}

    def sharded(name):
        ins, outs, statics = SHARDING[name]
        spec = {"b": P(axis), "r": P()}
        in_specs = tuple(spec[c] for c in ins)
        out_specs = spec[outs] if len(outs) == 1 else tuple(spec[c] for c in outs)
        cost, mapped = _cost(name, mesh.shape[axis], generation), {}

        def call(*args):
            tensors, consts = args[: len(args) - statics], args[len(args) - statics :]
            COSTS.append(cost(*tensors, *consts))  # per graph node (the shard_map body's trace is cached per shape)
            if consts not in mapped:
                fn = functools.partial(_trailing, fns[name], consts) if consts else fns[name]
                mapped[consts] = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
            return interop.call_jax(mapped[consts], *tensors)

        return call

    for name in OPS:
        lower = functools.partial(interop.call_jax, fns[name]) if name in XLA_OPS else sharded(name)
        env.override_op_definition(getattr(op, name).default, lower)


def _trailing(fn, consts, *tensors):
    return fn(*tensors, *consts)


def _across_shards(axis: str, generation: str | None) -> dict:
    """The ops of `kernel_functions` whose `shard_map` form differs from one device's: the grouped
    matmul takes its shard's slice of the global group sizes (`shard_group_sizes`), and the
    gradients of the replicated operands (the experts' and the head's weights, the sinks) are
    summed over the shards (every shard's rows contribute to them)."""
    import jax

    from titan_kernels.tpu import fused_ce, gmm, splash

    def local_sizes(x, sizes):
        return shard_group_sizes(sizes, x.shape[0], jax.lax.axis_index(axis))

    def gmm_fwd(x, w, sizes):
        return gmm.grouped_mm(x, w, local_sizes(x, sizes))

    def gmm_bwd(x, w, sizes, dy):
        dx, dw = jax.vjp(lambda x, w: gmm.grouped_mm(x, w, local_sizes(x, sizes)), x, w)[1](dy)
        return dx, jax.lax.psum(dw, axis)

    def ce_bwd(h, w, labels, lse, g):
        dh, dw = fused_ce.backward_rows(h, w, labels, lse, g, generation=generation)
        return dh, jax.lax.psum(dw, axis)

    def sink_bwd(q, k, v, sinks, win, seg, out, lse, dout, sliding_window):
        kw = dict(sliding_window=sliding_window, generation=generation)
        dq, dk, dv, dsinks = splash.sink_backward(q, k, v, sinks, win, seg, out, lse, dout, **kw)
        return dq, dk, dv, jax.lax.psum(dsinks, axis)

    return {
        "gmm": gmm_fwd,
        "gmm_bwd": gmm_bwd,
        "ce_bwd": ce_bwd,
        "sink_bwd": lambda q, k, v, sinks, win, out, lse, dout, sw: sink_bwd(
            q, k, v, sinks, win, None, out, lse, dout, sw
        ),
        "sink_seg_bwd": sink_bwd,
    }
