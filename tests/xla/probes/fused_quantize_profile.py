"""Experiment (not a product path): does quantizing in a float8 matmul's prologue pay on TPU7x?

    python fused_quantize_profile.py [--m 2048 --n 2048 --k 4096] [--tiles 1024,1024,1024]   (ttpu venv)

The projection's "fused" column (scripts/bench/low_precision_projection.py) assumed a kernel that
quantizes its bf16 operands inside the matmul would cost nothing beyond the float8 matmul. This
probe builds that kernel in Pallas and asks libtpu 0.0.52's static LLO profile
(`--xla_jf_dump_static_llo_profile_to`, the estimated cycles per compiled op; the estimate
scripts/bench/sweep_kernel_tiles.py uses) what one [m, k] x [n, k]^T float8_rowwise matmul costs
on TPU7x, beside XLA's bf16 and float8 dots on the same shape:

- `xla_bf16`: XLA's bf16 dot (bf16 out);
- `xla_f8`: XLA's float8 dot on operands already in float8 (f32 accumulation, bf16 out);
- `xla_quantize`: XLA quantizing one [m, k] bf16 operand rowwise (amax, power-of-two scale,
  clamp, cast to float8): what the unfused path runs per operand before its dot;
- `pallas_bf16`, `pallas_f8`, `pallas_fused`: one Pallas kernel with the given tiles, grid
  (m / tm, n / tn, k / tk), float32 accumulator in VMEM: bf16 operands multiplied as they are;
  float8 operands as they are; bf16 operands quantized in VMEM in the prologue of every step
  (divided by their row's scale, clamped, cast; the scales multiply the accumulator at the end).

The unfused XLA path itself (quantize + float8 dot in one program) cannot be profiled with this
libtpu: the profiler stops on the quantization fusion's "dma-general" DMA (`Unsupported DMA
direction for latency modeling`), and on a direct f32 -> float8 cast inside a Mosaic kernel (an
LLO type check: "Expected vector-int16, got vector-f8packed"), which the kernel here avoids by
casting through bf16 (exact for power-of-two scales of bf16 values). Prints one JSON line;
docs/low_precision.md ("A fused quantize-in-prologue kernel, measured by the compiler") has the
result of 2026-12-06.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
from pathlib import Path

PROFILE = Path(tempfile.mkdtemp())
os.environ["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_static_llo_profile_to={PROFILE}"
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "titan_kernels" / "tpu"))
import qmatmul  # noqa: E402
import tiles  # noqa: E402

ROW = ("e4m3", "axis", True)
F8 = jnp.float8_e4m3fn
NT = (((1,), (1,)), ((), ()))


def cycles() -> int:
    """Estimated cycles of the programs compiled since the last call (the files are removed)."""
    total = 0
    for f in PROFILE.glob("*.textproto"):
        for _, c, same in re.findall(
            r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)(?:\s+num_equivalent_hlos: (\d+))?', f.read_text()
        ):
            total += int(c) * int(same or 1)
        f.unlink()
    return total


def _prologue(t, s, mode: str):
    if mode != "fused":
        return t
    v = jnp.clip(t.astype(jnp.float32) * (1.0 / s), -448.0, 448.0)
    return v.astype(jnp.bfloat16).astype(F8)  # exact: a bf16 value times a power of two


def _kernel(sa_ref, sb_ref, sb_row_ref, a_ref, b_ref, o_ref, acc_ref, *, mode: str, nk: int):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    qa, qb = _prologue(a_ref[...], sa_ref[...], mode), _prologue(b_ref[...], sb_ref[...], mode)
    acc_ref[...] += lax.dot_general(qa, qb, NT, preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == nk - 1)
    def _out():
        o_ref[...] = (acc_ref[...] * sa_ref[...] * sb_row_ref[...]).astype(o_ref.dtype)


def pallas_matmul(a, b, sa, sb, *, mode: str, tm: int, tn: int, tk: int):
    m, k = a.shape
    n = b.shape[0]
    return pl.pallas_call(
        functools.partial(_kernel, mode=mode, nk=k // tk),
        grid=(m // tm, n // tn, k // tk),
        in_specs=[
            pl.BlockSpec((tm, 1), lambda i, j, kk: (i, 0)),
            pl.BlockSpec((tn, 1), lambda i, j, kk: (j, 0)),
            pl.BlockSpec((1, tn), lambda i, j, kk: (0, j)),  # b's scales as a row, for the epilogue
            pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((tn, tk), lambda i, j, kk: (j, kk)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(sa, sb, sb.reshape(1, n), a, b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--tiles", default="1024,1024,1024", help="tm,tn,tk of the Pallas kernels")
    args = p.parse_args()
    tm, tn, tk = map(int, args.tiles.split(","))
    m, n, k = args.m, args.n, args.k
    device = topologies.get_topology_desc(topology_name=tiles.GENERATIONS["v7x"].topology, platform="tpu").devices[0]
    sh = jax.sharding.SingleDeviceSharding(device)

    def S(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    a, b = S((m, k), jnp.bfloat16), S((n, k), jnp.bfloat16)
    sa, sb = S((m, 1), jnp.float32), S((n, 1), jnp.float32)
    variants = {
        "xla_bf16": (lambda a, b: lax.dot_general(a, b, NT, preferred_element_type=jnp.bfloat16), (a, b)),
        "xla_f8": (
            lambda a, b: lax.dot_general(a, b, NT, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
            (S((m, k), F8), S((n, k), F8)),
        ),
        "xla_quantize": (lambda a: qmatmul.quantize(a, ROW), (a,)),
        "pallas_bf16": (functools.partial(pallas_matmul, mode="bf16", tm=tm, tn=tn, tk=tk), (a, b, sa, sb)),
        "pallas_f8": (
            functools.partial(pallas_matmul, mode="f8", tm=tm, tn=tn, tk=tk),
            (S((m, k), F8), S((n, k), F8), sa, sb),
        ),
        "pallas_fused": (functools.partial(pallas_matmul, mode="fused", tm=tm, tn=tn, tk=tk), (a, b, sa, sb)),
    }
    out = {"shape": [m, n, k], "tiles": [tm, tn, tk], "cycles": {}}
    for name, (fn, fn_args) in variants.items():
        cycles()
        try:
            jax.jit(fn).lower(*fn_args).compile()
            out["cycles"][name] = cycles()
        except Exception as e:  # a tile set that does not fit VMEM
            out["cycles"][name] = f"{type(e).__name__}: {str(e)[:300]}"
    import importlib.metadata as md

    out["versions"] = {p: md.version(p) for p in ("jax", "libtpu")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
