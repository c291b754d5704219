"""Grouped matmul (Pallas megablox, TPU) for the op `grouped_mm`, group sizes a device array.

Pure JAX: `grouped_mm(x, w, group_sizes)` with x [M, K] rows sorted by group, w [G, K, N]
(or, with `transpose_rhs`, [G, N, K]: the MoE expert weights' own nn.Linear layout, so no
transpose is materialised) and group_sizes [G] int32 -> [M, N] in x.dtype.

`group_sizes` is an ordinary traced array: megablox builds its tile schedule from it on the
device (`make_group_metadata`), so one compiled program serves every routing pattern. Nothing
is copied to the host and nothing is cached per pattern (the TorchTitan TPU fork's wrapper
does both: `tuple(group_sizes.cpu().tolist())` keys its kernel cache).

Tiles: megablox needs M a multiple of the row tile; rows are padded with zeros at the end (they
belong to no group, and are sliced off). K and N tiles are the largest of 512/256/128 that
divide them, else the whole dimension. The backward is megablox's: gmm for dx, tgmm for dw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

ROW_TILE = 128


def _tile(size: int) -> int:
    for tile in (512, 256, 128):
        if size % tile == 0:
            return tile
    return size


def grouped_mm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
               interpret: bool = False) -> jax.Array:
    """Rows of group g times w[g] (w[g]^T with `transpose_rhs`); see the module docstring."""
    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    tm = min(ROW_TILE, -(-m // 8) * 8)
    pad = (-m) % tm
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
    out = megablox.gmm(x, w, group_sizes.astype(jnp.int32), x.dtype, (tm, _tile(k), _tile(n)),
                       None, None, transpose_rhs, interpret)
    return out[:m] if pad else out


def reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False) -> jax.Array:
    """Per-row weight gather in float32 (tests): row r uses w[group of r]."""
    if transpose_rhs:
        w = jnp.swapaxes(w, 1, 2)
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")
    return jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), w.astype(jnp.float32)[group])
