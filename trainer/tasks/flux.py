"""The FLUX task: rectified flow (trainer/tasks/flow.py) on a precomputed latent + text-embedding
data set (trainer/flux_data/loader.py), with held-out sample grids at validation (flux_sample.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from models.errors import ConfigError
from models.flux.flops import flops_per_sample
from trainer.flux_data.loader import build_flux_dataloader, resolve_flux_dataset
from trainer.tasks import flow
from trainer.tasks.flux_sample import log_sample_grid


@dataclass(frozen=True)
class FlowSettings:
    """What the FLUX task reads of a run's config (`FlowSettings.of(cfg, compute_dtype)`)."""

    flow: Any
    """`[flow]` (trainer.config.FlowConfig)."""
    dataset: str
    """`[training] dataset` (the train split's)."""
    validation_dataset: str
    """`[validation] dataset` (held-out captions, sample prompts)."""
    seed: int
    compute_dtype: torch.dtype
    """The run's resolved compute dtype (`Job.runtime.compute.dtype`): what the inputs are cast to."""

    @classmethod
    def of(cls, cfg, compute_dtype: torch.dtype) -> FlowSettings:
        return cls(
            flow=cfg.flow,
            dataset=cfg.training.dataset,
            validation_dataset=cfg.validation.dataset,
            seed=cfg.training.seed,
            compute_dtype=compute_dtype,
        )


class FlowTask:
    """Rectified flow (trainer/tasks/flow.py) on a precomputed latent + text-embedding data set
    (trainer/flux_data/loader.py). A micro-batch is (latents, t5, clip, noise, t, keep)."""

    name = "flow"
    unit = "samples"
    units_per_sample = 1

    @staticmethod
    def seq_len_to_divide(training) -> int:
        return 0  # the FLUX plan shards heads and MLP widths only, not the sequence

    def __init__(self, settings: FlowSettings, *, args):
        self.settings = settings
        self.args = args
        self.param_dtype = settings.compute_dtype
        self.guidance = settings.flow.guidance if getattr(args, "guidance_embed", False) else None
        self._shapes: tuple[tuple[int, ...], int] | None = None  # (latent [16, h, w], text length)
        self._sampling = None  # (text conditioner, VAE, prompts) for sample_grid

    def build_loader(self, *, split: str, local_batch_size: int, dp_rank: int, dp_degree: int):
        path = self.settings.dataset if split == "train" else self.settings.validation_dataset
        path = "procedural" if path == "bundled" else path  # the offline default of each task
        # Validation reads the data set's held-out split: caption combinations never trained on.
        split = "train" if split == "train" else "heldout"
        build = functools.partial(
            build_flux_dataloader,
            path=path,
            local_batch_size=local_batch_size,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            seed=self.settings.seed,
            split=split,
        )
        if split == "train" and self._shapes is None:
            self._shapes = self._check_shapes(build())  # a throwaway loader: the real one starts at 0
        return build()

    def _check_shapes(self, loader) -> tuple[tuple[int, ...], int]:
        """Read the first micro-batch and check its widths against the model."""
        latents, t5, clip, _ = loader.next_batch()
        where = f"dataset {self.settings.dataset}"
        if latents.shape[1] * 4 != self.args.in_channels:
            raise ConfigError(
                f"{where}: latents have {latents.shape[1]} channels, packed to {latents.shape[1] * 4}, "
                f"but model.in_channels is {self.args.in_channels}; allowed: in_channels = 4 x channels"
            )
        if t5.shape[-1] != self.args.context_in_dim or clip.shape[-1] != self.args.vec_in_dim:
            raise ConfigError(
                f"{where}: text embeddings are T5 {t5.shape[-1]} / CLIP {clip.shape[-1]} wide but "
                f"the model takes context_in_dim {self.args.context_in_dim} / vec_in_dim "
                f"{self.args.vec_in_dim}; allowed: build the data with the matching encoders"
            )
        f = self.settings.flow
        if f.latent_size and tuple(latents.shape[2:]) != (f.latent_size, f.latent_size):
            raise ConfigError(
                f"flow.latent_size: {f.latent_size}, but {where} holds {tuple(latents.shape[2:])} "
                "latents; allowed: the data set's latent side, or 0 (take it from the data)"
            )
        if f.text_seq_len and t5.shape[1] != f.text_seq_len:
            raise ConfigError(
                f"flow.text_seq_len: {f.text_seq_len}, but {where} holds {t5.shape[1]} T5 tokens; "
                "allowed: the data set's length, or 0 (take it from the data)"
            )
        return tuple(latents.shape[1:]), t5.shape[1]

    def shift(self, image_tokens: int) -> float:
        f = self.settings.flow
        return flow.resolution_shift(image_tokens) if f.resolution_shift else f.shift

    def sample_grid(self, model) -> torch.Tensor | None:
        """[3, H, W] grid of samples for `flow.sample_prompts` distinct held-out captions (None
        when 0). Every rank calls it (a sharded model's forward is collective)."""
        f = self.settings.flow
        if not f.sample_prompts:
            return None
        if self._sampling is None:  # encoders, VAE and prompts: loaded once
            path = self.settings.validation_dataset
            dataset = resolve_flux_dataset("procedural" if path == "bundled" else path)
            prompts = list(dict.fromkeys(row["caption"] for row in dataset.captions("heldout")))
            self._sampling = (dataset.text_conditioner(), dataset.vae(), prompts[: f.sample_prompts])
        text, vae, prompts = self._sampling
        latent_shape, _ = self._shapes
        return log_sample_grid(
            model,
            prompts,
            text=text,
            vae=vae,
            latent_shape=latent_shape,
            seed=self.settings.seed,
            num_steps=f.sample_steps,
            shift=self.shift(self.image_tokens(latent_shape)),
            cfg_scale=f.cfg_scale,
            guidance=self.guidance,
            dtype=self.param_dtype,
        )

    def image_tokens(self, latent_shape: tuple[int, ...]) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def prepare(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, t5, clip, index = batch
        f = self.settings.flow
        shift = self.shift(self.image_tokens(latents.shape))
        noise, t, keep = flow.draw(
            index,
            latent_shape=tuple(latents.shape[1:]),
            seed=self.settings.seed,
            timestep_sampling=f.timestep_sampling,
            logit_mean=f.logit_mean,
            logit_std=f.logit_std,
            shift=shift,
            text_dropout=f.text_dropout,
        )
        return latents, t5, clip, noise, t, keep

    def example_batch(self, local_batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A micro-batch of the shapes and dtypes `prepare` returns, from `[flow] latent_size` and
        `text_seq_len` (the recipe check captures with it)."""
        f, a, b = self.settings.flow, self.args, local_batch_size
        if not f.latent_size or not f.text_seq_len:
            raise ConfigError(
                "flow.latent_size / flow.text_seq_len: the recipe check needs the sample's shape; "
                "set both (e.g. latent_size = 128, text_seq_len = 512 for 1024 px FLUX.1-dev); allowed: both set"
            )
        latents = torch.zeros(b, a.in_channels // 4, f.latent_size, f.latent_size, device=device)
        return (
            latents,
            torch.zeros(b, f.text_seq_len, a.context_in_dim, device=device),
            torch.zeros(b, a.vec_in_dim, device=device),
            torch.zeros_like(latents),
            torch.zeros(b, device=device),
            torch.ones(b, device=device),
        )

    def loss_fn(self, step_plan) -> Callable:
        return functools.partial(flow.flow_loss, guidance=self.guidance, dtype=self.param_dtype)

    def flops_per_unit(self) -> float:
        assert self._shapes is not None, "build the train loader first"
        latent_shape, text_len = self._shapes
        return flops_per_sample(self.args, self.image_tokens(latent_shape), text_len)
