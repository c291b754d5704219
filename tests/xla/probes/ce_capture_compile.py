"""Probe (ttpu venv): the fused loss as scripts/estimate_xla.py lowers it, compiled deviceless at recipe widths.

    python ce_capture_compile.py CASE[:GEN] [CASE[:GEN] ...]
    CASE: llama3_70b_v6e | llama3_405b_v7x; GEN: the generation passed to `capture.add_lowerings`
    (default: the target's, from the topology's device kind; `none`: the conservative rule, what
    the capture did before issue 37)

For each case: a compile-only topology of the recipe's chip (`jax.experimental.topologies`, libtpu
0.0.52), a 1-D mesh "fsdp" over its devices, the `titan_capture` ops lowered by
`titan_kernels/tpu/capture.py`'s `add_lowerings(env, mesh, "fsdp", generation=GEN)` (the code path of
estimate_xla's worker), and two programs compiled separately: `ce_fwd(h, w, labels)` and
`ce_bwd(h, w, labels, lse, g)` on bf16 h [devices x rows, hidden], w [vocab, hidden], at the recipe's
rows per device (local batch 1 x seq 8192), so each shard_map body sees the run's per-device shape.
Prints one JSON line: {"versions", "compiles": {"case@gen:fwd|bwd": {"compiled", "compile_s",
"blocks", "est_vmem_mib", "limit_mib", "error"?, "vmem_used_mib"?, "vmem_limit_mib"?}}}.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from titan_kernels.tpu import capture  # noqa: E402
from tools.xla_lowering import load_torchax  # noqa: E402

# recipe -> (generation, hidden, vocab, rows per device): configs/llama3_70b_v6e.toml and
# configs/llama3_405b_v7x.toml (local_batch_size 1 x seq_len 8192; flavors 70B / 405B).
CASES = {
    "llama3_70b_v6e": ("v6e", 8192, 128256, 8192),
    "llama3_405b_v7x": ("v7x", 16384, 128256, 8192),
}


def _vmem(message: str) -> dict:
    """libtpu's "Scoped allocation with size 17.90M and limit 16.00M" (or "Used X of Y vmem") in MiB."""
    m = re.search(r"size ([0-9.]+)([MK]) and limit ([0-9.]+)([MK])", message) or re.search(
        r"Used ([0-9.]+)([MK]) of ([0-9.]+)([MK]) vmem", message
    )
    if not m:
        return {}
    scale = lambda v, u: float(v) / (1024 if u == "K" else 1)  # noqa: E731
    return {"vmem_used_mib": scale(m.group(1), m.group(2)), "vmem_limit_mib": scale(m.group(3), m.group(4))}


def main() -> None:
    capture._define()
    torchax = load_torchax()
    import importlib.metadata as md

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from torchax import interop

    from titan_kernels.tpu import tiles

    op = torch.ops.titan_capture
    out = {"versions": {p: md.version(p) for p in ("jax", "jaxlib", "libtpu", "torchax")}, "compiles": {}}
    for arg in sys.argv[1:]:
        case, _, gen_arg = arg.partition(":")
        target, hidden, vocab, rows = CASES[case]
        devices = topologies.get_topology_desc(topology_name=tiles.GENERATIONS[target].topology, platform="tpu").devices
        mesh = Mesh(np.array(devices), ("fsdp",))
        gen = None if gen_arg == "none" else (gen_arg or tiles.generation_of(devices[0].device_kind))
        env = torchax.default_env()
        capture.add_lowerings(env, mesh, "fsdp", generation=gen)
        n = len(devices) * rows
        split, whole = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
        h = jax.ShapeDtypeStruct((n, hidden), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
        w = jax.ShapeDtypeStruct((vocab, hidden), jnp.bfloat16, sharding=whole)
        labels = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=split)
        f32 = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=split)
        programs = {
            "fwd": (interop.jax_view(lambda h, w, y: tuple(op.ce_fwd(h, w, y))), (h, w, labels)),
            "bwd": (
                interop.jax_view(lambda h, w, y, lse, g: tuple(op.ce_bwd(h, w, y, lse, g))),
                (h, w, labels, f32, f32),
            ),
        }
        bn, bv = tiles.ce_blocks(gen, rows, vocab, hidden)
        for name, (fn, avals) in programs.items():
            entry = {
                "devices": len(devices),
                "device_kind": devices[0].device_kind,
                "rows_per_device": rows,
                "blocks": [bn, bv],
                "est_vmem_mib": round(tiles.ce_vmem_bytes(bn, bv, hidden) / 2**20, 2),
                "limit_mib": round(tiles.ce_vmem_limit(gen) / 2**20, 2),
            }
            start = time.perf_counter()
            try:
                with env:
                    jax.jit(fn).lower(*avals).compile()
                entry["compiled"] = True
            except Exception as e:  # the compiler's message is the evidence
                message = f"{type(e).__name__}: {e}"
                entry.update(compiled=False, error=message[:1500], **_vmem(message))
            entry["compile_s"] = round(time.perf_counter() - start, 2)
            out["compiles"][f"{case}@{gen or 'none'}:{name}"] = entry
            print(
                f"{case}@{gen or 'none'}:{name}: {entry['compile_s']} s "
                f"{'ok' if entry['compiled'] else entry['error'][:200]}",
                file=sys.stderr,
                flush=True,
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
