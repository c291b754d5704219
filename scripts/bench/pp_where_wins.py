#!/usr/bin/env python
"""Where pipeline parallelism wins over the DCN: the planner's best pipeline layout against its best
layout without one, on several slices, with every DCN byte priced (planner/multislice.py).

    flock /tmp/titan-heavy.lock nice python scripts/bench/pp_where_wins.py --out docs/results/NAME.csv
    python scripts/bench/pp_where_wins.py --models llama3_70b --generations v6e --slices 2   # one row

For each model (a shipped recipe's model, step settings and sequence, with graph-mode GPipe,
host offload of the block inputs and `allow_dcn_sharding` so that both sides get their best memory),
each multislice target (`<slice>x<S>`) and each global batch (tokens per optimizer step, reached
with gradient accumulation where a plan's micro-batch holds fewer): `planner.recommend` over the
layouts without a pipeline (HSDP, FSDP across slices, TP, CP, EP, AC, local batch) and over those
with the stages on the slices (pp = S, or a power of two dividing S with HSDP or FSDP across the
rest; the stage mesh searched the same way; the rules take only degrees that divide the layers), both at the assumed
MFU; the best of each side that fits within the global batch by tokens/s per device with the DCN
priced (`priced_tokens_per_s`: the step, a pipeline's bubble and permutes, plus the exposed HSDP
all-reduce or FSDP gathers and reduce-scatters). A plan whose global batch is below the row's is
run with gradient accumulation: the planner's per-token cost does not change (the bubble, the
gathers and the reduce-scatters are paid per accumulation micro-batch).
"""

from __future__ import annotations

import csv
import sys
import time

import planner
from models.errors import ConfigError
from planner.multislice import dcn_cost, dcn_split, priced_step_s, priced_tokens_per_s
from trainer.runtime import cli

MODELS = {
    "llama3_70b": "configs/llama3_70b_v6e.toml",
    "llama3_405b": "configs/llama3_405b_v7x.toml",
    "qwen3_235b": "configs/qwen3_235b_a22b_v7x.toml",
}
SLICES = {"v5e": "v5e-256", "v5p": "v5p-1024", "v6e": "v6e-256", "v7x": "v7x-512"}
"""One slice per generation: 256 chips (v5e, v6e; TPU7x-512 = 256 chips of 2 devices), v5p 512
chips (MaxText's v5p 405B run's slice)."""
BATCHES = {"4M": 4 * 2**20, "16M": 16 * 2**20}
"""Global batches, tokens: Llama 3 (Dubey et al. 2024, section 3.4.1) began 405B pre-training at
4M tokens a step and raised it to 8M and 16M; MaxText's published v6e 2 x 256 405B run uses
4,194,304 (512 x 8192; docs/pipeline_parallel.md "Across slices")."""
OVERRIDES = [
    ("parallelism.pipeline_schedule", "GPipe"),
    ("parallelism.pipeline_microbatches", "0"),
    ("parallelism.pipeline_first_stage_less_layers", "0"),
    ("parallelism.pipeline_last_stage_less_layers", "0"),
    ("parallelism.allow_dcn_sharding", "true"),
    ("activation_checkpoint.offload", "block_inputs"),
]
FIELDS = [
    "model",
    "target",
    "slices",
    "devices",
    "global_tokens",
    "side",
    "layout",
    "fits",
    "local_batch",
    "grad_accum",
    "ac_mode",
    "gib_per_device",
    "step_s",
    "bubble",
    "dcn_serial_s",
    "dcn_exposed_s",
    "priced_step_s",
    "tokens_per_s_device_unpriced",
    "tokens_per_s_device",
    "fsdp_bound",
    "pp_over_flat",
]


def _inputs(recipe: str):
    from tools.recipe_check import plan_inputs
    from trainer.config import build_config

    return plan_inputs(build_config(recipe, OVERRIDES))


def layout(est) -> str:
    r, s = dcn_split(est, est.target)
    over = [name for name, n in (("pp", est.pp if est.pp > 1 else 1), ("HSDP", r), ("FSDP", s)) if n > 1]
    dcn = " + ".join(over) + " over DCN" if over else "one slice"
    parts = [f"pp {est.pp}"] if est.pp > 1 else []
    parts += [f"dp_rep {est.dp_replicate}"] if est.dp_replicate > 1 else []
    parts += [f"fsdp {est.dp_shard}"]
    parts += [f"{k} {v}" for k, v in (("cp", est.cp), ("tp", est.tp), ("ep", est.ep)) if v > 1]
    if est.pipeline is not None:
        parts.append(f"m {est.pipeline.spec.m}")
    return f"{dcn}: " + " x ".join(parts)


def _best(candidates, tokens: int):
    """The most tokens/s per device with the DCN priced among the plans that fit within `tokens`,
    those whose micro-batch hides FSDP's ICI gathers first (`Estimate.fsdp_bound`: the planner does
    not price those gathers, nor CP's k/v gathers, so a plan of a few hundred tokens per device
    would otherwise look as fast as a big one)."""
    fits = [c for c in candidates if c.fits and c.global_batch_tokens <= tokens]
    return max(fits, key=lambda c: (not c.fsdp_bound, priced_tokens_per_s(c)), default=None)


def _row(model: str, target, tokens: int, side: str, est, other=None) -> dict:
    row = dict(model=model, target=target.name, slices=target.num_slices, devices=target.devices)
    row.update(global_tokens=tokens, side=side)
    if est is None:
        return {**row, "layout": "nothing fits", "fits": False}
    cost = dcn_cost(est, target)
    priced = priced_step_s(est)
    row.update(
        layout=layout(est),
        fits=est.fits,
        local_batch=est.local_batch_size,
        grad_accum=tokens // est.global_batch_tokens,
        ac_mode=est.ac_mode,
        gib_per_device=round(est.total / 2**30, 2),
        step_s=round(est.step_time_s, 3),
        bubble=round(est.pipeline.bubble, 4) if est.pipeline is not None else 0.0,
        dcn_serial_s=round(cost.dcn_s + (est.pipeline.p2p_serial_s if est.pipeline else 0.0), 4),
        dcn_exposed_s=round(cost.exposed_s + (est.pipeline.p2p_exposed_s(est.compute_s) if est.pipeline else 0.0), 4),
        priced_step_s=round(priced, 3),
        tokens_per_s_device_unpriced=round(est.tokens_per_s, 1),
        tokens_per_s_device=round(est.tokens_per_device_step / priced, 1),
        fsdp_bound=est.fsdp_bound,
    )
    if other is not None:
        row["pp_over_flat"] = round(priced_tokens_per_s(est) / priced_tokens_per_s(other), 3)
    return row


def study(
    models: list[str], generations: list[str], slices: list[int], out: str | None, ac_modes: tuple[str, ...]
) -> list[dict]:
    rows = []
    for model in models:
        inputs = _inputs(MODELS[model])
        for gen in generations:
            for s in slices:
                target = planner.parse_target(f"{SLICES[gen]}x{s}")
                t0 = time.time()
                top = max(BATCHES.values())
                kw = dict(max_global_tokens=top, ac_modes=ac_modes)
                flat = planner.recommend(inputs, target, pp_choices=[1], **kw)
                # the stages over the slices (pp = S) or over part of them, HSDP / FSDP across the rest
                degrees = [d for d in (2**i for i in range(1, 6)) if d <= s and s % d == 0]
                pipe = planner.recommend(inputs, target, pp_choices=degrees, **kw)
                for name, tokens in BATCHES.items():
                    bf, bp = _best(flat, tokens), _best(pipe, tokens)
                    rows.append(_row(model, target, tokens, "no pp", bf))
                    rows.append(_row(model, target, tokens, "pp", bp, other=bf if bp is not None else None))
                    if not pipe:  # the rules take no pipeline degree here
                        rows[-1]["layout"] = f"refused: no pp in {degrees} divides the {inputs.args.n_layers} layers"
                    _print(rows[-2], rows[-1], name)
                print(f"  ({len(flat) + len(pipe)} plans, {time.time() - t0:.0f} s)", flush=True)
                if out:
                    _write(rows, out)
    return rows


def _print(flat: dict, pipe: dict, batch: str) -> None:
    def cell(r):
        if not r.get("fits"):
            return "nothing fits"
        bound = ", FSDP-bound" if r["fsdp_bound"] else ""
        return f"{r['tokens_per_s_device']:>8.1f} tok/s ({r['layout']}, {r['gib_per_device']} GiB{bound})"

    ratio = pipe.get("pp_over_flat")
    print(
        f"{flat['model']:<12} {flat['target']:<12} {batch:>4}  no pp {cell(flat)}  |  pp {cell(pipe)}"
        + (f"  pp/no-pp {ratio:.3f}" if ratio else ""),
        flush=True,
    )


def markdown(path: str) -> str:
    """The table docs/pipeline_parallel.md prints ("Where PP wins"), from a CSV of this script."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    batches = sorted({int(r["global_tokens"]) for r in rows})
    names = {v: k for k, v in BATCHES.items()}
    head = "| model | target | devices |" + "".join(
        f" {names.get(b, b)}: no PP tok/s (layout) | {names.get(b, b)}: PP tok/s (layout, bubble) | PP / no PP |"
        for b in batches
    )
    out = [head, "|" + "---|" * (3 + 3 * len(batches))]
    keys = list(dict.fromkeys((r["model"], r["target"], r["devices"]) for r in rows))

    def cell(r):
        if r is None or r["fits"] != "True":
            return r["layout"] if r is not None and r["layout"].startswith("refused") else "nothing fits"
        bound = ", FSDP-bound" if r["fsdp_bound"] == "True" else ""
        bubble = f", bubble {float(r['bubble']):.0%}" if r["side"] == "pp" else ""
        shown = r["layout"].replace("dp_rep 1 x ", "")  # (CSVs written before the label dropped it
        if shown.startswith("FSDP over DCN: dp_rep"):  # and before it named HSDP beside FSDP)
            shown = "HSDP + " + shown
        return f"{float(r['tokens_per_s_device']):.0f} ({shown}{bubble}{bound})"

    for key in keys:
        line = f"| {key[0]} | {key[1]} | {key[2]} |"
        for b in batches:
            side = {
                r["side"]: r
                for r in rows
                if (r["model"], r["target"], r["devices"]) == key and int(r["global_tokens"]) == b
            }
            flat, pipe = side.get("no pp"), side.get("pp")
            ratio = pipe.get("pp_over_flat") if pipe else ""
            line += (
                f" {cell(flat)} | {cell(pipe)} | {float(ratio):.2f} |" if ratio else f" {cell(flat)} | {cell(pipe)} | |"
            )
        out.append(line)
    return "\n".join(out)


def _write(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--generations", default=",".join(SLICES), help=f"comma-separated, of {', '.join(SLICES)}")
    p.add_argument("--slices", default="2,4,8,16", help="comma-separated slice counts")
    p.add_argument("--out", default=None, help="CSV path (written after every target)")
    p.add_argument(
        "--markdown", default=None, metavar="CSV", help="print the docs' table of a CSV of this script and exit"
    )
    p.add_argument(
        "--ac-modes",
        default=",".join(planner.AC_SEARCH_ORDER),
        help="comma-separated AC modes to search (full alone is what these models fit at 8k on every side: a third of the search)",
    )
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    models = args.models.split(",")
    gens = args.generations.split(",")
    for key, values, allowed in (("--models", models, MODELS), ("--generations", gens, SLICES)):
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ConfigError(f"{key}: {bad[0]!r} is unknown; allowed: {', '.join(allowed)}")
    try:
        slices = [int(s) for s in args.slices.split(",")]
    except ValueError:
        raise ConfigError(f"--slices: {args.slices!r}; allowed: comma-separated integers >= 2") from None
    if any(s < 2 for s in slices):
        raise ConfigError(f"--slices: {args.slices!r}; allowed: comma-separated integers >= 2")
    modes = tuple(args.ac_modes.split(","))
    if any(m not in planner.AC_SEARCH_ORDER for m in modes):
        raise ConfigError(
            f"--ac-modes: {args.ac_modes!r}; allowed: comma-separated of {', '.join(planner.AC_SEARCH_ORDER)}"
        )
    study(models, gens, slices, args.out, modes)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
