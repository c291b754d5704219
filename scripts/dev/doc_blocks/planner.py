"""The blocks planned from the recipes as shipped (`planner.plan_estimate`) and the planner's searches:
docs/planner.md `pod_recipes`, `recommend`, `moe_search`, `breakdown`; `ep_recipes`, `cp_recipes`,
`low_precision_recipes`, `optimizer_memory`."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# -------------------------------------------------------------------------- planner figures


def pod_recipes() -> list[str]:
    """The recipes with a `[job] target` (the pod recipes), by name."""
    import tomllib

    return [
        p.stem
        for p in sorted((ROOT / "configs").glob("*.toml"))
        if tomllib.loads(p.read_text()).get("job", {}).get("target")
    ]


def recipe_estimate(name: str, overrides: tuple[tuple[str, str], ...] = ()):
    """(config, `planner.Estimate`) of configs/<name>.toml on its `[job] target` with the recipe's
    degrees, as `scripts/estimate.py --config` plans it (the one-block probe: the same total)."""
    import planner
    from tools.recipe_check import plan_inputs
    from trainer.config import build_config

    cfg = build_config(str(ROOT / "configs" / f"{name}.toml"), list(overrides))
    p = cfg.parallelism
    est = planner.plan_estimate(
        plan_inputs(cfg),
        planner.parse_target(cfg.job.target),
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        tp=p.tensor_parallel_degree,
        ep=p.expert_parallel_degree,
        cp=p.context_parallel_degree,
        ac_mode=cfg.activation_checkpoint.mode,
        loss_parallel=p.enable_loss_parallel,
        probe=True,
    )
    return cfg, est


def pod_compile_files() -> list[Path]:
    """docs/results/pod_compile_<date>_<commit>[_<part>].csv, oldest first: by date, then by the
    commit's time (a short hash does not sort in time), then by name."""
    import re
    import subprocess

    def key(path: Path):
        m = re.match(r"pod_compile_(\d{4}-\d{2}-\d{2})_([0-9a-f]{7,})", path.name)
        if not m:
            return ("", 0, path.name)
        r = subprocess.run(["git", "log", "-1", "--format=%ct", m.group(2)], cwd=ROOT, capture_output=True, text=True)
        return (m.group(1), int(r.stdout.strip() or 0), path.name)

    return sorted((ROOT / "docs" / "results").glob("pod_compile_*.csv"), key=key)


def compiled_figures() -> dict[str, tuple[str, str, str, str]]:
    """recipe -> (compiler GiB, planned GiB then, verdict, CSV name) from
    docs/results/pod_compile_*.csv; a later file (`pod_compile_files`) overrides an
    earlier one's row."""
    import csv

    out = {}
    for path in pod_compile_files():
        lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
        for row in csv.DictReader(lines):
            out[row["recipe"].removesuffix(".toml")] = (
                row["compiler GiB"],
                row["planned GiB"],
                row["verdict"],
                path.name,
            )
    return out


def _layout(cfg, est) -> str:
    axes = [f"FSDP {est.dp_shard}"]
    if est.dp_replicate > 1:
        axes.insert(0, f"replicate {est.dp_replicate}")
    axes += [f"{name} {n}" for name, n in (("TP", est.tp), ("CP", est.cp), ("EP", est.ep)) if n > 1]
    parts = [" x ".join(axes)]
    if cfg.compile.scan_layers:
        parts.append("scan")
    parts.append(f"AC {est.ac_mode}")
    parts.append(f"{est.local_batch_size} x {est.seq_len}")
    if est.ep > 1:
        parts.append(f"capacity {cfg.moe.capacity_factor:g}" if cfg.moe.capacity_factor else "dropless")
    if cfg.quantize.recipe != "none":
        parts.append(cfg.quantize.recipe)
    return ", ".join(parts)


def render_pod_recipes() -> str:
    import planner

    gib = planner.GiB
    compiled = compiled_figures()
    out = [
        "| recipe | target | layout | planner GiB / usable | tokens / device / step | est. step s, tok/s/device "
        "(40 % MFU) | compiled GiB (the planner then: verdict; CSV) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in pod_recipes():
        cfg, est = recipe_estimate(name)
        fits = "" if est.fits else " (does not fit)"
        gib_c, planned, verdict, csv_name = compiled.get(name, ("-", "", "not compiled", ""))
        if gib_c != "-":
            where = f"{gib_c} (planned {planned} then: {verdict}; {csv_name})"
        else:
            where = f"{verdict} ({csv_name})" if csv_name else verdict
        out.append(
            f"| {name} | {est.target.name} | {_layout(cfg, est)} | {est.total / gib:.1f} / {est.usable / gib:.1f}{fits} "
            f"| {est.tokens_per_device_step:,.0f} | {est.step_time_s:.2f}, {est.tokens_per_s:,.0f} | {where} |"
        )
    return "\n".join(out)


def render_recommend() -> str:
    """`scripts/estimate.py --model M --flavor F --target T --recommend --csv` for a few model and
    target pairs (docs/results/planner_recommend_*.csv: the first row and the first fitting ones of
    each search, in `recommend`'s order): the first fitting plan of each, or the smallest when none fits."""
    import csv

    gib = 2**30
    (path,) = sorted((ROOT / "docs" / "results").glob("planner_recommend_*.csv"))[-1:]
    rows = list(csv.DictReader(path.read_text().splitlines()))
    out = [
        "| model | target | recommended plan | GiB / device (usable) | tokens / device / step "
        "| est. step s, tok/s/device at 40 % MFU (x recompute) |",
        "|---|---|---|---|---|---|",
    ]
    for key in dict.fromkeys((r["model"], r["target"]) for r in rows):
        plans = [r for r in rows if (r["model"], r["target"]) == key]
        best = next((r for r in plans if r["fits"] == "True"), None)
        r = best or plans[0]
        axes = [f"FSDP {r['dp_shard']}"]
        if int(r["dp_replicate"]) > 1:
            axes.insert(0, f"replicate {r['dp_replicate']}")
        axes += [f"{a} {r[k]}" for a, k in (("CP", "cp"), ("TP", "tp"), ("EP", "ep")) if int(r[k]) > 1]
        plan = " x ".join(axes) + (" (loss parallel)" if r["loss_parallel"] == "True" and int(r["tp"]) > 1 else "")
        plan += f", AC {r['ac_mode']}, batch {r['local_batch_size']}"
        total = int(r["total_bytes"]) / gib
        if best is None:
            out.append(f"| {key[0]} | {key[1]} | **none fits**: closest {plan} needs {total:.2f} | - | - | - |")
            continue
        out.append(
            f"| {key[0]} | {key[1]} | {plan} | {total:.2f} ({int(r['usable_bytes']) / gib:.1f}) "
            f"| {float(r['tokens_per_device_step']):,.0f} | {float(r['est_step_s']):.2f} s, "
            f"{float(r['est_tokens_per_s_per_device']):,.0f} |"
        )
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}.)"


def render_moe_search() -> str:
    """The dropless DeepSeek-V3 / Kimi K2 slice search of docs/results/planner_*_v7x_*.csv
    (`estimate.py --recommend --csv`): per target the first fitting plan in `recommend`'s order
    (least recompute, most tokens per device, largest EP), or the smallest plan when none fits,
    and up to three other fitting (EP, batch) layouts."""
    import csv

    gib = 2**30
    rank = {"none": 0, "selective": 1, "full": 2}
    out = [
        "| model | target | best plan | GiB / device (usable) | other fitting layouts (EP, batch, GiB) | CSV |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted((ROOT / "docs" / "results").glob("planner_*_v7x_*.csv")):
        rows = list(csv.DictReader(path.read_text().splitlines()))
        for target in sorted({r["target"] for r in rows}, key=lambda t: int(t.rsplit("-", 1)[1])):
            plans = [r for r in rows if r["target"] == target]
            fitting = sorted(
                (r for r in plans if r["fits"] == "True"),
                key=lambda r: (
                    int(r["tp"]),
                    int(r["cp"]),
                    rank[r["ac_mode"]],
                    -float(r["tokens_per_device_step"]),
                    -int(r["ep"]),
                    int(r["dp_replicate"]),
                ),
            )
            name = plans[0]["model"]

            def layout(r: dict) -> str:
                return f"EP {r['ep']}, AC {r['ac_mode']}, batch {r['local_batch_size']}"

            if not fitting:
                smallest = min(plans, key=lambda r: int(r["total_bytes"]))
                need = int(smallest["total_bytes"]) / gib
                out.append(
                    f"| {name} | {target} | none fits: {layout(smallest)} needs {need:.1f} | - | - | {path.name} |"
                )
                continue
            best, others, seen = fitting[0], [], set()
            seen.add((best["ep"], best["local_batch_size"]))
            for r in fitting[1:]:
                key = (r["ep"], r["local_batch_size"])
                if key not in seen and r["ac_mode"] == best["ac_mode"]:
                    seen.add(key)
                    others.append(f"EP {r['ep']} b{r['local_batch_size']} {int(r['total_bytes']) / gib:.1f}")
            out.append(
                f"| {name} | {target} | {layout(best)} | {int(best['total_bytes']) / gib:.1f} "
                f"({int(best['usable_bytes']) / gib:.1f}) | {'; '.join(others[:3])} | {path.name} |"
            )
    return "\n".join(out)


def render_ep_recipes() -> str:
    """The pod recipes with expert parallelism, planned as shipped, with their compiled figure."""
    import planner

    gib = planner.GiB
    compiled = compiled_figures()
    out = [
        "| recipe | target | layout | efsdp | per device, planner (usable) | compiled (CSV) |",
        "|---|---|---|---|---|---|",
    ]
    for name in pod_recipes():
        cfg, est = recipe_estimate(name)
        if est.ep == 1:
            continue
        efsdp = est.dp_shard * est.cp // est.ep
        gib_c, _, verdict, csv_name = compiled.get(name, ("-", "", "not compiled", ""))
        where = f"{gib_c} GiB ({csv_name})" if gib_c != "-" else (f"{verdict} ({csv_name})" if csv_name else verdict)
        out.append(
            f"| {name} | {est.target.name} | {_layout(cfg, est)} | {efsdp} | {est.total / gib:.1f} GiB "
            f"({est.usable / gib:.1f}) | {where} |"
        )
    return "\n".join(out)


BREAKDOWN_RECIPES = ("llama3_8b_v6e", "llama3_70b_v6e", "llama3_405b_v7x")
"""The dense Llama 3 pod recipes whose per-device terms docs/planner.md tabulates."""


def render_breakdown() -> str:
    """Per-device terms of the dense Llama 3 pod recipes as shipped (GiB; scripts/estimate.py's rows)."""
    import planner

    ests = [recipe_estimate(name)[1] for name in BREAKDOWN_RECIPES]

    def g(n: float) -> str:
        return f"{n / planner.GiB:.2f}"

    def transient(e) -> str:
        which = "loss / LM head" if e.transient == e.transient_loss else "block backward"
        return f"{g(e.transient)} ({which})"

    rows = [
        ("parameters / gradients / AdamW (fp32)", lambda e: f"{g(e.params)} / {g(e.grads)} / {g(e.optimizer)}"),
        ("bf16 weights kept for backward", lambda e: g(e.saved_weights)),
        (
            "block activations (AC full)",
            lambda e: f"{e.n_layers} x {g(e.activations.per_block)} = {g(e.activations.blocks)}",
        ),
        ("final norm, LM-head input, ids", lambda e: g(e.activations.outside)),
        ("loss (fused: fp32 log-sum-exp per token)", lambda e: g(e.activations.loss)),
        ("transient peak", transient),
        ("undonated update", lambda e: g(e.update)),
        ("**total** / usable", lambda e: f"**{g(e.total)}** / {e.usable / planner.GiB:.1f}"),
    ]
    head = ["| |"] + [f" {name} ({e.target.name}) |" for name, e in zip(BREAKDOWN_RECIPES, ests)]
    out = ["".join(head), "|---|" + "---|" * len(ests)]
    for label, cell in rows:
        out.append(f"| {label} | " + " | ".join(cell(e) for e in ests) + " |")
    return "\n".join(out)


CP_RECIPES = ("llama3_8b_128k_v6e", "llama3_8b_128k_v7x", "qwen3_32b_128k_v6e", "qwen3_32b_128k_v7x")


def render_cp_recipes() -> str:
    """The 128k recipes (context parallelism) as shipped."""
    import planner

    out = [
        "| recipe | target | layout | tokens / device | global batch | planner GiB / device (usable) |",
        "|---|---|---|---|---|---|",
    ]
    for name in CP_RECIPES:
        cfg, est = recipe_estimate(name)
        out.append(
            f"| configs/{name}.toml | {est.target.name} | {_layout(cfg, est)} | {est.tokens_per_device_step:,.0f} "
            f"| {est.global_batch_tokens / 2**20:g}M | {est.total / planner.GiB:.2f} ({est.usable / planner.GiB:.1f}) |"
        )
    return "\n".join(out)


def render_low_precision_recipes() -> str:
    """Each low-precision pod recipe (`[quantize] recipe` set) against its parent (the name without
    the last `_` suffix), as shipped."""
    import planner

    gib = planner.GiB
    out = [
        "| recipe | `[quantize]` | planner GiB per device: parent -> variant (usable) | of which the largest quantized "
        "backward's low-precision copies | the variant's peak |",
        "|---|---|---|---|---|",
    ]
    for name in pod_recipes():
        cfg, est = recipe_estimate(name)
        if cfg.quantize.recipe == "none":
            continue
        _, parent = recipe_estimate(name.rsplit("_", 1)[0])
        peak = "loss / LM head" if est.transient == est.transient_loss else "block backward"
        out.append(
            f"| `{name}` | {cfg.quantize.recipe} | {parent.total / gib:.1f} -> {est.total / gib:.1f} "
            f"({est.usable / gib:.1f}) | {est.quantize_transient / gib:.2f} | {peak} |"
        )
    return "\n".join(out)


OPTIMIZER_RECIPES = ("deepseek_v3_671b_v7x", "kimi_k2_v7x", "qwen3_235b_a22b_v7x")
"""The MoE pod recipes whose optimizer docs/optimizers.md discusses (their recipes use AdamW)."""


def render_optimizer_memory() -> str:
    import planner

    gib = planner.GiB
    out = [
        "| recipe (as shipped) | optimizer | total GiB / usable | optimizer state | undonated update | Muon's update matrices |",
        "|---|---|---|---|---|---|",
    ]
    for name in OPTIMIZER_RECIPES:
        for opt in ("adamw", "muon"):
            _, est = recipe_estimate(name, (("optimizer.name", opt),))
            muon = f"{est.muon_update / gib:.2f}" if opt == "muon" else "-"
            out.append(
                f"| {name} | {opt} | {est.total / gib:.1f} / {est.usable / gib:.1f} | {est.optimizer / gib:.2f} "
                f"| {est.update / gib:.2f} | {muon} |"
            )
    return "\n".join(out)
