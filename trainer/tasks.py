"""Tasks: what a model family trains on, and how the trainer feeds and measures it.

A family declares its task (`ModelFamily.task`, models/__init__.py); `build_task` returns the
object `trainer/train.py` asks for everything that depends on it:
- `seq_len_check`: the sequence length the parallel degrees must divide (0: none);
- `build_loader(split=..., ...)`: the train / validation loader (`next_batch()`, `check(n)`,
  `state_dict()` / `load_state_dict()`, iteration), bad paths failing before any checkpoint;
- `prepare(batch) -> tuple[Tensor, ...]`: the host-side micro-batch the steps take;
- `loss_fn(step_plan)`: `loss(model, *micro_batch) -> 0-dim fp32 loss`, called by the eager
  and the graph step alike;
- `unit` ("tokens" | "samples"), `units_per_sample` and `flops_per_unit()` for throughput
  and MFU;
- `sample_grid(model)`: an image logged at validation, or None (FLUX's held-out prompts).

Two tasks exist: "lm" (decoder LMs: tokens in, next-token cross entropy) and "flow"
(FLUX: rectified flow on precomputed latents and text embeddings, trainer/flow.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from models.errors import ConfigError

TASKS = ("lm", "flow")


def _gather_objects() -> Callable[[object], list] | None:
    """All ranks' objects for one object of this rank (a collective over a gloo group made
    here, on every rank), or None in a single process: the LM loader gathers every rank's
    data-shard positions into the checkpointed state."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from trainer.device import cpu_backend

    group = dist.new_group(backend=cpu_backend())

    def gather(obj: object) -> list:
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather


class LMTask:
    """Next-token prediction on packed token windows (trainer/data.py)."""

    name = "lm"
    unit = "tokens"

    def __init__(self, cfg, *, args):
        from trainer.tokenizer import build_tokenizer

        self.cfg = cfg
        self.args = args
        self.seq_len_check = cfg.training.seq_len
        self.units_per_sample = cfg.training.seq_len
        self.tokenizer = build_tokenizer(cfg.model.tokenizer)
        if self.tokenizer.n_vocab > args.vocab_size:
            raise ConfigError(
                f"model.tokenizer: {cfg.model.tokenizer} has {self.tokenizer.n_vocab} tokens but the model's "
                f"vocab_size is {args.vocab_size}; set model.vocab_size >= {self.tokenizer.n_vocab}"
            )

    def build_loader(self, *, split: str, local_batch_size: int, dp_rank: int, dp_degree: int):
        from trainer.data import build_dataloader

        t = self.cfg.training
        return build_dataloader(
            dataset=t.dataset if split == "train" else self.cfg.validation.dataset, tokenizer=self.tokenizer,
            seq_len=t.seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank, dp_degree=dp_degree,
            seed=t.seed, split=split, text_field=t.dataset_text_field, num_shards=t.dataset_shards,
            gather=_gather_objects() if split == "train" else None,
        )

    def prepare(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(batch)  # (inputs, labels)

    def loss_fn(self, step_plan) -> Callable:
        return step_plan.lm_loss

    def sample_grid(self, model) -> None:
        return None

    def flops_per_unit(self) -> dict[str, float]:
        from trainer.flops import flops_per_token

        shape = self.args.shape()
        return flops_per_token(num_matmul_params=self.args.num_active_params(exclude_embedding=True),
                               n_layers=shape.n_layers, n_heads=shape.n_heads, head_dim=shape.head_dim,
                               seq_len=self.cfg.training.seq_len)


class FlowTask:
    """Rectified flow (trainer/flow.py) on a precomputed latent + text-embedding data set
    (trainer/flux_data.py). A micro-batch is (latents, t5, clip, noise, t, keep)."""

    name = "flow"
    unit = "samples"
    units_per_sample = 1
    seq_len_check = 0  # the FLUX plan shards heads and MLP widths only, not the sequence

    def __init__(self, cfg, *, args):
        self.cfg = cfg
        self.args = args
        f = cfg.flow
        if cfg.parallelism.enable_loss_parallel:
            raise ConfigError("parallelism.enable_loss_parallel: shards an LM's vocabulary; a flow model has "
                              "none; allowed: false")
        if f.resolution_shift and f.shift != 1.0:
            raise ConfigError(f"flow.shift: {f.shift} with flow.resolution_shift = true; set one of them "
                              "(shift = 1.0 with resolution_shift, or resolution_shift = false)")
        from trainer.train import _dtype

        self.param_dtype = _dtype(cfg.training.mixed_precision_param)  # resolved from `auto` by then
        self.guidance = f.guidance if getattr(args, "guidance_embed", False) else None
        self._shapes: tuple[tuple[int, ...], int] | None = None  # (latent [16, h, w], text length)
        self._sampling = None  # (text conditioner, VAE, prompts) for sample_grid

    def build_loader(self, *, split: str, local_batch_size: int, dp_rank: int, dp_degree: int):
        from trainer.flux_data import build_flux_dataloader

        path = self.cfg.training.dataset if split == "train" else self.cfg.validation.dataset
        path = "procedural" if path == "bundled" else path  # the offline default of each task
        # Validation reads the data set's held-out split: caption combinations never trained on.
        split = "train" if split == "train" else "heldout"
        build = functools.partial(build_flux_dataloader, path=path, local_batch_size=local_batch_size,
                                  dp_rank=dp_rank, dp_degree=dp_degree, seed=self.cfg.training.seed, split=split)
        if split == "train" and self._shapes is None:
            self._shapes = self._check_shapes(build())  # a throwaway loader: the real one starts at 0
        return build()

    def _check_shapes(self, loader) -> tuple[tuple[int, ...], int]:
        """Read the first micro-batch and check its widths against the model."""
        latents, t5, clip, _ = loader.next_batch()
        where = f"dataset {self.cfg.training.dataset}"
        if latents.shape[1] * 4 != self.args.in_channels:
            raise ConfigError(f"{where}: latents have {latents.shape[1]} channels, packed to {latents.shape[1] * 4}, "
                              f"but model.in_channels is {self.args.in_channels}; allowed: in_channels = 4 x channels")
        if t5.shape[-1] != self.args.context_in_dim or clip.shape[-1] != self.args.vec_in_dim:
            raise ConfigError(f"{where}: text embeddings are T5 {t5.shape[-1]} / CLIP {clip.shape[-1]} wide but "
                              f"the model takes context_in_dim {self.args.context_in_dim} / vec_in_dim "
                              f"{self.args.vec_in_dim}; build the data with the matching encoders")
        f = self.cfg.flow
        if f.latent_size and tuple(latents.shape[2:]) != (f.latent_size, f.latent_size):
            raise ConfigError(f"flow.latent_size: {f.latent_size}, but {where} holds {tuple(latents.shape[2:])} "
                              "latents; allowed: the data set's latent side, or 0 (take it from the data)")
        if f.text_seq_len and t5.shape[1] != f.text_seq_len:
            raise ConfigError(f"flow.text_seq_len: {f.text_seq_len}, but {where} holds {t5.shape[1]} T5 tokens; "
                              "allowed: the data set's length, or 0 (take it from the data)")
        return tuple(latents.shape[1:]), t5.shape[1]

    def shift(self, image_tokens: int) -> float:
        from trainer import flow

        f = self.cfg.flow
        return flow.resolution_shift(image_tokens) if f.resolution_shift else f.shift

    def sample_grid(self, model) -> torch.Tensor | None:
        """[3, H, W] grid of samples for `flow.sample_prompts` distinct held-out captions (None
        when 0). Every rank calls it (a sharded model's forward is collective)."""
        from trainer.flux_data import resolve_flux_dataset
        from trainer.flux_sample import log_sample_grid

        f = self.cfg.flow
        if not f.sample_prompts:
            return None
        if self._sampling is None:  # encoders, VAE and prompts: loaded once
            path = self.cfg.validation.dataset
            dataset = resolve_flux_dataset("procedural" if path == "bundled" else path)
            prompts = list(dict.fromkeys(row["caption"] for row in dataset.captions("heldout")))
            self._sampling = (dataset.text_conditioner(), dataset.vae(), prompts[:f.sample_prompts])
        text, vae, prompts = self._sampling
        latent_shape, _ = self._shapes
        return log_sample_grid(model, prompts, text=text, vae=vae, latent_shape=latent_shape,
                               seed=self.cfg.training.seed, num_steps=f.sample_steps,
                               shift=self.shift(self.image_tokens(latent_shape)), cfg_scale=f.cfg_scale,
                               guidance=self.guidance, dtype=self.param_dtype)

    def image_tokens(self, latent_shape: tuple[int, ...]) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def prepare(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        from trainer import flow

        latents, t5, clip, index = batch
        f = self.cfg.flow
        shift = self.shift(self.image_tokens(latents.shape))
        noise, t, keep = flow.draw(index, latent_shape=tuple(latents.shape[1:]), seed=self.cfg.training.seed,
                                   timestep_sampling=f.timestep_sampling, logit_mean=f.logit_mean,
                                   logit_std=f.logit_std, shift=shift, text_dropout=f.text_dropout)
        return latents, t5, clip, noise, t, keep

    def loss_fn(self, step_plan) -> Callable:
        from trainer import flow

        return functools.partial(flow.flow_loss, guidance=self.guidance, dtype=self.param_dtype)

    def flops_per_unit(self) -> float:
        from models.flux.flops import flops_per_sample

        assert self._shapes is not None, "build the train loader first"
        latent_shape, text_len = self._shapes
        return flops_per_sample(self.args, self.image_tokens(latent_shape), text_len)


def build_task(cfg, *, family, args):
    """The task object of `family` (its `task` field) for this run."""
    task = getattr(family, "task", "lm")
    if task == "lm":
        return LMTask(cfg, args=args)
    if task == "flow":
        return FlowTask(cfg, args=args)
    raise ConfigError(f"model.name: {family.name} declares task {task!r}; allowed: {', '.join(TASKS)}")
