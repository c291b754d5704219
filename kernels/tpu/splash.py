"""Splash attention (Pallas, TPU) for the op `causal_attention`: causal, GQA, document masking.

Pure JAX: `splash_attention(q, k, v, segment_ids=None)` takes the op's layout (q [B, Hq, S, D],
k/v [B, Hkv, S, D], segment_ids [B, S] or None) and returns [B, Hq, S, D]. It wraps JAX's
`splash_attention` kernel:
- GQA without repeating K/V: the kernel's MQA form runs the `Hq / Hkv` query heads of one KV
  head against that head's K/V, vmapped over batch and KV heads.
- Document masking: `segment_ids` become the kernel's `SegmentIds` (q and kv ids are the same
  row for self-attention); a token attends to earlier tokens of its own segment. (torch-tpu's
  `splash_sdpa` and the TorchTitan TPU fork have no segment ids.)
- Odd lengths: the sequence is padded at the end to a multiple of 128 (the kernel's tile) and
  the padding sliced off; with a causal mask no real query sees a padded key.
- Scale 1/sqrt(D) is applied to q in q's dtype (no float32 promotion of q).
Forward and backward (`jax.vjp`) come from the kernel's custom VJP (fused dq/dkv kernel).
`interpret=True` runs the same kernel in Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

TILE = 128
"""Sequence tile of the kernel; lengths are padded to a multiple of it."""


def block_size(seq_len: int) -> int:
    """Largest of 512, 256, 128 that divides the (padded) sequence length."""
    for block in (512, 256, TILE):
        if seq_len % block == 0:
            return block
    raise AssertionError(f"sequence length {seq_len} is not a multiple of {TILE}")


@functools.lru_cache(maxsize=64)
def _kernel(seq_len: int, group: int, block: int, interpret: bool):
    """The MQA splash kernel for `group` query heads sharing one KV head (built once per shape)."""
    mask = sm.MultiHeadMask([sm.CausalMask((seq_len, seq_len))] * group)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          use_fused_bwd_kernel=True)
    # Built on first use, usually inside a trace: without compile-time evaluation the kernel's
    # mask tables (jnp arrays) would be tracers of that trace, and this cache would leak them
    # into the next one. As numpy arrays they are plain literals of every program that uses
    # them (`jax.export`, which torch-tpu's jax_op runs, cannot take hoisted jax constants).
    with jax.ensure_compile_time_eval():
        kernel = sk.make_splash_mqa(mask=mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=interpret)
        return jax.tree_util.tree_map(np.asarray, kernel)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
                     *, interpret: bool = False) -> jax.Array:
    """softmax(q k^T / sqrt(D), causal [within segments]) v; see the module docstring."""
    batch, q_heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    assert q_heads % kv_heads == 0, f"q heads {q_heads} not a multiple of kv heads {kv_heads}"
    group = q_heads // kv_heads
    pad = (-seq) % TILE
    q = q * jnp.asarray(head_dim ** -0.5, dtype=q.dtype)
    if pad:
        widths = ((0, 0), (0, 0), (0, pad), (0, 0))
        q, k, v = (jnp.pad(t, widths) for t in (q, k, v))
    padded = seq + pad
    kernel = _kernel(padded, group, block_size(padded), interpret)
    q = q.reshape(batch, kv_heads, group, padded, head_dim)
    if segment_ids is None:
        per_head = lambda qg, kh, vh: kernel(qg, kh, vh)  # noqa: E731
        out = jax.vmap(jax.vmap(per_head))(q, k, v)
    else:
        ids = segment_ids.astype(jnp.int32)
        if pad:  # padded tokens get their own segment; causality already hides them
            ids = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
        per_head = lambda qg, kh, vh, s: kernel(qg, kh, vh, segment_ids=sk.SegmentIds(q=s, kv=s))  # noqa: E731
        out = jax.vmap(jax.vmap(per_head, in_axes=(0, 0, 0, None)))(q, k, v, ids)
    return out.reshape(batch, q_heads, padded, head_dim)[:, :, :seq]


def reference(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Plain jnp attention in float32 with the same semantics (tests)."""
    group = q.shape[1] // k.shape[1]
    k, v = (jnp.repeat(t, group, axis=1).astype(jnp.float32) for t in (k, v))
    seq = q.shape[2]
    scores = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k) * q.shape[-1] ** -0.5
    mask = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)
