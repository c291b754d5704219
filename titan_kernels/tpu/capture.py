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

NAMESPACE = "titan_capture"
_LIB: list = []
COSTS: list[tuple[str, float, float]] = []
"""(kernel, FLOPs, HBM bytes) per device of every kernel call lowered since the last clear."""


def _define() -> None:
    if _LIB:
        return
    lib = torch.library.Library(NAMESPACE, "DEF")  # noqa: TOR901 (kept alive in _LIB)
    lib.define("splash_fwd(Tensor q, Tensor k, Tensor v) -> Tensor")
    lib.define("splash_bwd(Tensor q, Tensor k, Tensor v, Tensor dout) -> (Tensor, Tensor, Tensor)")
    lib.define("splash_seg_fwd(Tensor q, Tensor k, Tensor v, Tensor segment_ids) -> Tensor")
    lib.define(
        "splash_seg_bwd(Tensor q, Tensor k, Tensor v, Tensor segment_ids, Tensor dout) -> (Tensor, Tensor, Tensor)"
    )
    lib.define("splash_full_fwd(Tensor q, Tensor k, Tensor v) -> Tensor")
    lib.define("splash_full_bwd(Tensor q, Tensor k, Tensor v, Tensor dout) -> (Tensor, Tensor, Tensor)")
    lib.define("gmm(Tensor x, Tensor w, Tensor group_sizes) -> Tensor")
    lib.define("gmm_bwd(Tensor x, Tensor w, Tensor group_sizes, Tensor dy) -> (Tensor, Tensor)")
    lib.define("ce_fwd(Tensor h, Tensor w, Tensor labels) -> (Tensor, Tensor)")
    lib.define("ce_bwd(Tensor h, Tensor w, Tensor labels, Tensor lse, Tensor g) -> (Tensor, Tensor)")
    lib.define(
        "gated_delta_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor h0, Tensor reset) -> (Tensor, Tensor)"
    )
    lib.define(
        "gated_delta_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor h0, Tensor reset, Tensor d_out, "
        "Tensor d_state) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    )
    _LIB.append(lib)
    op = getattr(torch.ops, NAMESPACE)

    def fake(name):
        return torch.library.register_fake(f"{NAMESPACE}::{name}", lib=lib)

    # The output has v's width (MLA: q/k 192, v 128), not q's.
    fake("splash_fwd")(lambda q, k, v: q.new_empty(*q.shape[:-1], v.shape[-1]))
    fake("splash_seg_fwd")(lambda q, k, v, s: q.new_empty(*q.shape[:-1], v.shape[-1]))
    fake("splash_full_fwd")(lambda q, k, v: q.new_empty(*q.shape[:-1], v.shape[-1]))
    fake("splash_bwd")(lambda q, k, v, dout: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))
    fake("splash_full_bwd")(lambda q, k, v, dout: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))
    fake("splash_seg_bwd")(lambda q, k, v, s, dout: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))
    fake("gmm")(lambda x, w, sizes: x.new_empty(x.shape[0], w.shape[-1]))
    fake("gmm_bwd")(lambda x, w, sizes, dy: (torch.empty_like(x), torch.empty_like(w)))
    fake("ce_fwd")(
        lambda h, w, labels: (
            h.new_empty(h.shape[0], dtype=torch.float32),
            h.new_empty(h.shape[0], dtype=torch.float32),
        )
    )
    fake("ce_bwd")(lambda h, w, labels, lse, g: (torch.empty_like(h), torch.empty_like(w)))
    fake("gated_delta_fwd")(lambda q, k, v, g, beta, h0, reset: (torch.empty_like(v), torch.empty_like(h0)))
    fake("gated_delta_bwd")(
        lambda q, k, v, g, beta, h0, reset, d_out, d_state: tuple(torch.empty_like(t) for t in (q, k, v, g, beta, h0))
    )

    def save_all(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def splash_backward(ctx, dout):
        return op.splash_bwd(*ctx.saved_tensors, dout.contiguous())

    def splash_full_backward(ctx, dout):
        return op.splash_full_bwd(*ctx.saved_tensors, dout.contiguous())

    def splash_seg_backward(ctx, dout):
        q, k, v, seg = ctx.saved_tensors
        return (*op.splash_seg_bwd(q, k, v, seg, dout.contiguous()), None)

    def gmm_backward(ctx, dy):
        return (*op.gmm_bwd(*ctx.saved_tensors, dy.contiguous()), None)

    torch.library.register_autograd(f"{NAMESPACE}::splash_fwd", splash_backward, setup_context=save_all, lib=lib)
    torch.library.register_autograd(
        f"{NAMESPACE}::splash_full_fwd", splash_full_backward, setup_context=save_all, lib=lib
    )
    torch.library.register_autograd(
        f"{NAMESPACE}::splash_seg_fwd", splash_seg_backward, setup_context=save_all, lib=lib
    )
    torch.library.register_autograd(f"{NAMESPACE}::gmm", gmm_backward, setup_context=save_all, lib=lib)

    def ce_setup(ctx, inputs, output):
        h, w, labels = inputs
        ctx.save_for_backward(h, w, labels, output[1])

    def ce_backward(ctx, d_rows, d_lse):
        del d_lse  # auxiliary output, never differentiated
        return (*op.ce_bwd(*ctx.saved_tensors, d_rows.float().contiguous()), None)

    torch.library.register_autograd(f"{NAMESPACE}::ce_fwd", ce_backward, setup_context=ce_setup, lib=lib)

    def gated_delta_backward(ctx, d_out, d_state):
        return (*op.gated_delta_bwd(*ctx.saved_tensors, d_out.contiguous(), d_state.contiguous()), None)

    torch.library.register_autograd(
        f"{NAMESPACE}::gated_delta_fwd", gated_delta_backward, setup_context=save_all, lib=lib
    )


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


def gated_delta_rule(q, k, v, g, beta, *, chunk_size=64, **kwargs):
    # As titan_kernels/tpu/register.py's op on a TPU: the prepared inputs to the kernel's op.
    from models.common import gated_delta

    if chunk_size != 64:  # the kernel's chunk (delta_rule.CHUNK; jax is not imported here)
        return gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    return gated_delta.call_prepared(getattr(torch.ops, NAMESPACE).gated_delta_fwd, q, k, v, g, beta, **kwargs)


def install() -> None:
    """Define the ops (once) and serve the model's attention (causal and full), grouped matmul and
    fused loss with them."""
    _define()
    ops.register("causal_attention", causal_attention)
    ops.register("attention", attention)
    ops.register("grouped_mm", grouped_mm)
    ops.register("linear_cross_entropy", linear_cross_entropy)
    ops.register("gated_delta_rule", gated_delta_rule)


def shard_group_sizes(group_sizes, rows: int, shard):
    """Group sizes of rows [shard * rows, (shard + 1) * rows) of a matrix whose rows are sorted by
    group with `group_sizes` (jax): how many rows of each group fall in that slice."""
    import jax.numpy as jnp

    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    lo = shard * rows
    return (jnp.clip(ends - lo, 0, rows) - jnp.clip(starts - lo, 0, rows)).astype(jnp.int32)


def splash_cost(
    q_shape, kv_heads: int, itemsize: int, backward: bool, v_dim: int | None = None, causal: bool = True
) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one splash call on q [B, Hq, S, D] with `kv_heads` K/V heads of
    value width `v_dim` (Dv; default D: MLA's v is narrower, 128 beside 192).

    The kernel visits only the causal blocks: (n + 1) / 2n of the n x n grid of its blocks
    (`causal=False`, the full mask of the op `attention`: all n x n). A
    forward is two S x S matmuls per head over those blocks, q k^T (width D) and p v (Dv); the
    backward op re-runs the forward (for its residuals) and does five: q k^T again, dS k and
    dS^T q at D, dO v^T and p^T dO at Dv. Bytes: q (D) and the output (Dv) once, K (D) and V (Dv)
    once per query block row of the grid; the backward reads and writes about three times the
    forward's (a model, not a measurement).
    """
    from titan_kernels.tpu import splash

    b, hq, s, d = q_shape
    dv = d if v_dim is None else v_dim
    padded = s + (-s) % splash.TILE
    n = padded // splash.block_size(padded)
    visited = (n + 1) / (2 * n) if causal else 1.0
    per_width = 2.0 * b * hq * padded * padded * visited  # one S x S matmul's FLOPs per unit of width
    fwd_bytes = itemsize * (b * hq * padded * (d + dv) + b * kv_heads * padded * (d + dv) * n * visited)
    if backward:
        return per_width * ((d + dv) + (3 * d + 2 * dv)), 4 * fwd_bytes
    return per_width * (d + dv), fwd_bytes


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


def add_lowerings(env, mesh, axis: str, *, generation: str | None) -> None:
    """Lower the `titan_capture` ops on torchax environment `env` to the Pallas kernels, each in
    `shard_map` over mesh axis `axis` (module docstring).

    generation: the TPU generation the program is compiled for (a key of tiles.GENERATIONS, e.g.
    `tiles.generation_of(device.device_kind)` of the target topology): the fused loss takes its
    blocks and VMEM limit, as a run on that chip does (register.py). None is the conservative
    rule (v4's 16 MiB), which cannot hold a 70B-wide (8192) head: compiled for v6e that way, the
    loss' backward stopped at "17.90M of 16.00M" scoped VMEM (docs/tpu.md, fused-CE regression).
    Splash takes the generation's blocks too (tiles.splash_blocks)."""
    import functools

    import jax
    from jax.sharding import PartitionSpec as P
    from torchax import interop

    from titan_kernels.tpu import delta_rule, fused_ce, gmm, splash

    op = getattr(torch.ops, NAMESPACE)

    shards = mesh.shape[axis]

    def sharded(fn, in_specs, out_specs, cost=None):
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

        def call(*tensors):
            if cost is not None:  # per graph node (the shard_map body's trace is cached per shape)
                COSTS.append(cost(*tensors))
            return interop.call_jax(mapped, *tensors)

        return call

    batch = P(axis)

    def local(shape):  # the per-device shape of a tensor split over `axis` along dim 0
        return (shape[0] // shards, *shape[1:])

    def splash_fwd(q, k, v, seg=None):
        return splash.splash_attention(q, k, v, seg, generation=generation)

    def splash_bwd(q, k, v, dout, seg=None):
        fwd = functools.partial(splash.splash_attention, segment_ids=seg, generation=generation)
        return tuple(jax.vjp(fwd, q, k, v)[1](dout))

    def splash_full_fwd(q, k, v):
        return splash.splash_attention(q, k, v, generation=generation, causal=False)

    def splash_full_bwd(q, k, v, dout):
        fwd = functools.partial(splash.splash_attention, generation=generation, causal=False)
        return tuple(jax.vjp(fwd, q, k, v)[1](dout))

    def splash_costs(backward, causal=True):
        def cost(q, k, v, *rest):
            name = "splash" if causal else "splash_full"
            return (
                f"{name}_bwd" if backward else f"{name}_fwd",
                *splash_cost(
                    local(q.shape), k.shape[1], q.dtype.itemsize, backward=backward, v_dim=v.shape[-1], causal=causal
                ),
            )

        return cost

    def local_sizes(x, sizes):
        return shard_group_sizes(sizes, x.shape[0], jax.lax.axis_index(axis))

    def gmm_fwd(x, w, sizes):
        return gmm.grouped_mm(x, w, local_sizes(x, sizes))

    def gmm_bwd(x, w, sizes, dy):
        dx, dw = jax.vjp(lambda x, w: gmm.grouped_mm(x, w, local_sizes(x, sizes)), x, w)[1](dy)
        return dx, jax.lax.psum(dw, axis)  # every shard's rows contribute to each expert's gradient

    def gmm_costs(backward):
        def cost(x, w, *rest):
            m = x.shape[0] // shards
            return (
                "gmm_bwd" if backward else "gmm",
                *gmm_cost(m, x.shape[1], w.shape[2], w.shape[0], x.dtype.itemsize, backward=backward),
            )

        return cost

    def splash_seg_bwd(q, k, v, seg, dout):
        return splash_bwd(q, k, v, dout, seg)

    def ce_fwd(h, w, labels):
        return fused_ce.forward_rows(h, w, labels, generation=generation)

    def ce_bwd(h, w, labels, lse, g):
        dh, dw = fused_ce.backward_rows(h, w, labels, lse, g, generation=generation)
        return dh, jax.lax.psum(dw, axis)  # every shard's rows contribute to the head's gradient

    def ce_costs(backward):
        def cost(h, w, *rest):
            return (
                "ce_bwd" if backward else "ce_fwd",
                *ce_cost(
                    h.shape[0] // shards,
                    h.shape[1],
                    w.shape[0],
                    h.dtype.itemsize,
                    backward=backward,
                    generation=generation,
                ),
            )

        return cost

    env.override_op_definition(op.ce_fwd.default, sharded(ce_fwd, (batch, P(), batch), (batch, batch), ce_costs(False)))
    env.override_op_definition(
        op.ce_bwd.default, sharded(ce_bwd, (batch, P(), batch, batch, batch), (batch, P()), ce_costs(True))
    )
    env.override_op_definition(op.splash_fwd.default, sharded(splash_fwd, (batch,) * 3, batch, splash_costs(False)))
    env.override_op_definition(
        op.splash_bwd.default, sharded(splash_bwd, (batch,) * 4, (batch,) * 3, splash_costs(True))
    )
    env.override_op_definition(op.splash_seg_fwd.default, sharded(splash_fwd, (batch,) * 4, batch, splash_costs(False)))
    env.override_op_definition(
        op.splash_seg_bwd.default, sharded(splash_seg_bwd, (batch,) * 5, (batch,) * 3, splash_costs(True))
    )
    env.override_op_definition(
        op.splash_full_fwd.default, sharded(splash_full_fwd, (batch,) * 3, batch, splash_costs(False, causal=False))
    )
    env.override_op_definition(
        op.splash_full_bwd.default,
        sharded(splash_full_bwd, (batch,) * 4, (batch,) * 3, splash_costs(True, causal=False)),
    )

    def gated_delta_fwd(q, k, v, g, beta, h0, reset):
        return delta_rule.forward(q, k, v, g, beta, h0, reset)

    def gated_delta_bwd(q, k, v, g, beta, h0, reset, d_out, d_state):
        return tuple(delta_rule.backward(q, k, v, g, beta, h0, reset, d_out, d_state))

    def gated_delta_costs(backward):
        def cost(q, k, v, *rest):
            b, h, s, dk = local(q.shape)
            name = "gated_delta_bwd" if backward else "gated_delta_fwd"
            return (name, *gated_delta_cost(b, h, s, dk, v.shape[-1], backward=backward))

        return cost

    env.override_op_definition(
        op.gated_delta_fwd.default, sharded(gated_delta_fwd, (batch,) * 7, (batch, batch), gated_delta_costs(False))
    )
    env.override_op_definition(
        op.gated_delta_bwd.default, sharded(gated_delta_bwd, (batch,) * 9, (batch,) * 6, gated_delta_costs(True))
    )
    env.override_op_definition(op.gmm.default, sharded(gmm_fwd, (batch, P(), P()), batch, gmm_costs(False)))
    env.override_op_definition(
        op.gmm_bwd.default, sharded(gmm_bwd, (batch, P(), P(), batch), (batch, P()), gmm_costs(True))
    )
