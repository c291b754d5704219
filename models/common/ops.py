"""The device-dependent ops that models call: one function per op, implementations from `titan_kernels/`.

A model calls `causal_attention(q, k, v)`, `attention(q, k, v)` (full, bidirectional: FLUX),
`sink_attention(q, k, v, sinks, window)` (causal with a sink logit per head and a sliding window:
gpt-oss, DeepSeek-V4's sliding blocks),
`grouped_mm(x, w, group_sizes)` or
`linear_cross_entropy(h, w, labels)`, the chunked gated delta rule `gated_delta_rule` (Qwen 3.5's
Gated DeltaNet, `gated_delta_rule(q, k, v, g, beta, ...)`), the two other places that network reads
earlier tokens, `causal_conv1d(x, weight, segment_ids)` and `segment_starts(segment_ids)` (served
for context parallelism by parallelisms/context_parallel_linear.py) (and a quantized linear
layer `quantized_linear(x, w, recipe)`, `[quantize]`); it never picks an implementation. Which one serves an op
on this run (SDPA, the CPU C++ kernel, a Pallas kernel on TPU) is registered once at start-up by
`titan_kernels.select(...)`, which the trainer calls before building the model. With nothing
registered the torch references below run; every kernel also falls back to them for inputs it
does not handle. The references are exact, run on every device, and read nothing on the host
(no `.item()`/`.tolist()`), so a model traces into one program with any of them.
This module imports torch only and reads no environment.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from models.common import gated_delta
from models.common.quantize import (
    emulated_batched_mm,
    emulated_float8_weight_linear,
    emulated_grouped_mm,
    emulated_linear,
    held_float8_weight,
)

OPS = ("causal_attention", "attention", "sink_attention", "grouped_mm", "linear_cross_entropy", "gated_delta_rule")
LOW_PRECISION_OPS = ("quantized_linear", "quantized_grouped_mm", "quantized_batched_mm")
"""Ops of the low-precision recipes (`[quantize]`, docs/low_precision.md): registered like `OPS`,
tested against their emulation (tests/unit/test_quantize.py, tests/xla) rather than by the
start-up self-check."""
SEQUENCE_OPS = ("causal_conv1d", "segment_starts")
"""Ops that read earlier tokens of the sequence (Qwen 3.5's short convolution and document
starts): the references read the local sequence; context parallelism serves them with the tokens
of the preceding chunk on another rank (parallelisms/context_parallel_linear.py), no kernel
serves them, so the start-up self-check has none."""

IGNORE_INDEX = -100
"""Label that `linear_cross_entropy` skips (F.cross_entropy's default)."""

_impls: dict[str, Callable] = {}


def register(op: str, fn: Callable | None) -> Callable | None:
    """Serve `op` with `fn` from now on (None: the torch reference); return the previous one."""
    known = OPS + LOW_PRECISION_OPS + SEQUENCE_OPS
    assert op in known, f"unknown op {op!r}; ops: {known}"
    previous = _impls.pop(op, None)
    if fn is not None:
        _impls[op] = fn
    return previous


def implementation(op: str) -> Callable:
    """The function that serves `op` now."""
    return _impls.get(op, _REFERENCES[op])


# --- attention --------------------------------------------------------------------------------


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, kv_heads, s, d] -> [b, kv_heads * n_rep, s, d]; kv head j serves q heads j*n_rep.. ."""
    if n_rep == 1:
        return x
    b, kv_heads, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv_heads, n_rep, s, d).reshape(b, kv_heads * n_rep, s, d)


def document_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """segment_ids [b, s] -> bool [b, 1, s, s]: query i sees key j iff j <= i and both are in
    the same segment (document). The diagonal is always True, so no row is fully masked."""
    s = segment_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, **kwargs)` with v at its own width (MLA).

    v narrower or wider than q/k: the narrower side is zero-padded to one width and the output
    sliced back to v's, with the scale kept at q's width. Exact (zero columns add nothing to q.k;
    padded value columns are sliced off, their gradients dropped), and needed: ATen's CPU flash
    kernel takes one width, and SDPA would otherwise fall back to the math kernel, which keeps
    the [seq, seq] probabilities for the backward. Kernels that take two widths (splash) are
    given them unpadded."""
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if head_dim == v_head_dim:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    width = max(head_dim, v_head_dim)
    if width > head_dim:
        q, k = F.pad(q, (0, width - head_dim)), F.pad(k, (0, width - head_dim))
        kwargs.setdefault("scale", head_dim**-0.5)  # SDPA's default would be the padded width's
    if width > v_head_dim:
        v = F.pad(v, (0, width - v_head_dim))
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    return out[..., :v_head_dim] if width > v_head_dim else out


def sdpa_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: `F.scaled_dot_product_attention` with k/v heads repeated; causal, or
    causal within documents (a block-diagonal causal mask) when `segment_ids` is given; v at its
    own width (`sdpa`)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if segment_ids is None:
        return sdpa(q, k, v, is_causal=True)
    return sdpa(q, k, v, attn_mask=document_causal_mask(segment_ids))


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim), causal) v.

    q and k [batch, q_heads | kv_heads, seq, head_dim], v [batch, kv_heads, seq, v_head_dim] with
    q_heads a multiple of kv_heads (grouped-query attention) -> [batch, q_heads, seq, v_head_dim]
    (possibly a transposed view). The scale is q's width (`head_dim`); v's width may differ from
    it (MLA: q/k 192, v 128): every implementation takes that, or hands such inputs to the
    reference (the CPU kernel does). `segment_ids` [batch, seq] (integers, e.g. the document
    index of each token in a packed row): a token attends only to earlier tokens of its own
    segment. Implementations take `(q, k, v)` or `(q, k, v, segment_ids)`.
    """
    fn = _impls.get("causal_attention", sdpa_causal_attention)
    if segment_ids is None:
        return fn(q, k, v)
    return fn(q, k, v, segment_ids)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference of `attention`: `F.scaled_dot_product_attention` without a mask, k/v heads
    repeated (nothing to repeat without GQA: then exactly the plain SDPA call), v at its own
    width (`sdpa`)."""
    n_rep = q.shape[1] // k.shape[1]
    return sdpa(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v over the whole sequence: full (bidirectional) attention,
    no mask (FLUX's joint attention over [txt; img]).

    Layout and widths as `causal_attention`: q and k [batch, q_heads | kv_heads, seq, head_dim],
    v [batch, kv_heads, seq, v_head_dim], q_heads a multiple of kv_heads -> [batch, q_heads,
    seq, v_head_dim] (possibly a transposed view). On TPU the splash kernel with a full mask
    serves it (titan_kernels/tpu/splash.py), elsewhere the reference `sdpa_attention`.
    """
    return _impls.get("attention", sdpa_attention)(q, k, v)


def sdpa_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: torch.Tensor | int,
    segment_ids: torch.Tensor | None = None,
    sliding_window: int = 0,
) -> torch.Tensor:
    """The reference of `sink_attention`: SDPA over one extra key per head (the sink).

    The sink is one more key, first in the sequence and visible to every query, whose logit is the
    sink and whose value is zero: q and k get extra columns (q: a one, then zeros; real keys: zeros;
    the sink key: sink / scale at the one's column, so its logit is exactly the sink), padded to a
    multiple of 8 for the kernels, and the scale stays `1/sqrt(d)`. That is `softmax([q k^T / sqrt(d)
    | sink]) v` with the sink column dropped (HF's eager formulation) computed by SDPA with a
    boolean mask, so the memory-efficient kernels serve it (no `[b, heads, s, s]` probabilities kept
    for the backward) and the sinks get their gradient through the sink key. The mask is built
    from `window` by tensor ops (no host read), so one traced program serves sliding and full
    layers. `sliding_window` is for kernels (see `sink_attention`); the reference reads `window`.
    """
    del sliding_window
    b, heads, s, d = q.shape
    n_rep = heads // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scale = d**-0.5
    extra = 8 - d % 8  # the sink's column, then zeros up to a multiple of 8 (8 columns when d is one)
    q = torch.cat([q, q.new_ones(b, heads, s, 1), q.new_zeros(b, heads, s, extra - 1)], dim=-1)
    sink_key = F.pad((sinks.to(q.dtype) / scale).view(1, heads, 1, 1).expand(b, heads, 1, 1), (d, extra - 1))
    k = torch.cat([sink_key, F.pad(k, (0, extra))], dim=2)
    v = torch.cat([v.new_zeros(b, heads, 1, d), v], dim=2)
    i = torch.arange(s, device=q.device).unsqueeze(1)
    j = torch.arange(s, device=q.device).unsqueeze(0)
    visible = (j <= i) & ((window <= 0) | (i - j < window))
    if segment_ids is not None:
        visible = (visible & (segment_ids[:, :, None] == segment_ids[:, None, :]))[:, None]
    visible = F.pad(visible, (1, 0), value=True)  # every query sees the sink
    return sdpa(q, k, v, attn_mask=visible, scale=scale)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: torch.Tensor | int,
    segment_ids: torch.Tensor | None = None,
    *,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Causal attention with a sink logit per head and an optional sliding window:
    `softmax([q k^T / sqrt(d) masked | sink_h]) v` with the sink column dropped (gpt-oss,
    DeepSeek-V4: the sink takes probability mass and attends to nothing).

    q [b, heads, s, d], k/v [b, kv_heads, s, d] (GQA: heads a multiple of kv_heads), sinks [heads],
    window: a 0-dim integer tensor (gpt-oss's per-layer buffer: a layer scan gives each layer its
    own) or an int; > 0: query i sees keys i - window < j <= i, 0: all j <= i. `segment_ids`
    [b, s]: also only keys of its own segment (the sink stays visible). -> [b, heads, s, d].
    `sliding_window` (static): the one value > 0 a tensor `window` may hold (0: none). A kernel
    builds its mask from it (TPU splash: the window's mask and the causal one, chosen on the
    device by `window`), so a tensor `window` must hold 0 or `sliding_window`; a kernel hands a
    tensor window without one to the reference. Implementations take `(q, k, v, sinks, window,
    segment_ids, sliding_window)`.
    """
    fn = _impls.get("sink_attention", sdpa_sink_attention)
    return fn(q, k, v, sinks, window, segment_ids, sliding_window)


# --- grouped matmul (MoE experts) ---------------------------------------------------------------


def _is_traced(x: torch.Tensor) -> bool:
    """True under torch.compile/export, and for meta or fake tensors (shape-only execution)."""
    return torch.compiler.is_compiling() or x.device.type == "meta" or isinstance(x, FakeTensor)


def torch_grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm(x, w, offs=...)` runs for x [M, K], w [G, K, N] (torch 2.13).

    - torch-tpu registers its own kernel and a relaxed meta function: always.
    - CPU/CUDA kernels take float32 and bfloat16 but need 16-byte aligned row strides, i.e.
      K and N multiples of 4 (fp32) / 8 (bf16).
    - torch 2.13's meta function (what compile, FakeTensor and the meta device run) accepts
      bfloat16 only, so traced float32 must take another path.
    """
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16) or w.dtype != x.dtype:
        return False
    if x.device.type == "tpu":
        return True
    if x.device.type not in ("cpu", "cuda", "meta"):
        return False
    align = 16 // x.element_size()
    if w.shape[-1] % align != 0 or w.shape[-2] % align != 0:
        return False
    return x.dtype == torch.bfloat16 or not _is_traced(x)


def group_of_rows(group_sizes: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[G] sizes -> [num_rows] int64 group index of each row (rows sorted by group), on device.

    Row r belongs to group g = the number of group end offsets <= r. Rows past
    sum(group_sizes) get G. Static shape, no host read; a [num_rows, G] comparison rather than
    `searchsorted`, which some lowerings (torchax 0.0.13) lack with `right=True`.
    """
    ends = torch.cumsum(group_sizes, dim=0)
    rows = torch.arange(num_rows, device=group_sizes.device, dtype=ends.dtype)
    return (rows.unsqueeze(-1) >= ends).sum(dim=-1)


def masked_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` by brute force: every group's weight on all rows, each row keeps its own.

    Exact and traceable anywhere (static shapes, no host read) at G times the FLOPs; meant for
    small models where `torch._grouped_mm` does not run (traced float32, unaligned sizes).
    """
    group = group_of_rows(group_sizes, x.shape[0]).unsqueeze(-1)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for g in range(w.shape[0]):
        out = torch.where(group == g, x @ w[g], out)
    return out


def torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The reference: `torch._grouped_mm` where it runs, else `masked_grouped_mm`."""
    if torch_grouped_mm_ok(x, w):
        offsets = torch.cumsum(group_sizes, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    return masked_grouped_mm(x, w, group_sizes)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Per-group matmul: rows of group g times w[g].

    x [M, K] with rows sorted by group; w [G, K, N] (a transposed view of a [G, N, K] weight is
    fine and cheap); group_sizes [G] integer tensor **on the device** (never read on the host,
    so one compiled program serves every routing) with sum(group_sizes) <= M -> [M, N] in
    x.dtype. Empty groups are allowed. Rows past sum(group_sizes) belong to no group and are
    not computed: their outputs are unspecified (torch._grouped_mm and megablox leave them
    unwritten, the masked fallback gives zeros), so a caller that pads masks them.
    """
    return _impls.get("grouped_mm", torch_grouped_mm)(x, w, group_sizes)


# --- fused linear + cross-entropy ------------------------------------------------------------


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean_i CE(h_i W^T, y_i) computed over vocabulary chunks, logits never whole.

    Numerics match `F.cross_entropy(F.linear(h, W).float(), y)`: each chunk's logits are the
    matmul in the input dtype, then upcast to float32 (so only [N, chunk] floats live at once);
    the log-sum-exp is combined across chunks in float32. The backward recomputes each chunk's
    logits, forms (softmax - onehot) * dloss / n_valid in float32, casts it to the input dtype
    (as autograd of `.float()` does) and accumulates dh in float32 over chunks.
    """

    @staticmethod
    def forward(ctx, h, w, labels, chunk_size: int, ignore_index: int):
        n, vocab = h.shape[0], w.shape[0]
        lse = torch.full((n,), float("-inf"), dtype=torch.float32, device=h.device)
        target = torch.zeros(n, dtype=torch.float32, device=h.device)
        for start in range(0, vocab, chunk_size):
            logits = F.linear(h, w[start : start + chunk_size]).float()
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
            local = labels - start
            inside = (local >= 0) & (local < logits.shape[-1])
            picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
            target = target + torch.where(inside, picked, 0.0)
        valid = labels != ignore_index
        n_valid = valid.sum()
        loss = torch.where(valid, lse - target, 0.0).sum() / n_valid
        ctx.save_for_backward(h, w, labels, lse, n_valid)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return loss

    @staticmethod
    def backward(ctx, dloss):
        h, w, labels, lse, n_valid = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        scale = torch.where(labels != ctx.ignore_index, dloss / n_valid, 0.0).unsqueeze(-1)
        dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[0] else None
        dw_chunks = []
        for start in range(0, w.shape[0], chunk_size):
            w_chunk = w[start : start + chunk_size]
            logits = F.linear(h, w_chunk).float()
            grad = torch.exp(logits - lse.unsqueeze(-1))
            cols = torch.arange(start, start + w_chunk.shape[0], device=h.device)
            grad = ((grad - (labels.unsqueeze(-1) == cols).float()) * scale).to(h.dtype)
            if dh is not None:
                dh = dh + (grad @ w_chunk).float()
            if ctx.needs_input_grad[1]:
                dw_chunks.append(grad.transpose(0, 1) @ h)
        dw = torch.cat(dw_chunks) if ctx.needs_input_grad[1] else None
        return (dh.to(h.dtype) if dh is not None else None), dw, None, None, None


def chunked_linear_cross_entropy(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 8192,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The reference for `linear_cross_entropy` (see `_ChunkedLinearCrossEntropy`)."""
    return _ChunkedLinearCrossEntropy.apply(h, w, labels, chunk_size, ignore_index)


def linear_cross_entropy(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """mean over labels != IGNORE_INDEX of cross_entropy(h @ w^T, labels), float32 0-dim.

    h [N, dim] hidden states (after the final norm), w [vocab, dim] the output projection's
    weight, labels [N] int64. Same value and gradients as
    `F.cross_entropy(F.linear(h, w).float(), labels)`, without ever holding the [N, vocab]
    logits (nor their float32 copy) at once.
    """
    return _impls.get("linear_cross_entropy", chunked_linear_cross_entropy)(h, w, labels)


# --- low-precision linear ([quantize]) -----------------------------------------------------------


def quantized_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    recipe: str,
    w_scale: torch.Tensor | None = None,
    w_grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T with the three matmuls (forward and both gradients) quantized as
    `recipe` says (models/common/quantize.py: RECIPES), -> [..., N] in x.dtype. The reference is
    the exact emulation (quantize, dequantize, sums in fp32); a device's kernel (XLA's float8 /
    int8 dots on TPU, `torch._scaled_mm` on CUDA) computes the same products.

    `w_scale` (float8_tensorwise): w arrives quantized, `float8_e4m3fn` values with this one scale
    (SimpleFSDP's float8 all-gather), and `w_grad` is the carrier of its gradient (zeros of w's
    shape in the compute dtype): the gradient of the dequantized weight goes to `w_grad`, w
    itself is not differentiable. An implementation marked `takes_float8_weight` (TPU, CUDA) gets
    the float8 tensor as it is and quantizes only the activations. The emulation uses the values
    as they are (held in the compute dtype, exactly). An implementation that does not take a
    quantized weight gets it dequantized in fp32, w * w_scale, and quantizes it again: the same
    e4m3 values, the scale within its fp32 rounding."""
    impl = _impls.get("quantized_linear")
    if w_scale is None:
        return (impl or emulated_linear)(x, w, recipe)
    assert w_grad is not None, "a quantized weight needs the carrier of its gradient"
    if getattr(impl, "takes_float8_weight", False):
        return impl(x, w, recipe, w_scale, w_grad)
    if impl is None:
        return emulated_float8_weight_linear(x, w, recipe, w_scale, w_grad)
    return impl(x, _Dequantize.apply(held_float8_weight(w, w_grad), w_scale), recipe)


class _Dequantize(torch.autograd.Function):
    """w * scale in fp32 (in bf16 the amax, and so the scale found again, would move by bf16's
    rounding); the gradient passes to w unchanged (it is the dequantized weight's), in w's dtype."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.dtype = w.dtype
        return w.float() * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def quantized_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, recipe: str) -> torch.Tensor:
    """`grouped_mm` (x [M, K] rows sorted by group, w [G, K, N]) with its three matmuls (forward,
    input gradient, per-group weight gradient) quantized as `recipe` says, every scale group inside
    one expert (models/common/quantize.py: emulated_grouped_mm, the reference). Rows past
    sum(group_sizes) are unspecified."""
    return _impls.get("quantized_grouped_mm", emulated_grouped_mm)(x, w, group_sizes, recipe)


def quantized_batched_mm(x: torch.Tensor, w: torch.Tensor, recipe: str) -> torch.Tensor:
    """x [E, R, K] @ w [E, K, N] -> [E, R, N] with the three matmuls quantized as `recipe` says,
    each expert's scale groups its own (the capacity layout's expert matmul; the reference is
    `emulated_batched_mm`, one `emulated_linear` per expert). The same matmuls as
    `quantized_grouped_mm` of the flattened rows with every group R rows, which is how a device
    serves it (TPU: titan_kernels/tpu/qlinear.py `build_batched`)."""
    return _impls.get("quantized_batched_mm", emulated_batched_mm)(x, w, recipe)


# --- the chunked gated delta rule (Gated DeltaNet) ------------------------------------------------


torch_gated_delta_rule = gated_delta.chunk_gated_delta_rule
"""The reference of `gated_delta_rule` (models/common/gated_delta.py, transformers' operations)."""


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    qk_l2norm: bool = False,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked gated delta rule (Gated DeltaNet: Qwen 3.5's linear attention) -> (out, the final
    state or None). Arguments, layouts and numerics: the reference `gated_delta.chunk_gated_delta_rule`
    (q, k [b, s, k_heads, k_dim], v [b, s, v_heads, v_dim], g, beta [b, s, v_heads]; `initial_state`
    and the final state [b, v_heads, k_dim, v_dim] are what context parallelism would pass between
    ranks; `reset` [b, s] zeroes the state before marked tokens, document starts). On TPU the Pallas
    kernel of titan_kernels/tpu/delta_rule.py serves it (chunks of 64; other chunk sizes take the
    reference), elsewhere the reference."""
    return _impls.get("gated_delta_rule", torch_gated_delta_rule)(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=chunk_size,
        initial_state=initial_state,
        output_final_state=output_final_state,
        qk_l2norm=qk_l2norm,
        reset=reset,
    )


# --- ops that read earlier tokens (Gated DeltaNet's short convolution, document starts) ----------


def torch_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of `causal_conv1d`: `F.conv1d` with `kernel - 1` zeros in front (transformers'
    causal_conv1d_fn, torch path); with `segment_ids` one term per tap, the token `shift` back
    kept only when it is of the same segment."""
    seqlen, kernel = x.shape[1], weight.shape[-1]
    if segment_ids is None:
        out = F.conv1d(x.transpose(1, 2), weight, None, padding=kernel - 1, groups=x.shape[-1])
        return out[..., :seqlen].transpose(1, 2)
    out = None
    for shift in range(kernel):
        past = F.pad(x, (0, 0, shift, 0))[:, :seqlen]
        same = F.pad(segment_ids, (shift, 0), value=-1)[:, :seqlen] == segment_ids
        term = past * same.unsqueeze(-1).to(x.dtype) * weight[:, 0, kernel - 1 - shift]
        out = term if out is None else out + term
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution over the sequence, no bias, no activation: x [b, s, C], weight
    [C, 1, K] -> [b, s, C], out[t] = sum_j weight[:, 0, K - 1 - j] x[t - j] over the tokens
    t - j >= 0 of the sequence (of t's segment with `segment_ids` [b, s]). Under context
    parallelism the tokens before a local chunk come from the rank holding the preceding one."""
    return _impls.get("causal_conv1d", torch_causal_conv1d)(x, weight, segment_ids)


def torch_segment_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """The reference of `segment_starts`: each token against the one before it in the row."""
    starts = torch.zeros_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return starts


def segment_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """segment_ids [b, s] -> bool [b, s], True where a token's segment differs from the previous
    token's (never at the sequence's first token): the `reset` of `gated_delta_rule`. Under
    context parallelism the previous token of a local chunk's first one is on another rank."""
    return _impls.get("segment_starts", torch_segment_starts)(segment_ids)


_REFERENCES: dict[str, Callable] = {
    "causal_attention": sdpa_causal_attention,
    "attention": sdpa_attention,
    "sink_attention": sdpa_sink_attention,
    "grouped_mm": torch_grouped_mm,
    "linear_cross_entropy": chunked_linear_cross_entropy,
    "gated_delta_rule": torch_gated_delta_rule,
    "quantized_linear": emulated_linear,
    "quantized_grouped_mm": emulated_grouped_mm,
    "quantized_batched_mm": emulated_batched_mm,
    "causal_conv1d": torch_causal_conv1d,
    "segment_starts": torch_segment_starts,
}
