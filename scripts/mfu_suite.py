#!/usr/bin/env python
"""MFU suite: sweep recipes x compile modes x process counts, write CSV, a markdown table and
PNG plots, in both MFU conventions, with the published anchors printed beside ours.

    python scripts/mfu_suite.py                       # the default CPU sweep (a few minutes)
    python scripts/mfu_suite.py --recipes llama3_debug,qwen3_debug --modes eager,graph,graph_scan \
        --nproc 1,2 --repeats 2 --steps 8 --warmup 3 --out outputs/mfu_suite/run -- --training.seq_len=256

Measured part: every (recipe, mode, nproc, repeat) is one `python -m trainer.train` run, through
scripts/benchmark.py's runner, tools/benchmark.py (interleaved repeats, quiet-machine wait,
metrics.jsonl parsing).
Per group: median tokens/s per device over the steps after --warmup and over the repeats,
TFLOP/s, MFU in the PaLM/TorchTitan convention (6N + 12·L·H·Q·T, `mfu_pct`), in MaxText's
causal-halved one (`mfu_pct_causal`), and against the faster compute dtype's peak on the CPU
(`mfu_pct_best`, docs/metrics.md). On a TPU the same command measures the pod recipes.

Projections (`--project`, default: the LM pod recipes, configs/*_v6e.toml and *_v7x.toml):
without a TPU, the deviceless XLA:TPU compile of scripts/estimate_xla.py (its `ttpu` venv,
scripts/xla_env.sh) at 1 and 2 layers, scan off, for a small slice of the generation, with
XLA's dump of the optimized per-device HLO (`XLA_FLAGS=--xla_dump_to`). tools/xla_projection.py
reads each program: compute time = per executed op max(FLOPs / peak, HBM bytes / bandwidth),
loop bodies times their trip count, plus the Pallas kernels (capture model; a kernel's own
CostEstimate bytes where the HLO carries one), never below the model's FLOPs; collective time
= each collective's bytes over the ICI bandwidth of its mesh axis at the recipe's target slice
(ring (n-1)/n; assets/anchors.toml [ici]). Both extrapolated to the recipe's layers; step time
fully exposed (compute + collectives) and perfectly overlapped (max): an upper bound on MFU
either way, never above 100 %. The old roofline of the compiler's totals is printed beside it.
Every such row is labeled "projection". Without that venv the projections are skipped with the
reason printed. `--hlo-cache DIR` keeps the compiles and reads them back (by recipe name and
overrides; a trainer-program compile also by the recipe file's hash).

The expert-parallel recipes (ep > 1) and the context-parallel ones (cp > 1: the 128k recipes, whose
whole-sequence 1-layer program does not fit the small slice) are projected from the trainer's own
per-device program instead (`trainer_program`): tools/tpu_compile.py (the real plan with EP on the target's fake world, the dispatch over
its all-to-alls, every collective as the trainer writes it, the Pallas kernels) compiled at full
depth with the recipe's layer scan, XLA's optimized HLO dumped and read by tools/xla_projection.py,
each collective priced where torch-tpu's layout puts its group on the torus; the table adds the EP
all-to-alls' and the dispatch ops' share. `--override KEY=VALUE` (repeatable, e.g.
moe.capacity_factor=1.25) and `--routing learned|random|both` change what is compiled.
`--weak-scaling default` projects Qwen3-235B on v7x from 8 to 1,024 chips and Qwen3-30B-A3B on
v6e from 8 to 256 at the recipe's per-device batch (`weak_scaling`: a few compiles, the rest
scaled), a table and <out>_weak_scaling.png.

Anchors: assets/anchors.toml (MaxText v6e/v7x, the TorchTitan TPU fork, torchax, TorchTitan on
H100, each with its source), printed beside our row for the same recipe.

Output: <out>.csv (one row per group), <out>_runs.csv (per run), <out>.md, <out>_vs_devices.png,
<out>_vs_mode.png. Needs matplotlib (`pip install '.[bench]'`). Exit: 0, 1 if a run failed, 2 bad input.

The suite is tools/mfu_suite.py (the selection, the runs, the projections, the outputs) over
tools/benchmark.py, tools/mfu_projection.py, tools/mfu_report.py and tools/mfu_runs.py; this
script reads the flags.
"""

from __future__ import annotations

import argparse
import sys

from tools import benchmark as bench
from tools.mfu_projection import WEAK_SCALING, InputError
from tools.mfu_suite import run
from trainer.runtime import cli

DEFAULT_RECIPES = "llama3_debug,qwen3_debug"
DEFAULT_MODES = "eager,graph_scan"


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma list of recipe names (configs/) or paths")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list of {', '.join(bench.VARIANTS)}")
    p.add_argument("--nproc", default="1,2", help="comma list of process counts (devices)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps dropped (compile, caches)")
    p.add_argument(
        "--project",
        default="pods",
        help="recipes to project from the deviceless compile: 'pods' (LM *_v6e/*_v7x), a comma list, or 'none'",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the projections from the trainer's program (repeatable), e.g. "
        "moe.capacity_factor=1.25",
    )
    p.add_argument(
        "--routing",
        default="learned",
        help="routing of the expert-parallel projections: learned, random (the benchmark routing) or both",
    )
    p.add_argument(
        "--weak-scaling",
        default="none",
        help="recipes whose weak scaling to project (same per-device batch, device counts of WEAK_SCALING): "
        "'default' (" + ", ".join(WEAK_SCALING) + "), a comma list of those, or 'none'",
    )
    p.add_argument(
        "--hlo-cache",
        default=None,
        help="folder for the projections' compiles (JSON + optimized HLO per recipe, slice and layer "
        "count); a compile found there is read back, not redone",
    )
    p.add_argument("--out", default=None, help="output stem (default outputs/mfu_suite/<time>/mfu_suite)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per process (default: inherited, else 1)")
    p.add_argument("--max-busy", type=float, default=0.25)
    p.add_argument("--max-wait", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run and per compile")
    p.add_argument("--dry-run", action="store_true", help="print the trainer commands only")
    p.add_argument(
        "--resume",
        action="store_true",
        help="read, not rerun, the runs whose folder under --out already holds a record of the last step",
    )
    return p.parse_args(argv), extra


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        ns, extra = parse(argv)
        return run(ns, extra, argv)
    except InputError as e:  # a bad flag: ConfigError, through cli.run
        cli.error_line(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(cli.run(main))
