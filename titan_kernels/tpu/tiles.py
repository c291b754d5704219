"""Block sizes of the Pallas kernels per TPU generation: a table plus a rule for every other shape.

Pure Python (no jax, no torch): the kernels (`gmm.py`, `fused_ce.py`) call it at trace time with
static shapes, `scripts/bench/sweep_kernel_tiles.py` enumerates and filters candidates with it, and
the CPU tests read it directly.

Hardware per generation (`GENERATIONS`): VMEM per TensorCore and MXU width from JAX 0.10.2's
`jax/_src/pallas/mosaic/tpu_info.py` (v4 16 MiB / 128, v5e 128 MiB / 128, v5p 64 MiB / 128,
v6e 128 MiB / 256, TPU7x 64 MiB / 256); the compiler's default *scoped* VMEM limit, which is
what a kernel that does not raise it (megablox) may use, from deviceless compiles with the
runtime libtpu 0.0.52: 16 MiB on v4, v5e, v5p (a 28 MiB gmm working set fails with
`CompileTimeScopedVmemOom`, v4: "Used 30.95M of 16.00M vmem"), 32 MiB on v6e and TPU7x (28 MiB
compiles, 64 MiB does not).

The table (`tiles.toml` next to this file, written by the sweep script) maps kernel ->
generation -> shape class -> tiles, with a `default` entry per generation:
- `gmm`: shape class `"KxN"` (the expert weight; rows vary with the batch), tiles
  `[tm, tk, tn]`;
- `fused_ce`: shape class `"d<dim>"` (the hidden size; rows and vocab vary), blocks
  `[block_n, block_v]`;
- `splash`: shape class `"s<seq>d<head_dim>"` (the padded sequence and the q/k head width),
  blocks `[block_q, block_kv, block_q_dkv, block_kv_dkv]` (forward; fused backward), each block
  also its compute block (`splash_blocks`).
The rule for any shape (a table entry or the generation's default, then fitted):
1. each tile is cut to the dimension (`fit`): the whole dimension when the tile covers it,
   else the largest of tile, tile/2, ... (>= 128) that divides it;
2. tiles halve until the working-set estimate fits the VMEM limit (gmm: `BUDGET_FRACTION` of
   the default scoped limit, tk first, which costs no reuse, then tn; the estimate undercounts
   the compiler by ~10 %: 28 MiB estimated, 31 MiB used on v4. The loss: half its raised
   limit, the vocab block down to the MXU width, then the row block, then the vocab block);
3. gmm's row tile: of the default's tm, tm/2, ..., 128 the one with the lowest roofline time
   (`gmm_cost`): a larger tm reads each expert weight fewer times, but a tile straddling a
   group boundary is computed once per group, so many small groups favour a smaller tm.
   An entry for the exact shape class (a sweep measured it) is taken as is (rules 1-2 only).
An unknown generation (None) gets the most conservative facts (v4's 16 MiB, 128-wide MXU).

Why the defaults (before a sweep on a TPU measures them): megablox reads each active row
tile's whole K x N weight and the rows once per column tile, so its FLOPs per byte are about
1 / (1/tm + 1/tn + 1/K): 98 at today's (128, -, 512) and K 2048, 293 at (512, -, 1024), 341 at
tn 2048 (ridge points: v5e ~240, v6e ~560, TPU7x ~310 FLOP/B). So tm 512 and tn as large as the
scoped VMEM allows: 1024 on the 16 MiB generations, 2048 on v6e / TPU7x. The loss reads the
whole vocabulary once per row block: its intensity is about block_n, so the row block is 512
and the vocabulary block shrinks first; its kernels raise their VMEM limit (`ce_vmem_limit`).
"""

from __future__ import annotations

import dataclasses
import functools
import os

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

TABLE = Path(__file__).with_name("tiles.toml")
MiB = 2**20
BUDGET_FRACTION = 0.8
MIN_TILE = 128


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str
    vmem_bytes: int
    """VMEM per TensorCore (tpu_info.py)."""
    scoped_vmem_bytes: int
    """The compiler's default scoped VMEM limit (deviceless compiles, libtpu 0.0.52)."""
    mxu: int
    """MXU width (tpu_info.py `mxu_column_size`)."""
    ridge: float
    """Peak dense bf16 FLOP/s over HBM bytes/s per device (public specs: v4 275 T / 1.2 TB/s,
    v5e 197 / 0.82, v5p 459 / 2.76, v6e 918 / 1.64, TPU7x 1153.5 / 3.69 per TensorCore)."""
    device_kind: str
    """JAX's device kind, and the compile-only topology the sweep and tests compile for."""
    topology: str


GENERATIONS = {
    "v4": Generation("v4", 16 * MiB, 16 * MiB, 128, 229.0, "TPU v4", "v4:2x2x1"),
    "v5e": Generation("v5e", 128 * MiB, 16 * MiB, 128, 240.0, "TPU v5 lite", "v5e:2x2"),
    "v5p": Generation("v5p", 64 * MiB, 16 * MiB, 128, 166.0, "TPU v5", "v5p:2x2x1"),
    "v6e": Generation("v6e", 128 * MiB, 32 * MiB, 256, 560.0, "TPU v6 lite", "v6e:2x2"),
    "v7x": Generation("v7x", 64 * MiB, 32 * MiB, 256, 313.0, "TPU7x", "tpu7x:2x2x1"),
}
UNKNOWN = Generation("unknown", 16 * MiB, 16 * MiB, 128, 240.0, "", "")
"""What an unrecognised generation is assumed to have: the smallest of each."""


def generation_of(kind: str | None) -> str | None:
    """A key of GENERATIONS for a device kind ("TPU v5 lite", "TPU7x") or accelerator type
    ("v5litepod-16", "v6e-8", "tpu7x-64"), else None. The product's one mapping: the trainer's
    peak table (`trainer.runtime.flops.tpu_generation`) and flag bundles read it too."""
    if not kind:
        return None
    s = kind.lower().replace("_", " ").replace("-", " ").strip().removeprefix("tpu").strip()
    if s.startswith(("7", "v7")) or "ironwood" in s:
        return "v7x"
    if s.startswith("v6") or "trillium" in s:
        return "v6e"
    if s.startswith("v5"):
        return "v5e" if ("lite" in s or s.startswith("v5e")) else "v5p"
    if s.startswith("v4"):
        return "v4"
    return None


def detect_generation(*kinds: str | None) -> str | None:
    """The first of `kinds` (e.g. torch-tpu's device name) or of the accelerator-type variables
    (GKE's TPU_ACCELERATOR_TYPE, TPU VMs' ACCELERATOR_TYPE) that names a generation."""
    for kind in (*kinds, os.environ.get("TPU_ACCELERATOR_TYPE"), os.environ.get("ACCELERATOR_TYPE")):
        gen = generation_of(kind)
        if gen:
            return gen
    return None


def hardware(generation: str | None) -> Generation:
    return GENERATIONS.get(generation or "", UNKNOWN)


@functools.lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict:
    """The tile table {kernel: {generation: {shape class: [tiles]}}} (TABLE unless `path`)."""
    with open(path or TABLE, "rb") as f:
        table = tomllib.load(f)
    check_table(table)
    return table


def check_table(table: dict) -> None:
    """ValueError naming the entry unless every entry is a list of positive multiples of 8 of
    the kernel's arity and every generation has a default."""
    arity = {"gmm": 3, "fused_ce": 2, "splash": 4}
    for kernel, n in arity.items():
        for gen, entries in table.get(kernel, {}).items():
            if gen not in GENERATIONS and gen != "unknown":
                raise ValueError(f"{kernel}.{gen}: unknown generation; allowed: {', '.join(GENERATIONS)}, unknown")
            if "default" not in entries:
                raise ValueError(f"{kernel}.{gen}: no default entry")
            for shape, tiles in entries.items():
                if not (
                    isinstance(tiles, list)
                    and len(tiles) == n
                    and all(isinstance(t, int) and t > 0 and t % 8 == 0 for t in tiles)
                ):
                    raise ValueError(f"{kernel}.{gen}.{shape}: {tiles!r}; allowed: {n} positive multiples of 8")


def _entry(kernel: str, generation: str | None, shape: str, table: dict | None) -> list[int]:
    entries = (table or load_table()).get(kernel, {})
    per_gen = entries.get(generation or "unknown") or entries["unknown"]
    return list(per_gen.get(shape, per_gen["default"]))


def _listed(kernel: str, generation: str | None, shape: str, table: dict | None) -> bool:
    """Whether the table has an entry for exactly this shape class (a measured one)."""
    entries = (table or load_table()).get(kernel, {})
    return shape in (entries.get(generation or "unknown") or {})


SPLASH_TILE = 128
"""Sequence tile of the splash kernels (splash.TILE); lengths are padded to a multiple of it."""


def splash_block_size(seq_len: int) -> int:
    """Largest of 512, 256, 128 that divides the (padded) sequence length: the blocks of the CP
    splash (splash.block_size) and of the splash cost model (capture.py)."""
    for block in (512, 256, SPLASH_TILE):
        if seq_len % block == 0:
            return block
    raise AssertionError(f"sequence length {seq_len} is not a multiple of {SPLASH_TILE}")


def fit(tile: int, dim: int) -> int:
    """Rule 1: `dim` itself when the tile covers it (one block); else the largest of tile,
    tile/2, ... (>= MIN_TILE) that divides `dim`; else the tile (megablox masks the irregular
    last tile)."""
    if dim <= tile:
        return dim
    t = tile
    while t >= MIN_TILE:
        if dim % t == 0:
            return t
        t //= 2
    return tile


def gmm_vmem_bytes(tm: int, tk: int, tn: int, itemsize: int = 2) -> int:
    """Working set of the largest of megablox's kernels (gmm forward and dx; tgmm for dw):
    double-buffered input tiles and output tile plus the float32 accumulator."""
    forward = 2 * itemsize * (tm * tk + tk * tn) + 2 * itemsize * tm * tn + 4 * tm * tn
    tgmm = 2 * itemsize * (tk * tm + tm * tn) + 2 * itemsize * tk * tn + 4 * tk * tn
    return max(forward, tgmm)


def gmm_cost(tm: int, tk: int, tn: int, m: int, k: int, groups: int, ridge: float) -> float:
    """Roofline time of megablox's forward in units of 2 m k n / HBM bandwidth (a model, for
    ranking tiles). Active row tiles ~ m / tm + groups (a tile straddling a group boundary is
    visited once per group, computing all tm rows); each reads its group's whole K x N weight;
    the rows are read once per column tile. So FLOPs grow by (1 + groups tm / m) and bytes per
    useful FLOP are (1/tm + groups/m) + 1/tn + 1/K."""
    del tk  # pipelining only; no effect on traffic in this model
    compute = (1 + groups * tm / m) / ridge
    memory = 1 / tm + groups / m + 1 / tn + 1 / k
    return max(compute, memory)


def gmm_kn_tiles(
    generation: str | None, tm: int, k: int, n: int, *, itemsize: int = 2, table: dict | None = None
) -> tuple[int, int]:
    """(tk, tn) for a megablox call with row tile `tm` (rules 1 and 2)."""
    _, tk, tn = _entry("gmm", generation, f"{k}x{n}", table)
    tk, tn = fit(tk, k), fit(tn, n)
    budget = BUDGET_FRACTION * hardware(generation).scoped_vmem_bytes
    while gmm_vmem_bytes(tm, tk, tn, itemsize) > budget:
        if tk > MIN_TILE and tk % 2 == 0 and k % (tk // 2) == 0:
            tk //= 2
        elif tn > MIN_TILE and tn % 2 == 0 and n % (tn // 2) == 0:
            tn //= 2
        else:
            break
    return tk, tn


def gmm_tiles(
    generation: str | None, m: int, k: int, n: int, groups: int, *, itemsize: int = 2, table: dict | None = None
) -> tuple[int, int, int]:
    """(tm, tk, tn) for megablox at rows m, weight [groups, k, n] (module docstring's rule)."""
    tm0 = _entry("gmm", generation, f"{k}x{n}", table)[0]
    hw = hardware(generation)
    budget = BUDGET_FRACTION * hw.scoped_vmem_bytes
    if _listed("gmm", generation, f"{k}x{n}", table):  # measured for this shape: taken as is
        tm = min(tm0, -(-m // 8) * 8)
        return (tm, *gmm_kn_tiles(generation, tm, k, n, itemsize=itemsize, table=table))
    candidates, tm = [], min(tm0, -(-m // 8) * 8)
    while True:
        tk, tn = gmm_kn_tiles(generation, tm, k, n, itemsize=itemsize, table=table)
        candidates.append((tm, tk, tn))
        if tm <= MIN_TILE:
            break
        tm //= 2
    fitting = [c for c in candidates if gmm_vmem_bytes(*c, itemsize) <= budget] or candidates[-1:]
    return min(fitting, key=lambda c: (round(gmm_cost(*c, max(m, 1), k, groups, hw.ridge), 9), -c[0]))


def ce_vmem_limit(generation: str | None) -> int:
    """The scoped VMEM limit the loss' kernels ask for: half the VMEM on 128 MiB generations
    (64 MiB), three quarters on 64 MiB ones (48 MiB), all of v4's 16 MiB (what its compiler
    allows; a unknown generation gets the same)."""
    vmem = hardware(generation).vmem_bytes
    if vmem >= 128 * MiB:
        return vmem // 2
    if vmem >= 64 * MiB:
        return vmem * 3 // 4
    return vmem


def ce_vmem_bytes(bn: int, bv: int, dim: int, itemsize: int = 2) -> int:
    """Working set of the largest of the loss' three kernels: double-buffered h and w tiles, a
    float32 accumulator and a double-buffered output tile of the larger block, float32 logits
    temporaries."""
    big = max(bn, bv)
    return 2 * itemsize * (bn + bv) * dim + 4 * big * dim + 2 * itemsize * big * dim + 3 * 4 * bn * bv


def ce_blocks(
    generation: str | None, n: int, vocab: int, dim: int, *, itemsize: int = 2, table: dict | None = None
) -> tuple[int, int]:
    """(block_n, block_v) of the fused loss at rows n, vocabulary `vocab`, hidden `dim`."""
    bn, bv = _entry("fused_ce", generation, f"d{dim}", table)
    bn = min(bn, -(-n // 8) * 8)
    bv = min(bv, -(-vocab // 128) * 128)
    mxu = hardware(generation).mxu
    budget = BUDGET_FRACTION * ce_vmem_limit(generation)
    while ce_vmem_bytes(bn, bv, dim, itemsize) > budget:
        if bv > max(mxu, MIN_TILE):
            bv //= 2
        elif bn > MIN_TILE:
            bn = max(MIN_TILE, bn // 2)
        elif bv > MIN_TILE:
            bv //= 2
        else:
            break
    return bn, bv


def splash_blocks(
    generation: str | None, seq_len: int, head_dim: int, *, table: dict | None = None
) -> tuple[int, int, int, int]:
    """(block_q, block_kv, block_q_dkv, block_kv_dkv) of the splash kernel at a (padded) sequence
    length and q/k head width: the table's entry for `"s<seq>d<head_dim>"` (else the generation's
    default), each block the largest of block, block/2, ... (>= MIN_TILE) that divides the
    sequence (a multiple of MIN_TILE: the kernel pads to it). The default [512] * 4 gives the
    kernels' rule from before the table had splash: the largest of 512, 256, 128 dividing it."""
    if seq_len % MIN_TILE:
        raise ValueError(f"splash: sequence length {seq_len} is not a multiple of {MIN_TILE}")
    entries = (table or load_table()).get("splash")
    blocks = _entry("splash", generation, f"s{seq_len}d{head_dim}", table) if entries else [512] * 4
    out = []
    for b in blocks:
        while b > MIN_TILE and seq_len % b:
            b //= 2
        out.append(b)
    return tuple(out)
