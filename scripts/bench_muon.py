"""AdamW vs Muon on the Llama 3 debug model: loss curves at a few learning rates, same tokens.

Builds the job of configs/llama3_debug.toml once (the trainer's own `build_job`: model, compute
dtype, attention kernel, data), draws `--steps` training batches and `--val-batches` validation
batches once, and then for each (optimizer, lr) of the sweep: restores the same initial weights,
builds the optimizer (`trainer.optim.build_optimizer_for`) and the recipe's lr schedule (warmup,
cosine), and runs the trainer's eager step over the same batches. Records per step the training
loss, and per run the final validation loss, tokens/s of the whole step and the milliseconds of
the optimizer's step alone. Writes a CSV of the curves and one of the summary; prints a table.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_muon.py --steps 150 \\
        --out docs/results/muon_vs_adamw
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from trainer.config import build_config  # noqa: E402
from trainer.job import build_job  # noqa: E402
from trainer.optim import build_lr_scheduler, build_optimizer_for  # noqa: E402
from trainer.runtime.device import cpu_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

    overrides = [("training.steps", str(args.steps)), ("training.local_batch_size", str(args.batch)),
                 ("training.seq_len", str(args.seq_len)), ("checkpoint.enable", "false"),
                 ("metrics.enable_tensorboard", "false"), ("job.dump_folder", "/tmp/bench_muon"),
                 ("lr_scheduler.warmup_steps", str(args.warmup))]
    cfg = build_config(args.config, overrides)
    job = build_job(cfg)
    task, device = job.task, job.device
    loss_fn = task.loss_fn(job.step_plan)
    batches = [tuple(x.to(device) for x in task.prepare(job.loader.next_batch())) for _ in range(args.steps)]
    val_loader = job.build_val_loader()
    val = [tuple(x.to(device) for x in task.prepare(val_loader.next_batch())) for _ in range(args.val_batches)]
    initial = copy.deepcopy(job.model.state_dict())
    tokens_per_step = args.batch * args.seq_len
    s = cfg.lr_scheduler
    runs = [("adamw", float(lr)) for lr in args.adamw_lrs.split(",")] + \
           [("muon", float(lr)) for lr in args.muon_lrs.split(",")]
    curves, summary = [], []
    for name, lr in runs:
        job.model.load_state_dict(initial)
        o = cfg.optimizer
        optimizer = build_optimizer_for(job.model, name=name, lr=lr, betas=o.betas, eps=o.eps,
                                        weight_decay=o.weight_decay)
        opt_s, started = [0.0], [0.0]
        optimizer.register_step_pre_hook(lambda *_: started.__setitem__(0, time.perf_counter()))
        optimizer.register_step_post_hook(
            lambda *_: opt_s.__setitem__(0, opt_s[0] + time.perf_counter() - started[0]))
        scheduler = build_lr_scheduler(optimizer, total_steps=args.steps, warmup_steps=s.warmup_steps,
                                       decay_type=s.decay_type, decay_ratio=s.decay_ratio,
                                       min_lr_factor=s.min_lr_factor)
        step_fn = dataclasses.replace(job, optimizer=optimizer, scheduler=scheduler).build_step(loss_fn=loss_fn)
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
        with torch.no_grad():
            val_loss = sum(float(loss_fn(job.model, *b)) for b in val) / len(val)
        timed = args.steps - 1
        row = {"optimizer": name, "lr": lr, "final_train_loss_avg10": round(sum(losses[-10:]) / len(losses[-10:]), 4),
               "val_loss": round(val_loss, 4), "tokens_per_s": round(timed * tokens_per_step / t_steps),
               "optimizer_step_ms": round(1000 * opt_s[0] / timed, 1)}
        summary.append(row)
        print(row, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, rows in ((f"{out}_curves.csv", curves), (f"{out}.csv", summary)):
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"\n{args.steps} steps x {tokens_per_step} tokens, {cpu_model()}, attention {job.attention}, "
          f"compute {job.compute.dtype if hasattr(job.compute, 'dtype') else job.compute}")
    print("| optimizer | lr | train loss (last 10) | val loss | tokens/s | optimizer step ms |")
    print("|---|---|---|---|---|---|")
    for r in summary:
        print(f"| {r['optimizer']} | {r['lr']:g} | {r['final_train_loss_avg10']} | {r['val_loss']} | "
              f"{r['tokens_per_s']:,} | {r['optimizer_step_ms']} |")


if __name__ == "__main__":
    main()
