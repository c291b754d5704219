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

`--compile` then compiles, for every recipe with a TPU target, the per-device program the pod
runs (tools/tpu_compile.py: the captured step with the recipe's kernels, SimpleFSDP's, EP's and
CP's collectives as written, lowered by torchax inside one shard_map over the target's topology
and compiled deviceless by libtpu in the XLA tier's ttpu venv) and prints a second table: the
mesh as compiled, the program (kernels, collectives, scans), the compile time, the compiler's
memory (arguments, outputs, temporaries, code) against the planner's, and a verdict; a recipe
whose program does not compile, does not fit, or differs from the plan by more than the stated
band fails. Minutes per pod recipe.

One row per recipe. Exit status: 0 every recipe would start and fits; 1 one would not (an
`error:` line per recipe names it and the rule or the shortfall); 2 bad input (one `error:` line:
a missing recipe, or an override whose key or value is malformed, checked once before any recipe).
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import os
import sys
from pathlib import Path

from trainer.runtime import cli

ROOT = Path(__file__).resolve().parents[1]


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


HEADER = (
    "recipe",
    "target",
    "mesh",
    "pipeline",
    "tpu mesh",
    "device order",
    "step plan",
    "planned GiB",
    "usable GiB",
    "fits",
    "capture",
    "flips GiB",
    "s",
    "verdict",
)


def row(r) -> tuple[str, ...]:
    fits = {None: "-", True: "yes", False: "NO"}[r.fits]
    flips = "-" if r.flips_gib is None else f"{r.flips_gib:.1f} (planned {_gib(r.planned_flips_gib)})"
    verdict = "starts" if r.ok else ("refused" if r.error else "does not fit")
    return (
        os.path.basename(r.recipe),
        r.target,
        r.mesh,
        r.pipeline,
        r.tpu_mesh,
        r.device_order,
        r.step,
        _gib(r.planned_gib),
        _gib(r.hbm_gib),
        fits,
        r.capture,
        flips,
        f"{r.seconds:.1f}",
        verdict,
    )


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(x[i]) for x in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def check_overrides(overrides: list[tuple[str, str]]) -> None:
    """Each `--section.key=value` on its own, once, before any recipe: an unknown key or a value of
    the wrong type or range is a ConfigError (the trainer's message). Combinations, and `[model]`
    keys of a flavor's args, depend on the recipe and are checked per recipe."""
    from models.errors import ConfigError
    from trainer.config import load
    from trainer.config.schema import Config

    cfg = Config()
    for dotted, raw in overrides:
        section, _, key = dotted.partition(".")
        if not key or "." in key:
            raise ConfigError(f"--{dotted}: expected --section.key=value; allowed: --section.key=value")
        load._set(cfg, section, key, load.parse_value(raw), f"--{dotted}")
        field = {f.name: f for f in dataclasses.fields(getattr(cfg, section))}.get(key)
        if field is not None:
            load._check_metadata(f"{section}.{key}", getattr(getattr(cfg, section), key), field.metadata)


def main(argv: list[str] | None = None) -> int:
    ap = cli.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="Recipe keys: --section.key=value after the recipes, as in training."
    )
    ap.add_argument("configs", nargs="*", help="recipe TOML files")
    ap.add_argument("--all", action="store_true", help="every recipe in configs/")
    ap.add_argument("--no-capture", action="store_true", help="rules and planner only (no model, no capture)")
    ap.add_argument("--csv", help="write one row per recipe here")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also compile each TPU recipe's per-device program deviceless (tools/tpu_compile.py)",
    )
    ap.add_argument("--compile-csv", metavar="PATH", help="with --compile: write one row per compiled recipe here")
    ns, rest = ap.parse_known_args(argv)
    overrides = []
    for arg in rest:
        if not arg.startswith("--") or "=" not in arg:
            cli.error_line(f"{arg}: not a recipe key override; allowed: --section.key=value")
            return 2
        key, value = arg[2:].split("=", 1)
        overrides.append((key, value))
    paths = sorted(glob.glob(str(ROOT / "configs" / "*.toml"))) if ns.all else ns.configs
    if not paths:
        cli.error_line("no recipe given; allowed: CONFIG... or --all")
        return 2
    for path in paths:
        if not os.path.isfile(path):
            cli.error_line(f"{path}: no such recipe file")
            return 2
    check_overrides(overrides)  # a malformed one: one error line and exit 2, not one per recipe
    from trainer.runtime.quiet import quiet_capture

    quiet_capture()  # torch's warnings of capture-only jobs, between the result lines otherwise
    from tools.recipe_check import check_recipe, torch_tpu_layouts

    torch_tpu = torch_tpu_layouts(paths, overrides)  # once for all recipes; None: the port answers

    results = []
    for path in paths:
        r = check_recipe(path, capture=not ns.no_capture, overrides=overrides, torch_tpu=torch_tpu)
        results.append(r)
        print(
            f"{os.path.basename(path)}: {'ok' if r.ok else 'FAILED'} ({r.seconds:.1f} s)", file=sys.stderr, flush=True
        )
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
        why = r.error or (
            f"needs {r.planned_gib:.1f} GiB per device, {r.hbm_gib:.1f} GiB usable on {r.target} "
            "(scripts/estimate.py --config ... for the breakdown)"
        )
        cli.error_line(f"{_name(r.recipe)}: {why}")
    compile_failed = _compile(paths, overrides, csv_path=ns.compile_csv) if ns.compile else []
    return 1 if failed or compile_failed else 0


def _name(recipe: str) -> str:
    return os.path.relpath(recipe, ROOT) if os.path.isabs(recipe) else recipe


COMPILE_HEADER = (
    "recipe",
    "target",
    "topology",
    "mesh as compiled",
    "program",
    "compile s",
    "args GiB",
    "out GiB",
    "temp GiB",
    "code MiB",
    "compiler GiB",
    "planned GiB",
    "verdict",
)


def compile_row(r) -> tuple[str, ...]:
    m = r.memory or {}
    gib = lambda k: f"{m[k] / 2**30:.2f}" if k in m else "-"  # noqa: E731
    return (
        os.path.basename(r.recipe),
        r.target,
        r.topology,
        r.mesh,
        r.program,
        f"{r.compile_s:.0f}",
        gib("argument_size_in_bytes"),
        gib("output_size_in_bytes"),
        gib("temp_size_in_bytes"),
        f"{m['generated_code_size_in_bytes'] / 2**20:.0f}" if "generated_code_size_in_bytes" in m else "-",
        _gib(r.compiler_gib),
        _gib(r.planned_gib),
        r.verdict,
    )


def _compile(paths: list[str], overrides: list, *, csv_path: str | None) -> list:
    """The TPU program of every recipe with a TPU target (tools/tpu_compile.py); the failed ones."""
    import planner
    from tools.tpu_compile import BAND, compile_recipe
    from trainer.config import build_config

    reports = []
    for path in paths:
        target = build_config(path, overrides).job.target
        if not target or planner.parse_target(target).device_type != "tpu":
            continue
        r = compile_recipe(path, overrides=overrides)
        reports.append(r)
        print(f"{os.path.basename(path)}: compile {r.verdict} ({r.wall_s:.0f} s)", file=sys.stderr, flush=True)
    if not reports:
        print("note: --compile: no recipe with a TPU target")
        return []
    print()
    rows = [compile_row(r) for r in reports]
    widths = [max(len(x[i]) for x in [COMPILE_HEADER, *rows]) for i in range(len(COMPILE_HEADER))]
    print("  ".join(h.ljust(w) for h, w in zip(COMPILE_HEADER, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for r in reports:
        for note in r.notes:
            print(f"note: {os.path.basename(r.recipe)}: {note}")
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COMPILE_HEADER)
            w.writerows(rows)
    failed = [r for r in reports if not r.ok]
    for r in failed:
        if r.error:
            why = f"the TPU program did not compile: {r.error}"
        elif r.oom:
            why = f"the compiler refused the program: {r.oom}"
        elif r.verdict == "does not fit":
            why = f"the program needs {r.compiler_gib:.1f} GiB per device, {r.hbm_gib:.1f} GiB on {r.target}"
        else:
            why = (
                f"the compiler's {r.compiler_gib:.1f} GiB per device and the planner's {r.planned_gib:.1f} GiB "
                f"differ by more than {BAND:.0%}"
            )
        cli.error_line(f"{_name(r.recipe)}: {why}")
    return failed


if __name__ == "__main__":
    sys.exit(cli.run(main))
