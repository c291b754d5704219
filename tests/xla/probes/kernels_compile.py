"""Probe (tpuc venv): compile the Pallas kernels of kernels/tpu for TPU chips without a TPU.

    python kernels_compile.py TOPOLOGY [TOPOLOGY ...]      e.g. v5e:2x2 v6e:2x2 tpu7x:2x2x1

For device 0 of each topology (`jax.experimental.topologies`, compile-only devices from libtpu)
it lowers and compiles, with Mosaic (interpret=False), bf16, forward + backward of:
- splash: GQA (8 q heads, 2 kv heads), seq 1000 (padded to 1024), head_dim 128, segment ids;
- gmm: 8 groups, M 1000, K 512, N 256, weights in nn.Linear layout (transpose_rhs);
- fused_ce: N 1000, D 256, vocab 5000 (padded to the vocab block); fused_ce_8b: Llama 3 8B's
  output layer (N 8192, D 4096, vocab 128256), where the blocks must shrink to fit VMEM.
The kernels' group sizes / segment ids are runtime arrays (ShapeDtypeStructs), so a compile
that succeeds serves every routing and every document layout.
It also exports each kernel for platform "tpu" with no device (`jax.export`), as torch-tpu's
`jax_op` does when it registers a kernel. Prints one JSON line: {"versions", "devices":
{topology: kind}, "compiles": {"kernel@topology": {"compile_s", "mosaic_calls"} or {"error"}},
"exports": {kernel: {"ok", "error"?}}}.
"""

from __future__ import annotations

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
# which this venv does not have).
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "kernels" / "tpu"))
import fused_ce  # noqa: E402
import gmm  # noqa: E402
import splash  # noqa: E402

BF16 = jnp.bfloat16


def _cases():
    def splash_step(q, k, v, seg, do):
        out, vjp = jax.vjp(lambda q, k, v: splash.splash_attention(q, k, v, seg), q, k, v)
        return out, vjp(do)

    def gmm_step(x, w, sizes, dy):
        out, vjp = jax.vjp(lambda x, w: gmm.grouped_mm(x, w, sizes, transpose_rhs=True), x, w)
        return out, vjp(dy)

    def ce_step(h, w, labels):
        return jax.value_and_grad(lambda h, w: fused_ce.linear_cross_entropy(h, w, labels), argnums=(0, 1))(h, w)

    s = jax.ShapeDtypeStruct
    return {
        "splash": (splash_step, [s((1, 8, 1000, 128), BF16), s((1, 2, 1000, 128), BF16), s((1, 2, 1000, 128), BF16),
                                 s((1, 1000), jnp.int32), s((1, 8, 1000, 128), BF16)]),
        "gmm": (gmm_step, [s((1000, 512), BF16), s((8, 256, 512), BF16), s((8,), jnp.int32), s((1000, 256), BF16)]),
        "fused_ce": (ce_step, [s((1000, 256), BF16), s((5000, 256), BF16), s((1000,), jnp.int32)]),
        # Llama 3 8B's head: blocks must shrink to fit VMEM (v5e's default scoped limit is 16 MiB).
        "fused_ce_8b": (ce_step, [s((8192, 4096), BF16), s((128256, 4096), BF16), s((8192,), jnp.int32)]),
    }


def main() -> None:
    devices, compiles, exports = {}, {}, {}
    cases = _cases()
    # What torch-tpu's `jax_op` does at registration: jax.export for platform "tpu" with no
    # device in sight (JAX's default device is the CPU here). A kernel whose Mosaic lowering
    # asks the device kind would fail this way ("Unsupported TPU device kind: cpu").
    for kernel, (fn, avals) in cases.items():
        try:
            exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*avals)
            exports[kernel] = {"ok": True, "stablehlo_chars": len(exported.mlir_module())}
        except Exception as e:
            exports[kernel] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    for name in sys.argv[1:]:
        device = topologies.get_topology_desc(topology_name=name, platform="tpu").devices[0]
        devices[name] = device.device_kind
        sharding = jax.sharding.SingleDeviceSharding(device)
        for kernel, (fn, avals) in cases.items():
            args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals]
            try:
                start = time.perf_counter()
                compiled = jax.jit(fn).lower(*args).compile()
                seconds = time.perf_counter() - start
                hlo = compiled.as_text()
                compiles[f"{kernel}@{name}"] = {"compile_s": round(seconds, 2),
                                                "mosaic_calls": len(re.findall(r"tpu_custom_call", hlo))}
            except Exception as e:
                compiles[f"{kernel}@{name}"] = {"error": f"{type(e).__name__}: {e}"[:3000],
                                                "traceback": traceback.format_exc()[-3000:]}
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("jax", "jaxlib", "libtpu")}
    print(json.dumps({"versions": versions, "devices": devices, "compiles": compiles, "exports": exports}))


if __name__ == "__main__":
    main()
