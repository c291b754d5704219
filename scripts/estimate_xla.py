#!/usr/bin/env python
"""Ask the real XLA:TPU compiler, without a TPU, for a recipe's per-device program; print its
memory and FLOP analysis beside the analytic planner's (scripts/estimate.py) numbers.

    python scripts/estimate_xla.py --config configs/llama3_debug.toml --target v6e-4
    python scripts/estimate_xla.py --config configs/llama3_8b_v6e.toml --target v6e-16 --model.n_layers=4

How (docs/tpu.md, "Compiler-backed pod check"): in the XLA tier's `ttpu` venv (torch + torchax +
jax 0.10.2 + libtpu 0.0.52; scripts/xla_env.sh), a worker process captures the recipe's graph step
(`[compile] scan_layers`, `[activation_checkpoint] mode`, the `mixed_precision_param` cast) at the
global batch (local batch x devices) with the Pallas kernels a TPU run calls as opaque ops
(`--kernels pallas`, the default: splash attention, megablox gmm for MoE experts;
kernels/tpu/capture.py) or the torch references (`--kernels reference`: math SDPA), lowers it
with torchax, and compiles it for a compile-only topology of the target (`jax.experimental.topologies`) with
every tensor sharded over all devices along its largest divisible dim (parameters and optimizer
state: FSDP / ZeRO-3; tokens: data parallel) and the state donated. XLA's SPMD partitioner turns
that into the per-device program, whose `memory_analysis()` and `cost_analysis()` are printed.
The planner evaluates the same plan (dp_shard = devices, tp = ep = 1).

Not trustworthy, by construction (see docs/tpu.md for what was measured):
- activations and temporaries: with `--kernels reference` the capture has math SDPA (T x T scores
  materialised) where a TPU runs splash; deviceless compiles here also report `temp_size_in_bytes`
  0 for some programs. Read the temp figure as indicative only;
- the sharding is XLA's SPMD choice for FSDP-style input shardings, not SimpleFSDP's explicit
  collectives, and not torch-tpu's lowering;
- FLOPs: XLA counts a `while` body once, so with scan the compiler's FLOPs cover one layer.
  libtpu counts a Mosaic custom call as 0 FLOPs, so each kernel call's FLOPs and HBM bytes are
  added from its shapes (kernels/tpu/capture.py: a model of the kernel, not the compiler's).
Host memory: the model and the AdamW moments are allocated on the CPU but never written (the step
is captured, not run), so their pages stay untouched: Llama 3 8B at 1 layer (1.27 B parameters)
peaks at 1.6 GB resident (11.5 GB when the moments were zero-filled). Layer scan's stacked weights
are copies (~4 bytes per block parameter); shrink a big flavor with `--model.n_layers=...` and
scale the per-layer part.
Trustworthy: the argument bytes (parameter, gradient-free optimizer state and batch shards per
device) and that the program compiles for the chip at all.
Exit status: 0 compiled, 1 the compile failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.errors import ConfigError  # noqa: E402

# Target generation -> (jax topology prefix, devices per chip, chip grid by device count).
_TOPOLOGIES = {
    "v5e": ("v5e", 1, {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}),
    "v6e": ("v6e", 1, {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}),
    "v5p": ("v5p", 1, {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}),
    "v7x": ("tpu7x", 2, {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4"}),
}


def topology_name(target) -> str:
    """The jax topology name of a planner Target (e.g. v6e-16 -> v6e:4x4, v7x-8 -> tpu7x:2x2x1)."""
    gen = target.generation.name
    if gen not in _TOPOLOGIES:
        raise ConfigError(f"--target: no compile-only topology for {gen}; allowed: {', '.join(_TOPOLOGIES)}")
    prefix, _, grids = _TOPOLOGIES[gen]
    if target.devices not in grids:
        raise ConfigError(f"--target: {target.name}: {target.devices} devices has no topology here; allowed "
                          f"device counts for {gen}: {sorted(grids)} (or pass --topology)")
    return f"{prefix}:{grids[target.devices]}"


# ---------------------------------------------------------------------------------------------
# Outer process (project venv): planner, worker launch, table.


def _run(argv: list[str]) -> int:
    import planner
    from trainer.config import build_config, resolve_model_args, split_cli

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--target", required=True, help="e.g. v6e-16, v5e-4, v7x-8 (planner names)")
    p.add_argument("--topology", help="jax topology name instead of the one derived from --target")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for capture + compile (default 1800)")
    p.add_argument("--kernels", choices=("pallas", "reference"), default="pallas",
                   help="attention and MoE experts in the captured step: the TPU run's Pallas kernels (default) "
                        "or the torch references (math SDPA)")
    p.add_argument("--json", action="store_true", help="also print the compiler's numbers as one JSON line "
                   "(last line; scripts/mfu_suite.py reads it)")
    ns, rest = p.parse_known_args(argv)
    target = planner.parse_target(ns.target)
    topology = ns.topology or topology_name(target)
    recipe, _, overrides = split_cli(rest)
    cfg = build_config(recipe, overrides)
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    t = cfg.training
    if cfg.parallelism.tensor_parallel_degree != 1 or cfg.parallelism.expert_parallel_degree != 1:
        print("note: the compiler check shards FSDP-style only; tp and ep are set to 1 for both columns")
    inputs = planner.PlanInputs(family=family, args=args, model_name=f"{cfg.model.name} {cfg.model.flavor}",
                                seq_len=t.seq_len, local_batch_size=t.local_batch_size,
                                grad_accum=t.gradient_accumulation_steps)
    est = planner.plan_estimate(inputs, target, dp_replicate=1, dp_shard=target.devices, tp=1, ep=1,
                                ac_mode=cfg.activation_checkpoint.mode, loss_parallel=False)
    spec = dict(family=cfg.model.name, args=dataclasses.asdict(args), seq_len=t.seq_len,
                global_batch=t.local_batch_size * target.devices, grad_accum=t.gradient_accumulation_steps,
                # `auto` is bfloat16 on a TPU (trainer.device.resolve_compute_dtype)
                param_dtype="bfloat16" if t.mixed_precision_param == "auto" else t.mixed_precision_param,
                reduce_dtype=t.mixed_precision_reduce,
                scan_layers=bool(cfg.compile.scan_layers), ac_mode=cfg.activation_checkpoint.mode,
                max_norm=t.max_norm, optimizer=dict(lr=cfg.optimizer.lr, betas=list(cfg.optimizer.betas),
                                                    eps=cfg.optimizer.eps, weight_decay=cfg.optimizer.weight_decay),
                topology=topology, kernels=ns.kernels)
    venv = subprocess.run(["bash", str(ROOT / "scripts" / "xla_env.sh"), "ttpu"], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    # Compile-only: no TPU is used, so libtpu's one-process-per-host lock is not needed.
    env.update(PYTHONPATH=str(ROOT), TORCH_DEVICE_BACKEND_AUTOLOAD="0", TPU_SKIP_MDS_QUERY="1", JAX_PLATFORMS="cpu",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    print(f"{inputs.model_name} on {target.name} ({target.devices} devices, {target.chips} chips)\n"
          f"compiling for {topology} (deviceless) ...", flush=True)
    proc = subprocess.run([str(Path(venv) / "bin" / "python"), __file__, "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=ns.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"compile worker exited {proc.returncode}:\n{proc.stderr[-6000:]}", file=sys.stderr)
        return 1
    res = json.loads(lines[-1])
    print(format_table(est, res))
    if ns.json:
        print(json.dumps({**res, "target": target.name, "topology": topology,
                          "tokens_per_device_step": est.tokens_per_device_step}))
    return 0


def format_table(est, res: dict) -> str:
    gib = 2.0**30
    mem, cost = res["memory"], res["cost"]
    planner_state = est.params + est.grads + est.optimizer
    tokens = est.tokens_per_device_step
    planner_flops = tokens * est.flops_per_token * est.recompute_factor
    rows = [
        ("plan", f"dp_shard {est.dp_shard}, tp {est.tp}, ep {est.ep}, AC {est.ac_mode}",
         f"FSDP-style SPMD over {res['devices']} x {res['device_kind']}"),
        ("params + grads + optimizer / device", f"{planner_state / gib:.3f} GiB",
         f"arguments {mem.get('argument_size_in_bytes', 0) / gib:.3f} GiB (params, AdamW moments, step, batch)"),
        ("activations + transients / device", f"{(est.activations.total + est.transient) / gib:.3f} GiB",
         f"temp {mem.get('temp_size_in_bytes', 0) / gib:.3f} GiB ({res.get('kernels', 'reference')} "
         "kernels; 0 = not reported)"),
        ("outputs / aliased", "-", f"{mem.get('output_size_in_bytes', 0) / gib:.3f} / "
                                    f"{mem.get('alias_size_in_bytes', 0) / gib:.3f} GiB"),
        ("total / device", f"{est.total / gib:.3f} GiB of {est.usable / gib:.1f} usable",
         f"{(mem.get('argument_size_in_bytes', 0) + mem.get('temp_size_in_bytes', 0)) / gib:.3f} GiB (args + temp)"),
        ("FLOPs / device / step", f"{planner_flops:.4g} (6N + 12LHQT per token x {tokens:g} tokens)",
         f"{cost.get('flops', 0):.4g}" + (" (one layer: XLA counts a while body once)"
                                          if res["stablehlo_while"] else "")
         + (f" = XLA ops {res['compiler_cost'].get('flops', 0):.4g} + {res['kernel_cost']['calls']} kernel calls "
            f"{res['kernel_cost']['flops']:.4g}" if res.get("kernel_cost", {}).get("calls") else "")),
        ("while loops (StableHLO / optimized)", "-", f"{res['stablehlo_while']} / "
                                                      f"{'unreadable' if res['while'] is None else res['while']}"),
        ("capture / lower / compile s", "-", f"{res['capture_s']:.1f} / {res['lower_s']:.1f} / {res['compile_s']:.1f}"),
    ]
    width = max(len(r[0]) for r in rows)
    out = [f"{'':{width}}  {'planner (analytic)':40}  XLA:TPU compiler (deviceless)"]
    out += [f"{a:{width}}  {b:40}  {c}" for a, b, c in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Worker (ttpu venv): capture on meta, lower with torchax, compile for the topology.


def worker(spec: dict) -> dict:

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models import get_model_family
    from parallelisms.activation_checkpoint import apply_ac
    from parallelisms.simple_fsdp import data_parallel
    from trainer.graph import build_graph_step
    from trainer.graph.xla import (RECORD, CaptureDone, add_lowerings, as_jax_function, load_torchax,
                                   record_first_call)
    from trainer.optim import build_optimizer

    family = get_model_family(spec["family"])
    args = family.args_cls(**spec["args"])  # attention: the SDPA reference (no kernel is selected here)
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    with torch.device("meta"):
        model = family.model_cls(args)
    data_parallel(model, mesh=None, param_dtype=dtypes[spec["param_dtype"]], reduce_dtype=dtypes[spec["reduce_dtype"]])
    # Host memory that is never written: the step is captured, not run, so parameters and the
    # AdamW moments only need shapes. `empty` pages are not touched (torch.zeros, the optimizer's
    # own init, would write ~8 bytes per parameter); only layer scan's stacking copies weights.
    model.to_empty(device="cpu")
    opt_cfg = spec["optimizer"]
    opt = build_optimizer(model.parameters(), lr=opt_cfg["lr"], betas=tuple(opt_cfg["betas"]), eps=opt_cfg["eps"],
                          weight_decay=opt_cfg["weight_decay"])
    for group in opt.param_groups:  # the graph step keeps a state that exists (init_adamw_state)
        for p in group["params"]:
            opt.state[p].update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.empty_like(p),
                                exp_avg_sq=torch.empty_like(p))
    plan = family.plan
    if not spec["scan_layers"]:  # unrolled blocks are checkpointed where the trainer does it
        apply_ac(model, plan=plan, mode=spec["ac_mode"])
    if spec["kernels"] == "pallas":
        from kernels.tpu import capture

        capture.install()
    record_first_call(clone=False, stop=True)
    start = time.perf_counter()
    step = build_graph_step(model=model, optimizer=opt, max_norm=spec["max_norm"], backend="aot_eager",
                            scan_layers=spec["scan_layers"], ac_mode=spec["ac_mode"] if spec["scan_layers"] else "none",
                            grad_accum_steps=spec["grad_accum"], plan=plan,
                            aux_loss_coef=1e-3 if getattr(args, "num_experts", 0) else 0.0)
    step.capture.fence_remat = True  # lowered for XLA: recomputed ops behind barriers, or XLA CSEs them away
    tokens = torch.zeros(spec["global_batch"], spec["seq_len"], dtype=torch.int64)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            step([(tokens, tokens)] * spec["grad_accum"], opt_cfg["lr"])
    except CaptureDone:
        pass
    assert "pre" in RECORD, "the graph step was not captured"
    capture_s = time.perf_counter() - start

    torchax = load_torchax()
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    add_lowerings(torchax.default_env())
    fn, idx = as_jax_function(RECORD)
    devices = topologies.get_topology_desc(topology_name=spec["topology"], platform="tpu").devices
    mesh = Mesh(np.array(devices), ("fsdp",))
    if spec["kernels"] == "pallas":
        capture.add_lowerings(torchax.default_env(), mesh, "fsdp")
    n = len(devices)

    def sharding(shape):
        dims = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d]) if shape[d] % n == 0]
        axes = [None] * len(shape)
        if dims:
            axes[dims[0]] = "fsdp"
        return NamedSharding(mesh, PartitionSpec(*axes))

    jdtype = {torch.float32: np.float32, torch.bfloat16: jax.numpy.bfloat16, torch.int64: np.int32,
              torch.int32: np.int32, torch.bool: np.bool_}
    shapes = [tuple(RECORD["pre"][i].shape) for i in idx]
    in_sh = [sharding(s) for s in shapes]
    abstract = [jax.ShapeDtypeStruct(s, jdtype[RECORD["pre"][i].dtype], sharding=sh)
                for s, i, sh in zip(shapes, idx, in_sh)]

    def step_fn(*tensors):  # scalar outputs (loss, grad norm, aux) replicated; state keeps its sharding
        outs, updated = fn(*tensors)
        return [o for o in outs if o is not None], updated

    if spec["kernels"] == "pallas":
        capture.COSTS.clear()
    # The one trace of the step (jit's lower below reuses it): every kernel node records its cost.
    num_outs = len(jax.eval_shape(step_fn, *abstract)[0])
    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(step_fn, out_shardings=([replicated] * num_outs, in_sh),
                     donate_argnums=tuple(range(len(abstract))))
    t = time.perf_counter()
    lowered = jitted.lower(*abstract)
    lower_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    cost = {k: float(v) for k, v in cost.items() if k in ("flops", "bytes accessed")}
    kernel = capture.kernel_costs() if spec["kernels"] == "pallas" else {"flops": 0.0, "bytes": 0.0, "calls": 0}
    # libtpu counts a Mosaic custom call as 0 FLOPs: add each kernel call's own (capture.py)
    total = {"flops": cost.get("flops", 0.0) + kernel["flops"],
             "bytes accessed": cost.get("bytes accessed", 0.0) + kernel["bytes"]}
    mem = compiled.memory_analysis()
    names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
             "generated_code_size_in_bytes")
    try:
        loops = compiled.as_text().count(" while(")
    except Exception:  # jaxlib 0.10.2 cannot read back some SPMD programs of libtpu 0.0.52 (async ops)
        loops = None
    return dict(devices=n, device_kind=devices[0].device_kind, capture_s=capture_s, lower_s=lower_s,
                compile_s=compile_s, kernels=spec["kernels"], cost=total, compiler_cost=cost, kernel_cost=kernel,
                memory={k: int(getattr(mem, k)) for k in names if hasattr(mem, k)},
                stablehlo_while=lowered.as_text().count("stablehlo.while"), **{"while": loops})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(json.loads(argv[1]))))
        return 0
    try:
        return _run(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
