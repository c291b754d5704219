"""The blocks read from measurement CSVs in docs/results/: `pod_compiles`, `moe_dispatch_capacity`, the
Muon benchmarks, `moe_balance`, `cp_compiles`, `estimate_xla`, `low_precision_projection` and the
CPU peer tables."""

from __future__ import annotations

from pathlib import Path

from .planner import pod_compile_files, recipe_estimate

ROOT = Path(__file__).resolve().parents[3]


def render_moe_dispatch_capacity() -> str:
    """docs/results/moe_dispatch_capacity_*.csv (scripts/bench/moe_dispatch_cost.py): the dropless
    recipes as they shipped against the capacity-1.25 ones, per layer."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob("moe_dispatch_capacity_*.csv"))[-1:]
    out = [
        "| recipe | ep before / after | batch before / after | buffer rows per routed copy: dropless / capacity "
        "| buffers per layer (fwd + bwd), GiB | per 1k tokens, MiB | all-to-all per layer, GiB: dropless ragged / "
        "dropless equal split / capacity |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in csv.DictReader(path.read_text().splitlines()):
        f = {k: float(v) for k, v in r.items() if k != "recipe"}
        out.append(
            f"| `{r['recipe']}` | {r['ep_before']} / {r['ep_after']} | {r['batch_before']} / {r['batch_after']} "
            f"| {f['rows_per_copy_before']:.2f} / {f['rows_per_copy_after']:.2f} "
            f"| {f['buffer_gib_before']:.1f} / {f['buffer_gib_after']:.1f} "
            f"| {f['buffer_mib_per_1k_tokens_before']:.0f} / {f['buffer_mib_per_1k_tokens_after']:.0f} "
            f"| {f['a2a_gib_before_ragged']:.2f} / {f['a2a_gib_before_equal_split']:.1f} / {f['a2a_gib_after']:.1f} |"
        )
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}.)"


_COLLECTIVES = {
    "all_gather_into_tensor": "all-gather",
    "all_reduce": "all-reduce",
    "all_to_all_single": "all-to-all",
    "reduce_scatter_tensor": "reduce-scatter",
}


def render_pod_compiles() -> str:
    """The latest row of each recipe in docs/results/pod_compile_*.csv (`scripts/check_recipe.py
    --compile --compile-csv`; files oldest first: `pod_compile_files`), in the order compiled: the deviceless XLA compile of each pod recipe at full depth against the planner of
    that run (the `planned GiB` column; the planner of this commit is in docs/planner.md)."""
    import csv

    out = [
        "| recipe | target | mesh as compiled | program | compile s | args / out / temp GiB | compiler GiB "
        "| planned GiB (then) | verdict | CSV |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    latest: dict[str, tuple] = {}  # a later file (by name: date, then commit) replaces a recipe's row
    for path in pod_compile_files():
        lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
        for r in csv.DictReader(lines):
            latest.pop(r["recipe"], None)
            latest[r["recipe"]] = (path, r)
    for path, r in latest.values():
        program = r["program"]
        for name, short in _COLLECTIVES.items():
            program = program.replace(name, short)
        verdict = r["verdict"]
        if r["compiler GiB"] not in ("", "-") and r["planned GiB"] not in ("", "-"):
            verdict += f" ({float(r['compiler GiB']) / float(r['planned GiB']) - 1:+.0%})"
        cells = [
            r["recipe"].removesuffix(".toml"),
            r["target"],
            r["mesh as compiled"],
            program,
            r["compile s"],
            f"{r['args GiB']} / {r['out GiB']} / {r['temp GiB']}",
            r["compiler GiB"],
            r["planned GiB"],
            verdict,
            path.name,
        ]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


def render_muon_sharded() -> str:
    """docs/results/muon_sharded_*.csv (scripts/bench/bench_muon_sharded.py): the all-to-all and the
    gather of each stack side by side."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob("muon_sharded_*.csv"))[-1:]
    rows = list(csv.DictReader(path.read_text().splitlines()))
    out = [
        "| ranks | stack B x m x n | all-to-all ms | gather ms | speed-up | elements received per rank "
        "(a2a / gather) | whole matrices held (a2a / gather) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in dict.fromkeys((r["ranks"], r["stack"]) for r in rows):
        a2a, gather = (
            next(r for r in rows if (r["ranks"], r["stack"]) == key and r["variant"] == v)
            for v in ("all_to_all", "gather")
        )
        a_ms, g_ms = float(a2a["median_ms"]), float(gather["median_ms"])
        out.append(
            f"| {key[0]} | {key[1].replace('x', ' x ')} | {a_ms:.0f} | {g_ms:.0f} | {g_ms / a_ms:.1f}x "
            f"| {int(a2a['received_elems']) / 1e6:.1f} M / {int(gather['received_elems']) / 1e6:.1f} M "
            f"| {a2a['whole_matrices_held']} / {gather['whole_matrices_held']} |"
        )
    worst = max(float(r["max_abs_diff"]) for r in rows)
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}; max |difference| between the two: {worst:g}.)"


def render_muon_vs_adamw() -> str:
    """docs/results/muon_vs_adamw_*.csv and its `_curves` companion (scripts/bench/bench_muon.py):
    the mean train loss over four 10-step windows, the validation loss, the speed; the best of each
    optimizer in bold (the last window and the validation loss)."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob("muon_vs_adamw_*[0-9a-f].csv"))[-1:]
    rows = list(csv.DictReader(path.read_text().splitlines()))
    curves = list(csv.DictReader(path.with_name(path.stem + "_curves.csv").read_text().splitlines()))
    windows = ((21, 30), (51, 60), (101, 110), (141, 150))

    def mean_loss(r: dict, lo: int, hi: int) -> float:
        losses = [
            float(c["loss"])
            for c in curves
            if (c["optimizer"], c["lr"]) == (r["optimizer"], r["lr"]) and lo <= int(c["step"]) <= hi
        ]
        return sum(losses) / len(losses)

    best = {}
    for col in ("last", "val"):
        for opt in {r["optimizer"] for r in rows}:
            mine = [r for r in rows if r["optimizer"] == opt]
            key = (lambda r: mean_loss(r, *windows[-1])) if col == "last" else (lambda r: float(r["val_loss"]))
            best[col, opt] = min(mine, key=key)["lr"]
    out = [
        "| optimizer | lr | train loss, steps 21-30 | 51-60 | 101-110 | 141-150 | val loss | tokens/s | optimizer step ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        losses = [f"{mean_loss(r, lo, hi):.3f}" for lo, hi in windows]
        val = f"{float(r['val_loss']):.3f}"
        if best["last", r["optimizer"]] == r["lr"]:
            losses[-1] = f"**{losses[-1]}**"
        if best["val", r["optimizer"]] == r["lr"]:
            val = f"**{val}**"
        out.append(
            f"| {r['optimizer']} | {float(r['lr']):.0e} | ".replace("e-0", "e-")
            + " | ".join(losses)
            + f" | {val} | {int(r['tokens_per_s']):,} | {float(r['optimizer_step_ms']):.1f} |"
        )
    return "\n".join(out)


def csv_columns(glob: str, columns: dict[str, str]) -> str:
    """The latest docs/results/<glob> as a table: `columns` maps a CSV column to its header; a
    number is printed as the CSV has it (thousands grouped when it is a whole number >= 1000)."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob(glob))[-1:]
    out = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    for r in csv.DictReader(path.read_text().splitlines()):
        cells = [f"{int(r[c]):,}" if r[c].isdigit() and int(r[c]) >= 1000 else r[c] for c in columns]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}.)"


MOE_BALANCE_COLUMNS = {
    "variant": "variant",
    "max_vio_first": "MaxVio step 1",
    "max_vio_second_half_mean": "MaxVio 2nd half (mean)",
    "max_over_mean_final": "max/mean load, last step",
    "bias_abs_max": "max abs bias",
    "train_loss_last10": "train loss (last 10)",
    "val_loss": "val loss",
    "tokens_per_s": "tokens/s",
}
"""scripts/bench/bench_moe_balance.py's CSV columns and their headers (docs/moe.md, docs/results.md)."""


def render_moe_balance() -> str:
    return csv_columns("moe_balance_*[0-9a-f].csv", MOE_BALANCE_COLUMNS)


def render_cp_compiles() -> str:
    """docs/results/cp_128k_compiles_*.csv (the 128k recipes' attention sublayer compiled with CP,
    and the planner of that run beside it)."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob("cp_128k_compiles_2*.csv"))[-1:]
    out = [
        "| recipe | compiled for | cp | tokens / device | compiler: args / out / temp GiB (attention sublayer, "
        "fwd + bwd) | planner: layer attention terms / block-backward transient GiB | planner: whole step GiB "
        "(usable) | all-gather / reduce-scatter in StableHLO; compiled HLO | Mosaic calls | lower + compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in csv.DictReader(path.read_text().splitlines()):
        hlo = (
            f"{r['hlo_all_gather']} all-gather, {r['hlo_all_reduce']} all-reduce"
            if r["counted_in"] == "compiled HLO"
            else "not printable (jaxlib 0.10.2)"
        )
        cells = [
            r["recipe"],
            r["compiled_for"],
            r["cp"],
            f"{int(r['tokens_per_device']):,}",
            f"{r['compiler_args_gib']} / {r['compiler_out_gib']} / {r['compiler_temp_gib']}",
            f"{r['planner_layer_attention_gib']} / {r['planner_block_backward_gib']}",
            f"{r['planner_step_total_gib']} ({r['planner_usable_gib']})",
            f"{r['stablehlo_all_gather']} / {r['stablehlo_reduce_scatter']}; {hlo}",
            r["mosaic_calls"],
            f"{float(r['lower_s']) + float(r['compile_s']):.0f}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}; the planner columns are the planner of that run.)"


def render_estimate_xla() -> str:
    """docs/results/estimate_xla_<date>_<commit>.csv (`scripts/estimate_xla.py --csv`, the dense pod
    recipes compiled at full depth): the compiler's figures, the planner of that run (the CSV's
    columns) and the planner of this commit for the same recipe."""
    import csv

    import planner

    (path,) = sorted((ROOT / "docs" / "results").glob("estimate_xla_2*.csv"))[-1:]
    out = [
        "| recipe (target) | layers compiled | scan, flips | arguments | outputs | temp | **total** | HBM | verdict "
        "| planner then: total (usable), verdict; compiler vs it | planner of this commit; compiler vs it "
        "| capture / compile / wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in csv.DictReader(path.read_text().splitlines()):
        name = r["recipe"].removesuffix(".toml")
        now = recipe_estimate(name)[1].total / planner.GiB
        total = float(r["total_gib"])
        cells = [
            f"{name} ({r['target']})",
            r["layers"],
            f"{'scan' if r['scan'] == '1' else 'unrolled'}, {r['flips']}",
            r["arg_gib"],
            r["out_gib"],
            r["temp_gib"],
            f"**{r['total_gib']}**",
            r["hbm_gib"],
            r["verdict"],
            f"{float(r['planner_total_gib']):.2f} ({r['planner_usable_gib']}), {r['planner_verdict']}; "
            f"{r['total_diff_pct']} %",
            f"{now:.2f}; {(total / now - 1) * 100:+.1f} %",
            f"{r['capture_s']} / {r['compile_s']} / {r['wall_s']}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def render_low_precision_projection() -> str:
    """docs/results/low_precision_projection_*.csv (scripts/bench/low_precision_projection.py): each
    low-precision recipe's own program and its bf16 parent's, both through the scheduled projector."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob("low_precision_projection_*.csv"))[-1:]
    out = [
        "| recipe (target, `[quantize]`) | parent predicted step s | low-precision predicted step s | **speed-up** "
        "| MaxText published FP8 / bf16 | old analytic split, exposed / overlapped | predicted MFU % parent -> "
        "low precision (bf16 peak, causal) | tokens/s/chip parent -> low precision | low-precision share of the "
        "dot FLOPs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    text = {"recipe", "parent", "target", "quantize", "overrides"}
    for r in csv.DictReader(path.read_text().splitlines()):
        f = {
            k: float(v)
            for k, v in r.items()
            if v and k not in text and not k.startswith(("error", "cache", "dot_flops_by"))
        }
        label = f"{r['recipe']} ({r['target']}, {r['quantize']}{', random routing' if r['overrides'] else ''})"
        if r.get("error_lp") or r.get("error_bf16"):
            out.append(f"| {label} | {r.get('error_bf16') or '-'} | {r.get('error_lp') or '-'} |" + " - |" * 6)
            continue
        mt = f"{f['maxtext_ratio']:.2f}x" if "maxtext_ratio" in f else "- (none published)"
        cal = (
            f"; calibrated **{f['calibrated_speedup']:.2f}x** (MaxText's FP8 and bf16 programs predicted "
            f"{f['maxtext_predicted_ratio']:.2f}x)"
            if "calibrated_speedup" in f
            else ""
        )
        old = (
            f"{f['analytic_speedup_exposed']:.2f}x / {f['analytic_speedup_overlapped']:.2f}x"
            if "analytic_speedup_exposed" in f
            else "-"
        )
        out.append(
            f"| {label} | {f['step_s_bf16']:.2f} | {f['step_s_lp']:.2f} | **{f['speedup']:.2f}x**{cal} | {mt} | {old} "
            f"| {f['mfu_causal_bf16']:.1f} -> {f['mfu_causal_lp']:.1f} "
            f"| {f['tokens_per_chip_bf16']:,.0f} -> {f['tokens_per_chip_lp']:,.0f} "
            f"| {f['low_precision_dot_share_lp'] * 100:.0f} % |"
        )
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}.)"


TORCHTITAN = "TorchTitan 0.3.0's own trainer (SDPA, its debugmodel, its SelectiveAC{})"
PEER_TABLES = {
    # block name -> (CSV, [(variant, label, ratio in bold)], peak memory column, scan against the unrolled graph)
    "peer_ttshape_3c806bd": (
        "cpu_peer_ttshape_2026-12-02_3c806bd.csv",
        [
            ("torchtitan", TORCHTITAN.format("; glibc defaults"), False),
            ("eager", "ours eager, bf16", True),
            ("graph", "ours graph, bf16", True),
            ("graph_scan", "ours graph + layer scan, bf16", True),
            ("graph_system", 'ours graph, bf16, `host_malloc = "system"`', False),
        ],
        True,
        True,
    ),
    "peer_ttshape_f5ff70c": (
        "cpu_peer_ttshape_2026-12-02_f5ff70c.csv",
        [
            ("torchtitan", TORCHTITAN.format(""), False),
            ("eager", "ours eager, bf16", True),
            ("graph", "ours graph, bf16", True),
        ],
        False,
        False,
    ),
    "peer_ttshape_8f1e82f": (
        "cpu_peer_ttshape_2026-12-02_8f1e82f.csv",
        [
            ("torchtitan", TORCHTITAN.format(""), False),
            ("eager", "ours eager, bf16", True),
            ("graph", "ours graph, bf16", True),
            ("graph_scan", "ours graph + layer scan, bf16", True),
        ],
        False,
        False,
    ),
}
"""docs/benchmarks.md's peer tables (`scripts/benchmark.py --preset ttshape`), from their CSVs."""


def render_peer_table(name: str) -> str:
    import csv

    csv_name, labels, mem, scan_note = PEER_TABLES[name]
    rows = {r["variant"]: r for r in csv.DictReader((ROOT / "docs" / "results" / csv_name).read_text().splitlines())}
    peer = float(rows["torchtitan"]["tokens_per_sec"])
    head = "| run | tok/s | vs TorchTitan (defaults vs defaults) | MFU % (of the bf16 peak) |" + (
        " peak mem GiB |" if mem else ""
    )
    out = [head, "|---|---|---|---|" + ("---|" if mem else "")]
    for variant, label, bold in labels:
        r = rows[variant]
        tok = float(r["tokens_per_sec"])
        ratio = f"{tok / peer:.2f}x"
        ratio = f"**{ratio}**" if bold else ratio
        if scan_note and variant == "graph_scan":
            ratio += f" ({tok / float(rows['graph']['tokens_per_sec']):.2f}x of the unrolled graph)"
        mfu = f"{float(r['mfu_pct']):.1f}" if r.get("mfu_pct") else "-"
        cells = [
            label,
            f"{tok:,.0f} ({float(r['tokens_per_sec_min']):,.0f}..{float(r['tokens_per_sec_max']):,.0f})",
            ratio,
            mfu,
        ]
        if mem:
            cells.append(f"{float(r['mem_gib']):.2f}" if r.get("mem_gib") else "-")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
