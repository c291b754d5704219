"""Latent packing for the FLUX transformer: 2x2 patches of the 16-channel VAE latent become
tokens of 64 channels, ordered row-major over the (H/2, W/2) patch grid, with channel order
(c, dy, dx) as BFL's `rearrange(x, "b c (h ph) (w pw) -> b (h w) (c ph pw)")` and diffusers'
`FluxPipeline._pack_latents`. Position ids are (0, row, col) for image tokens and zeros
for text tokens (angle 0 on every axis: text tokens are not rotated)."""

from __future__ import annotations

import torch

PATCH = 2


def _check_hw(h: int, w: int) -> None:
    if h % PATCH or w % PATCH:
        raise ValueError(f"latents: height and width must be even, got {h} x {w}; allowed: even sides (2x2 patches)")


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]."""
    b, c, h, w = latents.shape
    _check_hw(h, w)
    x = latents.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, (H/2)(W/2), 4C] -> [B, C, H, W], the inverse of `pack` for latent size `height` x `width`."""
    _check_hw(height, width)
    b, n, d = x.shape
    hp, wp = height // PATCH, width // PATCH
    if n != hp * wp:
        raise ValueError(f"latents: {n} tokens do not form a {hp} x {wp} patch grid; allowed: {hp * wp} tokens")
    c = d // (PATCH * PATCH)
    x = x.reshape(b, hp, wp, c, PATCH, PATCH)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)


def image_ids(batch: int, height: int, width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[B, (H/2)(W/2), 3] float32 position ids (0, row, col) of the packed tokens of an H x W latent."""
    _check_hw(height, width)
    hp, wp = height // PATCH, width // PATCH
    rows = torch.arange(hp, device=device, dtype=torch.float32)[:, None].expand(hp, wp)
    cols = torch.arange(wp, device=device, dtype=torch.float32)[None, :].expand(hp, wp)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(hp * wp, 3)
    return ids.unsqueeze(0).expand(batch, -1, -1).contiguous()


def text_ids(batch: int, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[B, S, 3] float32 zeros: FLUX gives every text token position 0 on all three axes."""
    return torch.zeros(batch, seq_len, 3, device=device, dtype=torch.float32)
