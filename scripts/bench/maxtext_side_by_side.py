#!/usr/bin/env python
"""Our trainer's program beside MaxText's at the same shapes, through the same projector (issue 51,
item 4; docs/maxtext_calibration.md, "Ours side by side").

    flock /tmp/titan-heavy.lock nice python scripts/bench/maxtext_side_by_side.py            # compile what is missing
    python scripts/bench/maxtext_side_by_side.py --table-only                                # re-read the kept compiles
    python scripts/bench/maxtext_side_by_side.py --runs llama3.1-8b_v6e-256 --no-shipped

For each published MaxText run (scripts/bench/maxtext_compile.py `RUNS`), `PAIRS` names our nearest
recipe and the overrides that put it at MaxText's model, slice, global batch, sequence length and
routing (tokens per device equal); what our keys cannot match is in the row (`unmatched`). The
trainer's own per-device program is compiled deviceless (tools/mfu_projection.py `program_compile`,
tools/tpu_compile.py in the `ttpu` venv, HLO kept under --cache) and projected by `program_bound`'s
scheduled prediction: the same walk of XLA's schedule (tools/xla_schedule.py), the same constants
(MXU_EFFICIENCY, the host link, the ICI) as MaxText's rows of the calibration table, which are read
from its CSV (--maxtext-csv).

Per run: ours predicted step and MFU (our FLOPs count, causal), MaxText's predicted step and MFU,
the ratio = MaxText's predicted step / ours (per token: > 1 means ours is faster), and the
calibrated MFU = MaxText's published MFU (at the compiled MaxText's FLOPs) x the ratio. Then our
shipped recipes at their own settings (`--shipped`, default on): calibrated MFU = our predicted MFU
x (MaxText published / MaxText predicted) of the same model's run, i.e. our prediction corrected by
the projector's error on MaxText's program.

Output: <out>.csv and <out>.md (default docs/results/maxtext_side_by_side_<date>_<commit>).
Exit 0; 1 when a compile failed (its row says why); 2 bad input.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

DEFAULT_MAXTEXT_CSV = ROOT / "docs" / "results" / "maxtext_calibration_2026-12-06_625adf1.csv"
DEFAULT_CACHE = ROOT / "outputs" / "maxtext_side_by_side"
RANDOM = (("moe.routing", "random"), ("moe.routing_benchmark_only", "true"))


@dataclass(frozen=True)
class Pair:
    """Our nearest recipe to one MaxText run, the overrides to MaxText's shape, and what stays different."""

    recipe: str
    overrides: tuple[tuple[str, str], ...]
    unmatched: str
    per_token: int = 1
    """MaxText's tokens per device over ours: > 1 when ours is compiled at the recipe's micro-batch
    without the accumulation that would make up MaxText's batch (an unrolled accumulation repeats the
    micro-batch's program, its gathers and reduces: per token the same, bar the optimizer update,
    which the shorter step amortizes over fewer tokens); the ratio is per token either way."""


PAIRS: dict[str, Pair] = {
    "llama3.1-8b_v6e-256": Pair(
        "llama3_8b_v6e",
        (("training.local_batch_size", "4"),),
        "remat: ours full AC (recompute each block), MaxText a custom policy with the decoder input and "
        "q/k/v/out projections offloaded to host (no host-offload key here); gradient reduce fp32 (ours) vs bf16",
    ),
    "llama3.1-70b_v6e-256": Pair(
        "llama3_70b_v6e",
        (("training.local_batch_size", "1"), ("training.gradient_accumulation_steps", "5")),
        "batch 5 per device as 5 micro-batches of 1 (full AC at 5 x 8192 holds 80 layer inputs, 54 GB, "
        "over v6e's 32 GiB; MaxText offloads them to host); remat full AC vs MaxText's custom offload policy; "
        "gradient reduce fp32 vs bf16",
    ),
    "llama3.1-405b_v7x-512": Pair(
        "llama3_405b_v7x",
        (),
        "MaxText's batch 3 per device compiled as one micro-batch of 1 (the recipe; full AC at 3 x 8192 holds "
        "126 layer inputs, 101 GB, over 96 GiB, and 3 unrolled micro-batches were too long a compile for this "
        "session), per token; remat full AC vs MaxText's custom policy (decoder input and mlpwo offloaded); "
        "no vocab tiling key (MaxText num_vocab_tiling=4; ours the fused linear + CE kernel); fp32 moments "
        "and reduce vs MaxText's bf16 moments",
        per_token=3,
    ),
    "qwen3-235b-a22b_v7x-512": Pair(
        "qwen3_235b_a22b_v7x",
        RANDOM,
        "MaxText's batch 16 per device as the recipe's micro-batch of 8, per token; EP 16 with the capacity "
        "dispatch (factor 1.125, 4 chunks, async all-to-alls) vs MaxText's FSDP 512 dropless sparse_matmul (MaxText compiled with learned "
        "routing, ours random as published); full AC vs MaxText's remat",
        per_token=2,
    ),
    "deepseek3-671b_v7x-512": Pair(
        "deepseek_v3_671b_v7x",
        RANDOM,
        "MaxText's batch 8 per device as the recipe's micro-batch of 4, per token; FSDP 512 x EP 64 with the "
        "capacity dispatch (1.25, 4 chunks, async all-to-alls) vs MaxText's FSDP 256 x fsdp_transpose 2 dropless (compiled learned, ours "
        "random as published); full AC vs MaxText's remat",
        per_token=2,
    ),
}
"""In order of compile cost, the smallest first (as maxtext_compile.RUNS)."""

UNCHUNKED = (("moe.dispatch_chunks", "1"), ("device.libtpu_init_args", "[]"))
"""The MoE recipes before 2026-12-07: one all-to-all each way per layer, synchronous (docs/moe.md)."""
BEFORE = "the dispatch unchunked with synchronous all-to-alls (the recipe before 2026-12-07)"
OFFLOAD = ("activation_checkpoint.offload", "block_inputs")
"""The layer scan's saved block inputs kept in host memory (docs/graph_trainer.md, "Host offload of the
saved block inputs"): what lets MaxText's per-device batch fit in one micro-batch."""


def AT_BATCH(n: int) -> tuple[tuple[str, str], ...]:  # noqa: N802  (reads as a constant in FIXES)
    """`n` sequences per device in one micro-batch (no accumulation)."""
    return (("training.local_batch_size", str(n)), ("training.gradient_accumulation_steps", "1"))


FIXES: dict[str, tuple[tuple[tuple[tuple[str, str], ...], str], ...]] = {
    "llama3.1-8b_v6e-256": (
        (
            (("activation_checkpoint.mode", "full_save_attention"),),
            "full AC keeping splash's output and log-sum-exp (attention forward once, as MaxText's policy)",
        ),
    ),
    "llama3.1-70b_v6e-256": (
        ((("training.mixed_precision_reduce", "bfloat16"),), "gradient reduce in bf16 (as MaxText)"),
        (
            (*AT_BATCH(5), OFFLOAD),
            "5 sequences per device in one micro-batch (MaxText's batch), the block inputs in host memory "
            "(activation_checkpoint.offload=block_inputs, as MaxText's decoder_layer_input=offload)",
        ),
    ),
    "llama3.1-405b_v7x-512": (
        (
            (("device.libtpu_init_args", "[]"),),
            "without --xla_tpu_prefer_async_allgather_to_allreduce=true (the recipe before 2026-12-07; MaxText's "
            "405B recipe sets the flag)",
        ),
        (
            (
                ("parallelism.tensor_parallel_degree", "2"),
                ("training.local_batch_size", "2"),
                ("parallelism.enable_loss_parallel", "true"),
                ("device.libtpu_init_args", '["--xla_tpu_prefer_async_allgather_to_allreduce=true"]'),
            ),
            "FSDP 256 x TP 2 at 2 sequences per dp rank, loss parallel (the planner's --recommend), with the "
            "prefer-all-gather flag",
        ),
        (
            (*AT_BATCH(3), OFFLOAD),
            "3 sequences per device in one micro-batch (MaxText's batch), the block inputs in host memory "
            "(activation_checkpoint.offload=block_inputs, as MaxText's decoder_layer_input=offload)",
        ),
    ),
    "qwen3-235b-a22b_v7x-512": (
        (UNCHUNKED, BEFORE),
        (
            (UNCHUNKED[0],),
            "the dispatch unchunked, the all-to-alls asynchronous (--xla_tpu_enable_async_all_to_all=true alone)",
        ),
        ((("parallelism.expert_parallel_degree", "8"),), "EP 8 (a 2x2x1-chip group: fewer hops per all-to-all byte)"),
        (
            (("moe.capacity_factor", "1.15"),),
            "capacity factor 1.15 (random routing drops 0.013 % of the copies at seq 4096)",
        ),
        (
            (("moe.capacity_factor", "1.25"),),
            "capacity factor 1.25 (the recipe before 13126b7; 1.125 drops 0.051 % of the copies)",
        ),
    ),
    "deepseek3-671b_v7x-512": (
        (UNCHUNKED, BEFORE),
        (
            (("parallelism.expert_parallel_degree", "16"),),
            "EP 16 (a 2x2x2-chip block: 1.0 buffer per busiest link, against EP 64's 2x4x4 block: 2.0)",
        ),
    ),
}
"""Cheap changes tried on top of a pair (a recipe key or flag), each a row of its own: `run + label`."""


# ------------------------------------------------------------------------------ pure parts (tested)


def read_maxtext(path: Path) -> dict[str, dict]:
    """The calibration table's rows (scripts/bench/maxtext_compile.py's CSV) by run, numbers as floats."""
    rows = {}
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            out = {}
            for k, v in r.items():
                try:
                    out[k] = float(v)
                except (TypeError, ValueError):
                    out[k] = v
            rows[r["run"]] = out
    return rows


def side_row(run: str, pair: Pair, mt: dict, ours: dict) -> dict:
    """One side-by-side row. `mt`: MaxText's calibration row (step_s, mfu_pct, tokens_per_device,
    published_mfu_same_flops_pct, published_step_s); `ours`: our program's row (`program_row`:
    step_scheduled_s, mfu_causal_scheduled, tokens). The ratio is per token, MaxText's predicted
    seconds per token over ours (the same tokens per device make it the step ratio): > 1 = ours
    faster. Calibrated MFU = MaxText's published MFU x the ratio; calibrated step = MaxText's published
    step x (ours / MaxText predicted), at our tokens."""
    row = {
        "run": run,
        "recipe": pair.recipe,
        "overrides": " ".join(f"{k}={v}" for k, v in pair.overrides),
        "unmatched": pair.unmatched,
        "maxtext_tokens_per_device": mt.get("tokens_per_device"),
        "maxtext_step_s": mt.get("step_s"),
        "maxtext_mfu_pct": mt.get("mfu_pct"),
        "maxtext_published_mfu_pct": mt.get("published_mfu_same_flops_pct"),
        "maxtext_published_step_s": mt.get("published_step_s"),
    }
    if ours.get("error"):
        row["error"] = ours["error"]
        return row
    step, tokens = ours["step_scheduled_s"], ours["tokens"]
    row.update(
        tokens_per_device=tokens,
        step_s=round(step, 4),
        mfu_pct=round(ours["mfu_causal_scheduled"], 2),
        compute_s=_r(ours.get("sched_compute_s")),
        exposed_comm_s=_r(ours.get("exposed_comm_s")),
        exposed_host_s=_r(ours.get("exposed_host_s")),
        ici_busy_s=_r(ours.get("ici_busy_s")),
        exposed_by=ours.get("exposed_by", ""),
        compiler_gib=ours.get("compiler_gib"),
        verdict=ours.get("verdict"),
        compile_s=ours.get("compile_s"),
        mesh=ours.get("mesh"),
    )
    if mt.get("step_s") and mt.get("tokens_per_device"):
        ratio = (mt["step_s"] / mt["tokens_per_device"]) / (step / tokens)
        row["ratio"] = round(ratio, 3)
        if mt.get("published_mfu_same_flops_pct"):
            row["calibrated_mfu_pct"] = round(mt["published_mfu_same_flops_pct"] * ratio, 2)
        if mt.get("published_step_s"):
            row["calibrated_step_s"] = round(mt["published_step_s"] / mt["tokens_per_device"] * tokens / ratio, 4)
    return row


def shipped_row(recipe: str, run: str, mt: dict, ours: dict) -> dict:
    """Our shipped recipe at its own settings: predicted step and MFU, and the calibrated MFU = ours
    predicted x (MaxText published / MaxText predicted) of the same model's run."""
    row = {"run": f"{recipe} (shipped)", "recipe": recipe, "overrides": "", "calibrated_by": run}
    if ours.get("error"):
        row["error"] = ours["error"]
        return row
    row.update(
        tokens_per_device=ours["tokens"],
        step_s=round(ours["step_scheduled_s"], 4),
        mfu_pct=round(ours["mfu_causal_scheduled"], 2),
        compiler_gib=ours.get("compiler_gib"),
        verdict=ours.get("verdict"),
        compute_s=_r(ours.get("sched_compute_s")),
        exposed_comm_s=_r(ours.get("exposed_comm_s")),
        exposed_host_s=_r(ours.get("exposed_host_s")),
    )
    if mt.get("mfu_pct") and mt.get("published_mfu_same_flops_pct"):
        factor = mt["published_mfu_same_flops_pct"] / mt["mfu_pct"]
        row["calibration_factor"] = round(factor, 4)
        row["calibrated_mfu_pct"] = round(ours["mfu_causal_scheduled"] * factor, 2)
    return row


def _r(v, digits: int = 4):
    return round(v, digits) if isinstance(v, float) else v


COLUMNS = [
    "run",
    "recipe",
    "overrides",
    "tokens_per_device",
    "step_s",
    "mfu_pct",
    "maxtext_tokens_per_device",
    "maxtext_step_s",
    "maxtext_mfu_pct",
    "maxtext_published_mfu_pct",
    "maxtext_published_step_s",
    "ratio",
    "calibrated_mfu_pct",
    "calibrated_step_s",
    "calibrated_by",
    "calibration_factor",
    "compute_s",
    "exposed_comm_s",
    "exposed_host_s",
    "ici_busy_s",
    "exposed_by",
    "compiler_gib",
    "verdict",
    "compile_s",
    "mesh",
    "unmatched",
    "error",
]


def _fmt(v, digits: int = 2) -> str:
    if v is None or v == "":
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _tokens(v) -> str:
    return f"{int(v):,}" if isinstance(v, (int, float)) else "-"


def _memory(row: dict) -> str:
    """GiB per device by the compiler, or the verdict when the program does not fit."""
    if row.get("verdict") == "does not fit":
        return "does not fit" + (f" ({row['compiler_gib']:.1f})" if row.get("compiler_gib") else " (HBM OOM)")
    return _fmt(row.get("compiler_gib"), 1)


def markdown(rows: list[dict], header: list[str]) -> str:
    """The two tables: at MaxText's shapes, then the shipped recipes."""
    same = [r for r in rows if not r.get("calibrated_by")]
    shipped = [r for r in rows if r.get("calibrated_by")]
    out = [*header, ""]
    out += [
        "| run | ours: recipe + overrides | ours predicted step s | ours predicted MFU % | MaxText predicted "
        "step s | MaxText predicted MFU % | **ratio** (MaxText / ours) | MaxText published MFU % | "
        "**calibrated MFU %** | ours compute / exposed comm / exposed host s | GiB/device |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in same:
        if r.get("error"):
            out.append(f"| {r['run']} | {r['recipe']} {r['overrides']} | {r['error']} |" + " - |" * 8)
            continue
        out.append(
            f"| {r['run']} | {r['recipe']} {r['overrides']} ({r['tokens_per_device']:,} tokens/device; MaxText "
            f"{_tokens(r.get('maxtext_tokens_per_device'))}) | {_fmt(r['step_s'])} | {_fmt(r['mfu_pct'], 1)} | "
            f"{_fmt(r.get('maxtext_step_s'))} | {_fmt(r.get('maxtext_mfu_pct'), 1)} | **{_fmt(r.get('ratio'), 3)}** | "
            f"{_fmt(r.get('maxtext_published_mfu_pct'), 1)} | **{_fmt(r.get('calibrated_mfu_pct'), 1)}** | "
            f"{_fmt(r.get('compute_s'))} / {_fmt(r.get('exposed_comm_s'))} / {_fmt(r.get('exposed_host_s'))} | "
            f"{_memory(r)} |"
        )
    if shipped:
        out += [
            "",
            "Our shipped recipes at their own settings (calibrated = predicted x MaxText's published / predicted "
            "MFU of the same model's run):",
            "",
            "| recipe | tokens/device | predicted step s | predicted MFU % | calibration factor (run) | "
            "**calibrated MFU %** | GiB/device |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in shipped:
            if r.get("error"):
                out.append(f"| {r['recipe']} | {r['error']} | - | - | - | - | - |")
                continue
            out.append(
                f"| {r['recipe']} | {r['tokens_per_device']} | {_fmt(r['step_s'])} | {_fmt(r['mfu_pct'], 1)} | "
                f"{_fmt(r.get('calibration_factor'), 3)} ({r['calibrated_by']}) | "
                f"**{_fmt(r.get('calibrated_mfu_pct'), 1)}** | {_memory(r)} |"
            )
    notes = [r for r in same if r.get("unmatched") and " + " not in r["run"]]
    if notes:
        out += ["", "Not matched (our keys cannot say it):", ""]
        out += [f"- {r['run']}: {r['unmatched']}" for r in notes]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ main


def kept(cache: Path, recipe: str, overrides) -> bool:
    """Whether `program_compile` would read this compile back from `cache`."""
    from tools.mfu_projection import override_tag

    folder = cache / f"{recipe}{override_tag(list(overrides))}"
    return (folder / "program.json").is_file() and (folder / "program.after_optimizations.txt").is_file()


def our_row(recipe: str, overrides, *, anchors: dict, ns) -> dict:
    from tools.mfu_projection import program_row

    if ns.table_only and not kept(ns.cache, recipe, overrides):
        return {"error": "not compiled (no kept compile under --cache)"}
    return program_row(recipe, list(overrides), anchors=anchors, timeout=ns.timeout, cache=ns.cache)


def parse(argv: list[str]):
    from trainer.runtime import cli

    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(PAIRS), help=f"comma list of {', '.join(PAIRS)}")
    p.add_argument("--maxtext-csv", type=Path, default=DEFAULT_MAXTEXT_CSV, help="MaxText's calibration table")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="our compiles (kept, reused)")
    p.add_argument("--out", type=Path, default=None, help="table path without extension")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per compile")
    p.add_argument("--table-only", action="store_true", help="read the kept compiles; compile nothing")
    p.add_argument(
        "--shipped",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also our shipped recipes at their own settings",
    )
    p.add_argument(
        "--fixes", action=argparse.BooleanOptionalAction, default=True, help="also the rows of FIXES (cheap changes)"
    )
    ns = p.parse_args(argv)
    ns.runs = [r for r in ns.runs.split(",") if r]
    bad = [r for r in ns.runs if r not in PAIRS]
    if bad:
        p.error(f"--runs: unknown {', '.join(bad)}; allowed: {', '.join(PAIRS)}")
    if not ns.maxtext_csv.is_file():
        p.error(f"--maxtext-csv: no file {ns.maxtext_csv}; allowed: a maxtext_calibration_*.csv of docs/results/")
    ns.cache = ns.cache.resolve()
    return ns


def main(argv: list[str] | None = None) -> int:
    from tools.maxtext_runs import write_tables
    from tools.mfu_report import load_anchors
    from trainer.runtime.device import cpu_model

    ns = parse(sys.argv[1:] if argv is None else argv)
    anchors = load_anchors()
    mts = read_maxtext(ns.maxtext_csv)
    rows, failed = [], False
    for run in ns.runs:
        pair, mt = PAIRS[run], mts.get(run, {})
        ours = our_row(pair.recipe, pair.overrides, anchors=anchors, ns=ns)
        failed |= bool(ours.get("error")) and not ns.table_only
        rows.append(side_row(run, pair, mt, ours))
        print(rows[-1], file=sys.stderr, flush=True)
    if ns.fixes:
        for run in ns.runs:
            for extra, label in FIXES.get(run, ()):
                base = PAIRS[run]
                pair = Pair(base.recipe, (*base.overrides, *extra), base.unmatched, base.per_token)
                ours = our_row(pair.recipe, pair.overrides, anchors=anchors, ns=ns)
                if ns.table_only and ours.get("error"):
                    continue  # a fix not tried: no row
                rows.append(side_row(f"{run} + {label}", pair, mts.get(run, {}), ours))
                print(rows[-1], file=sys.stderr, flush=True)
    if ns.shipped:
        for run in ns.runs:
            pair, mt = PAIRS[run], mts.get(run, {})
            ours = our_row(pair.recipe, [], anchors=anchors, ns=ns)
            failed |= bool(ours.get("error")) and not ns.table_only
            rows.append(shipped_row(pair.recipe, run, mt, ours))
            print(rows[-1], file=sys.stderr, flush=True)

    def header(commit: str) -> list[str]:
        return [
            "Our trainer's program (tools/tpu_compile.py, deviceless, libtpu 0.0.52 via the ttpu venv) beside "
            f"MaxText's ({ns.maxtext_csv.name}), both through tools/xla_projection.py's scheduled walk; "
            f"commit {commit}.",
            "",
            f"CPU: {cpu_model()}. MFU in MaxText's convention (causal attention halved) against the bf16 peak; "
            "ratio > 1: ours faster per token.",
        ]

    write_tables(rows, name="maxtext_side_by_side", out=ns.out, columns=COLUMNS, header=header, markdown=markdown)
    return 1 if failed else 0


if __name__ == "__main__":
    from trainer.runtime import cli

    sys.exit(cli.run(main))
