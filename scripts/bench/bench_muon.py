"""AdamW vs Muon on the Llama 3 debug model: loss curves at a few learning rates, same tokens.

Builds the job of configs/llama3_debug.toml once (the trainer's own `build_job`: model, compute
dtype, attention kernel, data), draws `--steps` training batches and `--val-batches` validation
batches once, and then for each (optimizer, lr) of the sweep: restores the same initial weights,
builds the optimizer (`trainer.optim.build_optimizer_for`) and the recipe's lr schedule (warmup,
cosine), and runs the trainer's eager step over the same batches. Records per step the training
loss, and per run the final validation loss, tokens/s of the whole step and the milliseconds of
the optimizer's step alone. Writes a CSV of the curves and one of the summary; prints a table.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/bench_muon.py --steps 150 \\
        --out docs/results/muon_vs_adamw
"""

from __future__ import annotations

import sys
import time

from trainer.runtime import cli
from trainer.runtime.device import cpu_model

from bench_runs import FixedBatches, write_csvs


def main() -> None:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/llama3_debug.toml")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=4, help="local batch size (sequences)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--muon-lrs", default="3e-3,1e-2,3e-2")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--out", default="docs/results/muon_vs_adamw", help="CSV prefix")
    args = ap.parse_args()

    fixed = FixedBatches.build(
        args.config,
        [
            ("training.local_batch_size", str(args.batch)),
            ("training.seq_len", str(args.seq_len)),
            ("job.dump_folder", "/tmp/bench_muon"),
            ("lr_scheduler.warmup_steps", str(args.warmup)),
        ],
        steps=args.steps,
        val_batches=args.val_batches,
    )
    job, batches = fixed.job, fixed.batches
    tokens_per_step = args.batch * args.seq_len
    runs = [("adamw", float(lr)) for lr in args.adamw_lrs.split(",")] + [
        ("muon", float(lr)) for lr in args.muon_lrs.split(",")
    ]
    curves, summary = [], []
    for name, lr in runs:
        step_fn, optimizer, scheduler = fixed.restart(optimizer=name, lr=lr)
        opt_s, started = [0.0], [0.0]
        optimizer.register_step_pre_hook(lambda *_: started.__setitem__(0, time.perf_counter()))
        optimizer.register_step_post_hook(lambda *_: opt_s.__setitem__(0, opt_s[0] + time.perf_counter() - started[0]))
        t_steps, losses = 0.0, []
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            out = step_fn([batch], scheduler.get_last_lr()[0])
            loss = float(out.loss)
            scheduler.step()
            if i == 0:  # first step: allocations, lazy state
                opt_s[0] = 0.0
            else:
                t_steps += time.perf_counter() - t0
            losses.append(loss)
            curves.append({"optimizer": name, "lr": lr, "step": i + 1, "loss": round(loss, 5)})
        val_loss = fixed.val_loss()
        timed = args.steps - 1
        row = {
            "optimizer": name,
            "lr": lr,
            "final_train_loss_avg10": round(sum(losses[-10:]) / len(losses[-10:]), 4),
            "val_loss": round(val_loss, 4),
            "tokens_per_s": round(timed * tokens_per_step / t_steps),
            "optimizer_step_ms": round(1000 * opt_s[0] / timed, 1),
        }
        summary.append(row)
        print(row, flush=True)
    write_csvs(args.out, {"_curves": curves, "": summary})
    print(
        f"\n{args.steps} steps x {tokens_per_step} tokens, {cpu_model()}, attention {job.attention}, "
        f"compute {job.runtime.compute.dtype if hasattr(job.runtime.compute, 'dtype') else job.runtime.compute}"
    )
    print("| optimizer | lr | train loss (last 10) | val loss | tokens/s | optimizer step ms |")
    print("|---|---|---|---|---|---|")
    for r in summary:
        print(
            f"| {r['optimizer']} | {r['lr']:g} | {r['final_train_loss_avg10']} | {r['val_loss']} | "
            f"{r['tokens_per_s']:,} | {r['optimizer_step_ms']} |"
        )


if __name__ == "__main__":
    sys.exit(cli.run(main))
