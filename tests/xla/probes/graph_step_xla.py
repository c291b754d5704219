"""Probe (xla venv): the graph trainer's step, captured with aot_eager, lowered by torchax, run on XLA:CPU.

    python graph_step_xla.py OUT_DIR VARIANT [VARIANT ...]
    VARIANT = family:flavor:unrolled|scan:n_layers[:lower]     e.g. llama3:debugmodel:scan:2

For each variant: build the model as the trainer does for one process (meta -> SimpleFSDP fp32
-> materialize -> init_weights, SDPA attention), capture `build_graph_step(backend="aot_eager")`
and run its first step under math SDPA (portable ATen ops instead of the CPU flash kernel),
recording the ATen graph's flat inputs before the step, the same inputs after it (the graph
updates parameters and AdamW state in place) and its outputs. All variants are captured before
torchax is imported (it breaks torch.compile in this process). Then each graph is lowered with
torchax to one StableHLO module, `stablehlo.while` ops are counted, and unless the variant ends
in `:lower` it is compiled and run on XLA:CPU from the recorded inputs, compared with the
aot_eager run, and exported for TPU (`OUT_DIR/<variant>.jax_export`, for the tpuc probe).

Prints one JSON line: {"versions": ..., "variants": {VARIANT: result}}; a variant that fails
reports {"error": ...} instead of stopping the probe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

import torch

# 512 tokens per step: enough that per-parameter work (clipping, AdamW) is ~1 % of the step's FLOPs
# (test_tpu_compile compares the compiler's FLOPs with the per-token formula).
SEQ, BATCH = 128, 4
LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM = 1e-3, (0.9, 0.95), 1e-6, 0.1, 1.0


def _build(family_name: str, flavor: str, n_layers: int):
    from models import get_model_family
    from parallelisms.simple_fsdp import data_parallel
    from trainer.optim import build_optimizer

    family = get_model_family(family_name)
    args = family.get_args(flavor, n_layers=n_layers, max_seq_len=SEQ)  # SDPA: no kernel is selected
    with torch.device("meta"):
        model = family.model_cls(args)
    data_parallel(model, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    opt = build_optimizer(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return args, model, opt, family.plan


def capture(variant: str) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tools.xla_lowering import RECORD
    from trainer.graph import build_graph_step

    family, flavor, mode, n_layers, *rest = variant.split(":")
    args, model, opt, plan = _build(family, flavor, int(n_layers))
    step = build_graph_step(
        model=model,
        optimizer=opt,
        max_norm=MAX_NORM,
        backend="aot_eager",
        scan_layers=(mode == "scan"),
        aux_loss_coef=1e-3 if getattr(args, "num_experts", 0) else 0.0,
        plan=plan,
    )
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ + 1), generator=g)
    RECORD.clear()
    start = time.perf_counter()
    with sdpa_kernel([SDPBackend.MATH]):
        out = step([(tokens[:, :-1], tokens[:, 1:])], LR)
        loss, grad_norm = out.loss, out.grad_norm
    rec = dict(RECORD)
    assert "pre" in rec, "the aot_eager graph was not called"
    # Which graph inputs are parameters and which their exp_avg (step 1: exp_avg = (1 - beta1) * grad).
    roles = {}
    for slot in step.slots.slots():
        roles[slot.param.data_ptr()] = ("param", slot.param.data_ptr())
        roles[slot.exp_avg.data_ptr()] = ("exp_avg", slot.param.data_ptr())
    rec["roles"] = [roles.get(a.data_ptr()) if torch.is_tensor(a) else None for a in rec.pop("originals")]
    assert rec["gm"] is step.graph_module
    rec.update(
        lower_only=rest == ["lower"],
        info=dict(
            graph_nodes=step.graph_nodes,
            scans=step.stats.scans,
            capture_s=time.perf_counter() - start,
            loss=float(loss),
            grad_norm=float(grad_norm),
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            head_dim=args.head_dim,
            seq_len=SEQ,
            tokens=BATCH * SEQ,
            num_experts=getattr(args, "num_experts", 0) or 0,
            num_matmul_params=args.num_active_params(exclude_embedding=True),
            num_matmul_params_one_layer=dataclasses.replace(args, n_layers=1).num_active_params(exclude_embedding=True),
            num_params=args.num_params(),
            lr=LR,
            eps=EPS,
            beta1=BETAS[0],
        ),
    )
    return rec


def _param_check(rec: dict, post_xla: list) -> dict:
    """Gradient differences (relative to each tensor's largest gradient) and parameter differences
    against a bound derived per element (test_lowering states both arguments)."""
    import numpy as np

    info = rec["info"]
    lr, eps, b1 = info["lr"], info["eps"], info["beta1"]
    by_param: dict = {}
    for i, role in enumerate(rec["roles"]):
        if role is not None:
            by_param.setdefault(role[1], {})[role[0]] = i
    grad_rel, worst_param, max_param_diff, max_grad_diff = 0.0, 0.0, 0.0, 0.0
    for idx in by_param.values():
        if "param" not in idx or "exp_avg" not in idx:
            continue
        g_ref = rec["post"][idx["exp_avg"]].double().numpy() / (1 - b1)
        g_xla = np.asarray(post_xla[idx["exp_avg"]], dtype=np.float64) / (1 - b1)
        p_pre = rec["pre"][idx["param"]].double().numpy()
        p_ref = rec["post"][idx["param"]].double().numpy()
        p_xla = np.asarray(post_xla[idx["param"]], dtype=np.float64)
        dg = np.abs(g_xla - g_ref)
        max_grad_diff = max(max_grad_diff, float(dg.max()))
        grad_rel = max(grad_rel, float(dg.max()) / max(float(np.abs(g_ref).max()), 1e-30))
        # First Adam step: p' = p (1 - lr wd) - lr g / (|g| + eps). By the mean value theorem the
        # update's difference is at most lr * eps * |dg| / (min|g| + eps)^2 when g_ref, g_xla share a
        # sign (2 lr otherwise), plus fp32 rounding of the update arithmetic: 4 ulp of |p| + lr.
        # The gradients are read back from fp32 exp_avg = 0.1 g, which adds one rounding of each.
        dg = dg + np.finfo(np.float32).eps * (np.abs(g_ref) + np.abs(g_xla))
        g_min = np.minimum(np.abs(g_ref), np.abs(g_xla))
        same = np.sign(g_ref) == np.sign(g_xla)
        bound = np.where(same, lr * eps * dg / (g_min + eps) ** 2, 2 * lr)
        bound = bound + 4 * np.finfo(np.float32).eps * (np.abs(p_pre) + lr)
        dp = np.abs(p_xla - p_ref)
        max_param_diff = max(max_param_diff, float(dp.max()))
        worst_param = max(worst_param, float((dp / bound).max()))
    return dict(
        max_grad_diff=max_grad_diff,
        grad_diff_rel=grad_rel,
        max_param_diff=max_param_diff,
        param_diff_over_bound=worst_param,
        params_checked=len(by_param),
    )


def lower_and_run(torchax, rec: dict, out_path: str) -> dict:
    import jax
    import numpy as np

    from tools.xla_lowering import as_jax_function

    env = torchax.default_env()
    fn, tensor_idx = as_jax_function(rec)
    pre = rec["pre"]
    jitted = jax.jit(fn)
    inputs = [env.t2j_copy(pre[i]) for i in tensor_idx]
    res = dict(rec["info"])
    t = time.perf_counter()
    lowered = jitted.lower(*inputs)
    res["lower_s"] = time.perf_counter() - t
    text = lowered.as_text()
    res["stablehlo_chars"] = len(text)
    res["stablehlo_while"] = text.count("stablehlo.while")
    if rec["lower_only"]:
        return res
    t = time.perf_counter()
    compiled = lowered.compile()
    res["xla_compile_s"] = time.perf_counter() - t
    t = time.perf_counter()
    outs, post = compiled(*inputs)
    jax.block_until_ready(post)
    res["xla_run_s"] = time.perf_counter() - t
    ref_loss, ref_norm = (float(rec["out"][k]) for k in (0, 1))
    res.update(
        xla_loss=float(np.asarray(outs[0])),
        aot_loss=ref_loss,
        xla_grad_norm=float(np.asarray(outs[1])),
        aot_grad_norm=ref_norm,
    )
    post_full = list(rec["pre"])
    for i, v in zip(tensor_idx, post):
        post_full[i] = np.asarray(v)
    # Every tensor the graph mutates must come back the same (parameters, moments, step counters).
    res["max_mutated_diff"] = max(
        float(np.abs(post_full[i] - rec["post"][i].numpy()).max()) for i in tensor_idx if rec["post"][i].numel()
    )
    res.update(_param_check(rec, post_full))
    t = time.perf_counter()
    exported = jax.export.export(jitted, platforms=["tpu"])(*inputs)
    with open(out_path, "wb") as f:
        f.write(exported.serialize())
    res["tpu_export_s"] = time.perf_counter() - t
    res["tpu_export"] = out_path
    return res


def main() -> None:
    out_dir, variants = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    from tools.xla_lowering import record_first_call

    record_first_call()
    results, records = {}, {}
    for v in variants:
        try:
            records[v] = capture(v)
        except Exception as e:  # reported per variant; the test decides
            results[v] = {
                "error": f"{type(e).__name__}: {e}"[:2000],
                "stage": "capture",
                "traceback": traceback.format_exc()[-3000:],
            }
    from tools.xla_lowering import add_lowerings, load_torchax

    torchax = load_torchax()
    add_lowerings(torchax.default_env())
    for v, rec in records.items():
        try:
            path = os.path.join(out_dir, v.replace(":", "_") + ".jax_export")
            results[v] = lower_and_run(torchax, rec, path)
        except Exception as e:
            results[v] = {
                "error": f"{type(e).__name__}: {e}"[:2000],
                "stage": "lower",
                "traceback": traceback.format_exc()[-3000:],
            }
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("torch", "jax", "jaxlib", "torchax")}
    print(json.dumps({"versions": versions, "variants": results}))


if __name__ == "__main__":
    main()
