"""The worker of scripts/estimate_xla.py (`python -m tools.xla_estimate SPEC` in the XLA tier's `ttpu`
venv, started by tools/xla_estimate_run.py): capture a recipe's graph step on the meta device, lower
it with torchax, compile it for a compile-only TPU topology, and print the compiler's memory and
cost analysis as one JSON line (docs/tpu.md, "Compiler-backed pod check").

Importing this module imports neither torch nor jax (the outer script reads `hbm_oom` from the
project venv); each phase imports what it needs.
"""

from __future__ import annotations

import time
from pathlib import Path


def hbm_oom(message: str) -> dict | None:
    """libtpu's CompileTimeHbmOom as numbers: {"required", "available"} bytes (from its "HLO
    temporaries (171.01G) exceeds available HBM (31.24G)"; libtpu writes K, M, G or T, binary:
    the Qwen3-235B SPMD compile's "(2.06T)"); None for any other error."""
    import re

    size = r"\(([\d.]+)([KMGT])\)"
    m = re.search(rf"CompileTimeHbmOom.*?{size} exceeds available HBM {size}", message, re.S)
    if m is None:
        return None
    unit = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    return {
        "required": float(m.group(1)) * unit[m.group(2)],
        "available": float(m.group(3)) * unit[m.group(4)],
        "message": m.group(0)[:300],
    }


def worker(spec: dict) -> dict:
    """Capture, lower and compile the step `spec` describes (tools/xla_estimate_run.py `worker_spec`);
    the compiler's analysis, or its CompileTimeHbmOom as the verdict (`oom`)."""
    import resource

    model, opt, args, step_plan, plan = abstract_training_state(spec)
    capture = captured_step(spec, model=model, opt=opt, args=args, step_plan=step_plan, plan=plan)
    mesh, devices = compile_mesh(spec)
    lowering = lower_first(capture["graphs"], spec, mesh, reverse_scan=capture["reverse_scan"])
    t = time.perf_counter()
    try:
        compiled = lowering["lowered"].compile()
    except Exception as e:  # libtpu refuses a program whose temporaries exceed the HBM: a verdict
        oom = hbm_oom(str(e))
        if oom is None:
            raise
        return dict(
            devices=len(devices),
            device_kind=devices[0].device_kind,
            capture_s=capture["capture_s"],
            lower_s=lowering["lower_s"],
            compile_s=time.perf_counter() - t,
            kernels=spec["kernels"],
            oom=oom,
            flips=lowering["flips"],
            reverse_scan=lowering["reverse_scan"],
            host_tensor_bytes=capture["host_bytes"],
            donated=bool(spec["donate"]),
            worker_peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )
    compile_s = time.perf_counter() - t
    analysis = compiled_analysis(compiled, lowering["lowered"], spec)
    return dict(
        devices=len(devices),
        device_kind=devices[0].device_kind,
        capture_s=capture["capture_s"],
        lower_s=lowering["lower_s"],
        compile_s=compile_s,
        kernels=spec["kernels"],
        cost=analysis["cost"],
        compiler_cost=analysis["compiler_cost"],
        kernel_cost=analysis["kernel_cost"],
        memory=analysis["memory"],
        stablehlo_while=analysis["stablehlo_while"],
        flips=lowering["flips"],
        reverse_scan=lowering["reverse_scan"],
        written_inputs=len(lowering["written"]),
        inputs=len(lowering["idx"]),
        host_tensor_bytes=capture["host_bytes"],
        tag_error=lowering["tag_error"],
        replicated_bytes=lowering["replicated_bytes"],
        donated=bool(spec["donate"]),
        hlo_kind=analysis["hlo_kind"] if spec.get("dump_hlo") else None,
        worker_peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **{"while": analysis["while"]},
    )


def abstract_training_state(spec: dict):
    """The recipe's model, SimpleFSDP-wrapped, its AdamW with a state, and the trainer's step plan
    on a TPU, all on the meta device: (model, optimizer, model args, StepPlan, parallel plan)."""
    import torch

    from models import get_model_family
    from parallelisms.activation_checkpoint import apply_ac
    from parallelisms.simple_fsdp import data_parallel
    from trainer.optim import build_optimizer
    from trainer.step.plan import StepPlan

    family = get_model_family(spec["family"])
    args = family.args_cls(**spec["args"])  # attention: the SDPA reference unless the kernels are installed
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    # Shapes only: parameters, moments and tokens stay on the meta device (the step is captured,
    # never run), so no host memory holds the model; layer scan stacks meta tensors
    # (models.common.stack.abstract_model).
    with torch.device("meta"):
        model = family.model_cls(args)
    data_parallel(model, mesh=None, param_dtype=dtypes[spec["param_dtype"]], reduce_dtype=dtypes[spec["reduce_dtype"]])
    opt_cfg = spec["optimizer"]
    opt = build_optimizer(
        model.parameters(),
        lr=opt_cfg["lr"],
        betas=tuple(opt_cfg["betas"]),
        eps=opt_cfg["eps"],
        weight_decay=opt_cfg["weight_decay"],
    )
    for group in opt.param_groups:  # the graph step keeps a state that exists (init_adamw_state)
        for p in group["params"]:
            opt.state[p].update(
                step=torch.zeros((), dtype=torch.float32, device="meta"),
                exp_avg=torch.empty_like(p),
                exp_avg_sq=torch.empty_like(p),
            )
    plan = family.plan
    # The trainer's step plan on a TPU (trainer.step.plan_step, resolved by the outer process).
    step_plan = StepPlan(
        mode="graph",
        backend="aot_eager",
        block_ac=spec["block_ac"],
        block_compile=None,
        scan=spec["scan_layers"],
        scan_ac=spec["scan_ac"],
        loss_parallel=False,
        fused_loss=spec["fused_loss"],
    )
    if not step_plan.scan:  # unrolled blocks are checkpointed where the trainer does it
        apply_ac(model, plan=plan, mode=step_plan.block_ac)
    return model, opt, args, step_plan, plan


def captured_step(spec: dict, *, model, opt, args, step_plan, plan) -> dict:
    """Capture the graph step (the Pallas kernels as opaque ops with `--kernels pallas`): `graphs`,
    the graphs to try lowering in order as (graph, flips) (the reverse-tagged one first where
    tag_reverse_scans tagged one), `reverse_scan` (what tag_reverse_scans answered; None where it
    did not run), `capture_s`, and `host_bytes` of captured inputs with host
    storage (0: everything is a meta tensor)."""
    import torch

    from models.common.stack import abstract_model
    from tools.xla_lowering import RECORD, CaptureDone, flip_count, record_first_call
    from trainer.graph import build_graph_step

    if spec["kernels"] == "pallas":
        from titan_kernels.tpu import capture

        capture.install()
    record_first_call(clone=False, stop=True)
    start = time.perf_counter()
    with abstract_model():
        step = build_graph_step(
            model=model,
            optimizer=opt,
            max_norm=spec["max_norm"],
            backend="aot_eager",
            scan_layers=step_plan.scan,
            ac_mode=step_plan.scan_ac,
            grad_accum_steps=spec["grad_accum"],
            plan=plan,
            loss_fn=step_plan.lm_loss,
            aux_loss_coef=spec["aux_loss_coef"] if getattr(args, "num_experts", 0) else 0.0,
        )
    step.capture.fence_remat = True  # lowered for XLA: recomputed ops behind barriers, or XLA CSEs them away
    tokens = torch.zeros(spec["global_batch"], spec["seq_len"], dtype=torch.int64, device="meta")
    try:
        step([(tokens, tokens)] * spec["grad_accum"], spec["optimizer"]["lr"])
    except CaptureDone:
        pass
    assert "pre" in RECORD, "the graph step was not captured"
    capture_s = time.perf_counter() - start
    gm = RECORD["gm"]
    flips = flip_count(gm)
    # The graph torch-tpu would lower: the backward scans without flips, their bodies tagged
    # reverse (trainer.graph.passes.tag_reverse_scans; the torchax lowering honours the tag).
    graphs, reverse_scan = [(gm, flips)], None
    if flips and spec["scan_layers"] and not spec["keep_flips"]:
        import copy

        from trainer.graph.passes import tag_reverse_scans

        tagged = copy.deepcopy(gm)
        reverse_scan = tag_reverse_scans(tagged)
        if reverse_scan:
            graphs.insert(0, (tagged, flip_count(tagged)))
    host_bytes = sum(
        a.numel() * a.element_size() for a in RECORD["pre"] if torch.is_tensor(a) and a.device.type != "meta"
    )
    return dict(graphs=graphs, reverse_scan=reverse_scan, capture_s=capture_s, host_bytes=host_bytes)


def compile_mesh(spec: dict):
    """Load torchax with the project's lowerings (and the kernels', at the target chip's blocks) and
    lay the topology's compile-only devices out as one `fsdp` axis: (mesh, devices)."""
    from tools.xla_lowering import add_lowerings, load_torchax

    torchax = load_torchax()
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    add_lowerings(torchax.default_env())
    devices = topologies.get_topology_desc(topology_name=spec["topology"], platform="tpu").devices
    mesh = Mesh(np.array(devices), ("fsdp",))
    if spec["kernels"] == "pallas":
        from titan_kernels.tpu import capture, tiles

        # The kernels' blocks are the target chip's (as a run there detects it), not the conservative rule.
        capture.add_lowerings(
            torchax.default_env(), mesh, "fsdp", generation=tiles.generation_of(devices[0].device_kind)
        )
    return mesh, devices


def shard_dim(shape, n: int) -> int | None:
    """SimpleFSDP's Shard(0) where dim 0 divides; else the largest dim that divides; else None."""
    if shape and shape[0] % n == 0:
        return 0
    dims = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d]) if shape[d] % n == 0]
    return dims[0] if dims else None


def fsdp_sharding(mesh, shape):
    """The NamedSharding of one input: its `shard_dim` over the mesh's `fsdp` axis."""
    from jax.sharding import NamedSharding, PartitionSpec

    axes = [None] * len(shape)
    d = shard_dim(shape, mesh.size)
    if d is not None:
        axes[d] = "fsdp"
    return NamedSharding(mesh, PartitionSpec(*axes))


def lower_step(graph, spec: dict, mesh):
    """Lower one captured graph as a jitted JAX step over `mesh`: (lowered, the indices of the
    written inputs among the function's, the function's input indices, bytes of the inputs no
    dim of which divides the devices)."""
    import jax
    import numpy as np
    import torch
    from jax.sharding import NamedSharding, PartitionSpec

    from tools.xla_lowering import RECORD, as_jax_function, mutated_inputs

    jdtype = {
        torch.float32: np.float32,
        torch.bfloat16: jax.numpy.bfloat16,
        torch.int64: np.int32,
        torch.int32: np.int32,
        torch.bool: np.bool_,
    }
    replicated = NamedSharding(mesh, PartitionSpec())
    RECORD["gm"] = graph
    fn, idx = as_jax_function(RECORD)
    shapes = [tuple(RECORD["pre"][i].shape) for i in idx]
    in_sh = [fsdp_sharding(mesh, s) for s in shapes]
    abstract = [
        jax.ShapeDtypeStruct(s, jdtype[RECORD["pre"][i].dtype], sharding=sh) for s, i, sh in zip(shapes, idx, in_sh)
    ]
    replicated_bytes = sum(
        int(np.prod(s)) * np.dtype(a.dtype).itemsize
        for s, a in zip(shapes, abstract)
        if shard_dim(s, mesh.size) is None
    )
    # Only the written inputs come back (torch-tpu: the updated state is a new buffer, copied
    # back by eager copy_s afterwards; R6 in docs/tpu.md), donated only with --donate.
    mutated = mutated_inputs(graph)
    written = [k for k, i in enumerate(idx) if i in mutated]

    def step_fn(*tensors):  # scalar outputs (loss, grad norm, aux) replicated; state keeps its sharding
        outs, updated = fn(*tensors)
        return [o for o in outs if o is not None], [updated[k] for k in written]

    if spec["kernels"] == "pallas":
        from titan_kernels.tpu import capture

        capture.COSTS.clear()
    # The one trace of the step (jit's lower below reuses it): every kernel node records its cost.
    num_outs = len(jax.eval_shape(step_fn, *abstract)[0])
    jitted = jax.jit(
        step_fn,
        out_shardings=([replicated] * num_outs, [in_sh[k] for k in written]),
        donate_argnums=tuple(written) if spec["donate"] else (),
    )
    return jitted.lower(*abstract), written, idx, replicated_bytes


def lower_first(graphs: list, spec: dict, mesh, *, reverse_scan) -> dict:
    """Lower the first of `graphs` that lowers (the reverse-tagged one, else the flipped one):
    `lowered`, `written`, `idx`, `replicated_bytes`, its `flips`, `reverse_scan` (None where the
    tagged graph did not lower), `tag_error` (why it did not), `lower_s`."""
    tag_error = None
    t = time.perf_counter()
    for k, (graph, graph_flips) in enumerate(graphs):
        try:
            lowered, written, idx, replicated_bytes = lower_step(graph, spec, mesh)
            flips = graph_flips
            break
        except Exception as e:  # the tagged graph did not lower: say so, and compile the flipped one
            if k == len(graphs) - 1:
                raise
            tag_error, reverse_scan = f"{type(e).__name__}: {str(e)[:300]}", None
    return dict(
        lowered=lowered,
        written=written,
        idx=idx,
        replicated_bytes=replicated_bytes,
        flips=flips,
        reverse_scan=reverse_scan,
        tag_error=tag_error,
        lower_s=time.perf_counter() - t,
    )


def compiled_analysis(compiled, lowered, spec: dict) -> dict:
    """The compiled program's cost (XLA's plus each kernel call's own: libtpu counts a Mosaic custom
    call as 0 FLOPs), memory analysis and loops; writes the program's text to `spec["dump_hlo"]`."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    cost = {k: float(v) for k, v in cost.items() if k in ("flops", "bytes accessed")}
    if spec["kernels"] == "pallas":
        from titan_kernels.tpu import capture

        kernel = capture.kernel_costs()
    else:
        kernel = {"flops": 0.0, "bytes": 0.0, "calls": 0}
    total = {
        "flops": cost.get("flops", 0.0) + kernel["flops"],
        "bytes accessed": cost.get("bytes accessed", 0.0) + kernel["bytes"],
    }
    mem = compiled.memory_analysis()
    names = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    try:
        text = compiled.as_text()
        loops = text.count(" while(")
        hlo_kind = "optimized HLO"
    except Exception:  # jaxlib 0.10.2 cannot read back some SPMD programs of libtpu 0.0.52 (async ops)
        text, loops, hlo_kind = None, None, "StableHLO (the optimized HLO could not be read back)"
    stablehlo = lowered.as_text()
    if spec.get("dump_hlo"):
        Path(spec["dump_hlo"]).write_text(text if text is not None else stablehlo)
    return dict(
        cost=total,
        compiler_cost=cost,
        kernel_cost=kernel,
        memory={k: int(getattr(mem, k)) for k in names if hasattr(mem, k)},
        stablehlo_while=stablehlo.count("stablehlo.while"),
        hlo_kind=hlo_kind,
        **{"while": loops},
    )


if __name__ == "__main__":
    import json
    import sys

    from trainer.runtime.quiet import quiet_capture

    quiet_capture()  # third-party warnings of capture-only jobs, which a user cannot act on
    print(json.dumps(worker(json.loads(sys.argv[1]))))
