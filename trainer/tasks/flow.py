"""Rectified flow, the FLUX.1 training objective (docs/flux.md); the task is `trainer/tasks/flux.py`.

A training sample is a clean VAE latent x0 [16, h, w], its text conditioning (T5 sequence,
CLIP pooled vector) and three random draws made here, on the host:
- `noise` ~ N(0, I), the latent's shape;
- `t` in (0, 1): uniform, or logit-normal (t = sigmoid(z), z ~ N(logit_mean, logit_std)), then
  optionally shifted toward the noisy end (`shift_timesteps`);
- `keep`: 1.0, or 0.0 with probability `text_dropout` (classifier-free text dropout).

Every draw comes from a generator seeded by (seed, the sample's global index), never from a
per-rank stream, so the same sample gets the same noise, t and dropout on any mesh and any
batch split: the trajectory is mesh independent. The loss function is then pure in its tensor
arguments (graph-capturable): x_t = (1 - t) x0 + t noise, the model predicts the velocity
dx_t/dt = noise - x0, and the loss is the mean squared error over every element.

Dropped samples get *zero* conditioning (T5 sequence and CLIP vector both zero), not the
encoded empty prompt: the precomputed data set stores only the encoded captions, zeros need
no text encoder at train or sample time, and the sampler's unconditional branch feeds the
same zeros (`uncond_conditioning`), so training and classifier-free guidance agree.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TIMESTEP_SAMPLING = ("uniform", "logit_normal")

# FLUX's resolution-dependent shift: mu grows linearly in the image token count from
# BASE_SHIFT at BASE_TOKENS (256: 256x256 px) to MAX_SHIFT at MAX_TOKENS (4096: 1024x1024 px),
# and the shift factor is exp(mu) (1.65 at 256 tokens, 3.16 at 4096), as in BFL's sampling
# schedule; SD3 uses a fixed shift of 3.0 at 1024 px.
BASE_TOKENS, MAX_TOKENS = 256, 4096
BASE_SHIFT, MAX_SHIFT = 0.5, 1.15

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio): spreads (seed, index) over seeds


def resolution_shift(image_tokens: int) -> float:
    """exp(mu(image_tokens)): the shift factor for this many image tokens (extrapolated linearly
    in mu outside 256..4096 tokens)."""
    slope = (MAX_SHIFT - BASE_SHIFT) / (MAX_TOKENS - BASE_TOKENS)
    return math.exp(BASE_SHIFT + slope * (image_tokens - BASE_TOKENS))


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """t' = shift t / (1 + (shift - 1) t): monotone on [0, 1], fixes 0 and 1; shift > 1 moves
    mass toward t = 1 (more noise), which high resolutions need because neighbouring pixels of a
    large image keep its structure visible at a noise level that erases a small one."""
    return shift * t / (1.0 + (shift - 1.0) * t)


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of global sample `index` under run seed `seed` (63-bit)."""
    return ((seed * _MIX) ^ (index + 1) * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF


def draw(
    index: torch.Tensor,
    *,
    latent_shape: tuple[int, ...],
    seed: int,
    timestep_sampling: str,
    logit_mean: float,
    logit_std: float,
    shift: float,
    text_dropout: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noise [B, *latent_shape], t [B], keep [B]) for the samples whose global indices are `index` [B].

    Float32, on the CPU. Each sample's generator draws, in this order: the timestep variate,
    the dropout variate, the noise; so changing `text_dropout` leaves noise and t unchanged.
    """
    if timestep_sampling not in TIMESTEP_SAMPLING:
        raise ValueError(f"timestep_sampling: {timestep_sampling!r}; allowed: {', '.join(TIMESTEP_SAMPLING)}")
    n = index.numel()
    noise = torch.empty((n, *latent_shape), dtype=torch.float32)
    u = torch.empty(n, dtype=torch.float32)
    drop_u = torch.empty(n, dtype=torch.float32)
    g = torch.Generator(device="cpu")
    for i, idx in enumerate(index.tolist()):
        g.manual_seed(sample_seed(seed, int(idx)))
        if timestep_sampling == "uniform":
            u[i] = torch.rand((), generator=g)
        else:
            u[i] = torch.sigmoid(logit_mean + logit_std * torch.randn((), generator=g))
        drop_u[i] = torch.rand((), generator=g)
        noise[i] = torch.randn(latent_shape, generator=g)
    t = shift_timesteps(u, shift) if shift != 1.0 else u
    keep = (drop_u >= text_dropout).to(torch.float32)
    return noise, t, keep


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, velocity target) for clean `x0` and `noise` of one shape [B, ...] and `t` [B]."""
    tb = t.reshape(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1.0 - tb) * x0 + tb * noise, noise - x0


def uncond_conditioning(t5: torch.Tensor, clip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The conditioning of a dropped (unconditional) sample: zeros shaped like the real one."""
    return torch.zeros_like(t5), torch.zeros_like(clip)


def flow_loss(
    model,
    latents: torch.Tensor,
    t5: torch.Tensor,
    clip: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    keep: torch.Tensor,
    *,
    guidance: float | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Mean squared velocity error of `model` (a FLUX transformer) on one micro-batch (fp32, 0-dim).

    latents, noise [B, 16, h, w]; t5 [B, S, D_t5]; clip [B, D_clip]; t, keep [B] (from `draw`).
    `guidance`: the value fed to the guidance embedding (a model with one), None for none.
    `dtype`: the compute dtype the image and text inputs are cast to (`mixed_precision_param`);
    noise, t and the target stay fp32, and the error is taken in fp32.
    The mean runs over all B x (h/2)(w/2) x 64 elements; every sample has the same count.
    """
    from models.flux.latents import image_ids, pack, text_ids

    batch, _, h, w = latents.shape
    x_t, target = noisy_latents(latents, noise, t)
    keep_t5 = keep.to(t5.dtype).reshape(-1, 1, 1)
    keep_clip = keep.to(clip.dtype).reshape(-1, 1)
    g = None if guidance is None else torch.full((batch,), float(guidance), dtype=t.dtype, device=t.device)
    velocity = model(
        pack(x_t).to(dtype),
        image_ids(batch, h, w).to(latents.device),
        (t5 * keep_t5).to(dtype),
        text_ids(batch, t5.shape[1]).to(latents.device),
        t,
        (clip * keep_clip).to(dtype),
        g,
    )
    return F.mse_loss(velocity.float(), pack(target).float())
