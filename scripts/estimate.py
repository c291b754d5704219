#!/usr/bin/env python
"""Plan a pod job without the pod: per-device memory, fit verdict and step time of a plan.

    python scripts/estimate.py --config configs/llama3_70b_v6e.toml --target v6e-256
    python scripts/estimate.py --model llama3 --flavor 70B --target v6e-256 --tp 4 --ac full \\
        --local-batch 1 --seq-len 8192
    python scripts/estimate.py --model llama3 --flavor 405B --target v7x-1024 --recommend --csv plans.csv
    python scripts/estimate.py --list-targets

One process, PyTorch's fake process group and meta tensors: the real mesh, the real flavor
and the real plan (`parallelize_model`) give the parameter shards; an analytic model gives the
activations (docs/planner.md). Recipe keys work as in training (`--section.key=value`); the
short flags below override them. Exit status: 0 the plan fits (or --recommend found one),
1 it does not fit (the table and the verdict are printed), 2 invalid input (one `error:` line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.errors import ConfigError  # noqa: E402

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
    "ep": "parallelism.expert_parallel_degree",
    "ac": "activation_checkpoint.mode",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `error:` line and exit 2, like the trainer
        raise ConfigError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="slice or cluster, e.g. v6e-256, v5p-1024, v7x-1024, h100-64 (--list-targets)")
    p.add_argument("--list-targets", action="store_true", help="print the generations and exit")
    p.add_argument("--model", help="model.name (llama3, qwen3)")
    p.add_argument("--flavor", help="model.flavor (8B, 70B, 405B, 235B-A22B, ...)")
    p.add_argument("--seq-len", type=int, help="training.seq_len")
    p.add_argument("--local-batch", type=int, help="training.local_batch_size (sequences per micro-batch per dp rank)")
    p.add_argument("--grad-accum", type=int, help="training.gradient_accumulation_steps")
    p.add_argument("--dp-replicate", type=int, help="parallelism.data_parallel_replicate_degree")
    p.add_argument("--dp-shard", type=int, help="parallelism.data_parallel_shard_degree (-1 fills)")
    p.add_argument("--tp", type=int, help="parallelism.tensor_parallel_degree")
    p.add_argument("--ep", type=int, help="parallelism.expert_parallel_degree")
    p.add_argument("--ac", help="activation_checkpoint.mode: none | selective | full")
    p.add_argument("--loss-parallel", action="store_true", help="parallelism.enable_loss_parallel = true")
    p.add_argument("--recommend", action="store_true",
                   help="search dp_replicate, tp, AC mode and local batch for the target and print the best plan")
    p.add_argument("--csv", help="write one CSV row per evaluated plan to this path")
    p.add_argument("--headroom", type=float, default=0.10, help="fraction of HBM kept free (default 0.10)")
    p.add_argument("--mfu", type=float, default=0.40,
                   help="assumed MFU without recompute, for the step-time estimate (default 0.40)")
    p.add_argument("--max-global-tokens", type=int, default=16 * 2**20,
                   help="--recommend: largest global batch in tokens (default 16Mi, Llama 3 405B's final batch)")
    p.add_argument("--top", type=int, default=8, help="--recommend: rows of the candidate table (default 8)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _run(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    from trainer import planner
    from trainer.config import build_config, resolve_model_args, split_cli

    ns, rest = _parser().parse_known_args(argv)
    if ns.list_targets:
        print(planner.target_table())
        print("\nA TPU target's size counts TensorCores, as Cloud TPU accelerator types do: "
              "v6e-256 = 256 devices, v5p-1024 = 512 chips = 512 devices, v7x-1024 = 512 chips = 1024 devices.")
        return 0
    if not ns.target:
        raise ConfigError("--target: required, e.g. --target v6e-256 (see --list-targets)")
    if not 0 <= ns.headroom < 1:
        raise ConfigError(f"--headroom: {ns.headroom} is out of range; allowed: 0 <= headroom < 1")
    if not 0 < ns.mfu <= 1:
        raise ConfigError(f"--mfu: {ns.mfu} is out of range; allowed: 0 < mfu <= 1")
    target = planner.parse_target(ns.target)
    recipe, _, overrides = split_cli(rest)
    for name, key in _SHORT.items():
        value = getattr(ns, name)
        if value is not None:
            overrides.append((key, str(value)))
    if ns.loss_parallel:
        overrides.append(("parallelism.enable_loss_parallel", "true"))
    cfg = build_config(recipe, overrides)
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    t, p = cfg.training, cfg.parallelism
    inputs = planner.PlanInputs(family=family, args=args, model_name=f"{cfg.model.name} {cfg.model.flavor}",
                                seq_len=t.seq_len, local_batch_size=t.local_batch_size,
                                grad_accum=t.gradient_accumulation_steps)
    kw = dict(headroom=ns.headroom, assumed_mfu=ns.mfu)

    if ns.recommend:
        candidates = planner.recommend(inputs, target, max_global_tokens=ns.max_global_tokens, **kw)
        if ns.csv:
            planner.write_csv(candidates, ns.csv)
        fitting = [c for c in candidates if c.fits]
        shown = planner.best_per_layout(fitting or candidates)[: ns.top]
        print(f"{inputs.model_name} on {target.describe()}; seq_len {t.seq_len}; "
              f"{len(candidates)} plans evaluated, {len(fitting)} fit")
        print(planner.format_summary(shown))
        print()
        if not fitting:
            print(planner.format_estimate(candidates[0]))
            print(f"verdict: no plan fits {target.name}; the smallest needs {planner.gib(candidates[0].total)} GiB "
                  f"per device")
            need = planner.devices_needed(candidates[0])
            if need:
                print(f"suggestion: about {need} devices for that plan")
            return 1
        best = fitting[0]
        # Re-check the choice on the full model (every block sharded, not one block x n_layers).
        inputs = planner.PlanInputs(family=family, args=args, model_name=inputs.model_name, seq_len=t.seq_len,
                                    local_batch_size=best.local_batch_size)
        est = planner.plan_estimate(inputs, target, dp_replicate=best.dp_replicate, tp=best.tp,
                                    ac_mode=best.ac_mode, loss_parallel=best.loss_parallel, **kw)
        assert est.total == best.total, "one-block probe and full model disagree"
        print("recommended (heuristic in docs/planner.md: pure FSDP first, then TP; least recompute; most tokens):")
        print(planner.format_estimate(est))
        print("\nrecipe keys:\n" + planner.recipe_snippet(est))
        return 0

    est = planner.plan_estimate(
        inputs, target, dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
        tp=p.tensor_parallel_degree, ep=p.expert_parallel_degree, ac_mode=cfg.activation_checkpoint.mode,
        loss_parallel=p.enable_loss_parallel, **kw)
    if ns.csv:
        planner.write_csv([est], ns.csv)
    print(planner.format_estimate(est))
    if est.fits:
        return 0
    print("suggestions:")
    for line in planner.suggest_fixes(inputs, est):
        print(f"  - {line}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
