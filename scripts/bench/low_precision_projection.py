#!/usr/bin/env python
"""The low-precision pod recipes' speed from their own compiled programs: each `[quantize]` recipe's
per-device program and its bf16 parent's, compiled deviceless and walked by the same calibrated
scheduled projector, and the speed-up between them.

    flock /tmp/titan-heavy.lock nice python scripts/bench/low_precision_projection.py   # compile what is missing
    python scripts/bench/low_precision_projection.py --table-only                       # re-read the kept compiles
    python scripts/bench/low_precision_projection.py --recipes llama3_405b_v7x_fp8 --out /tmp/lp

**The headline: both programs through one projector.** `tools/mfu_projection.py` `program_row`:
the trainer's own per-device program (tools/tpu_compile.py, libtpu 0.0.52 in the ttpu venv; the
capture serves the quantized linears and experts with the TPU's own ops, titan_kernels/tpu/
qmatmul.py / qgmm.py, so the HLO holds the float8 / int8 dots a TPU run executes), its optimized HLO
walked in XLA's schedule (`scheduled_prediction`: MXU_EFFICIENCY 0.66 of the peak, collectives on
the target's torus), the same constants as MaxText's calibration rows (docs/maxtext_calibration.md).
A dot of float8 operands on a v7x, int8 on a v6e, is charged at the chip's low-precision peak
(assets/anchors.toml `[mxu_peak_tflops_per_chip]`: twice bf16's; tools/xla_hlo.py `peak_rates`).
Per recipe: both programs' predicted step, tokens/s per chip, MFU (MaxText's convention: model
FLOPs 6N + 6·L·H·Q·T per token, causal attention halved, recompute not counted, against the bf16
peak, whatever the dtype), the speed-up = parent step / low-precision step (the same tokens), the
share of the program's dot FLOPs that is low precision, the XLA ops' HBM bytes of both. MoE recipes
at random routing (`moe.routing=random`), as MaxText published its FP8 and bf16 runs; the bf16
parent's compile is read from --parent-cache (the side-by-side's, scripts/bench/
maxtext_side_by_side.py) when it is kept there at the same recipe values and flags.

**The fallback: the analytic split** of 2026-12-05 (`project`, the `analytic_*` columns): the
parent's old exposed / overlapped bounds (scripts/mfu_suite.py --project CSVs), the quantized
linears' share of the bf16 compute halved, the quantization passes' bytes from the compiled 8B block,
the float8 all-gather's halved weight gathers. Kept beside the headline to show what the programs
changed; not a prediction of the step.

Analytic details (`quantized_work`, `bytes_per_element`, `fsdp_traffic_ratio`):

- **Quantized matmul FLOPs** per device and step: the linears `apply_quantize` chooses on the
  recipe's meta model (parallelisms/quantize.py's own rule), 2 M N K per matmul for M tokens, each
  forward run twice under full activation checkpointing, the gradient matmuls once; int8's weight
  gradient stays bf16. The routed experts it quantizes (MoE recipes) likewise, at M = tokens x
  top-k x the capacity factor, the weight operand the device's local experts. Their share of the
  model's FLOPs is applied to the dot FLOPs the parent's program executes where the projection
  has them; at the chip's low-precision peak (twice bf16's) half the time.
- **Quantization passes**: the HBM bytes per quantized operand element measured on the compiled
  Llama 3 8B block (docs/results/low_precision_block_compiles_2026-12-05_ddb6cff.json), times the
  pod step's quantized operand elements, over the HBM bandwidth. With `fsdp_float8_all_gather`
  only the activation / gradient operands count.
- **Collectives**: the parent's, except under the float8 all-gather (`fsdp_traffic_ratio`).

Output: <out>.csv and <out>.md (default docs/results/low_precision_projection_<date>_<commit>).
Exit 0; 1 when a compile failed (its row says why); 2 bad input.
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
    ("llama3_405b_v7x_fp8", "llama3_405b_v7x", DENSE_405_CSV, (499.8, 763.5)),
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


RANDOM = (("moe.routing", "random"), ("moe.routing_benchmark_only", "true"))
"""MaxText's MoE runs (bf16 and FP8) were published with random routing: both programs compiled so."""
DEFAULT_CACHE = ROOT / "outputs" / "low_precision_projection"
PARENT_CACHE = ROOT / "outputs" / "maxtext_side_by_side"


MAXTEXT_RUNS = {"llama3_405b_v7x_fp8": ("llama3.1-405b_v7x-512", "llama3.1-405b-fp8_v7x-512")}
"""MaxText's bf16 and FP8 runs of the same model whose programs the calibration table projects
(scripts/bench/maxtext_compile.py): the projector's error on the FP8 / bf16 ratio. Not Qwen3-235B:
MaxText's FP8 experts are tokamax gmm kernels priced by their own cost estimate (its error there is
that estimate's), ours XLA ragged dots (docs/maxtext_calibration.md, "FP8")."""


def maxtext_csv() -> Path | None:
    """The newest calibration table (docs/results/maxtext_calibration_*.csv) that has an FP8 run."""
    for path in sorted((ROOT / "docs" / "results").glob("maxtext_calibration_*.csv"), reverse=True):
        if any("fp8" in r["run"] for r in csv.DictReader(path.open())):
            return path
    return None


def calibrate(row: dict, mt: dict[str, dict]) -> None:
    """The FP8 columns calibrated on MaxText's own programs (`MAXTEXT_RUNS`), added to `row`: MaxText's
    predicted FP8 / bf16 ratio (per token, its two programs through the same projector), the
    calibrated speed-up = ours x MaxText's published / predicted ratio, the per-token ratio of our
    FP8 program to MaxText's (> 1: ours faster) and the calibrated tokens/s/chip = MaxText's
    published FP8 rate x that ratio."""
    runs = MAXTEXT_RUNS.get(row["recipe"])
    if not runs or "speedup" not in row or not all(r in mt and mt[r].get("step_s") for r in runs):
        return
    bf, fp = (mt[r] for r in runs)
    per_token = {k: float(v["step_s"]) / float(v["tokens_per_device"]) for k, v in (("bf16", bf), ("fp8", fp))}
    row["maxtext_predicted_ratio"] = per_token["bf16"] / per_token["fp8"]
    row["maxtext_fp8_error_pct"] = float(fp["error_pct"])
    row["maxtext_bf16_error_pct"] = float(bf["error_pct"])
    if "maxtext_ratio" in row:
        row["calibrated_speedup"] = row["speedup"] * row["maxtext_ratio"] / row["maxtext_predicted_ratio"]
    ours = row["step_s_lp"] / row["tokens_per_device"]
    row["ratio_to_maxtext_fp8"] = per_token["fp8"] / ours
    if "maxtext_fp8" in row:
        row["calibrated_tokens_per_chip_lp"] = row["maxtext_fp8"] * row["ratio_to_maxtext_fp8"]


def routing(variant: str) -> tuple[tuple[str, str], ...]:
    """The overrides both programs of `variant` are compiled with: random routing for the MoE ones."""
    return RANDOM if variant.startswith(("qwen3_235b", "deepseek_v3")) else ()


def program_kept(cache: Path, recipe: str, overrides) -> bool:
    """Whether `program_compile` finds this compile under `cache` (it re-checks the values and flags)."""
    from tools.mfu_projection import override_tag

    folder = cache / f"{recipe}{override_tag(list(overrides))}"
    return (folder / "program.json").is_file() and (folder / "program.after_optimizations.txt").is_file()


def low_precision_share(hlo) -> dict:
    """The program's (a parsed `tools.xla_hlo.Hlo`) dot FLOPs per step by operand type
    (`dot_flops_by_type`): the low-precision share (float8 / int8 operands on both sides) and the
    largest other types."""
    from tools.xla_hlo import dot_flops_by_type

    by = dot_flops_by_type(hlo)
    total = sum(by.values()) or 1.0
    low = sum(v for k, v in by.items() if all(t.startswith(("f8", "s8", "u8")) for t in k.split(" x ")))
    top = sorted(by.items(), key=lambda kv: -kv[1])[:4]
    return {
        "dot_tflop": total / 1e12,
        "low_precision_dot_share": low / total,
        "dot_flops_by_type": "; ".join(f"{k} {v / total:.1%}" for k, v in top),
    }


def dot_seconds(hlo, *, gen: str, peak: float, anchors: dict) -> dict:
    """Where a program's (a parsed `tools.xla_hlo.Hlo`) XLA compute goes, per step, as the scheduled
    walk charges it (each op once
    per run at max(MXU FLOPs at its rate / (peak x MXU_EFFICIENCY), bytes / HBM)): the ops with dots
    (matmul fusions, the quantization passes fused into them included) and the rest (elementwise,
    reductions, copies; a quantization pass XLA did not fuse into its dot is here)."""
    from tools import xla_hlo
    from tools.xla_projection import MXU_EFFICIENCY

    mxu = xla_hlo.mxu_flops(hlo, 256 if gen in ("v6e", "v7x") else 128, xla_hlo.peak_rates(anchors, gen))
    hbm = anchors["hbm_gbps_per_device"][gen] * 1e9
    dots = other = 0.0
    for o in xla_hlo.compute_ops(hlo):
        if o.kind != "xla":
            continue
        t = o.times * max(mxu.get(o.name, 0.0) / (peak * MXU_EFFICIENCY), o.bytes / hbm)
        if o.name in mxu:
            dots += t
        else:
            other += t
    return {"dot_ops_s": dots, "other_xla_s": other}


def program_side(name: str, overrides, *, anchors: dict, ns, caches: list[Path]) -> dict:
    """One program's scheduled prediction (`program_row`) from the first cache that keeps it, else
    compiled into the last (--table-only: an error row instead)."""
    from tools.mfu_projection import program_row

    cache = next((c for c in caches if program_kept(c, name, overrides)), None)
    if cache is None and ns.table_only:
        where = " or ".join(c.relative_to(ROOT).as_posix() if c.is_relative_to(ROOT) else str(c) for c in caches)
        return {"error": f"not compiled (no kept compile under {where})"}
    cache = cache or caches[-1]
    row = program_row(name, list(overrides), anchors=anchors, timeout=ns.timeout, cache=cache)
    if row.get("error"):
        return row
    from tools.mfu_projection import override_tag
    from tools.xla_hlo import parse_hlo

    # the optimized HLO, parsed once for both readings
    hlo = parse_hlo((cache / f"{name}{override_tag(list(overrides))}" / "program.after_optimizations.txt").read_text())
    row.update(low_precision_share(hlo))
    row.update(dot_seconds(hlo, gen=row["generation"], peak=program_peak(row), anchors=anchors))
    row["cache"] = cache.relative_to(ROOT).as_posix() if cache.is_relative_to(ROOT) else str(cache)
    return row


def program_peak(row: dict) -> float:
    """The bf16 peak per device of a program row's generation (trainer.runtime.flops)."""
    from trainer.runtime.flops import TPU_PEAK_TFLOPS

    return TPU_PEAK_TFLOPS[row["generation"]] * 1e12


def program_row_of(variant: str, parent: str, csv_path: Path | None, maxtext, *, anchors: dict, ns) -> dict:
    """One table row: the low-precision program and its parent's, both predicted; the speed-up;
    MaxText's published FP8 ratio; the analytic split's figures beside them."""
    ovs = routing(variant)
    lp = program_side(variant, ovs, anchors=anchors, ns=ns, caches=[ns.cache])
    bf = program_side(parent, ovs, anchors=anchors, ns=ns, caches=[ns.parent_cache, ns.cache])
    row = {
        "recipe": variant,
        "parent": parent,
        "overrides": " ".join(f"{k}={v}" for k, v in ovs),
    }
    cfg = build_config(str(ROOT / "configs" / f"{variant}.toml"))
    row["target"] = cfg.job.target
    row["quantize"] = cfg.quantize.recipe + (" + float8 all-gather" if cfg.quantize.fsdp_float8_all_gather else "")
    for tag, r in (("lp", lp), ("bf16", bf)):
        if r.get("error"):
            row[f"error_{tag}"] = r["error"]
            continue
        per_chip = r["devices"] // r["chips"]
        row.update(
            {
                f"step_s_{tag}": r["step_scheduled_s"],
                f"tokens_per_chip_{tag}": r["tokens"] * per_chip / r["step_scheduled_s"],
                f"mfu_causal_{tag}": r["mfu_causal_scheduled"],
                f"mfu_palm_{tag}": r["mfu_palm_scheduled"],
                f"compute_s_{tag}": r.get("sched_compute_s"),
                f"exposed_comm_s_{tag}": r.get("exposed_comm_s"),
                f"xla_gbytes_{tag}": r.get("xla_bytes", 0.0) / 1e9,
                f"dot_ops_s_{tag}": r["dot_ops_s"],
                f"other_xla_s_{tag}": r["other_xla_s"],
                f"dot_tflop_{tag}": r["dot_tflop"],
                f"low_precision_dot_share_{tag}": r["low_precision_dot_share"],
                f"dot_flops_by_type_{tag}": r["dot_flops_by_type"],
                f"compiler_gib_{tag}": r.get("compiler_gib"),
                f"compile_s_{tag}": r.get("compile_s"),
                f"cache_{tag}": r["cache"],
                "tokens_per_device": r["tokens"],
            }
        )
    if "step_s_lp" in row and "step_s_bf16" in row:
        row["speedup"] = row["step_s_bf16"] / row["step_s_lp"]
    if maxtext:
        row["maxtext_bf16"], row["maxtext_fp8"] = maxtext
        row["maxtext_ratio"] = maxtext[1] / maxtext[0]
    calibrate(row, ns.maxtext)
    if csv_path is not None:  # the fallback: the analytic split of the parent's old bounds
        old = project(variant, parent, csv_path, maxtext)
        for k in ("speedup_exposed", "speedup_overlapped"):
            row[f"analytic_{k}"] = old[k]
    return row


COLUMNS = [
    "recipe",
    "parent",
    "target",
    "quantize",
    "overrides",
    "tokens_per_device",
    "step_s_bf16",
    "step_s_lp",
    "speedup",
    "maxtext_bf16",
    "maxtext_fp8",
    "maxtext_ratio",
    "maxtext_predicted_ratio",
    "calibrated_speedup",
    "ratio_to_maxtext_fp8",
    "calibrated_tokens_per_chip_lp",
    "maxtext_bf16_error_pct",
    "maxtext_fp8_error_pct",
    "analytic_speedup_exposed",
    "analytic_speedup_overlapped",
    "tokens_per_chip_bf16",
    "tokens_per_chip_lp",
    "mfu_causal_bf16",
    "mfu_causal_lp",
    "mfu_palm_bf16",
    "mfu_palm_lp",
    "compute_s_bf16",
    "compute_s_lp",
    "exposed_comm_s_bf16",
    "exposed_comm_s_lp",
    "dot_ops_s_bf16",
    "dot_ops_s_lp",
    "other_xla_s_bf16",
    "other_xla_s_lp",
    "xla_gbytes_bf16",
    "xla_gbytes_lp",
    "dot_tflop_bf16",
    "dot_tflop_lp",
    "low_precision_dot_share_lp",
    "dot_flops_by_type_lp",
    "compiler_gib_bf16",
    "compiler_gib_lp",
    "compile_s_bf16",
    "compile_s_lp",
    "cache_bf16",
    "cache_lp",
    "error_bf16",
    "error_lp",
]


def _f(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def calibrated(r: dict) -> str:
    """The speed-up calibrated on MaxText's FP8 / bf16 programs, where they are projected."""
    if "calibrated_speedup" not in r:
        return ""
    return (
        f"; calibrated **{r['calibrated_speedup']:.2f}x** (MaxText's two programs predicted "
        f"{r['maxtext_predicted_ratio']:.2f}x)"
    )


def split(r: dict, tag: str) -> str:
    """Dot ops / other XLA ops / the rest of the scheduled compute (the kernels) of one program."""
    rest = r[f"compute_s_{tag}"] - r[f"dot_ops_s_{tag}"] - r[f"other_xla_s_{tag}"]
    return f"{r[f'dot_ops_s_{tag}']:.2f} / {r[f'other_xla_s_{tag}']:.2f} / {rest:.2f}"


def markdown(rows: list[dict], header: list[str]) -> str:
    """The table: both programs' predicted steps, the speed-up, MaxText's published ratio, the old
    analytic split's, MFU (bf16 peak, causal)."""
    out = [*header, ""]
    out += [
        "| recipe (target, `[quantize]`) | parent predicted step s | low-precision predicted step s | **speed-up** "
        "| MaxText published FP8 / bf16 | old analytic split, exposed / overlapped | predicted MFU % parent -> "
        "low precision (bf16 peak, causal) | tokens/s/chip parent -> low precision | low-precision share of the "
        "dot FLOPs | compute / exposed comm s, parent -> low precision | of the compute: dot ops / other XLA ops / "
        "kernels s, parent -> low precision |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = r.get("error_lp") or r.get("error_bf16")
        if err:
            out.append(f"| {r['recipe']} ({r['target']}, {r['quantize']}) | {err} |" + " - |" * 9)
            continue
        mt = f"{r['maxtext_ratio']:.2f}x" if "maxtext_ratio" in r else "- (none published)"
        old = (
            f"{r['analytic_speedup_exposed']:.2f}x / {r['analytic_speedup_overlapped']:.2f}x"
            if "analytic_speedup_exposed" in r
            else "-"
        )
        out.append(
            f"| {r['recipe']} ({r['target']}, {r['quantize']}{', ' + r['overrides'] if r['overrides'] else ''}) "
            f"| {r['step_s_bf16']:.2f} | {r['step_s_lp']:.2f} | **{r['speedup']:.2f}x**{calibrated(r)} | {mt} | {old} "
            f"| {r['mfu_causal_bf16']:.1f} -> {r['mfu_causal_lp']:.1f} "
            f"| {r['tokens_per_chip_bf16']:,.0f} -> {r['tokens_per_chip_lp']:,.0f} "
            f"| {r['low_precision_dot_share_lp']:.0%} "
            f"| {_f(r.get('compute_s_bf16'), '.2f')} / {_f(r.get('exposed_comm_s_bf16'), '.2f')} -> "
            f"{_f(r.get('compute_s_lp'), '.2f')} / {_f(r.get('exposed_comm_s_lp'), '.2f')} "
            f"| {split(r, 'bf16')} -> {split(r, 'lp')} |"
        )
    return "\n".join(out) + "\n"


def parse(argv: list[str] | None):
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [v[0] for v in VARIANTS]
    p.add_argument("--recipes", default=",".join(names), help=f"comma list of {', '.join(names)}")
    p.add_argument(
        "--out",
        default=None,
        help="the table's path (.csv or without extension; default "
        "docs/results/low_precision_projection_<date>_<commit>); the .md beside it",
    )
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="the low-precision compiles (kept, reused)")
    p.add_argument(
        "--parent-cache", type=Path, default=PARENT_CACHE, help="where the bf16 parents' kept compiles are read first"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per compile")
    p.add_argument("--table-only", action="store_true", help="read the kept compiles; compile nothing")
    p.add_argument(
        "--maxtext-csv",
        type=Path,
        default=None,
        help="MaxText's calibration table with its FP8 run (default: the newest docs/results/maxtext_calibration_*.csv "
        "that has one)",
    )
    ns = p.parse_args(argv)
    path = ns.maxtext_csv or maxtext_csv()
    if ns.maxtext_csv is not None and not ns.maxtext_csv.is_file():
        p.error(f"--maxtext-csv: no file {ns.maxtext_csv}; allowed: a maxtext_calibration_*.csv of docs/results/")
    ns.maxtext = {r["run"]: r for r in csv.DictReader(path.open())} if path else {}
    ns.maxtext_path = path
    ns.recipes = [r for r in ns.recipes.split(",") if r]
    bad = [r for r in ns.recipes if r not in names]
    if bad:
        p.error(f"--recipes: unknown {', '.join(bad)}; allowed: {', '.join(names)}")
    ns.cache, ns.parent_cache = ns.cache.resolve(), ns.parent_cache.resolve()
    return ns


def main(argv: list[str] | None = None) -> int:
    from tools.maxtext_runs import write_tables
    from tools.mfu_report import load_anchors
    from trainer.runtime.device import cpu_model

    ns = parse(argv)
    anchors = load_anchors()
    rows, failed = [], False
    for variant, parent, csv_path, maxtext in VARIANTS:
        if variant not in ns.recipes:
            continue
        rows.append(program_row_of(variant, parent, csv_path, maxtext, anchors=anchors, ns=ns))
        failed |= any(k.startswith("error") for k in rows[-1]) and not ns.table_only
        print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)

    def header(commit: str) -> list[str]:
        return [
            "Each low-precision pod recipe's own per-device program and its bf16 parent's (tools/tpu_compile.py, "
            "deviceless, libtpu 0.0.52 via the ttpu venv), both through tools/mfu_projection.py's scheduled "
            f"prediction (MXU_EFFICIENCY 0.66, float8 / int8 dots at the chip's low-precision peak); commit {commit}.",
            "",
            f"CPU: {cpu_model()}. MFU in MaxText's convention (model FLOPs, causal attention halved) against the "
            "bf16 peak; speed-up = parent step / low-precision step (the same tokens per device). MaxText's FP8 "
            "ratios: tpu-recipes training/ironwood/README.md (../shared/reference/published_anchors.md). Old "
            "analytic split (`project`: the parents' old exposed / overlapped bounds, the quantized matmuls halved; "
            "docs/results/low_precision_projection_2026-12-05_932a036.csv): a fallback, not the headline. "
            "Calibrated (where MaxText's FP8 and bf16 programs of the model are projected, "
            f"{ns.maxtext_path.name if ns.maxtext_path else 'none'}): ours x MaxText's published / predicted ratio.",
        ]

    out = Path(ns.out) if ns.out else None
    if out is not None and out.suffix in (".csv", ".md"):
        out = out.with_suffix("")
    if out is not None and not out.is_absolute():
        out = ROOT / out
    write_tables(rows, name="low_precision_projection", out=out, columns=COLUMNS, header=header, markdown=markdown)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
