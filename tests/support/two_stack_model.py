"""A small two-stack diffusion transformer for the graph trainer's multi-stack scan tests.

It has the layout that matters to layer scan in FLUX (models/flux, interface item 3), at a
size the CPU runs in milliseconds, and does not depend on models/flux:
- two `BlockStack`s run in order, `double_blocks` then `single_blocks`, of different block
  types (so each stack is its own scan, with its own stacked parameters);
- the residual `h` is the concatenated `[txt; img]` sequence; a double block splits it at the
  text length, read from the shape of a tensor argument (`txt_marker [S]`), and runs separate
  weights per stream with joint attention; a single block runs one fused stream;
- adaLN modulation from `vec` (timestep + pooled text embedding): an extra block argument
  that *requires grad*, so the scan must return gradients for a closed-over tensor too.

`velocity_loss` is the rectified-flow MSE of the velocity (the test-side stand-in for
flux-train's loss; interface item 7 signature).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.common.plan import ModelPlan
from models.common.stack import BlockStack


@dataclass
class TwoStackArgs:
    dim: int = 32
    n_heads: int = 4
    depth: int = 2
    """Double-stream blocks."""
    depth_single_blocks: int = 3
    """Single-stream blocks."""
    in_channels: int = 8
    context_in_dim: int = 16
    vec_in_dim: int = 16
    mlp_ratio: float = 2.0


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


def _attention(qkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, 3, n_heads, -1).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)


class Stream(nn.Module):
    """One stream's weights in a double block: modulation, qkv, out-projection, MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.mod = nn.Linear(dim, 6 * dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp_in = nn.Linear(dim, hidden)
        self.mlp_out = nn.Linear(hidden, dim)


class DoubleBlock(nn.Module):
    def __init__(self, args: TwoStackArgs):
        super().__init__()
        self.n_heads = args.n_heads
        hidden = int(args.dim * args.mlp_ratio)
        self.txt = Stream(args.dim, hidden)
        self.img = Stream(args.dim, hidden)

    def forward(self, h: torch.Tensor, vec: torch.Tensor, txt_marker: torch.Tensor) -> torch.Tensor:
        s = txt_marker.shape[0]
        parts, mods = [], []
        for x, stream in ((h[:, :s], self.txt), (h[:, s:], self.img)):
            m = stream.mod(F.silu(vec)).chunk(6, dim=-1)
            mods.append(m)
            parts.append(stream.qkv(_modulate(F.layer_norm(x, x.shape[-1:]), m[0], m[1])))
        attn = _attention(torch.cat(parts, dim=1), self.n_heads)
        out = []
        for x, a, m, stream in ((h[:, :s], attn[:, :s], mods[0], self.txt), (h[:, s:], attn[:, s:], mods[1], self.img)):
            x = x + m[2][:, None] * stream.proj(a)
            y = _modulate(F.layer_norm(x, x.shape[-1:]), m[3], m[4])
            out.append(x + m[5][:, None] * stream.mlp_out(F.gelu(stream.mlp_in(y), approximate="tanh")))
        return torch.cat(out, dim=1)


class SingleBlock(nn.Module):
    def __init__(self, args: TwoStackArgs):
        super().__init__()
        self.n_heads, self.dim = args.n_heads, args.dim
        self.hidden = int(args.dim * args.mlp_ratio)
        self.mod = nn.Linear(args.dim, 3 * args.dim)
        self.linear1 = nn.Linear(args.dim, 3 * args.dim + self.hidden)
        self.linear2 = nn.Linear(args.dim + self.hidden, args.dim)

    def forward(self, h: torch.Tensor, vec: torch.Tensor, txt_marker: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.mod(F.silu(vec)).chunk(3, dim=-1)
        x = _modulate(F.layer_norm(h, h.shape[-1:]), shift, scale)
        qkv, mlp = self.linear1(x).split([3 * self.dim, self.hidden], dim=-1)
        out = self.linear2(torch.cat([_attention(qkv, self.n_heads), F.gelu(mlp, approximate="tanh")], dim=-1))
        return h + gate[:, None] * out


class TwoStackDiT(nn.Module):
    """`forward(img [B, L, C], txt [B, S, D], t [B], y [B, V]) -> velocity [B, L, C]`."""

    def __init__(self, args: TwoStackArgs):
        super().__init__()
        self.args = args
        d = args.dim
        self.img_in = nn.Linear(args.in_channels, d)
        self.txt_in = nn.Linear(args.context_in_dim, d)
        self.time_in = nn.Sequential(nn.Linear(64, d), nn.SiLU(), nn.Linear(d, d))
        self.vector_in = nn.Sequential(nn.Linear(args.vec_in_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.double_blocks = BlockStack(DoubleBlock(args) for _ in range(args.depth))
        self.single_blocks = BlockStack(SingleBlock(args) for _ in range(args.depth_single_blocks))
        self.final_mod = nn.Linear(d, 2 * d)
        self.final = nn.Linear(d, args.in_channels)

    def forward(self, img, txt, t, y):
        half = 32
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = 1000.0 * t[:, None].float() * freqs[None]
        vec = self.time_in(torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)) + self.vector_in(y)
        s = txt.shape[1]
        marker = txt.new_ones(s)
        h = torch.cat([self.txt_in(txt), self.img_in(img)], dim=1)
        h = self.double_blocks(h, vec, marker)
        h = self.single_blocks(h, vec, marker)
        shift, scale = self.final_mod(F.silu(vec)).chunk(2, dim=-1)
        x = h[:, s:]
        return self.final(_modulate(F.layer_norm(x, x.shape[-1:]), shift, scale))

    def pop_aux_loss(self):
        return None


PLAN = ModelPlan(block=("double_blocks", "single_blocks"))


def build(args: TwoStackArgs, seed: int = 0) -> TwoStackDiT:
    """Built on meta, materialized and initialized as the trainer does (default nn init from `seed`)."""
    with torch.device("meta"):
        model = TwoStackDiT(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    return model


def velocity_loss(model, latents, txt, y, noise, t, keep):
    """Rectified flow: x_t = (1 - t) x0 + t noise; MSE of the velocity (noise - x0); text dropped
    (zeroed) where `keep` is 0. Latents are already packed `[B, L, C]` here."""
    tb = t[:, None, None]
    x_t = (1 - tb) * latents + tb * noise
    kb = keep[:, None]
    pred = model(x_t, txt * kb[:, :, None], t, y * kb)
    return (pred - (noise - latents)).square().mean()


def batches(
    args: TwoStackArgs,
    steps: int,
    accum: int = 1,
    *,
    batch: int = 2,
    img_len: int = 12,
    txt_len: int = 5,
    seed: int = 1,
):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(accum):
            mbs.append(
                (
                    torch.randn(batch, img_len, args.in_channels, generator=g),
                    torch.randn(batch, txt_len, args.context_in_dim, generator=g),
                    torch.randn(batch, args.vec_in_dim, generator=g),
                    torch.randn(batch, img_len, args.in_channels, generator=g),
                    torch.rand(batch, generator=g),
                    (torch.rand(batch, generator=g) > 0.2).float(),
                )
            )
        out.append(mbs)
    return out
