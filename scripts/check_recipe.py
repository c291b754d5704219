#!/usr/bin/env python
"""Prove, without a TPU, that recipes would start on their targets (tools/recipe_check.py).

    python scripts/check_recipe.py --all
    python scripts/check_recipe.py configs/llama3_405b_v7x.toml [--training.seq_len=4096]
    python scripts/check_recipe.py --all --no-capture --csv checks.csv

For each recipe: the trainer's own start-up (config, model args, degrees, step-plan rules, task,
mesh, the model at full depth on the meta device parallelized by the real plan, optimizer, and
the first step captured) inside PyTorch's fake process group at the world size of the recipe's
`[job] target`, plus the planner's per-device memory for that plan against the target's HBM.
`--no-capture` stops after the rules (about a second per recipe).

One row per recipe. Exit status: 0 every recipe would start and fits; 1 one would not (an
`error:` line per recipe names it and the rule or the shortfall); 2 bad input.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import glob
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.errors import ConfigError


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


HEADER = ("recipe", "target", "mesh", "tpu mesh", "step plan", "planned GiB", "usable GiB", "fits", "capture",
          "flips GiB", "s", "verdict")


def row(r) -> tuple[str, ...]:
    fits = {None: "-", True: "yes", False: "NO"}[r.fits]
    flips = "-" if r.flips_gib is None else f"{r.flips_gib:.1f} (planned {_gib(r.planned_flips_gib)})"
    verdict = "starts" if r.ok else ("refused" if r.error else "does not fit")
    return (os.path.basename(r.recipe), r.target, r.mesh, r.tpu_mesh, r.step, _gib(r.planned_gib), _gib(r.hbm_gib),
            fits, r.capture, flips, f"{r.seconds:.1f}", verdict)


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(x[i]) for x in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="*", help="recipe TOML files")
    ap.add_argument("--all", action="store_true", help="every recipe in configs/")
    ap.add_argument("--no-capture", action="store_true", help="rules and planner only (no model, no capture)")
    ap.add_argument("--csv", help="write one row per recipe here")
    ns, rest = ap.parse_known_args(argv)
    overrides = []
    for arg in rest:
        if not arg.startswith("--") or "=" not in arg:
            print(f"error: {arg}: not a recipe key override; allowed: --section.key=value", file=sys.stderr)
            return 2
        key, value = arg[2:].split("=", 1)
        overrides.append((key, value))
    paths = sorted(glob.glob(str(ROOT / "configs" / "*.toml"))) if ns.all else ns.configs
    if not paths:
        print("error: no recipe given; allowed: CONFIG... or --all", file=sys.stderr)
        return 2
    for path in paths:
        if not os.path.isfile(path):
            print(f"error: {path}: no such recipe file", file=sys.stderr)
            return 2
    from tools.recipe_check import check_recipe, torch_tpu_layouts

    torch_tpu = torch_tpu_layouts(paths, overrides)  # once for all recipes; None: the port answers

    results = []
    for path in paths:
        r = check_recipe(path, capture=not ns.no_capture, overrides=overrides, torch_tpu=torch_tpu)
        results.append(r)
        print(f"{os.path.basename(path)}: {'ok' if r.ok else 'FAILED'} ({r.seconds:.1f} s)", file=sys.stderr,
              flush=True)
    print(table([row(r) for r in results]))
    if ns.csv:
        with open(ns.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[f.name for f in dataclasses.fields(results[0]) if f.name != "notes"])
            w.writeheader()
            for r in results:
                w.writerow({k: v for k, v in dataclasses.asdict(r).items() if k != "notes"})
    for r in results:
        for note in r.notes:
            print(f"note: {os.path.basename(r.recipe)}: {note}")
    failed = [r for r in results if not r.ok]
    for r in failed:
        why = r.error or (f"needs {r.planned_gib:.1f} GiB per device, {r.hbm_gib:.1f} GiB usable on {r.target} "
                          "(scripts/estimate.py --config ... for the breakdown)")
        print(f"error: {os.path.relpath(r.recipe, ROOT) if os.path.isabs(r.recipe) else r.recipe}: {why}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
