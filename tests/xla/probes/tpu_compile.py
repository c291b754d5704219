"""Probe (tpuc venv): compile exported train steps for real TPU targets without a TPU (deviceless).

    python tpu_compile.py EXPORT=TOPOLOGIES [EXPORT=TOPOLOGIES ...]
    TOPOLOGIES: comma-separated jax topology names, e.g. step.jax_export=v5e:2x2,v6e:2x2,tpu7x:2x2x1

`jax.experimental.topologies` builds compile-only TPU devices from libtpu; each serialized
`jax.export` artifact (made by graph_step_xla.py with platforms=["tpu"]) is compiled by XLA:TPU
for device 0 of each topology. Reports per (export, topology): compile seconds, `while` ops left
in the optimized HLO, the compiler's cost analysis (flops, bytes accessed) and memory analysis.
Prints one JSON line: {"versions": ..., "devices": {topology: device_kind},
"compiles": {"<export file name>@<topology>": result}}.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback

import jax
from jax.experimental import topologies


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {k: float(cost[k]) for k in ("flops", "transcendentals", "bytes accessed") if k in cost}


def _memory(compiled) -> dict:
    mem = compiled.memory_analysis()
    names = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return {n: int(getattr(mem, n)) for n in names if mem is not None and hasattr(mem, n)}


def compile_for(exported, device) -> dict:
    sharding = jax.sharding.SingleDeviceSharding(device)
    flat = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in exported.in_avals]
    args, kwargs = jax.tree_util.tree_unflatten(exported.in_tree, flat)
    start = time.perf_counter()
    compiled = jax.jit(exported.call).lower(*args, **kwargs).compile()
    seconds = time.perf_counter() - start
    hlo = compiled.as_text()
    return {
        "compile_s": seconds,
        "while": len(re.findall(r"\bwhile\(", hlo)),
        "hlo_chars": len(hlo),
        "cost": _cost(compiled),
        "memory": _memory(compiled),
    }


def main() -> None:
    jobs = [(arg.rsplit("=", 1)[0], arg.rsplit("=", 1)[1].split(",")) for arg in sys.argv[1:]]
    devices, compiles, targets = {}, {}, {}
    for _, names in jobs:
        for name in names:
            if name not in targets:
                topo = topologies.get_topology_desc(topology_name=name, platform="tpu")
                targets[name] = topo.devices[0]
                devices[name] = topo.devices[0].device_kind
    for path, names in jobs:
        with open(path, "rb") as f:
            exported = jax.export.deserialize(bytearray(f.read()))
        for name in names:
            device = targets[name]
            key = f"{os.path.basename(path)}@{name}"
            try:
                compiles[key] = compile_for(exported, device)
            except Exception as e:
                compiles[key] = {
                    "error": f"{type(e).__name__}: {e}"[:2000],
                    "traceback": traceback.format_exc()[-3000:],
                }
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("jax", "jaxlib", "libtpu")}
    print(json.dumps({"versions": versions, "devices": devices, "compiles": compiles}))


if __name__ == "__main__":
    main()
