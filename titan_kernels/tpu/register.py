"""The Pallas kernels as torch ops on TPU, through torch-tpu's `torch.tpu.pallas.jax_op`.

Imported only by `titan_kernels.tpu.load()` on a TPU run (it imports jax and needs torch-tpu).
`build()` defines, once per process:
- `titan_tpu::splash_fwd / splash_bwd` and `splash_seg_fwd / splash_seg_bwd` (with segment ids):
  the forward returns (out, lse), the backward takes them and runs only the splash backward
  kernel (`splash.backward`), not the forward again;
- `titan_tpu::splash_full_fwd / splash_full_bwd`: the same with a full mask, for the op
  `attention` (FLUX's joint attention; padded keys hidden by the kernel's segment ids);
- `titan_tpu::sink_splash_w{W}_fwd / _bwd` (and `_seg_`), for the op `sink_attention` (gpt-oss):
  splash with the kernel's sinks, the sliding window W's mask or the causal one picked on the
  device by the window tensor; one set per W, defined at its first call (the start-up self-check
  makes the run's: `KernelShapes.sliding_window`); the backward returns dsinks too;
- `titan_tpu::gmm / gmm_bwd` (w as [G, K, N]) and `gmm_t / gmm_t_bwd` (w in nn.Linear layout
  [G, N, K], what the MoE experts hold: their transposed view is passed without a copy);
- `titan_tpu::linear_ce_fwd / linear_ce_bwd` (per-row loss and lse; gradients);
- `titan_tpu::gated_delta_fwd / gated_delta_bwd` for the op `gated_delta_rule` (Qwen 3.5's Gated
  DeltaNet, titan_kernels/tpu/delta_rule.py): the Pallas forward (out, final state); the backward
  op takes the saved inputs and runs the forward kernel again for the chunk states, then the
  Pallas backward kernel (delta_rule.py `backward`).
`build_cp(cp_rank, cp_size)` adds, per context-parallel rank, `titan_tpu::splash_cp{size}r{rank}_fwd
/ _bwd` (and `_seg_`): splash over all-gathered keys with that rank's causal offsets.
Each forward op gets autograd through `register_autograd` with its backward op (jax_op registers
none). The gmm backward ops take the JAX VJP of the forward (megablox's own: gmm for dx, tgmm
for dw; the unused forward is dead code that XLA drops). Splash and the fused loss save their
residuals (out and lse; lse), so their backward ops do not recompute the forward.

Tiles: `build()` detects the TPU generation once (`tiles.detect_generation`: torch-tpu's device
name, then the accelerator-type variables) and every kernel takes that generation's blocks
(titan_kernels/tpu/tiles.py); an unrecognised one gets the conservative rule.

`build()` returns {op name: torch function} for `models.common.ops.register`; each function
falls back to the op's torch reference for tensors that are not on the TPU.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import torch

from models.common import ops
from titan_kernels.tpu import delta_rule, fused_ce, gmm, splash, tiles

NAMESPACE = "titan_tpu"
_BUILT: dict[str, Callable] = {}
_BUILT_CP: dict[str, Callable] = {}
GENERATION: dict[str, str | None] = {}


def device_generation() -> str | None:
    """This host's TPU generation for the tile table, or None (detected once)."""
    if "value" not in GENERATION:
        names = []
        for getter in ("get_device_name", "get_device_properties"):
            try:
                value = getattr(torch.tpu, getter)()
            except Exception:  # no device, or not in this torch-tpu: the next source
                continue
            names.append(str(getattr(value, "name", value)))
        GENERATION["value"] = tiles.detect_generation(*names)
    return GENERATION["value"]


def build() -> dict[str, Callable]:
    """Register the ops (idempotent) and return the implementations of the model's ops."""
    if not _BUILT:
        jax_op = torch.tpu.pallas.jax_op
        gen = device_generation()
        _BUILT.update(
            causal_attention=_build_splash(jax_op, gen),
            attention=_build_full_splash(jax_op, gen),
            sink_attention=_build_sink_splash(jax_op, gen),
            grouped_mm=_build_gmm(jax_op, gen),
            linear_cross_entropy=_build_linear_ce(jax_op, gen),
            gated_delta_rule=_build_gated_delta(jax_op),
        )
    return dict(_BUILT)


def build_cp(cp_rank: int, cp_size: int) -> Callable:
    """The splash kernels for context-parallel rank `cp_rank` of `cp_size` as torch ops (once per
    process): `titan_tpu::splash_cp{size}r{rank}_fwd / _bwd` and the `_seg_` pair, with autograd.

    Returns `attention(q, k_all, v_all, segment_ids=None, segment_ids_all=None)`: this rank's
    queries (its two load-balanced chunks) against the keys and values already all-gathered in
    global order (parallelisms/context_parallel.py gathers them, and reduce-scatters their
    gradients); see splash.py "context parallelism". The rank is part of the op because the
    kernels' block tables are built from its static query offsets. Call `build()` first (a TPU
    run does, in `titan_kernels.tpu.load()`)."""
    key = f"cp{cp_size}r{cp_rank}"
    if key in _BUILT_CP:
        return _BUILT_CP[key]
    jax_op = torch.tpu.pallas.jax_op
    kw = dict(cp_rank=cp_rank, cp_size=cp_size)

    @jax_op(f"{NAMESPACE}::splash_{key}_fwd")
    def fwd(q: jax.Array, k_all: jax.Array, v_all: jax.Array) -> tuple[jax.Array, jax.Array]:
        return splash.cp_forward(q, k_all, v_all, **kw)

    @jax_op(f"{NAMESPACE}::splash_{key}_bwd")
    def bwd(
        q: jax.Array, k_all: jax.Array, v_all: jax.Array, out: jax.Array, lse: jax.Array, dout: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        return splash.cp_backward(q, k_all, v_all, None, None, out, lse, dout, **kw)

    @jax_op(f"{NAMESPACE}::splash_{key}_seg_fwd")
    def seg_fwd(
        q: jax.Array, k_all: jax.Array, v_all: jax.Array, segment_ids: jax.Array, segment_ids_all: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        return splash.cp_forward(q, k_all, v_all, segment_ids, segment_ids_all, **kw)

    @jax_op(f"{NAMESPACE}::splash_{key}_seg_bwd")
    def seg_bwd(
        q: jax.Array,
        k_all: jax.Array,
        v_all: jax.Array,
        segment_ids: jax.Array,
        segment_ids_all: jax.Array,
        out: jax.Array,
        lse: jax.Array,
        dout: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        return splash.cp_backward(q, k_all, v_all, segment_ids, segment_ids_all, out, lse, dout, **kw)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output)

    def backward(ctx, dout, d_lse):
        del d_lse
        return bwd(*ctx.saved_tensors, dout.contiguous())

    def backward_seg(ctx, dout, d_lse):
        del d_lse
        q, k_all, v_all, seg, seg_all, out, lse = ctx.saved_tensors
        return (*seg_bwd(q, k_all, v_all, seg, seg_all, out, lse, dout.contiguous()), None, None)

    fwd.register_autograd(backward, setup_context=setup)
    seg_fwd.register_autograd(backward_seg, setup_context=setup)

    def attention(q, k_all, v_all, segment_ids=None, segment_ids_all=None):
        q, k_all, v_all = q.contiguous(), k_all.contiguous(), v_all.contiguous()
        if segment_ids is None:
            return fwd(q, k_all, v_all)[0]
        return seg_fwd(
            q, k_all, v_all, segment_ids.to(torch.int32).contiguous(), segment_ids_all.to(torch.int32).contiguous()
        )[0]

    _BUILT_CP[key] = attention
    return attention


def saved_ops() -> list:
    """The forward ops that selective AC saves, like SDPA and `_grouped_mm` (after `build()`)."""
    names = ("splash_fwd", "splash_seg_fwd", "splash_full_fwd", "gmm", "gmm_t")
    return [getattr(torch.ops.titan_tpu, name).default for name in names] + list(_SINK_SAVED)


def _on_tpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "tpu" for t in tensors)


def _build_splash(jax_op, gen: str | None) -> Callable:
    @jax_op(f"{NAMESPACE}::splash_fwd")
    def splash_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        return splash.forward(q, k, v, generation=gen)

    @jax_op(f"{NAMESPACE}::splash_bwd")
    def splash_bwd(
        q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, dout: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        return splash.backward(q, k, v, None, out, lse, dout, generation=gen)

    @jax_op(f"{NAMESPACE}::splash_seg_fwd")
    def splash_seg_fwd(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        return splash.forward(q, k, v, segment_ids, generation=gen)

    @jax_op(f"{NAMESPACE}::splash_seg_bwd")
    def splash_seg_bwd(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        segment_ids: jax.Array,
        out: jax.Array,
        lse: jax.Array,
        dout: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        return splash.backward(q, k, v, segment_ids, out, lse, dout, generation=gen)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output)

    def backward(ctx, dout, d_lse):
        del d_lse  # an auxiliary output; nothing differentiates through it
        return splash_bwd(*ctx.saved_tensors, dout.contiguous())

    def backward_seg(ctx, dout, d_lse):
        del d_lse
        q, k, v, seg, out, lse = ctx.saved_tensors
        return (*splash_seg_bwd(q, k, v, seg, out, lse, dout.contiguous()), None)

    splash_fwd.register_autograd(backward, setup_context=setup)
    splash_seg_fwd.register_autograd(backward_seg, setup_context=setup)

    def causal_attention(q, k, v, segment_ids=None):
        if not _on_tpu(q, k, v):
            return ops.sdpa_causal_attention(q, k, v, segment_ids)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if segment_ids is None:
            return splash_fwd(q, k, v)[0]
        return splash_seg_fwd(q, k, v, segment_ids.to(torch.int32).contiguous())[0]

    return causal_attention


def _build_full_splash(jax_op, gen: str | None) -> Callable:
    """The op `attention` (full mask) as `titan_tpu::splash_full_fwd / _bwd`, like `_build_splash`."""

    @jax_op(f"{NAMESPACE}::splash_full_fwd")
    def full_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        return splash.forward(q, k, v, generation=gen, causal=False)

    @jax_op(f"{NAMESPACE}::splash_full_bwd")
    def full_bwd(
        q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, dout: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        return splash.backward(q, k, v, None, out, lse, dout, generation=gen, causal=False)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output)

    def backward(ctx, dout, d_lse):
        del d_lse  # an auxiliary output; nothing differentiates through it
        return full_bwd(*ctx.saved_tensors, dout.contiguous())

    full_fwd.register_autograd(backward, setup_context=setup)

    def attention(q, k, v):
        if not _on_tpu(q, k, v):
            return ops.sdpa_attention(q, k, v)
        return full_fwd(q.contiguous(), k.contiguous(), v.contiguous())[0]

    return attention


_SINK_OPS: dict[int, tuple] = {}
_SINK_SAVED: list = []


def _sink_ops(jax_op, gen: str | None, window: int) -> tuple:
    """(fwd, seg_fwd) for sliding window `window` (0: causal only): `titan_tpu::sink_splash_w{window}_*`
    with autograd (once per window; see the module docstring)."""
    if window in _SINK_OPS:
        return _SINK_OPS[window]
    name = f"{NAMESPACE}::sink_splash_w{window}"
    kw = dict(sliding_window=window, generation=gen)

    @jax_op(f"{name}_fwd")
    def fwd(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array, win: jax.Array) -> tuple[jax.Array, jax.Array]:
        return splash.sink_forward(q, k, v, sinks, win, **kw)

    @jax_op(f"{name}_bwd")
    def bwd(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        sinks: jax.Array,
        win: jax.Array,
        out: jax.Array,
        lse: jax.Array,
        dout: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        return splash.sink_backward(q, k, v, sinks, win, None, out, lse, dout, **kw)

    @jax_op(f"{name}_seg_fwd")
    def seg_fwd(
        q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array, win: jax.Array, segment_ids: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        return splash.sink_forward(q, k, v, sinks, win, segment_ids, **kw)

    @jax_op(f"{name}_seg_bwd")
    def seg_bwd(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        sinks: jax.Array,
        win: jax.Array,
        segment_ids: jax.Array,
        out: jax.Array,
        lse: jax.Array,
        dout: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        return splash.sink_backward(q, k, v, sinks, win, segment_ids, out, lse, dout, **kw)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output)

    def backward(ctx, dout, d_lse):
        del d_lse  # an auxiliary output; nothing differentiates through it
        return (*bwd(*ctx.saved_tensors, dout.contiguous()), None)

    def backward_seg(ctx, dout, d_lse):
        del d_lse
        return (*seg_bwd(*ctx.saved_tensors, dout.contiguous()), None, None)

    fwd.register_autograd(backward, setup_context=setup)
    seg_fwd.register_autograd(backward_seg, setup_context=setup)
    _SINK_OPS[window] = (fwd, seg_fwd)
    _SINK_SAVED.extend(
        getattr(torch.ops.titan_tpu, f"sink_splash_w{window}{part}_fwd").default for part in ("", "_seg")
    )
    return _SINK_OPS[window]


def _build_sink_splash(jax_op, gen: str | None) -> Callable:
    """The op `sink_attention`: splash with sinks (ops `sink_splash_w{W}_*`, built per window W).

    A tensor window (gpt-oss's per-layer buffer) goes to the device as int32 [1] and picks the
    kernel there: it must hold 0 or `sliding_window` (the op's contract); an int window is its own
    W. A tensor window without `sliding_window` (its values unknown here) takes the reference."""

    def sink_attention(q, k, v, sinks, window, segment_ids=None, sliding_window=0):
        if not isinstance(window, int) and not sliding_window:
            return ops.sdpa_sink_attention(q, k, v, sinks, window, segment_ids)
        if not _on_tpu(q, k, v, sinks):
            return ops.sdpa_sink_attention(q, k, v, sinks, window, segment_ids)
        if isinstance(window, int):
            sliding_window, window = window, torch.full((1,), window, dtype=torch.int32, device=q.device)
        fwd, seg_fwd = _sink_ops(jax_op, gen, max(int(sliding_window), 0))
        q, k, v, sinks = q.contiguous(), k.contiguous(), v.contiguous(), sinks.contiguous()
        win = window.reshape(1).to(torch.int32)
        if segment_ids is None:
            return fwd(q, k, v, sinks, win)[0]
        return seg_fwd(q, k, v, sinks, win, segment_ids.to(torch.int32).contiguous())[0]

    return sink_attention


def _build_gmm(jax_op, gen: str | None) -> Callable:
    @jax_op(f"{NAMESPACE}::gmm")
    def gmm_kn(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return gmm.grouped_mm(x, w, group_sizes, generation=gen)

    @jax_op(f"{NAMESPACE}::gmm_bwd")
    def gmm_kn_bwd(x: jax.Array, w: jax.Array, group_sizes: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
        return tuple(jax.vjp(lambda x, w: gmm.grouped_mm(x, w, group_sizes, generation=gen), x, w)[1](dy))

    @jax_op(f"{NAMESPACE}::gmm_t")
    def gmm_nk(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return gmm.grouped_mm(x, w, group_sizes, transpose_rhs=True, generation=gen)

    @jax_op(f"{NAMESPACE}::gmm_t_bwd")
    def gmm_nk_bwd(x: jax.Array, w: jax.Array, group_sizes: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
        return tuple(
            jax.vjp(lambda x, w: gmm.grouped_mm(x, w, group_sizes, transpose_rhs=True, generation=gen), x, w)[1](dy)
        )

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward_kn(ctx, dy):
        return (*gmm_kn_bwd(*ctx.saved_tensors, dy.contiguous()), None)

    def backward_nk(ctx, dy):
        return (*gmm_nk_bwd(*ctx.saved_tensors, dy.contiguous()), None)

    gmm_kn.register_autograd(backward_kn, setup_context=setup)
    gmm_nk.register_autograd(backward_nk, setup_context=setup)

    def grouped_mm(x, w, group_sizes):
        if not _on_tpu(x, w):
            return ops.torch_grouped_mm(x, w, group_sizes)
        sizes = group_sizes.to(torch.int32)  # stays on the device: no host read
        w_nk = w.transpose(-2, -1)
        if w_nk.is_contiguous():  # the experts' nn.Linear-layout weight: no copy
            return gmm_nk(x.contiguous(), w_nk, sizes)
        return gmm_kn(x.contiguous(), w.contiguous(), sizes)

    return grouped_mm


def _build_linear_ce(jax_op, gen: str | None) -> Callable:
    @jax_op(f"{NAMESPACE}::linear_ce_fwd")
    def ce_fwd(h: jax.Array, w: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
        return fused_ce.forward_rows(h, w, labels, generation=gen)

    @jax_op(f"{NAMESPACE}::linear_ce_bwd")
    def ce_bwd(
        h: jax.Array, w: jax.Array, labels: jax.Array, lse: jax.Array, g: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        return fused_ce.backward_rows(h, w, labels, lse, g, generation=gen)

    def setup(ctx, inputs, output):
        h, w, labels = inputs
        ctx.save_for_backward(h, w, labels, output[1])

    def backward(ctx, d_rows, d_lse):
        del d_lse  # an auxiliary output; nothing differentiates through it
        return (*ce_bwd(*ctx.saved_tensors, d_rows.float().contiguous()), None)

    ce_fwd.register_autograd(backward, setup_context=setup)

    def linear_cross_entropy(h, w, labels):
        if not _on_tpu(h, w):
            return ops.chunked_linear_cross_entropy(h, w, labels)
        rows, _ = ce_fwd(h.contiguous(), w.contiguous(), labels.to(torch.int32))
        valid = labels != ops.IGNORE_INDEX
        return torch.where(valid, rows, 0.0).sum() / valid.sum()

    return linear_cross_entropy


def _build_gated_delta(jax_op) -> Callable:
    """The op `gated_delta_rule` as `titan_tpu::gated_delta_fwd / _bwd` (delta_rule.py), called
    on the inputs the torch side prepares as the reference does (`gated_delta.call_prepared`).
    Chunk sizes other than the kernel's and tensors off the TPU go to the torch reference."""
    from models.common import gated_delta

    @jax_op(f"{NAMESPACE}::gated_delta_fwd")
    def gd_fwd(
        q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, h0: jax.Array, reset: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        return delta_rule.forward(q, k, v, g, beta, h0, reset)

    @jax_op(f"{NAMESPACE}::gated_delta_bwd")
    def gd_bwd(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        h0: jax.Array,
        reset: jax.Array,
        d_out: jax.Array,
        d_state: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
        return tuple(delta_rule.backward(q, k, v, g, beta, h0, reset, d_out, d_state))

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, d_out, d_state):
        return (*gd_bwd(*ctx.saved_tensors, d_out.contiguous(), d_state.contiguous()), None)

    gd_fwd.register_autograd(backward, setup_context=setup)

    def chunk_gated_delta_rule(q, k, v, g, beta, *, chunk_size=64, **kwargs):
        # kwargs: initial_state, output_final_state, qk_l2norm, reset (models/common/gated_delta.py)
        if not _on_tpu(q, k, v) or chunk_size != delta_rule.CHUNK:
            return gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
        return gated_delta.call_prepared(gd_fwd, q, k, v, g, beta, **kwargs)

    return chunk_gated_delta_rule
