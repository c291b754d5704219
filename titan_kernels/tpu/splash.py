"""Splash attention (Pallas, TPU) for the ops `causal_attention` (causal, GQA, document masking),
`attention` (full, bidirectional: FLUX's joint attention) and `sink_attention` (a sink logit per
head and a sliding window: gpt-oss, DeepSeek-V4's sliding blocks; `sink_forward` / `sink_backward`
/ `splash_sink_attention`, section "sinks and a sliding window" below).

Pure JAX: `splash_attention(q, k, v, segment_ids=None, causal=True)` takes the op's layout (q
[B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], segment_ids [B, S] or None) and returns
[B, Hq, S, Dv]. It wraps JAX's `splash_attention` kernel:
- The mask: `CausalMask` (`causal=True`, the op `causal_attention`) or `FullMask` (`causal=False`,
  the op `attention`: every query sees every key; the kernel visits every block).
- Two head widths: the kernel's q.k products run at D and its p.v products at Dv (its blocks
  take each operand's own last dim), so MLA's v (128 beside q/k 192 in DeepSeek-V3) is passed
  unpadded; tests/xla checks forward and backward at 192 / 128 in interpret mode.
- GQA without repeating K/V: the kernel's MQA form runs the `Hq / Hkv` query heads of one KV
  head against that head's K/V, vmapped over batch and KV heads.
- Document masking: `segment_ids` become the kernel's `SegmentIds` (q and kv ids are the same
  row for self-attention); a token attends to earlier tokens of its own segment. (torch-tpu's
  `splash_sdpa` and the TorchTitan TPU fork have no segment ids.)
- Odd lengths: the sequence is padded at the end to a multiple of 128 (the kernel's tile) and
  the padding sliced off; with a causal mask no real query sees a padded key. With the full
  mask it would: the padded keys get a segment of their own (id 1 beside the real tokens' 0,
  or -1 beside the caller's ids), so real queries never see them and padded queries see only
  padded keys (a finite lse, an output of zeros that is sliced off). A length that is already a
  multiple of 128 (FLUX at 1024 px: 4352, 4608 tokens) takes no segment ids.
- Scale 1/sqrt(D) is applied to q in q's dtype (no float32 promotion of q).
- Backward from saved residuals: `forward` returns (out, lse), `backward` takes them and calls
  JAX's splash backward kernel (`_splash_attention_bwd`, fused dq/dkv) directly, so the
  backward op never runs the forward kernel again (it did when it was `jax.vjp` of the
  forward: one extra attention forward per layer and step). `splash_attention` binds the two
  as a custom VJP for JAX callers; titan_kernels/tpu/register.py binds them as two torch ops.
  (`_splash_attention_bwd` is private in jax 0.10.2, pinned; tests/xla checks it.)
- Blocks per TPU generation (`generation`, a key of `tiles.GENERATIONS` or None):
  `tiles.splash_blocks` reads `[block_q, block_kv, block_q_dkv, block_kv_dkv]` from the tile
  table (`"s<seq>d<head_dim>"`, else the generation's default: the largest of 512, 256, 128
  dividing the sequence); `blocks` overrides them (the tile sweep). The context-parallel
  kernels below keep `block_size`.
`interpret=True` runs the same kernels in Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

try:  # a package import (titan_kernels.tpu.splash) or a plain module next to tiles.py (the probes)
    from titan_kernels.tpu import tiles
except ImportError:  # pragma: no cover - the XLA-tier probes put titan_kernels/tpu on sys.path
    import tiles

TILE = tiles.SPLASH_TILE
"""Sequence tile of the kernel; lengths are padded to a multiple of it."""

block_size = tiles.splash_block_size
"""Largest of 512, 256, 128 that divides the (padded) sequence length (tiles.py: jax-free, for the
capture's cost model)."""


def _head_mask(seq_len: int, causal: bool, window: int):
    """One head's mask: causal, causal within the last `window` keys (`window` > 0: query i sees
    keys i - window < j <= i, a `LocalMask` reaching `window - 1` back; a window covering the whole
    sequence is causal), or full (`causal=False`)."""
    if not causal:
        assert window == 0, "a window is causal"
        return sm.FullMask((seq_len, seq_len))
    if 0 < window < seq_len:
        return sm.LocalMask((seq_len, seq_len), window_size=(window - 1, 0), offset=0)
    return sm.CausalMask((seq_len, seq_len))


@functools.lru_cache(maxsize=64)
def _kernel(
    seq_len: int, group: int, blocks: tuple[int, int, int, int], interpret: bool, causal: bool = True, window: int = 0
):
    """The MQA splash kernel for `group` query heads sharing one KV head (built once per shape),
    causal, causal within a sliding `window` (> 0), or full (`causal=False`: every query sees every key).

    Built with `save_residuals=True`: calling it returns (out, (logsumexp,)), the residuals its
    backward needs; `backward` below calls that backward kernel on them directly."""
    mask = sm.MultiHeadMask([_head_mask(seq_len, causal, window)] * group)
    bq, bkv, bq_dkv, bkv_dkv = blocks
    sizes = sk.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq_dkv,
        block_kv_dkv=bkv_dkv,
        block_kv_dkv_compute=bkv_dkv,
        use_fused_bwd_kernel=True,
    )
    # Built on first use, usually inside a trace: without compile-time evaluation the kernel's
    # mask tables (jnp arrays) would be tracers of that trace, and this cache would leak them
    # into the next one. As numpy arrays they are plain literals of every program that uses
    # them (`jax.export`, which torch-tpu's jax_op runs, cannot take hoisted jax constants).
    with jax.ensure_compile_time_eval():
        kernel = sk.make_splash_mqa(
            mask=mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, save_residuals=True, interpret=interpret
        )
        return jax.tree_util.tree_map(np.asarray, kernel)


def _collapsed(mask_info):
    """A MaskInfo with its partial mask blocks as [blocks, bq, bkv], as the kernel's own call
    passes them (`_splash_attention` collapses the leading dims before the custom VJP)."""
    if mask_info is None or mask_info.partial_mask_blocks is None:
        return mask_info
    blocks = mask_info.partial_mask_blocks
    return mask_info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


class _Layout:
    """The op's [B, H, S, D] layout <-> the kernel's per-KV-head MQA form (padded, q scaled)."""

    def __init__(
        self,
        q: jax.Array,
        k: jax.Array,
        interpret: bool,
        generation: str | None = None,
        blocks=None,
        causal: bool = True,
        window: int = 0,
    ):
        self.causal = causal
        self.batch, self.q_heads, self.seq, self.head_dim = q.shape
        self.kv_heads = k.shape[1]
        assert self.q_heads % self.kv_heads == 0, f"q heads {self.q_heads} not a multiple of kv heads {self.kv_heads}"
        self.group = self.q_heads // self.kv_heads
        self.pad = (-self.seq) % TILE
        self.padded = self.seq + self.pad
        self.scale = self.head_dim**-0.5
        blocks = tuple(blocks) if blocks else tiles.splash_blocks(generation, self.padded, self.head_dim)
        self.kernel = _kernel(self.padded, self.group, blocks, interpret, causal, window)

    def seq_pad(self, t: jax.Array) -> jax.Array:
        """Pad dim 2 (the sequence) of [B, H, S, D] with zeros to the kernel's tile."""
        return jnp.pad(t, ((0, 0), (0, 0), (0, self.pad), (0, 0))) if self.pad else t

    def to_mqa(self, t: jax.Array) -> jax.Array:
        """[B, Hq, S, D] -> [B, Hkv, group, S_pad, D]."""
        return self.seq_pad(t).reshape(self.batch, self.kv_heads, self.group, self.padded, t.shape[-1])

    def from_mqa(self, t: jax.Array) -> jax.Array:
        """[B, Hkv, group, S_pad, D] -> [B, Hq, S, D]."""
        return t.reshape(self.batch, self.q_heads, self.padded, t.shape[-1])[:, :, : self.seq]

    def ids(self, segment_ids: jax.Array | None) -> jax.Array | None:
        """The kernel's segment ids [B, S_pad], or None. Padded tokens get a segment of their own:
        causality already hides them from real queries; the full mask needs it (module docstring)."""
        if segment_ids is None:
            if self.causal or not self.pad:
                return None
            real = jnp.zeros((self.batch, self.seq), jnp.int32)
            return jnp.pad(real, ((0, 0), (0, self.pad)), constant_values=1)
        ids = segment_ids.astype(jnp.int32)
        if self.pad:
            ids = jnp.pad(ids, ((0, 0), (0, self.pad)), constant_values=-1)
        return ids

    def per_head(self, fn, *args, ids=None):
        """vmap `fn(*per_head_args, segment_ids)` over batch and KV heads."""
        if ids is None:
            return jax.vmap(jax.vmap(lambda *a: fn(*a, None)))(*args)
        inner = jax.vmap(lambda *a: fn(*a[:-1], sk.SegmentIds(q=a[-1], kv=a[-1])), in_axes=(*(0,) * len(args), None))
        return jax.vmap(inner)(*args, ids)


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    interpret: bool = False,
    generation: str | None = None,
    blocks: tuple[int, int, int, int] | None = None,
    causal: bool = True,
    window: int = 0,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(out [B, Hq, S, Dv], lse [B, Hq, S_pad] float32): the attention and the log-sum-exp of
    each (scaled) query row, the residual `backward` needs (S_pad: S padded to the tile).
    Blocks: `blocks` if given, else the `generation`'s (module docstring). `causal=False`: the
    full mask (the op `attention`); `window` > 0: causal within the window; `sinks` [Hq]: the
    kernel's own sink logits (one per query head; the lse includes them; see "Sinks" below)."""
    lay = _Layout(q, k, interpret, generation, blocks, causal, window)
    qg = lay.to_mqa(q * jnp.asarray(lay.scale, dtype=q.dtype))
    k, v = lay.seq_pad(k), lay.seq_pad(v)
    if sinks is not None:
        # The kernel takes one sink per query head of its MQA call (the group of one KV head).
        sinks_g = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, lay.kv_heads, lay.group), qg.shape[:3])

        def head(qh, kh, vh, sh, seg):
            out, (lse,) = lay.kernel(qh, kh, vh, segment_ids=seg, sinks=sh)
            return out, lse

        out, lse = lay.per_head(head, qg, k, v, sinks_g, ids=lay.ids(segment_ids))
    else:

        def head(qh, kh, vh, seg):
            out, (lse,) = lay.kernel(qh, kh, vh, segment_ids=seg)
            return out, lse

        out, lse = lay.per_head(head, qg, k, v, ids=lay.ids(segment_ids))
    return lay.from_mqa(out), lse.reshape(lay.batch, lay.q_heads, lay.padded).astype(jnp.float32)


def backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    interpret: bool = False,
    generation: str | None = None,
    blocks: tuple[int, int, int, int] | None = None,
    causal: bool = True,
    window: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) from the forward's residuals (out, lse) with the splash backward kernel
    alone (fused dq/dkv), without running the forward kernel again. Blocks and mask as
    `forward`'s (the same `generation` / `blocks` / `causal`: the backward reads the forward's
    kernel object).

    Padded query rows get dout = 0 (and, seeing padded v only, out = 0), so their
    `di = rowsum(dout * out)` is 0 and they add nothing; their lse is the forward's own (finite:
    each row sees at least itself). With sinks the forward's lse includes them, and that is all
    the dq / dk / dv kernels need of them (the sink's value is zero: it adds nothing to
    `rowsum(dout * out)`); `sink_backward` adds their own gradient."""
    lay = _Layout(q, k, interpret, generation, blocks, causal, window)
    qg = lay.to_mqa(q * jnp.asarray(lay.scale, dtype=q.dtype))
    k, v = lay.seq_pad(k), lay.seq_pad(v)
    og, dog = lay.to_mqa(out), lay.to_mqa(dout.astype(out.dtype))
    lseg = lse.reshape(lay.batch, lay.kv_heads, lay.group, lay.padded)
    kernel = lay.kernel
    kw = kernel.kwargs
    dq_info, dkv_info = _collapsed(kernel.dq_mask_info), _collapsed(kernel.dkv_mask_info)

    def head(qh, kh, vh, oh, lh, doh, seg):
        res = (qh, kh, vh, seg, None, oh, lh, dq_info, dkv_info)
        grads = sk._splash_attention_bwd(
            False,
            kw["mask_value"],
            kw["is_mqa"],
            kw["block_sizes"],
            kw["residual_checkpoint_name"],
            kw["mask_function"],
            kw["attn_logits_soft_cap"],
            kw["interpret"],
            res,
            doh,
        )
        return grads[3], grads[4], grads[5]

    dq, dk, dv = lay.per_head(head, qg, k, v, og, lseg, dog, ids=lay.ids(segment_ids))
    dq = lay.from_mqa(dq * jnp.asarray(lay.scale, dtype=dq.dtype))
    return dq, dk[:, :, : lay.seq], dv[:, :, : lay.seq]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q, k, v, segment_ids, interpret, generation, blocks, causal):
    return forward(q, k, v, segment_ids, interpret=interpret, generation=generation, blocks=blocks, causal=causal)[0]


def _attention_fwd(q, k, v, segment_ids, interpret, generation, blocks, causal):
    out, lse = forward(q, k, v, segment_ids, interpret=interpret, generation=generation, blocks=blocks, causal=causal)
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(interpret, generation, blocks, causal, res, dout):
    q, k, v, segment_ids, out, lse = res
    dq, dk, dv = backward(
        q, k, v, segment_ids, out, lse, dout, interpret=interpret, generation=generation, blocks=blocks, causal=causal
    )
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    interpret: bool = False,
    generation: str | None = None,
    blocks: tuple[int, int, int, int] | None = None,
    causal: bool = True,
) -> jax.Array:
    """softmax(q k^T / sqrt(D), causal [within segments]) v, or with `causal=False` every query
    against every key [of its segment]; differentiable in JAX with the residual backward
    (`forward` + `backward`); see the module docstring."""
    return _attention(q, k, v, segment_ids, interpret, generation, tuple(blocks) if blocks else None, causal)


def reference(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, causal: bool = True
) -> jax.Array:
    """Plain jnp attention in float32 with the same semantics (tests)."""
    group = q.shape[1] // k.shape[1]
    k, v = (jnp.repeat(t, group, axis=1).astype(jnp.float32) for t in (k, v))
    seq = q.shape[2]
    scores = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k) * q.shape[-1] ** -0.5
    mask = jnp.ones((seq, seq), bool)
    mask = (jnp.tril(mask) if causal else mask)[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


# --- sinks and a sliding window (the op `sink_attention`: gpt-oss, DeepSeek-V4) ----------------
#
# The softmax with a sink s_h per query head is over [scores | s_h] with the sink column dropped:
# p_ij = exp(x_ij - L_i), L_i = log(exp(s_h) + sum_j exp(x_ij)) over the visible keys j. JAX's
# splash (0.10.2) takes the sinks itself: its forward starts each row's running max at s_h and
# its running sum at 1 (exp(s_h - s_h)), so the saved lse is L_i, sink included. The backward
# needs nothing else of them: dx_ij = p_ij (dp_ij - D_i) with dp_ij = dout_i . v_j and
# D_i = sum_j p_ij dp_ij = dout_i . out_i (the sink's value is zero, so its term vanishes): the
# dq / dkv kernels on (out, L) are the plain ones. The sink's own gradient: d out_i / d s_h =
# sum_j v_j p_ij (-exp(s_h - L_i)) = -exp(s_h - L_i) out_i, so
#     dsinks_h = -sum_{b, i} exp(s_h - L_bhi) D_bhi,
# summed here in float32 over real rows (padded rows have dout = 0, so D = 0). (The kernel's own
# `_splash_attention_bwd` forms this in out's dtype, bf16 in a run, summed over S x D terms.)
# The window: `LocalMask` with `window - 1` keys back and none ahead. gpt-oss's window is a
# per-layer tensor (a layer scan runs one block's code on every layer's row), and a kernel's mask
# is static, so a traced window picks at run time (`lax.cond`) between the sliding kernel built
# for `sliding_window` and the causal one: both are in the program, one runs per layer.


def _pick(window, sliding_window: int, fn):
    """fn(static window) for a static int `window`; for a traced one (0 or `sliding_window`),
    `lax.cond` between fn(sliding_window) and fn(0)."""
    if isinstance(window, int) or not sliding_window:
        return fn(int(window) if isinstance(window, int) else 0)
    on = jnp.reshape(window, (-1,))[0] > 0
    return jax.lax.cond(on, lambda: fn(sliding_window), lambda: fn(0))


def sink_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array,
    window,
    segment_ids: jax.Array | None = None,
    *,
    sliding_window: int = 0,
    interpret: bool = False,
    generation: str | None = None,
    blocks: tuple[int, int, int, int] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(out [B, Hq, S, Dv], lse [B, Hq, S_pad] float32, sinks included) of causal attention with
    `sinks` [Hq] and a sliding window: `window` an int (0: none), or an integer array of one
    element holding 0 or `sliding_window` (chosen on the device; see "sinks" above)."""
    kw = dict(interpret=interpret, generation=generation, blocks=blocks, sinks=sinks)
    return _pick(window, sliding_window, lambda w: forward(q, k, v, segment_ids, window=w, **kw))


def sink_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array,
    window,
    segment_ids: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    sliding_window: int = 0,
    interpret: bool = False,
    generation: str | None = None,
    blocks: tuple[int, int, int, int] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv, dsinks) from `sink_forward`'s residuals: the splash backward kernel on (out,
    lse) for dq / dk / dv, and dsinks [Hq] = -sum exp(sink - lse) rowsum(dout * out) in float32."""
    kw = dict(interpret=interpret, generation=generation, blocks=blocks)
    dq, dk, dv = _pick(window, sliding_window, lambda w: backward(q, k, v, segment_ids, out, lse, dout, window=w, **kw))
    di = jnp.einsum("bhsd,bhsd->bhs", out.astype(jnp.float32), dout.astype(jnp.float32))
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse[:, :, : q.shape[2]])
    dsinks = -(p_sink * di).sum(axis=(0, 2))
    return dq, dk, dv, dsinks.astype(sinks.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _sink_attention(q, k, v, sinks, window, segment_ids, sliding_window, interpret, generation, blocks):
    kw = dict(sliding_window=sliding_window, interpret=interpret, generation=generation, blocks=blocks)
    return sink_forward(q, k, v, sinks, window, segment_ids, **kw)[0]


def _sink_attention_fwd(q, k, v, sinks, window, segment_ids, sliding_window, interpret, generation, blocks):
    kw = dict(sliding_window=sliding_window, interpret=interpret, generation=generation, blocks=blocks)
    out, lse = sink_forward(q, k, v, sinks, window, segment_ids, **kw)
    return out, (q, k, v, sinks, window, segment_ids, out, lse)


def _sink_attention_bwd(sliding_window, interpret, generation, blocks, res, dout):
    q, k, v, sinks, window, segment_ids, out, lse = res
    kw = dict(sliding_window=sliding_window, interpret=interpret, generation=generation, blocks=blocks)
    dq, dk, dv, dsinks = sink_backward(q, k, v, sinks, window, segment_ids, out, lse, dout, **kw)
    return dq, dk, dv, dsinks, None, None


_sink_attention.defvjp(_sink_attention_fwd, _sink_attention_bwd)


def splash_sink_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array,
    window,
    segment_ids: jax.Array | None = None,
    *,
    sliding_window: int = 0,
    interpret: bool = False,
    generation: str | None = None,
    blocks: tuple[int, int, int, int] | None = None,
) -> jax.Array:
    """softmax([q k^T / sqrt(D) causal [within the window] [within segments] | sinks]) v with the
    sink column dropped (the op `sink_attention`), differentiable in JAX (q, k, v, sinks) with the
    residual backward. `window`: an int, or an integer array holding 0 or `sliding_window`."""
    if isinstance(window, int):
        window, sliding_window = jnp.asarray([window], jnp.int32), window
    blocks = tuple(blocks) if blocks else None
    return _sink_attention(q, k, v, sinks, window, segment_ids, sliding_window, interpret, generation, blocks)


# --- context parallelism: local queries against the all-gathered keys --------------------------
#
# parallelisms/context_parallel.py's layout: the sequence of length s is cut into 2 cp chunks of
# c = s / (2 cp) tokens and CP rank r holds chunks r and 2 cp - 1 - r (its queries, in that
# order); the keys and values are all-gathered over cp into global order (the gather is the
# caller's: a torch functional collective, or `jax.lax.all_gather` in a shard_map). Rank r's
# early chunk (queries at r c + i) sees keys [0, r c + i] -- all within the first s / 2 -- and its
# late chunk (queries at (2 cp - 1 - r) c + i) keys [0, (2 cp - 1 - r) c + i]. Each chunk is one
# splash call with a causal mask whose query rows start at that chunk's global offset
# (`CausalMask((c, n_keys), offset)`: q + offset >= kv), against the first s / 2 keys (early) or
# all s (late). Splash skips the fully masked blocks, so a rank computes about
# (2 cp + 1) / (4 cp) of the dense [s / cp, s] product and no mask tensor exists; the offsets
# are static per rank (the kernel's block tables are built from them), so a rank's program
# holds its own two kernels (a shard_map over cp selects them by `lax.axis_index`).


@functools.lru_cache(maxsize=64)
def _offset_kernel(q_len: int, kv_len: int, offset: int, group: int, interpret: bool):
    """The MQA splash kernel for `group` query heads of one KV head, queries at global rows
    `offset .. offset + q_len` against keys `0 .. kv_len` (causal); cf. `_kernel`."""
    mask = sm.MultiHeadMask([sm.CausalMask((q_len, kv_len), offset=offset)] * group)
    bq, bkv = block_size(q_len), block_size(kv_len)
    # Separate dq and dkv backward kernels: the fused one accumulates dq unreduced over the kv
    # blocks ([kv_len / bkv, heads, q_len, d] float32, summed afterwards): at 128k tokens that is
    # 256 x a chunk's dq per head, and the compiler's temporaries for one Llama 3 8B attention
    # layer at cp 4 came to 34.7 GB of v6e's 31.2 (CompileTimeHbmOom). The split backward
    # computes the scores twice and keeps only [q_len, d] per head.
    sizes = sk.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
        use_fused_bwd_kernel=False,
    )
    with jax.ensure_compile_time_eval():
        kernel = sk.make_splash_mqa(
            mask=mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, save_residuals=True, interpret=interpret
        )
        return jax.tree_util.tree_map(np.asarray, kernel)


def _cp_chunks(q: jax.Array, k_all: jax.Array, cp_rank: int, cp_size: int):
    """[(query slice, number of keys, global offset)] of the rank's early and late chunk."""
    s_local, seq = q.shape[2], k_all.shape[2]
    assert s_local * cp_size == seq and s_local % 2 == 0, f"local {q.shape} vs gathered {k_all.shape}, cp {cp_size}"
    chunk = s_local // 2
    assert chunk % TILE == 0, f"CP splash needs chunks of a multiple of {TILE} tokens, got {chunk}"
    assert 0 <= cp_rank < cp_size
    return [
        (slice(0, chunk), seq // 2, cp_rank * chunk),
        (slice(chunk, s_local), seq, (2 * cp_size - 1 - cp_rank) * chunk),
    ]


def _per_head(fn, batch_args, q_ids, kv_ids):
    """vmap `fn(*head_args, SegmentIds | None)` over batch and KV heads (cf. `_Layout.per_head`)."""
    if q_ids is None:
        return jax.vmap(jax.vmap(lambda *a: fn(*a, None)))(*batch_args)
    inner = jax.vmap(
        lambda *a: fn(*a[:-2], sk.SegmentIds(q=a[-2], kv=a[-1])), in_axes=(*(0,) * len(batch_args), None, None)
    )
    return jax.vmap(inner)(*batch_args, q_ids, kv_ids)


def cp_forward(
    q: jax.Array,
    k_all: jax.Array,
    v_all: jax.Array,
    segment_ids: jax.Array | None = None,
    segment_ids_all: jax.Array | None = None,
    *,
    cp_rank: int,
    cp_size: int,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Rank `cp_rank`'s causal attention under CP: q [B, Hq, s/cp, D] (its two chunks, local
    order), k_all [B, Hkv, s, D] / v_all [B, Hkv, s, Dv] and `segment_ids_all` [B, s] gathered in
    global order, `segment_ids` [B, s/cp] its own -> (out [B, Hq, s/cp, Dv], lse [B, Hq, s/cp]
    float32)."""
    batch, q_heads, s_local, head_dim = q.shape
    kv_heads = k_all.shape[1]
    group = q_heads // kv_heads
    qs = (q * jnp.asarray(head_dim**-0.5, dtype=q.dtype)).reshape(batch, kv_heads, group, s_local, head_dim)
    outs, lses = [], []
    for part, n_keys, offset in _cp_chunks(q, k_all, cp_rank, cp_size):
        kernel = _offset_kernel(part.stop - part.start, n_keys, offset, group, interpret)

        def head(qh, kh, vh, seg, kernel=kernel):
            out, (lse,) = kernel(qh, kh, vh, segment_ids=seg)
            return out, lse

        q_ids = None if segment_ids is None else segment_ids[:, part].astype(jnp.int32)
        kv_ids = None if segment_ids_all is None else segment_ids_all[:, :n_keys].astype(jnp.int32)
        out, lse = _per_head(head, (qs[:, :, :, part], k_all[:, :, :n_keys], v_all[:, :, :n_keys]), q_ids, kv_ids)
        outs.append(out)
        lses.append(lse)
    out = jnp.concatenate(outs, axis=3).reshape(batch, q_heads, s_local, v_all.shape[-1])
    lse = jnp.concatenate(lses, axis=3).reshape(batch, q_heads, s_local).astype(jnp.float32)
    return out, lse


def cp_backward(
    q: jax.Array,
    k_all: jax.Array,
    v_all: jax.Array,
    segment_ids: jax.Array | None,
    segment_ids_all: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    cp_rank: int,
    cp_size: int,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq [B, Hq, s/cp, D], dk_all [B, Hkv, s, D], dv_all [B, Hkv, s, Dv]) from `cp_forward`'s residuals with the
    splash backward kernel alone; dk_all / dv_all are this rank's contributions to every key's
    gradient (the caller reduce-scatters them over cp: the all-gather's transpose)."""
    batch, q_heads, s_local, head_dim = q.shape
    kv_heads, seq = k_all.shape[1], k_all.shape[2]
    group = q_heads // kv_heads
    mqa = lambda t: t.reshape(batch, kv_heads, group, s_local, t.shape[-1])  # noqa: E731
    qs = mqa(q * jnp.asarray(head_dim**-0.5, dtype=q.dtype))
    og, dog = mqa(out), mqa(dout.astype(out.dtype))
    lseg = lse.reshape(batch, kv_heads, group, s_local)
    dqs, dks, dvs = [], [], []
    for part, n_keys, offset in _cp_chunks(q, k_all, cp_rank, cp_size):
        kernel = _offset_kernel(part.stop - part.start, n_keys, offset, group, interpret)
        kw = kernel.kwargs
        dq_info, dkv_info = _collapsed(kernel.dq_mask_info), _collapsed(kernel.dkv_mask_info)

        def head(qh, kh, vh, oh, lh, doh, seg, kw=kw, dq_info=dq_info, dkv_info=dkv_info):
            res = (qh, kh, vh, seg, None, oh, lh, dq_info, dkv_info)
            grads = sk._splash_attention_bwd(
                False,
                kw["mask_value"],
                kw["is_mqa"],
                kw["block_sizes"],
                kw["residual_checkpoint_name"],
                kw["mask_function"],
                kw["attn_logits_soft_cap"],
                kw["interpret"],
                res,
                doh,
            )
            return grads[3], grads[4], grads[5]

        q_ids = None if segment_ids is None else segment_ids[:, part].astype(jnp.int32)
        kv_ids = None if segment_ids_all is None else segment_ids_all[:, :n_keys].astype(jnp.int32)
        dq, dk, dv = _per_head(
            head,
            (
                qs[:, :, :, part],
                k_all[:, :, :n_keys],
                v_all[:, :, :n_keys],
                og[:, :, :, part],
                lseg[:, :, :, part],
                dog[:, :, :, part],
            ),
            q_ids,
            kv_ids,
        )
        dqs.append(dq)
        dks.append(dk)
        dvs.append(dv)
    dq = jnp.concatenate(dqs, axis=3).reshape(batch, q_heads, s_local, head_dim)
    dq = dq * jnp.asarray(head_dim**-0.5, dtype=dq.dtype)
    # The early chunk's keys are the first s / 2: its dk / dv add to those rows of the late
    # chunk's (all s keys), in the keys' dtype, as the reduce-scatter that follows sums them:
    # no float32 copy of the gathered sequence (the planner counts one bf16 dk, dv pair).
    half = seq // 2
    dk_all = dks[1].at[:, :, :half].add(dks[0].astype(dks[1].dtype))
    dv_all = dvs[1].at[:, :, :half].add(dvs[0].astype(dvs[1].dtype))
    return dq, dk_all.astype(k_all.dtype), dv_all.astype(v_all.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _cp_attention(q, k_all, v_all, segment_ids, segment_ids_all, cp_rank, cp_size, interpret):
    return cp_forward(
        q, k_all, v_all, segment_ids, segment_ids_all, cp_rank=cp_rank, cp_size=cp_size, interpret=interpret
    )[0]


def _cp_attention_fwd(q, k_all, v_all, segment_ids, segment_ids_all, cp_rank, cp_size, interpret):
    out, lse = cp_forward(
        q, k_all, v_all, segment_ids, segment_ids_all, cp_rank=cp_rank, cp_size=cp_size, interpret=interpret
    )
    return out, (q, k_all, v_all, segment_ids, segment_ids_all, out, lse)


def _cp_attention_bwd(cp_rank, cp_size, interpret, res, dout):
    q, k_all, v_all, segment_ids, segment_ids_all, out, lse = res
    dq, dk, dv = cp_backward(
        q,
        k_all,
        v_all,
        segment_ids,
        segment_ids_all,
        out,
        lse,
        dout,
        cp_rank=cp_rank,
        cp_size=cp_size,
        interpret=interpret,
    )
    return dq, dk, dv, None, None


_cp_attention.defvjp(_cp_attention_fwd, _cp_attention_bwd)


def splash_cp_attention(
    q: jax.Array,
    k_all: jax.Array,
    v_all: jax.Array,
    segment_ids: jax.Array | None = None,
    segment_ids_all: jax.Array | None = None,
    *,
    cp_rank: int,
    cp_size: int,
    interpret: bool = False,
) -> jax.Array:
    """`cp_forward`'s output, differentiable in JAX with the residual backward (`cp_backward`)."""
    return _cp_attention(q, k_all, v_all, segment_ids, segment_ids_all, cp_rank, cp_size, interpret)


def cp_positions(seq_len: int, cp_rank: int, cp_size: int) -> np.ndarray:
    """The global positions rank `cp_rank` holds (parallelisms/context_parallel.py `positions`)."""
    chunk = seq_len // (2 * cp_size)
    return np.concatenate([cp_rank * chunk + np.arange(chunk), (2 * cp_size - 1 - cp_rank) * chunk + np.arange(chunk)])


def cp_reference(
    q: jax.Array,
    k_all: jax.Array,
    v_all: jax.Array,
    segment_ids: jax.Array | None = None,
    segment_ids_all: jax.Array | None = None,
    *,
    cp_rank: int,
    cp_size: int,
) -> jax.Array:
    """Dense jnp attention (float32) of the rank's queries at their global positions against
    all keys, mask `key <= query` (and same segment): what `splash_cp_attention` computes
    (float32, or float64 for float64 inputs)."""
    dtype = jnp.result_type(q.dtype, jnp.float32)
    group = q.shape[1] // k_all.shape[1]
    k, v = (jnp.repeat(t, group, axis=1).astype(dtype) for t in (k_all, v_all))
    q_pos = jnp.asarray(cp_positions(k_all.shape[2], cp_rank, cp_size))
    scores = jnp.einsum("bhqd,bhkd->bhqk", q.astype(dtype), k) * q.shape[-1] ** -0.5
    mask = (jnp.arange(k_all.shape[2])[None, :] <= q_pos[:, None])[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids_all[:, None, None, :])
    scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)
