"""MaxText's own AOT train-step compile (`maxtext.trainers.pre_train.train_compile`), run in the
`maxtext` venv (scripts/xla_env.sh maxtext) by scripts/bench/maxtext_compile.py; imports only
MaxText and jax.

    python scripts/bench/maxtext_worker.py OUT.json model_name=llama3.1-8b compile_topology=v6e-256 ...

It calls train_compile's own `main` with MaxText's base.yml and the arguments, and wraps its
`jit_and_compile` to time the compile and keep the compiled program and its mesh. Written to OUT.json:
compile_s (lower + compile), memory (compiled.memory_analysis()), cost (compiled.cost_analysis()),
the mesh (axis names, shape) and each device's chip coordinates and core, row-major over the mesh
(the order of the program's device ids), tokens per device and step, and MaxText's own model FLOPs
per device and step (`calculate_tflops_training_per_device`: the FLOPs its TFLOP/s log line and the
published MFU count). The same facts go to OUT.json.pre.json before the compile starts (with its
start time), for a caller that stops at the HLO dump. The HLO is dumped by the caller's XLA_FLAGS.
"""

from __future__ import annotations

import json
import os
import sys
import time


def facts(config, mesh) -> dict:
    """The mesh, each device's chip coordinates and core (flat mesh order), tokens per device and
    step, MaxText's own FLOPs per device and step (TFLOPs: total, weights, causal attention)."""
    from maxtext.utils import maxtext_utils

    total_tflops, weight_tflops, attention_tflops = maxtext_utils.calculate_tflops_training_per_device(config)
    return {
        "mesh_axes": list(mesh.axis_names),
        "mesh_shape": list(mesh.devices.shape),
        "device_coords": [[*d.coords, getattr(d, "core_on_chip", 0)] for d in mesh.devices.flat],
        "device_kind": mesh.devices.flat[0].device_kind,
        "tokens_per_device": float(config.per_device_batch_size) * int(config.max_target_length),
        "maxtext_tflops_per_device_step": float(total_tflops),
        "maxtext_weight_tflops": float(weight_tflops),
        "maxtext_attention_tflops": float(attention_tflops),
    }


def main(argv: list[str]) -> int:
    out_path, args = argv[0], argv[1:]
    # tokamax's ragged dot (the MoE runs' gmm) refuses to trace on a CPU host unless told the program
    # is compiled for another machine; tokamax reads its flags from sys.argv's --tokamax_* arguments
    sys.argv.append("--tokamax_cross_compile=true")
    import maxtext
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train_compile as tc

    base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    seen: dict = {}
    initialize = pyconfig.initialize

    def keep_config(*a, **k):
        config = initialize(*a, **k)
        seen["config"] = config
        return config

    pyconfig.initialize = keep_config
    compile_fn = tc.jit_and_compile

    def timed_compile(func, func_input_args, func_input_kwargs, mesh, *rest, **kw):
        # what the projection needs, written before the compile: a caller that stops at the HLO
        # dump (maxtext_compile.py --until hlo) has it without waiting for the backend's codegen
        with open(out_path + ".pre.json", "w") as f:
            json.dump({**facts(seen["config"], mesh), "compile_started": time.time()}, f)
        start = time.time()
        compiled = compile_fn(func, func_input_args, func_input_kwargs, mesh, *rest, **kw)
        seen.update(compile_s=time.time() - start, compiled=compiled, mesh=mesh)
        return compiled

    tc.jit_and_compile = timed_compile
    start = time.time()
    tc.main(["train_compile", base_yml, *args])
    total_s = time.time() - start
    compiled, mesh, config = seen["compiled"], seen["mesh"], seen["config"]
    mem = compiled.memory_analysis()
    memory = {
        k: int(getattr(mem, k))
        for k in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
            "generated_code_size_in_bytes",
            "host_argument_size_in_bytes",
            "host_output_size_in_bytes",
            "host_alias_size_in_bytes",
            "host_temp_size_in_bytes",
        )
        if hasattr(mem, k)
    }
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    cost = {k: float(v) for k, v in (cost or {}).items() if k in ("flops", "bytes accessed", "transcendentals")}
    result = {"compile_s": seen["compile_s"], "total_s": total_s, "memory": memory, "cost": cost, **facts(config, mesh)}
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k != "device_coords"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
