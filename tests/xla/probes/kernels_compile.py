"""Probe (ttpu or tpuc venv): compile the Pallas kernels of titan_kernels/tpu for each TPU generation without a TPU.

    python kernels_compile.py [--cases small|recipe] [--csv FILE] GEN [GEN ...]   GEN: v4 v5e v5p v6e v7x

For device 0 of each generation's compile-only topology (`jax.experimental.topologies`, from
the venv's libtpu: 0.0.52 in ttpu, the one torch-tpu 0.2.0 runs; 0.0.42.1 in tpuc) it lowers
and compiles, with Mosaic (interpret=False), bf16, each case with that generation's tiles
(titan_kernels/tpu/tiles.py, passed as `generation=`):
- small (the test): splash fwd+bwd (GQA 8/2 heads, seq 1000 padded to 1024, head_dim 128,
  segment ids) and its backward alone from saved (out, lse); gmm fwd+bwd (8 groups, M 1000,
  K 512, N 256, nn.Linear layout); fused CE fwd+bwd at N 1000, D 256, vocab 5000 and at
  Llama 3 8B's head (N 8192, D 4096, vocab 128256);
- recipe (docs/results/kernel_compiles_2026-12-03_0b0ac9d.csv): splash at Llama 3 8B (32/8 heads, seq 8192) and
  its backward alone; gmm at Qwen3-30B-A3B's experts (65,536 token copies, 128 experts,
  2048 -> 768 and 768 -> 2048) and Qwen3-235B-A22B's (4096 -> 1536, 1536 -> 4096); fused CE at
  Llama 3 8B's and 70B's heads (D 4096 / 8192, vocab 128256) and Qwen 3 32B's (D 5120, vocab 151936).
Group sizes and segment ids are runtime arrays, so a compile that succeeds serves every routing.
A compile that runs out of VMEM is recorded with the compiler's "Used X of Y" numbers.
Mosaic calls are counted in the compiled program's HLO text; where jaxlib 0.10.2 cannot print
a module libtpu 0.0.52 compiled (gmm on v5p, v6e, TPU7x: "RET_CHECK failure ... async-update
instruction should have 1 operands but sees 4", raised by `as_text()` after the compile
succeeded), they are counted in the lowered StableHLO instead (`counted_in`).
It also exports each small case for platform "tpu" with no device (`jax.export`), as torch-tpu's
`jax_op` does at registration. Prints one JSON line: {"versions", "devices": {gen: kind},
"compiles": {"case@gen": {"compile_s", "mosaic_calls", "tiles", "est_vmem_mib", "limit_mib"} or
{"error", "vmem_used_mib"?}}, "exports": {case: {"ok", "error"?}}}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

# Compile-only use of libtpu touches no TPU, so let it load next to other probes (libtpu's
# multi-process lockfile otherwise aborts the second process: "libtpu multi-process lockfile").
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

# The kernels are pure JAX modules; import them directly (the `kernels` package imports torch,
# which the tpuc venv does not have).
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "titan_kernels" / "tpu"))
import fused_ce  # noqa: E402
import gmm  # noqa: E402
import splash  # noqa: E402
import tiles  # noqa: E402

BF16 = jnp.bfloat16
S = jax.ShapeDtypeStruct


def _splash(b, hq, hkv, s, d, gen):
    def step(q, k, v, seg, do):
        out, vjp = jax.vjp(lambda q, k, v: splash.splash_attention(q, k, v, seg), q, k, v)
        return out, vjp(do)

    avals = [
        S((b, hq, s, d), BF16),
        S((b, hkv, s, d), BF16),
        S((b, hkv, s, d), BF16),
        S((b, s), jnp.int32),
        S((b, hq, s, d), BF16),
    ]
    return step, avals, f"b{b} hq{hq} hkv{hkv} s{s} d{d}", f"block {splash.block_size(-(-s // 128) * 128)}", None


def _splash_bwd(b, hq, hkv, s, d, gen):
    padded = -(-s // 128) * 128

    def bwd(q, k, v, seg, out, lse, do):
        return splash.backward(q, k, v, seg, out, lse, do)

    avals = [
        S((b, hq, s, d), BF16),
        S((b, hkv, s, d), BF16),
        S((b, hkv, s, d), BF16),
        S((b, s), jnp.int32),
        S((b, hq, s, d), BF16),
        S((b, hq, padded), jnp.float32),
        S((b, hq, s, d), BF16),
    ]
    return bwd, avals, f"b{b} hq{hq} hkv{hkv} s{s} d{d}, backward op alone", f"block {splash.block_size(padded)}", None


def _gmm(m, k, n, groups, gen):
    def step(x, w, sizes, dy):
        out, vjp = jax.vjp(lambda x, w: gmm.grouped_mm(x, w, sizes, transpose_rhs=True, generation=gen), x, w)
        return out, vjp(dy)

    tm, tk, tn = tiles.gmm_tiles(gen, m, k, n, groups)
    avals = [S((m, k), BF16), S((groups, n, k), BF16), S((groups,), jnp.int32), S((m, n), BF16)]
    est = max(tiles.gmm_vmem_bytes(tm, tk, tn), tiles.gmm_vmem_bytes(tm, *tiles.gmm_kn_tiles(gen, tm, n, k)))
    return (
        step,
        avals,
        f"m{m} k{k} n{n} groups{groups}",
        f"tm {tm} tk {tk} tn {tn}",
        (est, tiles.hardware(gen).scoped_vmem_bytes),
    )


def _ce(n, d, vocab, gen):
    def step(h, w, labels):
        return jax.value_and_grad(
            lambda h, w: fused_ce.linear_cross_entropy(h, w, labels, generation=gen), argnums=(0, 1)
        )(h, w)

    bn, bv = tiles.ce_blocks(gen, n, vocab, d)
    avals = [S((n, d), BF16), S((vocab, d), BF16), S((n,), jnp.int32)]
    return (
        step,
        avals,
        f"n{n} d{d} vocab{vocab}",
        f"block_n {bn} block_v {bv}",
        (tiles.ce_vmem_bytes(bn, bv, d), tiles.ce_vmem_limit(gen)),
    )


CASES = {
    "small": {
        "splash": lambda g: _splash(1, 8, 2, 1000, 128, g),
        "splash_bwd": lambda g: _splash_bwd(1, 8, 2, 1000, 128, g),
        "gmm": lambda g: _gmm(1000, 512, 256, 8, g),
        "fused_ce": lambda g: _ce(1000, 256, 5000, g),
        "fused_ce_8b": lambda g: _ce(8192, 4096, 128256, g),
    },
    "recipe": {
        "splash_llama3_8b": lambda g: _splash(1, 32, 8, 8192, 128, g),
        "splash_bwd_llama3_8b": lambda g: _splash_bwd(1, 32, 8, 8192, 128, g),
        "gmm_qwen3_30b_up": lambda g: _gmm(65536, 2048, 768, 128, g),
        "gmm_qwen3_30b_down": lambda g: _gmm(65536, 768, 2048, 128, g),
        "gmm_qwen3_235b_up": lambda g: _gmm(65536, 4096, 1536, 128, g),
        "gmm_qwen3_235b_down": lambda g: _gmm(65536, 1536, 4096, 128, g),
        "fused_ce_llama3_8b": lambda g: _ce(8192, 4096, 128256, g),
        "fused_ce_llama3_70b": lambda g: _ce(8192, 8192, 128256, g),
        "fused_ce_qwen3_32b": lambda g: _ce(8192, 5120, 151936, g),
    },
}


def _vmem_used(message: str) -> float | None:
    m = re.search(r"Used ([0-9.]+)([MK]) of ([0-9.]+)([MK]) vmem", message)
    if not m:
        return None
    return float(m.group(1)) / (1024 if m.group(2) == "K" else 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", choices=sorted(CASES), default="small")
    parser.add_argument("--csv", help="also write the compiles as CSV rows to this file")
    parser.add_argument("generations", nargs="+", choices=sorted(tiles.GENERATIONS))
    args = parser.parse_args()
    cases = CASES[args.cases]
    devices, compiles, exports, rows = {}, {}, {}, []
    if args.cases == "small":
        # What torch-tpu's `jax_op` does at registration: jax.export for platform "tpu" with no
        # device in sight (JAX's default device is the CPU). A kernel whose Mosaic lowering asks
        # the device kind would fail this way ("Unsupported TPU device kind: cpu").
        for case, make in cases.items():
            fn, avals, *_ = make(None)
            try:
                exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*avals)
                exports[case] = {"ok": True, "stablehlo_chars": len(exported.mlir_module())}
            except Exception as e:
                exports[case] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("jax", "jaxlib", "libtpu")}
    for gen in args.generations:
        hw = tiles.GENERATIONS[gen]
        device = topologies.get_topology_desc(topology_name=hw.topology, platform="tpu").devices[0]
        devices[gen] = device.device_kind
        sharding = jax.sharding.SingleDeviceSharding(device)
        for case, make in cases.items():
            fn, avals, shape, tile_text, vmem = make(gen)
            placed = [S(a.shape, a.dtype, sharding=sharding) for a in avals]
            entry = {"shape": shape, "tiles": tile_text}
            if vmem:
                entry.update(est_vmem_mib=round(vmem[0] / 2**20, 1), limit_mib=round(vmem[1] / 2**20, 1))
            start = time.perf_counter()
            try:
                lowered = jax.jit(fn).lower(*placed)
                compiled = lowered.compile()
                entry["compile_s"] = round(time.perf_counter() - start, 2)
                try:
                    hlo, entry["counted_in"] = compiled.as_text(), "compiled"
                except Exception as e:  # see the module docstring: the compiled HLO's text dump
                    hlo, entry["counted_in"] = lowered.as_text(), "lowered"
                    entry["as_text_error"] = f"{type(e).__name__}: {e}"[:300]
                entry["mosaic_calls"] = len(re.findall(r"tpu_custom_call", hlo))
            except Exception as e:
                message = f"{type(e).__name__}: {e}"
                entry.update(
                    error=message[:3000],
                    traceback=traceback.format_exc()[-2000:],
                    compile_s=round(time.perf_counter() - start, 2),
                )
                used = _vmem_used(message)
                if used is not None:
                    entry["vmem_used_mib"] = used
            compiles[f"{case}@{gen}"] = entry
            rows.append(
                {
                    "libtpu": versions["libtpu"],
                    "generation": gen,
                    "device_kind": devices[gen],
                    "case": case,
                    "shape": shape,
                    "tiles": tile_text,
                    "est_vmem_mib": entry.get("est_vmem_mib", ""),
                    "vmem_limit_mib": entry.get("limit_mib", ""),
                    "compiled": "error" not in entry,
                    "compile_s": entry["compile_s"],
                    "mosaic_calls": entry.get("mosaic_calls", ""),
                    "counted_in": entry.get("counted_in", ""),
                    "error": entry.get("error", "").splitlines()[0][:160] if "error" in entry else "",
                }
            )
            print(
                f"{case}@{gen}: {entry.get('compile_s')} s {'ok' if 'error' not in entry else entry['error'][:120]}",
                file=sys.stderr,
                flush=True,
            )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(json.dumps({"versions": versions, "devices": devices, "compiles": compiles, "exports": exports}))


if __name__ == "__main__":
    main()
