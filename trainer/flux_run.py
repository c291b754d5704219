"""A trained FLUX run rebuilt in one process from its dump folder (scripts/sample.py,
scripts/eval_flux.py): config.toml -> the model (unsharded, fp32, eval) with a checkpoint's
weights, and the data set's text encoders and VAE. For the sampling commands; the trainer samples
through `trainer.tasks.flux_sample` on its own sharded model."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from models.errors import ConfigError
from trainer.checkpoint import complete_steps, load_initial
from trainer.config import build_config, model_args
from trainer.flux_data.loader import resolve_flux_dataset
from trainer.tasks import flow


@dataclass
class FluxRun:
    """What sampling needs from a run: its model (unsharded, eval), conditioning and schedule."""

    cfg: object
    """The run's resolved `trainer.config.Config` (from its dump folder's config.toml)."""
    model: torch.nn.Module
    args: object
    dataset: object
    """The run's `trainer.flux_data.loader.FluxDataset` (captions, encoders, VAE)."""
    text: object
    vae: object
    checkpoint: str | None
    """The DCP folder loaded, or None (the untrained, initialized model)."""

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.dataset.latent_shape)

    @property
    def shift(self) -> float:
        """The run's training shift (fixed, or FLUX's resolution shift for its image tokens)."""
        f = self.cfg.flow
        if f.resolution_shift:
            _, h, w = self.latent_shape
            return flow.resolution_shift((h // 2) * (w // 2))
        return f.shift

    def guidance(self, value: float | None = None) -> float | None:
        """The guidance-embedding value: `value`, else the run's `flow.guidance`; None without the embedding."""
        if not getattr(self.args, "guidance_embed", False):
            return None
        return self.cfg.flow.guidance if value is None else value


def find_checkpoint(run_dir: str, cfg, *, step: int | None = None) -> str:
    """The DCP folder `step-N` of a run (`step` None: the newest) under its checkpoint folder."""
    folder = os.path.join(run_dir, cfg.checkpoint.folder)
    steps = {n: os.path.join(folder, f"step-{n}") for n in complete_steps(folder)}
    if not steps:
        raise ConfigError(
            f"--run {run_dir}: no checkpoint (step-N with .metadata) in {folder}; allowed: the "
            "dump folder of a run with [checkpoint] enable = true"
        )
    if step is None:
        return steps[max(steps)]
    if step not in steps:
        raise ConfigError(
            f"--step {step}: no such checkpoint in {folder}; allowed: {', '.join(map(str, sorted(steps)))}"
        )
    return steps[step]


def load_run(run_dir: str, *, step: int | None = None, untrained: bool = False, seed: int = 0) -> FluxRun:
    """Rebuild a FLUX run from its dump folder: config.toml -> model (one process, unsharded,
    fp32, eval) with the weights of checkpoint `step` (newest when None), or initialized from
    `seed` and left untrained (`untrained=True`: the baseline of scripts/eval_flux.py); the data
    set's text encoders and VAE."""
    config_path = os.path.join(run_dir, "config.toml")
    if not os.path.isfile(config_path):
        raise ConfigError(f"--run {run_dir}: no config.toml; allowed: the dump folder of a training run")
    cfg = build_config(config_path)
    family, args = model_args(cfg.model.name, cfg.model.flavor, cfg.model.overrides)
    if getattr(family, "task", "lm") != "flow":
        raise ConfigError(
            f"--run {run_dir}: model.name {cfg.model.name!r} is not a flow (FLUX) model; "
            "allowed: a run of model.name = flux"
        )
    checkpoint = None if untrained else find_checkpoint(run_dir, cfg, step=step)
    with torch.device("meta"):
        model = family.model_cls(args)
    model.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights()
    if checkpoint is not None:
        load_initial(model, path=checkpoint, fmt="dcp")
    model.eval()
    path = cfg.training.dataset
    dataset = resolve_flux_dataset("procedural" if path == "bundled" else path)
    return FluxRun(
        cfg=cfg,
        model=model,
        args=args,
        dataset=dataset,
        text=dataset.text_conditioner(),
        vae=dataset.vae(),
        checkpoint=checkpoint,
    )
