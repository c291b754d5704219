#!/usr/bin/env python
"""Plan a pod job without the pod: per-device memory, fit verdict and step time of a plan.

    python scripts/estimate.py --config configs/llama3_70b_v6e.toml          # on its [job] target
    python scripts/estimate.py --config configs/llama3_70b_v6e.toml --target v6e-512
    python scripts/estimate.py --model llama3 --flavor 70B --target v6e-256 --tp 4 --ac full \\
        --local-batch 1 --seq-len 8192
    python scripts/estimate.py --model llama3 --flavor 405B --target v7x-1024 --recommend --csv plans.csv
    python scripts/estimate.py --config configs/flux_dev_v7x.toml --target v7x-256
    python scripts/estimate.py --list-targets
    python scripts/estimate.py --config configs/llama3_70b_v6e.toml --target v6e-256x2      # 2 slices (DCN)
    python scripts/estimate.py --config configs/llama3_70b_v6e.toml --weak-scaling 1,2,4    # slices of the target

FLUX (task flow): a sample is `[flow] text_seq_len` T5 tokens + (latent_size / 2)^2 image
tokens; `seq len` in the reports is their sum, FLOPs come from the model's own count
(models/flux/flops.py) and activations from planner/flux.py; samples/s are printed too.

One process, PyTorch's fake process group and meta tensors: the real mesh, the real flavor
and the real plan (`parallelize_model`) give the parameter shards; an analytic model gives the
activations (docs/planner.md). The `planner/` package computes and `planner/report.py` prints the
reports, the CSV and the recipe keys; this script reads the flags. Recipe keys work as in training (`--section.key=value`); the
short flags below override them, and `--target` overrides the recipe's `[job] target`.
Exit status: 0 the plan fits (or --recommend found one), 1 it does not fit (the table and the
verdict are printed), 2 invalid input (one `error:` line), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys

import planner
from models import FAMILIES
from models.errors import ConfigError
from parallelisms.activation_checkpoint import AC_MODES
from planner import report
from trainer.runtime import cli

# Short flag -> recipe key it overrides.
_SHORT = {
    "model": "model.name",
    "flavor": "model.flavor",
    "seq_len": "training.seq_len",
    "local_batch": "training.local_batch_size",
    "grad_accum": "training.gradient_accumulation_steps",
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "cp": "parallelism.context_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "ac": "activation_checkpoint.mode",
}


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Recipe keys: --section.key=value, as in training (docs/config.md).",
    )
    p.add_argument(
        "--target",
        help="slice or cluster, e.g. v6e-256, v5p-1024, v7x-1024, h100-64 (--list-targets), several slices "
        "v6e-256x2; default: the recipe's [job] target",
    )
    p.add_argument(
        "--weak-scaling",
        help="comma-separated slice counts (e.g. 1,2,4): the plan on that many slices of the target (dp_replicate "
        "x slices, the same per-device batch) and the projected weak-scaling efficiency (planner/multislice.py)",
    )
    p.add_argument("--list-targets", action="store_true", help="print the generations and exit")
    p.add_argument("--model", help=f"model.name ({', '.join(FAMILIES)})")
    p.add_argument("--flavor", help="model.flavor (8B, 70B, 405B, 235B-A22B, 671B, kimi_k2, ...)")
    p.add_argument("--seq-len", type=int, help="training.seq_len")
    p.add_argument("--local-batch", type=int, help="training.local_batch_size (sequences per micro-batch per dp rank)")
    p.add_argument("--grad-accum", type=int, help="training.gradient_accumulation_steps")
    p.add_argument("--dp-replicate", type=int, help="parallelism.data_parallel_replicate_degree")
    p.add_argument("--dp-shard", type=int, help="parallelism.data_parallel_shard_degree (-1 fills)")
    p.add_argument("--tp", type=int, help="parallelism.tensor_parallel_degree")
    p.add_argument("--cp", type=int, help="parallelism.context_parallel_degree")
    p.add_argument("--ep", type=int, help="parallelism.expert_parallel_degree")
    p.add_argument("--ac", help=f"activation_checkpoint.mode: {' | '.join(AC_MODES)}")
    p.add_argument("--loss-parallel", action="store_true", help="parallelism.enable_loss_parallel = true")
    p.add_argument(
        "--recommend",
        action="store_true",
        help="search dp_replicate, tp, cp, ep (MoE), AC mode and local batch for the target and print the best plan",
    )
    p.add_argument("--csv", help="write one CSV row per evaluated plan to this path")
    p.add_argument("--headroom", type=float, default=0.10, help="fraction of HBM kept free (default 0.10)")
    p.add_argument(
        "--mfu",
        type=float,
        default=0.40,
        help="assumed MFU without recompute, for the step-time estimate (default 0.40)",
    )
    p.add_argument(
        "--max-global-tokens",
        type=int,
        default=16 * 2**20,
        help="--recommend: largest global batch in tokens (default 16Mi, Llama 3 405B's final batch)",
    )
    p.add_argument("--top", type=int, default=8, help="--recommend: rows of the candidate table (default 8)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _run(argv)
    except ConfigError as e:
        cli.error_line(str(e))
        return 2


def _run(argv: list[str]) -> int:
    ns, rest = _parser().parse_known_args(argv)
    if ns.list_targets:
        print(report.target_table())
        print("\n" + report.TARGETS_NOTE)
        return 0
    overrides = [(key, str(getattr(ns, name))) for name, key in _SHORT.items() if getattr(ns, name) is not None]
    if ns.loss_parallel:
        overrides.append(("parallelism.enable_loss_parallel", "true"))
    cfg, target = _config_and_target(rest, overrides, target=ns.target, headroom=ns.headroom, mfu=ns.mfu)
    from tools.recipe_check import plan_inputs

    inputs = plan_inputs(cfg)  # the step settings: PlanInputs.refusals / step_plan per layout
    kw = dict(headroom=ns.headroom, assumed_mfu=ns.mfu, csv_path=ns.csv)
    if ns.recommend:
        return report.recommend_report(inputs, target, max_global_tokens=ns.max_global_tokens, top=ns.top, **kw)
    if ns.weak_scaling:
        slices = _slice_counts(ns.weak_scaling)
        return report.weak_scaling(inputs, target, cfg, slices, headroom=ns.headroom, assumed_mfu=ns.mfu)
    return report.plan_report(inputs, target, cfg, **kw)


def _config_and_target(
    argv: list[str], overrides: list[tuple[str, str]], *, target: str | None, headroom: float, mfu: float
):
    """(config, target) from the flags: the recipe and recipe keys in `argv` (`--config R
    --section.key=value`, as in training) plus `overrides` (the short flags' keys, applied after),
    and `target` or else the recipe's `[job] target`."""
    from trainer.config import build_config, split_cli

    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom: {headroom} is out of range; allowed: 0 <= headroom < 1")
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu: {mfu} is out of range; allowed: 0 < mfu <= 1")
    parsed = planner.parse_target(target) if target else None
    recipe, _, keys = split_cli(argv)
    cfg = build_config(recipe, keys + overrides)
    if parsed is None:  # the recipe's [job] target; a bad one names the recipe key, not the flag
        if recipe is None:
            raise ConfigError(
                "--target: required without a recipe; allowed: a target name, e.g. --target v6e-256 (see --list-targets)"
            )
        if not cfg.job.target:
            raise ConfigError(
                f"job.target: {recipe} sets no [job] target and no --target was given; allowed: a "
                "[job] target in the recipe or --target, e.g. --target v6e-256 (see --list-targets)"
            )
        parsed = planner.parse_target(cfg.job.target, key="job.target")
    return cfg, parsed


def _slice_counts(counts: str) -> list[int]:
    """--weak-scaling's comma-separated slice counts."""
    try:
        slices = [int(c) for c in counts.split(",")]
        assert slices and all(c >= 1 for c in slices)
    except (ValueError, AssertionError):
        raise ConfigError(
            f"--weak-scaling: {counts!r}; allowed: comma-separated slice counts >= 1, e.g. 1,2,4"
        ) from None
    return slices


if __name__ == "__main__":
    from trainer.runtime.quiet import quiet_capture

    quiet_capture()  # third-party warnings of capture-only jobs, which a user cannot act on
    sys.exit(cli.run(main))
