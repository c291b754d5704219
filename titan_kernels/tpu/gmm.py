"""Grouped matmul (Pallas megablox, TPU) for the op `grouped_mm`, group sizes a device array.

Pure JAX: `grouped_mm(x, w, group_sizes)` with x [M, K] rows sorted by group, w [G, K, N]
(or, with `transpose_rhs`, [G, N, K]: the MoE expert weights' own nn.Linear layout, so no
transpose is materialised) and group_sizes [G] int32 -> [M, N] in x.dtype.

`group_sizes` is an ordinary traced array: megablox builds its tile schedule from it on the
device (`make_group_metadata`), so one compiled program serves every routing pattern. Nothing
is copied to the host and nothing is cached per pattern (the TorchTitan TPU fork's wrapper
does both: `tuple(group_sizes.cpu().tolist())` keys its kernel cache).

Tiles per TPU generation (`generation`, a key of `tiles.GENERATIONS` or None) from `tiles.py`:
the row tile from the table and a roofline model of this shape, fixed for the forward and both
backward kernels; each megablox call then asks `GmmTiling` for its own K and N tiles (the dx
gmm has K and N swapped), fitted to the dimensions and to the generation's scoped VMEM.
megablox needs M a multiple of the row tile; rows are padded with zeros at the end (they belong
to no group, and are sliced off). The backward is megablox's: gmm for dx, tgmm for dw.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

try:  # a package import (titan_kernels.tpu.gmm) or a plain module next to tiles.py (the probes)
    from titan_kernels.tpu import tiles
except ImportError:  # pragma: no cover - the XLA-tier probes put titan_kernels/tpu on sys.path
    import tiles


@dataclasses.dataclass(frozen=True)
class GmmTiling:
    """megablox's tiling look-up `(m, k, n) -> (tm, tk, tn)`: the row tile is fixed (rows are
    padded to it), K and N tiles fitted per call (hashable: megablox keys its VJP on it)."""

    generation: str | None
    tm: int
    itemsize: int

    def __call__(self, m: int, k: int, n: int) -> tuple[int, int, int]:
        del m
        return (self.tm, *tiles.gmm_kn_tiles(self.generation, self.tm, k, n, itemsize=self.itemsize))


def grouped_mm(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    generation: str | None = None,
    tiling: tuple[int, int, int] | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Rows of group g times w[g] (w[g]^T with `transpose_rhs`); see the module docstring.
    `tiling`: explicit (tm, tk, tn) for every call, forward and backward (the tile sweep);
    default: the generation's (tiles.py)."""
    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    if tiling is None:
        tm = tiles.gmm_tiles(generation, m, k, n, w.shape[0], itemsize=x.dtype.itemsize)[0]
        lut = GmmTiling(generation, tm, x.dtype.itemsize)
    else:
        tm, lut = tiling[0], tuple(tiling)
    pad = (-m) % tm
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
    out = megablox.gmm(x, w, group_sizes.astype(jnp.int32), x.dtype, lut, None, None, transpose_rhs, interpret)
    return out[:m] if pad else out


def reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False) -> jax.Array:
    """Per-row weight gather in float32 (tests): row r uses w[group of r]."""
    if transpose_rhs:
        w = jnp.swapaxes(w, 1, 2)
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")
    return jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), w.astype(jnp.float32)[group])
