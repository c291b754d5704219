"""Shared set-up of the optimizer-comparison benchmarks (scripts/bench/bench_muon.py,
scripts/bench/bench_moe_balance.py): one job, fixed batches, restartable runs, CSV output."""

from __future__ import annotations

import copy
import csv
import dataclasses
from pathlib import Path

from trainer.config import build_config
from trainer.job import build_job
from trainer.optim import build_lr_scheduler, build_optimizer_for


@dataclasses.dataclass
class FixedBatches:
    """The job of a recipe (the trainer's `build_job`), `steps` training and `val_batches`
    validation micro-batches drawn once, and the initial weights, so every run of a comparison
    sees the same data from the same start."""

    cfg: object
    job: object
    loss_fn: object
    batches: list
    val: list
    initial: dict

    @classmethod
    def build(cls, config: str, overrides: list[tuple[str, str]], *, steps: int, val_batches: int) -> "FixedBatches":
        cfg = build_config(
            config,
            [
                ("training.steps", str(steps)),
                ("checkpoint.enable", "false"),
                ("metrics.enable_tensorboard", "false"),
                *overrides,
            ],
        )
        job = build_job(cfg)
        task, device = job.data.task, job.runtime.device
        batches = [tuple(x.to(device) for x in task.prepare(job.data.loader.next_batch())) for _ in range(steps)]
        val_loader = job.data.build_val_loader()
        val = [tuple(x.to(device) for x in task.prepare(val_loader.next_batch())) for _ in range(val_batches)]
        return cls(cfg, job, task.loss_fn(job.plan.step_plan), batches, val, copy.deepcopy(job.model.state_dict()))

    def restart(self, *, optimizer: str, lr: float, training_overrides: dict | None = None):
        """Initial weights back; a fresh optimizer and the recipe's lr schedule ->
        (step_fn, optimizer, scheduler); `training_overrides` replace `[training]` keys of the step."""
        self.job.model.load_state_dict(self.initial)
        o, s, cfg = self.cfg.optimizer, self.cfg.lr_scheduler, self.cfg
        opt = build_optimizer_for(
            self.job.model, name=optimizer, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        scheduler = build_lr_scheduler(
            opt,
            total_steps=len(self.batches),
            warmup_steps=s.warmup_steps,
            decay_type=s.decay_type,
            decay_ratio=s.decay_ratio,
            min_lr_factor=s.min_lr_factor,
        )
        if training_overrides:
            cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, **training_overrides))
        step_fn = dataclasses.replace(self.job, cfg=cfg, optimizer=opt, scheduler=scheduler).build_step(
            loss_fn=self.loss_fn
        )
        return step_fn, opt, scheduler

    def val_loss(self) -> float:
        import torch

        with torch.no_grad():
            return sum(float(self.loss_fn(self.job.model, *b)) for b in self.val) / len(self.val)


def write_csv(path: str, rows: list[dict]) -> None:
    """`rows` (dicts with the first row's keys) -> a CSV file at `path`."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_csvs(out: str, tables: dict[str, list[dict]]) -> None:
    """`{suffix: rows}` -> `<out><suffix>.csv` each (parents created)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    for suffix, rows in tables.items():
        write_csv(f"{out}{suffix}.csv", rows)
