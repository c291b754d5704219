"""Sampling from a FLUX model: Euler steps over the rectified-flow ODE with classifier-free guidance.

Training (trainer/tasks/flow.py) teaches the model the velocity v = dx_t/dt = noise - x0 of the path
x_t = (1 - t) x0 + t noise. Sampling integrates that ODE backwards, from pure noise at t = 1 to
an image latent at t = 0, with `num_steps` explicit Euler steps x <- x + (t_next - t) v(x, t).
The step times are uniform in [1, 0] and then shifted with the training run's shift
(`flow.shift_timesteps`: the same fixed or resolution shift the run trained with), as BFL's and
diffusers' FLUX samplers do, so the steps concentrate where training put its timesteps.

Classifier-free guidance: each step runs the model on the prompt's conditioning and on the
unconditional one (zeros, `flow.uncond_conditioning`: what text dropout trained), in one batch,
and uses v = v_uncond + cfg_scale (v_cond - v_uncond); cfg_scale = 1 skips the unconditional
pass. A guidance-distilled model (FLUX.1-dev, `guidance_embed`) also gets the `guidance` value
through its embedding; a schnell-style model has none.

Noise is drawn per image from `flow.sample_seed(seed, i)` (image i of the call), so a prompt's
image depends only on (seed, its position), not on the batch it is drawn in or the device count.

`log_sample_grid` returns the images of a prompt list as one [3, H, W] grid (TensorBoard's
`add_image` format). Rebuilding a trained run from its dump folder for the sampling scripts is
`trainer/flux_run.py`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from models.errors import ConfigError
from trainer.tasks import flow


def step_times(num_steps: int, *, shift: float = 1.0) -> torch.Tensor:
    """t_0 = 1 > t_1 > ... > t_num_steps = 0 (float32 [num_steps + 1]): uniform, then shifted."""
    if num_steps < 1:
        raise ConfigError(f"sample steps: {num_steps}; allowed: >= 1")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (flow.shift_timesteps(t, shift) if shift != 1.0 else t).float()


def initial_noise(count: int, latent_shape: Sequence[int], *, seed: int, first: int = 0) -> torch.Tensor:
    """Noise [count, *latent_shape] for images first .. first + count - 1 (one generator per image)."""
    out = torch.empty((count, *latent_shape), dtype=torch.float32)
    g = torch.Generator(device="cpu")
    for i in range(count):
        g.manual_seed(flow.sample_seed(seed, first + i))
        out[i] = torch.randn(tuple(latent_shape), generator=g)
    return out


@torch.no_grad()
def euler_sample(
    model,
    noise: torch.Tensor,
    t5: torch.Tensor,
    clip: torch.Tensor,
    *,
    num_steps: int,
    shift: float = 1.0,
    cfg_scale: float = 1.0,
    guidance: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Latents [B, 16, h, w] (fp32) from `noise` [B, 16, h, w] and the prompts' t5 [B, S, D] / clip [B, D].

    `model` is a FLUX transformer (interface: `model(img, img_ids, txt, txt_ids, t, y, guidance)`).
    `dtype`: the compute dtype the model's inputs are cast to (the run's mixed_precision_param);
    the state x and the Euler update stay fp32.
    """
    from models.flux.latents import image_ids, pack, text_ids, unpack

    if cfg_scale < 0:
        raise ConfigError(f"cfg_scale: {cfg_scale}; allowed: >= 0")
    device = noise.device
    batch, _, h, w = noise.shape
    guided = cfg_scale != 1.0
    if guided:  # one forward for both branches: [cond; uncond]
        t5_u, clip_u = flow.uncond_conditioning(t5, clip)
        t5, clip = torch.cat([t5, t5_u]), torch.cat([clip, clip_u])
    n = t5.shape[0]
    img_ids = image_ids(n, h, w).to(device)
    txt_ids = text_ids(n, t5.shape[1]).to(device)
    txt, y = t5.to(device=device, dtype=dtype), clip.to(device=device, dtype=dtype)
    g = None if guidance is None else torch.full((n,), float(guidance), device=device)
    x = noise.float()
    times = step_times(num_steps, shift=shift).tolist()
    for t_cur, t_next in zip(times[:-1], times[1:]):
        img = pack(torch.cat([x, x]) if guided else x).to(dtype)
        t = torch.full((n,), t_cur, device=device)
        v = model(img, img_ids, txt, txt_ids, t, y, g).float()
        if guided:
            v_cond, v_uncond = v[:batch], v[batch:]
            v = v_uncond + cfg_scale * (v_cond - v_uncond)
        x = x + (t_next - t_cur) * unpack(v, h, w)
    return x


def image_grid(images: torch.Tensor, *, ncols: int | None = None, pad: int = 2, pad_value: float = 1.0) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> one [3, rows (H + pad) + pad, ncols (W + pad) + pad] image, row-major."""
    n, c, h, w = images.shape
    ncols = ncols or math.ceil(math.sqrt(n))
    nrows = math.ceil(n / ncols)
    grid = torch.full((c, nrows * (h + pad) + pad, ncols * (w + pad) + pad), pad_value, dtype=torch.float32)
    for i, image in enumerate(images):
        r, col = divmod(i, ncols)
        y, x = pad + r * (h + pad), pad + col * (w + pad)
        grid[:, y : y + h, x : x + w] = image.float().cpu()
    return grid


def save_png(image: torch.Tensor, path: str, *, scale: int = 1) -> None:
    """Write a [3, H, W] image in [0, 1] as an 8-bit PNG, each pixel repeated `scale` x `scale`."""
    from PIL import Image

    x = image.clamp(0, 1).mul(255).round().to(torch.uint8)
    if scale > 1:
        x = x.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray(x.permute(1, 2, 0).cpu().numpy()).save(path)


def sample_images(
    model,
    prompts: Sequence[str],
    *,
    text,
    vae,
    latent_shape: Sequence[int],
    seed: int = 0,
    num_steps: int = 20,
    shift: float = 1.0,
    cfg_scale: float = 4.0,
    guidance: float | None = None,
    dtype: torch.dtype = torch.float32,
    batch_size: int = 16,
) -> torch.Tensor:
    """Images [len(prompts), 3, H, W] in [0, 1]: encode the prompts (`text`, a TextConditioner),
    sample latents of `latent_shape` ([16, h, w]) and decode them (`vae`, a FluxVae).

    Deterministic in (seed, prompt position). With a sharded model, call on every rank."""
    device = next(iter(model.parameters())).device
    out = []
    was_training = model.training
    model.eval()
    try:
        for first in range(0, len(prompts), batch_size):
            chunk = list(prompts[first : first + batch_size])
            with torch.no_grad():
                t5, clip = text.encode(chunk)
            noise = initial_noise(len(chunk), latent_shape, seed=seed, first=first).to(device)
            latents = euler_sample(
                model,
                noise,
                t5.to(device),
                clip.to(device),
                num_steps=num_steps,
                shift=shift,
                cfg_scale=cfg_scale,
                guidance=guidance,
                dtype=dtype,
            )
            out.append(vae.decode(latents.cpu()))
    finally:
        model.train(was_training)
    return torch.cat(out)


def log_sample_grid(
    model,
    prompts: Sequence[str],
    *,
    text,
    vae,
    latent_shape: Sequence[int],
    seed: int = 0,
    num_steps: int = 20,
    shift: float = 1.0,
    cfg_scale: float = 4.0,
    guidance: float | None = None,
    dtype: torch.dtype = torch.float32,
    ncols: int | None = None,
) -> torch.Tensor:
    """The sample grid of `prompts` as one float32 [3, H, W] image in [0, 1], row-major in prompt
    order, for `SummaryWriter.add_image(tag, grid, step)` (validation every `freq` steps)."""
    images = sample_images(
        model,
        prompts,
        text=text,
        vae=vae,
        latent_shape=latent_shape,
        seed=seed,
        num_steps=num_steps,
        shift=shift,
        cfg_scale=cfg_scale,
        guidance=guidance,
        dtype=dtype,
    )
    return image_grid(images, ncols=ncols)
