#!/usr/bin/env python
"""The low-precision column of the MFU projection: each `[quantize]` pod recipe's step time from
its bf16 parent's projected program, with the quantized linears' matmuls at the chip's
low-precision peak and the quantization passes' HBM traffic added.

    python scripts/bench/low_precision_projection.py [--out docs/results/low_precision_projection.csv]

Why an analytic split and not a compile of the FP8 recipe: XLA's cost analysis counts a float8 or
int8 multiply-add like a bf16 one (docs/low_precision.md, "Compiled for TPU without one"), so a
compiled FP8 program's FLOPs would not show the MXU's 2x rate anyway, and the pod-size compiles
take 4-14 minutes each on the development machine. So, per recipe:

- **bf16 program**: the parent's projection as `scripts/mfu_suite.py --project` wrote it (the
  per-op compute time, the collectives at the target slice): docs/results/mfu_suite_2026-12-03_2ed2d29 for the
  dense recipes (FSDP-only small-slice compile, extrapolated), docs/results/mfu_suite_ep_2026-12-05_84e8d64 for the
  expert-parallel ones (the trainer's own program at full size, capacity dispatch as shipped).
- **Quantized matmul FLOPs** per device and step: the linears `apply_quantize` chooses on the
  recipe's meta model (parallelisms/quantize.py's own rule), 2 M N K per matmul for M tokens, each
  forward run twice under full activation checkpointing, the gradient matmuls once; int8's weight
  gradient stays bf16. The routed experts it quantizes (MoE recipes) likewise, at M = tokens x
  top-k x the capacity factor (the capacity layout computes its padding rows), the weight operand
  the device's local experts. Their share of the model's FLOPs (6N + 12·L·H·Q·T per token, x 4/3 under
  full AC) is applied to the dot FLOPs the compiled program executes where the projection has
  them (the dense rows: the 405B program runs 11 % fewer dot FLOPs than 8N + attention, so the
  analytic count alone would overstate the quantized part); the EP rows use the analytic count.
  At the bf16 peak they take F / peak_bf16 of the program's compute time (the projection charges
  a large matmul its FLOPs over the peak); at the chip's low-precision peak (v7x FP8 4614, v6e int8
  1836 TFLOP/s per chip, twice bf16: docs/low_precision.md) half that.
- **Quantization passes**: the HBM bytes per quantized operand element measured on the compiled
  Llama 3 8B block (docs/results/low_precision_block_compiles_2026-12-05_ddb6cff.json: the bytes a recipe adds over
  bf16 divided by the operand elements its 20 quantized dots read), times the pod step's quantized
  operand elements, over the HBM bandwidth (assets/anchors.toml). With `fsdp_float8_all_gather`
  (float8_tensorwise) the weights arrive quantized: the block compiled with float8 weights gives
  the bytes per activation / gradient operand element, and only those are counted.
- **Collectives**: the parent's, except under the float8 all-gather, where the quantized weights'
  gathers move 1 byte per element instead of 2 (`fsdp_traffic_ratio`).

compute_lp = compute_bf16 - F / peak_bf16 + F / peak_lp + extra bytes / HBM bandwidth; the step is
compute + collectives (exposed) or the larger (overlapped), as the bf16 bound. Same caveats as the
bf16 bound (docs/benchmarks.md "Projections"), plus: a matmul the projection charged by its bytes
(memory-bound) gains less than assumed; the recipes' matmuls at these widths are compute-bound.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import torch

import planner
from models.common.moe import MoE
from parallelisms.quantize import QuantizePlan, apply_quantize
from trainer.config import build_config, resolve_model_args
from trainer.runtime import cli

ROOT = Path(__file__).resolve().parents[2]

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

LOW_PRECISION_SPEEDUP = {"v7x": 4614 / 2307, "v6e": 1836 / 918}
"""The chip's low-precision peak over its bf16 peak (v7x FP8, v6e int8: docs/low_precision.md's
device table, Google's TPU7x and v6e pages)."""

# (variant, bf16 parent, projection CSV of the parent, MaxText tokens/s/chip bf16 -> FP8 on v7x as
# issue 41 quotes MaxText's TPU7x table, AI-Hypercomputer/tpu-recipes training/ironwood/README.md)
DENSE_CSV = ROOT / "docs/results/mfu_suite_2026-12-03_2ed2d29/mfu_suite_2026-12-03_2ed2d29.csv"
# the 405B recompiled and read with the corrected per-op model (docs/benchmarks.md, 2026-12-05)
DENSE_405_CSV = (
    ROOT / "docs/results/mfu_suite_405_corrected_2026-12-05_9efb0c7/mfu_suite_405_corrected_2026-12-05_9efb0c7.csv"
)
EP_CSV = (
    ROOT / "docs/results/mfu_suite_ep_compact_2026-12-05_2faca5f/mfu_suite_ep_compact_2026-12-05_2faca5f_programs.csv"
)
DSV3_CSV = (
    ROOT
    / "docs/results/mfu_suite_ep_compact_2026-12-05_2faca5f/mfu_suite_ep_compact_deepseek_v3_2026-12-06_5375d65_programs.csv"
)
VARIANTS = [
    ("llama3_405b_v7x_fp8", "llama3_405b_v7x", DENSE_405_CSV, (500, 764)),
    ("qwen3_235b_a22b_v7x_fp8", "qwen3_235b_a22b_v7x", EP_CSV, (4246, 4737)),
    ("deepseek_v3_671b_v7x_fp8", "deepseek_v3_671b_v7x", DSV3_CSV, (2446, 2968)),
    ("llama3_70b_v6e_int8", "llama3_70b_v6e", DENSE_CSV, None),
    ("qwen3_32b_v6e_int8", "qwen3_32b_v6e", DENSE_CSV, None),
]
MAXTEXT_70B_V7X = (2687, 4128)
"""Llama 3 70B on v7x, bf16 -> FP8 (no v7x 70B recipe here: beside the table, not in a row)."""

BLOCK_COMPILES = ROOT / "docs/results/low_precision_block_compiles_2026-12-05_ddb6cff.json"
# The compiled block: Llama 3 8B, 4096 tokens, forward + gradients, no AC; the last linear's (w2)
# forward is dropped by the compiler (its output is not needed), so 20 quantized dots.
BLOCK_TOKENS = 4096
BLOCK_LINEARS = {  # (out, in)
    "wq": (4096, 4096),
    "wk": (1024, 4096),
    "wv": (1024, 4096),
    "wo": (4096, 4096),
    "w1": (14336, 4096),
    "w3": (14336, 4096),
    "w2": (4096, 14336),
}


def matmuls(recipe: str, *, recompute: bool) -> list[str]:
    """The quantized matmuls one linear runs per step: forward (twice under full AC), input
    gradient, weight gradient (int8: not quantized)."""
    out = ["fwd", "fwd"] if recompute else ["fwd"]
    out.append("grad_input")
    if recipe != "int8":
        out.append("grad_weight")
    return out


def operand_elements(kind: str, n: int, k: int, m: int, *, weights: bool = True) -> int:
    """Elements of the two quantized operands of one matmul of a linear w [n, k] at m tokens
    (`weights=False`: the activation / gradient operands only, the weight arriving quantized)."""
    w = n * k if weights else 0
    return {"fwd": m * k + w, "grad_input": m * n + w, "grad_weight": m * n + m * k}[kind]


W8 = "float8_tensorwise_w8"
"""The block compile's name for float8_tensorwise with the float8 all-gather (the weight enters
the op as float8 and its scale: tests/xla/probes/quantize_xla.py `W8`)."""


def bytes_per_element(recipe: str) -> float:
    """HBM bytes the quantization passes add per quantized operand element, from the compiled
    8B block (module docstring). `W8`: per activation / gradient operand element (the weights
    arrive quantized; what the block saves reading float8 weights is netted in)."""
    compiles = json.loads(BLOCK_COMPILES.read_text())["compiles"]
    target = "v6e" if recipe == "int8" else "v7x"
    base, quant = (compiles[f"{target}:{r}"]["cost"] for r in ("bf16", recipe))
    elements = 0
    for name, (n, k) in BLOCK_LINEARS.items():
        for kind in matmuls(recipe, recompute=False):
            if name == "w2" and kind == "fwd":
                continue
            elements += operand_elements(kind, n, k, BLOCK_TOKENS, weights=recipe != W8)
    return (quant["bytes accessed"] - base["bytes accessed"]) / elements


FSDP_GATHERS_PER_STEP = 2
"""All-gathers of each weight per step under full activation checkpointing (the forward and the
backward's recompute)."""
FSDP_BYTES_BF16 = {"gather": 2, "reduce": 2}
"""Bytes per parameter element of one gather and of the gradient's reduce-scatter in the bf16
parent program as compiled: every collective the 405B program adds per layer is bf16 (3.49 GB of
all-gathers and 18.87 GB of collective-permutes, XLA:TPU's decomposed FSDP rings, per layer and
device; layers 2 minus 1 of the v7x-8 compile, 2026-12-06)."""


def fsdp_traffic_ratio(quantized_param_share: float) -> float:
    """The float8 all-gather's FSDP traffic over the bf16 program's: the quantized weights' gathers
    move 1 byte per element instead of 2; the reduce-scatter and the other weights are unchanged."""
    g, r = FSDP_GATHERS_PER_STEP * FSDP_BYTES_BF16["gather"], FSDP_BYTES_BF16["reduce"]
    return 1 - quantized_param_share * (g / 2) / (g + r)


def quantized_work(recipe_path: Path, tokens: int) -> dict:
    """Quantized matmul FLOPs and operand elements per device and step at `tokens` per device."""
    cfg = build_config(str(recipe_path))
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    with torch.device("meta"):
        model = family.model_cls(args)
    plan = QuantizePlan.of(cfg.quantize)
    chosen = set(apply_quantize(model, recipe=plan.recipe, filter_fqns=plan.filter_fqns, min_dim=plan.min_dim))
    recompute = cfg.activation_checkpoint.mode in ("full", "full_save_attention")
    flops = elements = quantized_params = expert_flops = 0
    cf = cfg.moe.capacity_factor or 1.0  # the capacity layout computes its padding rows too
    ep = max(cfg.parallelism.expert_parallel_degree, 1)
    for fqn, module in model.named_modules():
        if fqn in chosen:
            n, k = module.out_features, module.in_features
            quantized_params += n * k
            for kind in matmuls(plan.recipe, recompute=recompute):
                flops += 2 * tokens * n * k
                elements += operand_elements(kind, n, k, tokens, weights=not plan.fsdp_float8_all_gather)
        elif isinstance(module, MoE) and module.experts.recipe != "none":
            # The routed experts (quantized_grouped_mm / quantized_batched_mm): each device's
            # local experts see its tokens' top-k slots (balanced), times the capacity factor.
            experts = module.experts
            rows = tokens * module.router.top_k * cf
            hidden, dim = experts.w1.shape[1:]
            local_experts = experts.num_experts // ep
            quantized_params += 3 * experts.num_experts * hidden * dim
            for n, k in ((hidden, dim), (hidden, dim), (dim, hidden)):  # w1, w3, w2 as [out, in]
                for kind in matmuls(plan.recipe, recompute=recompute):
                    expert_flops += 2 * rows * n * k
                    weights = 0 if kind == "grad_weight" else local_experts * n * k
                    elements += operand_elements(kind, n, k, round(rows), weights=False) + weights
    flops += expert_flops
    from tools.recipe_check import plan_inputs

    model_flops = plan_inputs(cfg).flops_per_token(args.shape()) * tokens * (4 / 3 if recompute else 1)
    return {
        "recipe": W8 if plan.fsdp_float8_all_gather else plan.recipe,
        "flops": flops,
        "elements": elements,
        "linears": len(chosen),
        "expert_flops": expert_flops,
        "model_flops": model_flops,
        "quantized_param_share": quantized_params / sum(p.numel() for p in model.parameters()),
    }


def parent_row(csv_path: Path, parent: str) -> dict:
    for row in csv.DictReader(csv_path.open()):
        if row["recipe"] == parent and row["kind"].startswith("projection"):
            return row
    raise SystemExit(f"error: {csv_path}: no projection row for {parent}")


def project(variant: str, parent: str, csv_path: Path | None, maxtext) -> dict:
    cfg = build_config(str(ROOT / "configs" / f"{variant}.toml"))
    target = planner.parse_target(cfg.job.target)
    gen = target.generation.name
    peak = target.peak_flops  # bf16, per device
    anchors = tomllib.loads((ROOT / "assets" / "anchors.toml").read_text())
    hbm = anchors["hbm_gbps_per_device"][gen] * 1e9
    devices_per_chip = target.devices // target.chips
    t = cfg.training
    tokens = t.local_batch_size * t.seq_len * t.gradient_accumulation_steps  # per device (tp = cp = 1)
    label = cfg.quantize.recipe + (" + float8 all-gather" if cfg.quantize.fsdp_float8_all_gather else "")
    out = {"recipe": variant, "parent": parent, "target": cfg.job.target, "quantize": label}
    if csv_path is not None:
        row = parent_row(csv_path, parent)
        compute = float(row.get("hlo_compute_s") or row["compute_s"])
        comm = float(row["comm_s"])
        # tokens per device of the projected program (the dense projection's own batch)
        tokens = round(
            float(row.get("tokens_per_sec_exposed") or row["tokens_per_s_exposed"]) * float(row["step_exposed_s"])
        )
        out["program"] = csv_path.relative_to(ROOT).as_posix()
    work = quantized_work(ROOT / "configs" / f"{variant}.toml", tokens)
    bpe = bytes_per_element(work["recipe"])
    share = work["flops"] / work["model_flops"]  # of the model's FLOPs, recompute included
    program_flops = float(row["hlo_xla_flops"]) if csv_path is not None and row.get("hlo_xla_flops") else None
    t_bf16 = (share * program_flops if program_flops else work["flops"]) / peak
    t_lp = t_bf16 / LOW_PRECISION_SPEEDUP[gen]
    t_bytes = bpe * work["elements"] / hbm
    out.update(
        tokens_per_device=tokens,
        quantized_linears=work["linears"],
        quantized_tflop=work["flops"] / 1e12,
        quantized_share_of_model_flops=share,
        program_dot_tflop=program_flops / 1e12 if program_flops else "",
        quantized_matmul_s_bf16=t_bf16,
        quantized_matmul_s_lp=t_lp,
        quantize_bytes_per_element=bpe,
        quantize_pass_s=t_bytes,
    )
    if csv_path is not None:
        compute_lp = compute - t_bf16 + t_lp + t_bytes
        # SimpleFSDP's float8 all-gather: the quantized weights' gathers move half the bytes
        comm_lp = comm * fsdp_traffic_ratio(work["quantized_param_share"]) if work["recipe"] == W8 else comm
        for tag, c, cm in (("bf16", compute, comm), ("lp", compute_lp, comm_lp)):
            out[f"compute_s_{tag}"] = c
            out[f"step_exposed_s_{tag}"] = c + cm
            out[f"step_overlapped_s_{tag}"] = max(c, cm)
            out[f"tokens_per_chip_exposed_{tag}"] = tokens * devices_per_chip / (c + cm)
            out[f"tokens_per_chip_overlapped_{tag}"] = tokens * devices_per_chip / max(c, cm)
        out["comm_s"] = comm
        out["comm_s_lp"] = comm_lp
        out["quantized_param_share"] = work["quantized_param_share"]
        out["quantized_share_of_compute"] = t_bf16 / compute
        out["speedup_exposed"] = out["step_exposed_s_bf16"] / out["step_exposed_s_lp"]
        out["speedup_overlapped"] = out["step_overlapped_s_bf16"] / out["step_overlapped_s_lp"]
        fused = compute_lp - t_bytes  # the quantization passes' bytes removed altogether (an upper bound)
        out["speedup_exposed_fused"] = out["step_exposed_s_bf16"] / (fused + comm_lp)
        out["speedup_overlapped_fused"] = out["step_overlapped_s_bf16"] / max(fused, comm_lp)
    if maxtext:
        out["maxtext_bf16"], out["maxtext_fp8"] = maxtext
        out["maxtext_ratio"] = maxtext[1] / maxtext[0]
    return out


def comm_cell(r: dict) -> str:
    if r["comm_s_lp"] == r["comm_s"]:
        return f"{r['comm_s']:.2f}"
    return f"{r['comm_s']:.2f} -> {r['comm_s_lp']:.2f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| recipe (target) | quantized linears: share of bf16 compute | compute s bf16 -> low precision | "
        "collectives s | tokens/s/chip bf16 -> low precision, exposed / overlapped | speed-up exposed / overlapped | "
        "the same with the quantization passes free (a bound) | MaxText tokens/s/chip bf16 -> FP8 (ratio) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mt = (
            f"{r['maxtext_bf16']:,} -> {r['maxtext_fp8']:,} ({r['maxtext_ratio']:.2f}x)" if "maxtext_bf16" in r else "-"
        )
        if "compute_s_bf16" not in r:
            lines.append(
                f"| {r['recipe']} ({r['target']}, {r['quantize']}) | {r['quantized_share_of_model_flops']:.0%} of the "
                f"model's FLOPs ({r['quantized_tflop']:,.0f} TFLOP per device and step); no bf16 program projected | "
                f"- | - | - | - | - | {mt} |"
            )
            continue
        lines.append(
            f"| {r['recipe']} ({r['target']}, {r['quantize']}) | {r['quantized_share_of_compute']:.0%} | "
            f"{r['compute_s_bf16']:.2f} -> {r['compute_s_lp']:.2f} | {comm_cell(r)} | "
            f"{r['tokens_per_chip_exposed_bf16']:,.0f} -> {r['tokens_per_chip_exposed_lp']:,.0f} / "
            f"{r['tokens_per_chip_overlapped_bf16']:,.0f} -> {r['tokens_per_chip_overlapped_lp']:,.0f} | "
            f"{r['speedup_exposed']:.2f}x / {r['speedup_overlapped']:.2f}x | "
            f"{r['speedup_exposed_fused']:.2f}x / {r['speedup_overlapped_fused']:.2f}x | {mt} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/results/low_precision_projection.csv", help="the CSV to write")
    a = p.parse_args(argv)
    rows = [project(*v) for v in VARIANTS]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    for recipe in ("float8_rowwise", "float8_blockwise", "int8", W8):
        print(
            f"quantization passes: {bytes_per_element(recipe):.2f} HBM bytes per quantized operand element ({recipe})"
        )
    print(table(rows))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
