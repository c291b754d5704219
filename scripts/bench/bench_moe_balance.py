"""Expert-load balance of the DeepSeek-V3 debug model: selection bias vs auxiliary losses.

Builds the job of configs/deepseek_v3_debug.toml once (the trainer's `build_job`), draws
`--steps` training batches and `--val-batches` validation batches once, and for each variant
restores the same initial weights (selection biases at zero), builds the recipe's AdamW and lr
schedule, and runs the trainer's eager step (`Job.build_step`, with its `ExpertBalance`) over
the same batches. A variant sets the auxiliary loss (none, the global-batch load-balancing loss
of Qwen 3, DeepSeek-V3's sequence-wise loss), its coefficient, and the bias rate
(`training.expert_bias_rate`; 0 keeps the bias at zero, so routing is by the scores alone).

Per step it records MaxVio over the global batch (max load / mean load - 1, averaged over the MoE
layers; trainer/optim/expert_balance.py) and the LM loss; per variant the mean MaxVio of the second
half of the run, the final max/mean load ratio, the training loss (last 10 steps), the
validation loss and tokens/s. Writes `<out>_curves.csv` and `<out>.csv`; prints a table.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/bench_moe_balance.py --steps 200 \\
        --out docs/results/moe_balance
"""

from __future__ import annotations

import statistics
import sys
import time

from models.common.moe import MoE
from trainer.runtime import cli
from trainer.runtime.device import cpu_model

from bench_runs import FixedBatches, write_csvs

# name -> (aux loss, aux coefficient, bias rate)
VARIANTS = {
    "none": ("none", 0.0, 0.0),
    "global LBL 1e-3": ("load_balance", 1e-3, 0.0),
    "global LBL 1e-2": ("load_balance", 1e-2, 0.0),
    "sequence 1e-4": ("sequence", 1e-4, 0.0),
    "bias 1e-3": ("none", 0.0, 1e-3),
    "bias 1e-3 + sequence 1e-4": ("sequence", 1e-4, 1e-3),
    "bias 1e-2": ("none", 0.0, 1e-2),
}


def _parse_args():
    """The command line; `--variants` comes back as a list of VARIANTS names (unknown ones refused)."""
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/deepseek_v3_debug.toml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4, help="local batch size (sequences)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    ap.add_argument("--out", default="docs/results/moe_balance", help="CSV prefix")
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    unknown = [n for n in args.variants if n not in VARIANTS]
    if unknown:
        cli.fail(f"--variants: {unknown} unknown; allowed: {', '.join(VARIANTS)}")
    return args


def _fixed_batches(args) -> FixedBatches:
    """The recipe's job (fp32 parameters) and its training and validation batches, drawn once."""
    return FixedBatches.build(
        args.config,
        [
            ("training.local_batch_size", str(args.batch)),
            ("training.seq_len", str(args.seq_len)),
            ("job.dump_folder", "/tmp/bench_moe_balance"),
            ("training.mixed_precision_param", "float32"),
        ],
        steps=args.steps,
        val_batches=args.val_batches,
    )


def _train_variant(name: str, fixed: FixedBatches, moes: list[MoE], lr: float) -> dict:
    """One variant's run from the initial weights: its per-step curve rows, losses, MaxVios and
    the seconds of every step but the first."""
    aux, coef, rate = VARIANTS[name]
    step_fn, _, scheduler = fixed.restart(
        optimizer="adamw", lr=lr, training_overrides=dict(aux_loss_coef=coef, expert_bias_rate=rate)
    )
    for m in moes:  # after the restart's weight reload: a plain attribute of each layer
        m.aux_loss = aux
    t_steps, losses, vios, curves = 0.0, [], [], []
    for i, batch in enumerate(fixed.batches):
        t0 = time.perf_counter()
        out = step_fn([batch], scheduler.get_last_lr()[0])
        loss, vio = float(out.loss), float(out.moe_max_vio)
        scheduler.step()
        if i > 0:  # first step: allocations, lazy state
            t_steps += time.perf_counter() - t0
        losses.append(loss)
        vios.append(vio)
        curves.append({"variant": name, "step": i + 1, "loss": round(loss, 5), "max_vio": round(vio, 4)})
    return {"curves": curves, "losses": losses, "vios": vios, "t_steps": t_steps}


def _summary_row(name: str, run: dict, *, val_loss: float, moes: list[MoE], steps: int, tokens_per_step: int) -> dict:
    """The variant's summary: MaxVio first and over the second half, final max/mean load, bias, losses, tokens/s."""
    aux, coef, rate = VARIANTS[name]
    vios, losses = run["vios"], run["losses"]
    half = vios[len(vios) // 2 :]
    return {
        "variant": name,
        "aux_loss": aux,
        "aux_coef": coef,
        "bias_rate": rate,
        "max_vio_first": round(vios[0], 3),
        "max_vio_second_half_mean": round(statistics.fmean(half), 3),
        "max_over_mean_final": round(1 + vios[-1], 3),
        "bias_abs_max": round(
            max(
                (m.router.expert_bias.abs().max().item() for m in moes if m.router.expert_bias is not None),
                default=0.0,
            ),
            4,
        ),
        "train_loss_last10": round(statistics.fmean(losses[-10:]), 4),
        "val_loss": round(val_loss, 4),
        "tokens_per_s": round((steps - 1) * tokens_per_step / run["t_steps"]),
    }


def _print_table(summary: list[dict], *, steps: int, tokens_per_step: int, lr: float, attention) -> None:
    """The run's settings line, then the summary as a markdown table."""
    print(f"\n{steps} steps x {tokens_per_step} tokens, lr {lr:g}, {cpu_model()}, attention {attention}, float32")
    print(
        "| variant | MaxVio step 1 | MaxVio 2nd half (mean) | max/mean load, last step | max abs bias | "
        "train loss (last 10) | val loss | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in summary:
        print(
            f"| {r['variant']} | {r['max_vio_first']} | {r['max_vio_second_half_mean']} | "
            f"{r['max_over_mean_final']} | {r['bias_abs_max']} | {r['train_loss_last10']} | {r['val_loss']} | "
            f"{r['tokens_per_s']:,} |"
        )


def main() -> None:
    args = _parse_args()
    fixed = _fixed_batches(args)
    job, lr = fixed.job, fixed.cfg.optimizer.lr
    moes = [m for m in job.model.modules() if isinstance(m, MoE)]
    tokens_per_step = args.batch * args.seq_len
    curves, summary = [], []
    for name in args.variants:
        run = _train_variant(name, fixed, moes, lr)
        curves += run["curves"]
        row = _summary_row(
            name, run, val_loss=fixed.val_loss(), moes=moes, steps=args.steps, tokens_per_step=tokens_per_step
        )
        summary.append(row)
        print(row, flush=True)
    write_csvs(args.out, {"_curves": curves, "": summary})
    _print_table(summary, steps=args.steps, tokens_per_step=tokens_per_step, lr=lr, attention=job.attention)


if __name__ == "__main__":
    sys.exit(cli.run(main))
