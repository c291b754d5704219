"""The outputs of scripts/mfu_suite.py: the published anchors (assets/anchors.toml) beside our rows,
the markdown tables of the measured runs and of the projections with their method notes, and the
PNG plots (matplotlib, imported where a plot is drawn).
"""

from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ANCHORS = Path(__file__).resolve().parents[1] / "assets" / "anchors.toml"
SIDE_BY_SIDE = Path(__file__).resolve().parents[1] / "docs" / "results" / "maxtext_side_by_side_2026-12-07_247c68f.csv"
"""The table of ours beside MaxText's program (scripts/bench/maxtext_side_by_side.py): the TPU headline."""


def load_anchors(path: Path = ANCHORS) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def anchor_per_device(anchor: dict) -> float | None:
    """An anchor's tokens/s per device (a v7x chip is two devices; other chips are one)."""
    tps = anchor.get("tokens_per_sec")
    if tps is None:
        return None
    return tps / 2 if anchor.get("per") == "chip" and anchor["hardware"] == "v7x" else tps


PROJECTION_NOTE = [
    'Method (docs/benchmarks.md, "Projections"): the recipe\'s step compiled for a small slice (1 and 2 layers, '
    "scan off, FSDP-style over one mesh axis) and extrapolated to its layers. Compute: per executed op of the "
    "optimized HLO, max(FLOPs / peak, HBM bytes / bandwidth), loop bodies times their trip count, plus the Pallas "
    "kernels (capture model; megablox's own CostEstimate bytes where the HLO carries one), floored at the model's "
    "FLOPs (causal). Collectives: each one's bytes over the ICI bandwidth of the torus dims its mesh axis spans "
    "at the recipe's target slice (FSDP over all of it), ring (n-1)/n with n the target's axis size "
    "(tools/xla_projection.py; ICI table in assets/anchors.toml). Overlap is an assumption, shown both ways: "
    "exposed = compute + collectives, overlapped = max(compute, collectives). Every number is an upper bound on "
    "MFU: rated bandwidths, ideal rings, no kernel inefficiency, no host overhead; the palm convention is capped "
    "at 100 %.",
]


PROGRAM_NOTE = [
    'Method (docs/benchmarks.md, "Projections"): the per-device program the trainer emits on the recipe\'s '
    "target (tools/tpu_compile.py: the fake world at the target's size, the real plan with expert parallelism, "
    "the EP dispatch and its all-to-alls (ragged when dropless, equal-split with a capacity), every collective as the trainer writes it, the Pallas kernels), "
    "compiled deviceless at full depth with the recipe's layer scan (loop bodies times their trip counts: "
    "nothing extrapolated). Compute: XLA ops per-op roofline + kernels (capture model; megablox's CostEstimate "
    "scaled from the worst-case receive buffer to the routed rows, its grid being sized on the device); "
    "collectives priced where torch-tpu's layout puts each group on the torus (groups' sizes, torus dims, "
    "all-to-all mean hops, a chip's links shared by its cores). Routing: the program's shapes are static and "
    "worst-case, so learned and random routing compile to the same buffers; the bound prices the gmm at the "
    "balanced rows, which random routing gives and learned routing only approaches.",
]


def anchor_for(anchors: dict, recipe: str) -> dict | None:
    return next((a for a in anchors.get("anchor", []) if a.get("recipe") == recipe), None)


def program_table(rows: list[dict], anchors: dict) -> list[str]:
    """The bound of each MoE recipe from the trainer's program, beside MaxText's run."""
    out = [
        "| recipe (projection, trainer's program) | target (chips) | compute s (XLA ops + kernels) | collectives s "
        "(per mesh axis) | step s exposed / overlapped | MFU % palm, exposed / overlapped | MFU % causal, exposed / "
        "overlapped | published | ratio ours / published, exposed / overlapped | EP all-to-all GB / s | dispatch "
        "ops GB / s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['recipe']} | {r.get('target', '-')} | {r['error']} |" + " - |" * 8)
            continue
        a = anchor_for(anchors, r.get("base_recipe", r["recipe"]))
        pub, ratio = "-", "-"
        if a:
            conv = a.get("convention")
            ref = a.get("mfu_pct_palm") if a.get("mfu_pct_palm") else a.get("mfu_pct")
            conv = "palm" if a.get("mfu_pct_palm") else conv
            pub = f"{ref} % {conv} ({a['framework']}, {a.get('chips', '?')} chips, seq {a.get('seq_len', '?')})"
            if conv in ("palm", "causal"):
                ratio = f"{r[f'mfu_{conv}_exposed'] / ref:.2f} / {r[f'mfu_{conv}_overlapped'] / ref:.2f}"
        out.append(
            f"| {r['recipe']} | {r['target']} ({r['chips']}) | {r['compute_s']:.3g} ({r['xla_s']:.3g} + "
            f"{r['kernel_s']:.3g}) | {r['comm_s']:.3g} ({r['comm_by_axis']}) | {r['step_exposed_s']:.3g} / "
            f"{r['step_overlapped_s']:.3g} | {r['mfu_palm_exposed']:.1f} / {r['mfu_palm_overlapped']:.1f} | "
            f"{r['mfu_causal_exposed']:.1f} / {r['mfu_causal_overlapped']:.1f} | {pub} | {ratio} | "
            f"{r['a2a_bytes'] / 1e9:.3g} / {r['a2a_s']:.3g} | {r['dispatch_ops_bytes'] / 1e9:.3g} / "
            f"{r['dispatch_ops_s']:.3g} |"
        )
    return out


def weak_table(rows: list[dict]) -> list[str]:
    out = [
        "| recipe | chips (devices) | how | compute s | collectives s (per axis) | step s exposed / overlapped | "
        "tokens/s per chip, exposed / overlapped | weak-scaling efficiency %, exposed / overlapped | "
        "MFU % palm, exposed / overlapped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['recipe']} | - ({r['devices']}) | {r['error']} |" + " - |" * 6)
            continue
        per_chip = r["devices"] / r["chips"]
        out.append(
            f"| {r['recipe']} | {r['chips']} ({r['devices']}) | {r['how']} | {r['compute_s']:.3g} | "
            f"{r['comm_s']:.3g} ({r['comm_by_axis']}) | {r['step_exposed_s']:.3g} / {r['step_overlapped_s']:.3g} | "
            f"{r['tokens_per_device_s_exposed'] * per_chip:.0f} / {r['tokens_per_device_s_overlapped'] * per_chip:.0f} | "
            f"{r['efficiency_exposed']:.1f} / {r['efficiency_overlapped']:.1f} | {r['mfu_palm_exposed']:.1f} / "
            f"{r['mfu_palm_overlapped']:.1f} |"
        )
    return out


ANNOUNCED_WEAK_SCALING = (8, 1024, 93.0)
"""The TorchTitan-on-TPU launch announcement's Qwen3-235B weak scaling, 8 -> 1,024 chips, in % (no
stored primary source: /work/shared/reference/anchors.md section 3.6 marks it unverified)."""


def write_weak_plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        pts = sorted(
            (r["chips"], r["efficiency_exposed"], r["efficiency_overlapped"])
            for r in rows
            if r["recipe"] == recipe and "error" not in r
        )
        if not pts:
            continue
        xs = [p[0] for p in pts]
        (line,) = ax.plot(xs, [p[2] for p in pts], marker="o", label=f"{recipe} (overlapped)")
        ax.plot(xs, [p[1] for p in pts], marker="x", ls="--", color=line.get_color(), label=f"{recipe} (exposed)")
    lo, hi, pct = ANNOUNCED_WEAK_SCALING
    ax.scatter(
        [hi],
        [pct],
        marker="*",
        s=150,
        color="black",
        zorder=3,
        label=f"announced {pct:.0f} % ({lo}->{hi} chips, unverified)",
    )
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="chips",
        ylabel="tokens/s per chip, % of the smallest size",
        title="weak scaling, projected (upper bound)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out.with_name(out.name + "_weak_scaling.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def measured_table(rows: list[dict]) -> list[str]:
    lines = [
        "| recipe | mode | nproc | ok | dtype | tok/s/dev | tok/s total | TFLOP/s/dev | MFU % (palm) | "
        "MFU % (causal) | MFU % vs best dtype | peak / best TFLOP/s | cpu busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['mode']} | {r['nproc']} | {r['ok']}/{r['runs']} | {r['dtype'] or '-'} | "
            f"{_fmt(r['tokens_per_sec'], ',.0f')} | {_fmt(r['tokens_per_sec_total'], ',.0f')} | "
            f"{_fmt(r['tflops'], '.3g')} | {_fmt(r['mfu_pct'], '.2f')} | {_fmt(r['mfu_pct_causal'], '.2f')} | "
            f"{_fmt(r['mfu_pct_best'], '.2f')} | {_fmt(r['peak_tflops'], '.3g')} / "
            f"{_fmt(r['peak_tflops_best'], '.3g')} | {_fmt(r['busy_before'], '.2f')} |"
        )
    return lines


def projection_table(rows: list[dict]) -> list[str]:
    """The step-time bound per recipe (compute + collectives from the compiled HLO), beside the
    plain roofline it replaces."""
    lines = [
        "| recipe (projection) | compiled for -> FSDP over | predicted MFU % causal / palm (scheduled; "
        "docs/maxtext_calibration.md) | compute s | collectives s (per axis) | "
        "step s exposed / overlapped | tok/s/dev exposed / overlapped | upper bound on MFU % causal, "
        "exposed / overlapped | upper bound on MFU % palm, exposed / overlapped | roofline MFU % palm (old) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r.get('target', '-')} | {r['error']} |  |  |  |  |  |  |  |")
            continue
        if "step_exposed_s" not in r:
            lines.append(
                f"| {r['recipe']} | {r['target']} | {r.get('bound_note', '-')} |  |  |  |  |  |  | {r['mfu_pct']:.1f} |"
            )
            continue
        sched = (
            f"{r['mfu_causal_scheduled']:.1f} / {r['mfu_palm_scheduled']:.1f}" if "mfu_causal_scheduled" in r else "-"
        )
        lines.append(
            f"| {r['recipe']} | {r['target']} -> {r.get('fsdp_devices') or '-'} devices | {sched} | "
            f"{r['hlo_compute_s']:.3g} | "
            f"{r['comm_s']:.3g} ({r['comm_by_axis']}) | {r['step_exposed_s']:.3g} / {r['step_overlapped_s']:.3g} | "
            f"{r['tokens_per_sec_exposed']:,.0f} / {r['tokens_per_sec_overlapped']:,.0f} | "
            f"{r['mfu_causal_exposed']:.1f} / {r['mfu_causal_overlapped']:.1f} | "
            f"{r['mfu_palm_exposed']:.1f} / {r['mfu_palm_overlapped']:.1f} | {r['mfu_pct']:.1f} |"
        )
    return lines


def counts_table(rows: list[dict]) -> list[str]:
    """What the bound was made of, per recipe (per device and step, at the recipe's layers)."""
    lines = [
        "| recipe | XLA-op FLOPs (HLO / compiler) | XLA-op HBM bytes (HLO / compiler) | kernel bytes "
        "(CostEstimate where carried) | collective bytes | calls with a CostEstimate | loops without a trip "
        "count | model FLOPs (causal) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "step_exposed_s" not in r:
            continue
        lines.append(
            f"| {r['recipe']} | {r['hlo_xla_flops']:.3e} / {_fmt(r.get('compiler_xla_flops'), '.3e')} | "
            f"{r['hlo_xla_bytes']:.3e} / {_fmt(r.get('compiler_xla_bytes'), '.3e')} | {r['hlo_kernel_bytes']:.3e} | "
            f"{r['hlo_collective_bytes']:.3e} | {r['kernel_calls_with_estimate']} | "
            f"{r['loops_without_trip_count']} | {r['model_flops_per_step']:.3e} |"
        )
    return lines


def anchor_match(anchor: dict, mine: dict, ici: dict) -> bool:
    """Whether a published run has our projection's model, chip count and sequence length."""
    if mine.get("kind") != "projection" or anchor.get("recipe") != mine.get("recipe"):
        return False
    per_chip = ici.get(anchor["hardware"], {}).get("devices_per_chip", 1)
    chips_ok = anchor.get("chips") is not None and mine.get("fsdp_devices") == anchor["chips"] * per_chip
    return chips_ok and anchor.get("seq_len") == mine.get("seq_len")


def anchor_table(anchors: dict, ours: dict[str, dict]) -> list[str]:
    """Each published anchor beside our row for its recipe (measured or projection); for a
    projection of the same model, chip count and sequence length, the ratio of our bound's
    tokens/s per device to the published (overlapped / exposed)."""
    lines = [
        "| published | framework | hardware | size | seq | tok/s/dev | MFU % (as published) | MFU % (palm) | "
        "ours (recipe) | ours tok/s/dev (overlapped / exposed) | ours MFU % (palm / causal, overlapped) | "
        "ratio ours / published (overlapped / exposed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ici = anchors.get("ici", {})
    for a in anchors.get("anchor", []):
        size = a.get("slice") or f"{a.get('chips', '?')} chips"
        mine = ours.get(a.get("recipe", ""), {})
        label = a.get("recipe", "-")
        if mine:
            label += f" ({mine.get('kind', 'measured')})"
        published = anchor_per_device(a)
        if "tokens_per_sec_overlapped" in mine:
            tps = f"{mine['tokens_per_sec_overlapped']:,.0f} / {mine['tokens_per_sec_exposed']:,.0f}"
            mfu = f"{mine['mfu_palm_overlapped']:.1f} / {mine['mfu_causal_overlapped']:.1f}"
            if published and anchor_match(a, mine, ici):
                ratio = (
                    f"{mine['tokens_per_sec_overlapped'] / published:.2f} / "
                    f"{mine['tokens_per_sec_exposed'] / published:.2f}"
                )
            else:
                ratio = "not the same chips / seq"
        else:
            tps = _fmt(mine.get("tokens_per_sec"), ",.0f")
            mfu = f"{_fmt(mine.get('mfu_pct'), '.1f')} / {_fmt(mine.get('mfu_pct_causal'), '.1f')}"
            ratio = "-"
        lines.append(
            f"| {a['model']} | {a['framework']} | {a['hardware']} | {size} | {a.get('seq_len', '-')} | "
            f"{_fmt(published, ',.0f')} | {a['mfu_pct']:g} ({a['convention']}) | "
            f"{_fmt(a.get('mfu_pct_palm'), 'g')} | {label} | {tps} | {mfu} | {ratio} |"
        )
    lines.append("")
    lines.append(
        "Sources: assets/anchors.toml (each anchor's `source` and `note`). v7x per-chip numbers are halved "
        "to per device; MFU is the same either way. The ratio is printed only where the published run has "
        "the recipe's model, chip count and sequence length (batch per device and parallelism may differ: "
        "see each anchor's note); tokens/s per device, so no MFU convention enters it."
    )
    return lines


def write_plots(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for recipe, mode in dict.fromkeys((r["recipe"], r["mode"]) for r in rows):
        pts = sorted(
            (r["nproc"], r["tokens_per_sec_total"], r["mfu_pct"], r["mfu_pct_causal"])
            for r in rows
            if r["recipe"] == recipe and r["mode"] == mode and r["tokens_per_sec"] is not None
        )
        if not pts:
            continue
        xs = [p[0] for p in pts]
        (line,) = ax_t.plot(xs, [p[1] for p in pts], marker="o", label=f"{recipe} {mode}")
        ax_m.plot(xs, [p[2] for p in pts], marker="o", color=line.get_color(), label=f"{recipe} {mode} (palm)")
        ax_m.plot(
            xs, [p[3] for p in pts], marker="x", ls="--", color=line.get_color(), label=f"{recipe} {mode} (causal)"
        )
    for ax in (ax_t, ax_m):
        ax.set_xticks(sorted({r["nproc"] for r in rows}))
    ax_t.set(xlabel="devices (processes)", ylabel="tokens/s, all devices", title="throughput vs devices")
    ax_m.set(xlabel="devices (processes)", ylabel="MFU % per device", title="MFU vs devices")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out.with_name(out.name + "_vs_devices.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    nmin = min((r["nproc"] for r in rows), default=1)
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        sel = [
            next((r for r in rows if r["recipe"] == rc and r["mode"] == mode and r["nproc"] == nmin), None)
            for rc in recipes
        ]
        xs = [j + i * width for j in range(len(recipes))]
        ax_t.bar(xs, [(r or {}).get("tokens_per_sec") or 0 for r in sel], width, label=mode)
        ax_m.bar(xs, [(r or {}).get("mfu_pct") or 0 for r in sel], width, label=f"{mode} (palm)")
        ax_m.scatter(
            xs,
            [(r or {}).get("mfu_pct_causal") or 0 for r in sel],
            marker="_",
            s=200,
            color="black",
            zorder=3,
            label="causal" if i == 0 else None,
        )
    for ax, ylabel in ((ax_t, "tokens/s per device"), (ax_m, "MFU % per device")):
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(recipes))], recipes)
        ax.set(ylabel=ylabel, title=f"{ylabel.split(' per')[0]} vs mode ({nmin} process{'es' if nmin > 1 else ''})")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out.with_name(out.name + "_vs_mode.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def calibrated_headline(path: Path = SIDE_BY_SIDE) -> list[str]:
    """The TPU headline: per MaxText run, our program's ratio to MaxText's (predicted time per token,
    > 1: ours faster) and the calibrated MFU (MaxText's published x the ratio), from the side-by-side
    CSV; [] without one. The bounds of the tables after it are upper bounds (a footnote)."""
    import csv

    if not path.is_file():
        return []
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if not r.get("calibrated_by")]
    md = [
        "### TPU headline: ours beside MaxText's program, calibrated",
        "",
        f"From {path.name} (scripts/bench/maxtext_side_by_side.py; docs/maxtext_calibration.md). "
        "Predictions, nothing has run on a TPU; MFU causal (MaxText's convention). The bounds below "
        "(exposed / overlapped) are upper bounds, kept as a footnote.",
        "",
        "| run | ours (recipe, overrides) | ratio (MaxText / ours) | calibrated MFU % | MaxText published MFU % |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"**{float(r['ratio']):.3f}**" if r.get("ratio") else (r.get("error") or "-")
        calibrated = f"**{float(r['calibrated_mfu_pct']):.1f}**" if r.get("calibrated_mfu_pct") else "-"
        md.append(
            f"| {r['run']} | {r['recipe']} {r.get('overrides', '')} | {ratio} | {calibrated} | "
            f"{r.get('maxtext_published_mfu_pct') or '-'} |"
        )
    return [*md, ""]


def projection_sections(
    projections: list, programs: list, weak: list, *, skipped: str, anchors: dict, headline: Path | None = SIDE_BY_SIDE
) -> list[str]:
    """The report's projection tables: the TPU headline (`calibrated_headline`), the FSDP bound with
    its method and what it is made of, the trainer-program bound of the expert-parallel recipes, the
    weak scaling; or why none was made."""
    md = calibrated_headline(headline) if headline is not None and (projections or programs) else []
    if projections:
        md += [
            *projection_table(projections),
            "",
            *PROJECTION_NOTE,
            "",
            "What the bound is made of (per device and step):",
            "",
            *counts_table(projections),
            "",
        ]
    elif not programs:
        md.append(f"Skipped: {skipped}.")
    if programs:
        md += [
            "### Expert parallelism in the bound: the trainer's own per-device program",
            "",
            *program_table(programs, anchors),
            "",
            *PROGRAM_NOTE,
            "",
        ]
    if weak:
        md += ["### Weak scaling, projected (same per-device batch)", "", *weak_table(weak), ""]
    return md


def ours_by_recipe(projections: list[dict], rows: list[dict]) -> dict[str, dict]:
    """Our row per recipe for the anchors table: a projection, or a measured row (the largest
    process count), which wins over a projection."""
    ours: dict[str, dict] = {}
    for p in projections:
        if "error" not in p:
            ours[p["recipe"]] = p
    for r in rows:
        if r["tokens_per_sec"] is not None:
            ours[r["recipe"]] = {**r, "kind": f"measured, {r['mode']}, {r['nproc']} dev"}
    return ours
