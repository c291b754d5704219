#!/usr/bin/env python
"""Benchmark a recipe: tokens/s, TFLOP/s, MFU and peak memory per device, per variant.

Runs the trainer as a subprocess for every (variant, process count), `--repeats` times with
the runs interleaved (so slow drift of the machine spreads over all variants), reads each run's
metrics.jsonl, drops the warm-up steps, and reports the median over steps and then over
repeats. Prints a table and writes CSV (summary to --out, one row per run to <out>_runs.csv).

    python scripts/benchmark.py --config configs/llama3_debug.toml \
        --variants eager,compile --nproc 1,2 --repeats 3 --steps 20 --warmup 5 --out bench.csv \
        -- --training.local_batch_size=4

Variants: eager, compile, graph, graph_scan, or NAME='--section.key=value ...' via --variant
(NAME@2 or NAME@2+4: only at those process counts).
Arguments after `--` are passed to every run of ours. Bad input (a flag, the recipe, a variant's
overrides or the arguments after `--`, resolved as the trainer will) prints one `error:` line and
exits with status 2 before the first run starts.

`--peer torchtitan` adds TorchTitan 0.3.0's own trainer (scripts/bench/reference_torchtitan.py, run in the
peer venv that scripts/bench/peer_env.sh builds) to every repeat, interleaved with our variants, and a
`vs peer` column: our tokens/s per device over the peer's at the same process count. The issue's
side-by-side table (ours eager/graph/graph_scan in bf16 and fp32 at TorchTitan's shape, against
TorchTitan) is one command:

    python scripts/benchmark.py --preset ttshape [--quick]

The MoE side-by-side (our Qwen 3 MoE against TorchTitan's own qwen3_moe_debug trainer, 64 experts,
top-8, learned routing on both sides or round-robin on both) is `--preset moe_ttshape` and
`--preset moe_ttshape_balanced` (docs/benchmarks.md, "MoE side by side").

Every row records the CPU model (lscpu) and the OpenMP thread count of its runs. The script measures how busy the CPUs are
(/proc/stat) before each run and prints it next to the numbers: on a shared machine a busy
fraction above ~0.2 makes throughput numbers unreliable.

The runner (variants, commands, runs, summaries, the table and the CSVs) is tools/benchmark.py; this
script reads the flags.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from tools import benchmark as bench
from trainer.runtime import cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = _parser()
    args = parser.parse_args(argv)

    preset = bench.PRESETS.get(args.preset, {})
    extra = _apply_shape(args, parser, preset, extra)
    variants = _variants(args, parser, preset)
    if args.peer is not None and not args.dry_run and not Path(args.peer_python).is_file():
        cli.error_line(
            f"--peer-python: {args.peer_python} not found; build the peer venv with `bash scripts/bench/peer_env.sh`"
        )
        return 2
    nprocs = _check_args(args, parser)
    root = Path(args.dump_root or bench.REPO / "outputs" / "benchmark" / time.strftime("%Y%m%d-%H%M%S"))
    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    machine = bench.machine_fields(args.threads)

    for name in args.ceiling:
        if name not in variants:
            parser.error(f"--ceiling: {name!r} is not one of the variants ({', '.join(variants)})")
    jobs = bench.plan_jobs(
        recipe=args.config,
        variants=variants,
        nprocs=nprocs,
        repeats=args.repeats,
        steps=args.steps,
        warmup=args.warmup,
        root=root,
        extra=extra,
        ceiling=args.ceiling,
        peer=args.peer,
        peer_python=args.peer_python,
        peer_seq_len=args.peer_seq_len,
        peer_batch=args.peer_batch,
        peer_args=args.peer_arg,
        preset=preset,
    )
    _check_runs(jobs, parser)
    if args.dry_run:
        for job in jobs:
            print(" & ".join(shlex.join(cmd) for cmd in job.get("cmds", [job.get("cmd")])))
        return 0
    runs = [
        {**run, **machine}
        for run in bench.execute(
            jobs, env=env, warmup=args.warmup, timeout=args.timeout, max_busy=args.max_busy, max_wait=args.max_wait
        )
    ]
    return bench.report(
        runs,
        machine,
        recipe=args.config,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        peer=args.peer,
        out=Path(args.out),
    )


def _parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="recipe TOML (required unless --preset)")
    parser.add_argument("--variants", default=None, help=f"comma list of {', '.join(bench.VARIANTS)} (default: eager)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES", help="a custom variant")
    parser.add_argument("--nproc", default="1", help="comma list of process counts, e.g. 1,2,4")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=None, help="first steps dropped (compile, caches; default 5)")
    parser.add_argument(
        "--peer", default=None, choices=bench.PEERS, help="also run this peer's own trainer, interleaved"
    )
    parser.add_argument(
        "--peer-python", default=str(bench.PEER_PYTHON), help="the peer venv's python (scripts/bench/peer_env.sh)"
    )
    parser.add_argument("--peer-seq-len", type=int, default=2048, help="the peer's seq_len (ours: the recipe's)")
    parser.add_argument("--peer-batch", type=int, default=8, help="the peer's local batch size (ours: the recipe's)")
    parser.add_argument("--peer-arg", action="append", default=[], metavar="ARG", help="an argument for the peer's CLI")
    parser.add_argument(
        "--preset",
        default=None,
        choices=sorted(bench.PRESETS),
        help="ttshape: ours eager/graph/graph_scan bf16+fp32 at TorchTitan's llama3 debugmodel shape vs TorchTitan; "
        "moe_ttshape (learned routing) and moe_ttshape_balanced (round-robin on both sides): our Qwen 3 MoE eager "
        "bf16 at TorchTitan's qwen3_moe_debug shape vs TorchTitan's MoE trainer",
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {bench.QUICK} (both sides)")
    parser.add_argument("--out", default="benchmark.csv", help="summary CSV (runs go to <stem>_runs.csv)")
    parser.add_argument("--dump-root", default=None, help="run folders (default: outputs/benchmark/<time>)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per process (default: inherited)")
    parser.add_argument("--max-busy", type=float, default=0.25, help="wait for CPU busy fraction below this")
    parser.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for a quiet machine per run")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument(
        "--ceiling",
        action="append",
        default=[],
        metavar="VARIANT",
        help="also run, at each process count N > 1, N independent 1-process copies of "
        "VARIANT at once (variant VARIANT+solo): the host's N-process ceiling, "
        "no communication",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    return parser


def _apply_shape(args, parser, preset: dict, extra: list[str]) -> list[str]:
    """Fill the run shape (config, repeats, steps, warmup, peer, the peer's seq_len and batch) from the
    preset and --quick where a flag left it unset; returns the recipe overrides after `--`, with
    --quick's shape first."""
    shape = {
        **{k: preset[k] for k in ("seq_len", "batch", "repeats", "steps", "warmup") if k in preset},
        **(bench.QUICK if args.quick else {}),
    }
    args.config = args.config or preset.get("config")
    if args.config is None:
        parser.error("--config is required (or --preset)")
    args.repeats = args.repeats if args.repeats is not None else shape.get("repeats", 3)
    args.steps = args.steps if args.steps is not None else shape.get("steps", 20)
    args.warmup = args.warmup if args.warmup is not None else shape.get("warmup", 5)
    args.peer = args.peer or preset.get("peer")
    if "seq_len" in shape:  # the preset/quick shape holds for both sides
        args.peer_seq_len, args.peer_batch = shape["seq_len"], shape["batch"]
        if args.quick:
            extra = [f"--training.seq_len={shape['seq_len']}", f"--training.local_batch_size={shape['batch']}", *extra]
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    return extra


def _variants(args, parser, preset: dict) -> dict[str, list[str]]:
    """The variants to run: --variants (default eager), or the preset's, plus each --variant."""
    if args.variants is None and preset:
        variants = (
            {**preset["variants"], **bench.parse_variants("", args.variant)}
            if args.variant
            else dict(preset["variants"])
        )
    else:
        variants = bench.parse_variants("eager" if args.variants is None else args.variants, args.variant)
    if args.peer is not None:
        if args.peer in variants:
            parser.error(f"--variant: {args.peer!r} is the peer's name")
    return variants


def _check_args(args, parser) -> list[int]:
    """The process counts; every number in range, before the first run starts."""
    import math

    try:
        nprocs = [int(n) for n in args.nproc.split(",") if n.strip()]
    except ValueError:
        nprocs = []
    if not nprocs or min(nprocs) < 1:
        parser.error(f"--nproc: {args.nproc!r}; allowed: a comma list of process counts >= 1, e.g. 1,2")
    for flag, value, least in (
        ("--repeats", args.repeats, 1),
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
        ("--threads", args.threads, 1),
        ("--peer-seq-len", args.peer_seq_len, 1),
        ("--peer-batch", args.peer_batch, 1),
    ):
        if value is not None and value < least:
            parser.error(f"{flag}: {value}; allowed: >= {least}")
    for flag, value in (("--max-busy", args.max_busy), ("--max-wait", args.max_wait), ("--timeout", args.timeout)):
        if not math.isfinite(value) or value < 0 or (flag == "--timeout" and value == 0):
            parser.error(f"{flag}: {value}; allowed: a finite number {'> 0' if flag == '--timeout' else '>= 0'}")
    return nprocs


def _check_runs(jobs: list[dict], parser) -> None:
    """Resolve the config of each variant's trainer command line as the trainer will (recipe,
    variant overrides, the arguments after --), so a bad recipe or key stops here, not in a run."""
    from models.errors import ConfigError
    from trainer.config import build_config, split_cli

    seen = set()
    for job in jobs:
        for cmd in job.get("cmds", [job.get("cmd")]):
            if job["variant"] in seen or "trainer.train" not in cmd:
                continue
            seen.add(job["variant"])
            try:
                recipe, _, cli = split_cli(cmd[cmd.index("trainer.train") + 1 :])
                build_config(recipe, cli)
            except ConfigError as e:
                parser.error(f"{e} (variant {job['variant']})")


if __name__ == "__main__":
    sys.exit(cli.run(main))
