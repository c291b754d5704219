#!/usr/bin/env python
"""The 128k CP recipes: the planner's per-device memory beside the deviceless compiles of their
attention sublayer (tests/xla/probes/splash_cp.py, docs/context_parallel.md "128k recipes").

    python scripts/dev/cp_compile_report.py COMPILES.csv [--csv OUT.csv]

COMPILES.csv: the probe's `--csv` output (one row per case, named after the recipe). For each
recipe row: the planner's whole-step total and usable HBM per device (tools/recipe_check.py
`planned`, the recipe check's figure), the planner's attention terms of one layer without AC
(q, output and log-sum-exp of the device's tokens, the gathered k/v, their gradients) and its
whole block-backward transient (recomputed block + gathered k/v gradients + weight gradients), and
the compiler's arguments, outputs and temporaries for the attention sublayer's forward + backward
(a part of that block: the compiled temporaries must stay below the planner's block transient).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from trainer.runtime import cli

ROOT = Path(__file__).resolve().parents[2]

GiB = 2**30


def main() -> int:
    ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("compiles")
    ap.add_argument("--csv")
    ns = ap.parse_args()
    import planner
    from tools.recipe_check import plan_inputs, planned
    from trainer.config import build_config

    rows = []
    for c in csv.DictReader(open(ns.compiles)):
        recipe = ROOT / "configs" / f"{c['case']}.toml"
        if not recipe.exists():
            continue
        cfg = build_config(str(recipe))
        target = planner.parse_target(cfg.job.target, key="job.target")
        est = planned(cfg, target)
        shape = plan_inputs(cfg).args.shape()
        tokens = cfg.training.local_batch_size * cfg.training.seq_len // est.cp
        gathered = planner.cp_gathered_kv_bytes(
            shape, local_batch_size=cfg.training.local_batch_size, seq_len=cfg.training.seq_len, tp=est.tp, cp=est.cp
        )
        attention = (4 * shape.n_heads * shape.head_dim + 4 * shape.n_heads) * tokens + 2 * gathered
        row = {
            "recipe": c["case"],
            "target": target.name,
            "compiled_for": f"{c['topology']} ({c['device_kind']})",
            "cp": est.cp,
            "tokens_per_device": tokens,
            "planner_step_total_gib": round(est.total / GiB, 2),
            "planner_usable_gib": round(est.usable / GiB, 2),
            "planner_layer_attention_gib": round(attention / GiB, 3),
            "planner_block_backward_gib": round(est.transient_block / GiB, 3),
            **{
                f"compiler_{short}_gib": round(int(c[field]) / GiB, 3) if c.get(field) else ""
                for short, field in (
                    ("args", "argument_size_in_bytes"),
                    ("out", "output_size_in_bytes"),
                    ("temp", "temp_size_in_bytes"),
                )
            },
            "compile_s": c.get("compile_s", ""),
            "lower_s": c.get("lower_s", ""),
            "stablehlo_all_gather": c.get("stablehlo_all_gather", ""),
            "stablehlo_reduce_scatter": c.get("stablehlo_reduce_scatter", ""),
            "hlo_all_gather": c.get("all_gather", ""),
            "hlo_reduce_scatter": c.get("reduce_scatter", ""),
            "hlo_all_reduce": c.get("all_reduce", ""),
            "counted_in": c.get("counted_in", ""),
            "mosaic_calls": c.get("mosaic_calls", ""),
            "error": (c.get("error") or "")[:200],
        }
        rows.append(row)
    if not rows:
        cli.error_line("no row of COMPILES names a recipe in configs/")
        return 2
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items() if v != ""))
    if ns.csv:
        with open(ns.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
