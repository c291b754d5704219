"""The FLUX.1 transformer (Black Forest Labs' MM-DiT) as a pure nn.Module.

Data flow of `FluxTransformer.forward` (shapes for batch B, L image tokens, S text tokens):

1. `img_in` / `txt_in` project the packed latents [B, L, in_channels] and the T5 states
   [B, S, context_in_dim] to `hidden_size`; the conditioning vector `vec` [B, hidden] is
   `time_in(sinusoid(1000 t)) + guidance_in(sinusoid(1000 g)) + vector_in(y)`.
2. 3-axis RoPE tables from the position ids of [txt; img] (text index, row, column), one
   rotation per adjacent pair of q/k channels (the BFL / diffusers layout), in float64.
3. The residual stream `h = [txt; img]` [B, S+L, hidden] runs through `double_blocks` then
   `single_blocks` (two `BlockStack`s; blocks take `(h, *tensors) -> h`, so activation
   checkpointing, per-block compile and layer scan apply to each stack unchanged).
   A double block splits h at S (read from `txt_ids.shape[1]`), gives image and text their
   own adaLN-Zero modulation, q/k/v, QK RMSNorm, out-projection and tanh-GELU MLP, and
   attends jointly over [txt; img]. A single block runs attention and an MLP in parallel
   from one modulated input and adds both through a gated out-projection.
4. `final_layer`: adaLN (shift, scale) on the image tokens, then a linear to `out_channels`.

Layout for tensor parallelism (models/flux/plan.py): q, k, v are separate projections
(colwise), and the single block's out-projection is two linears, `attn.wo` (with the bias)
and `mlp.w2`, whose sum equals BFL's `linear2` applied to [attn; mlp] (each rowwise).
Attention is the ops registry's `attention` (models/common/ops.py): full, not causal, scale
1/sqrt(head_dim); its reference is `F.scaled_dot_product_attention` without a mask (CPU, GPU),
on TPU the splash kernel with a full mask serves it (titan_kernels/tpu/splash.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.common import ops
from models.common.norm import RMSNorm
from models.common.stack import BlockStack
from models.flux.args import TIME_EMBED_DIM, FluxArgs

NORM_EPS = 1e-6
"""LayerNorm (no affine) and QK RMSNorm epsilon, as BFL and diffusers."""


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` with `x` cast to the parameters' dtype (model inputs are float32; under bf16
    mixed precision the weights are bf16). The dtype is read from the bias: with SimpleFSDP
    every read is a gather, and the bias is small. The module itself is called, so the hooks of
    a parallel style (the plan's TP "replicate") see the input."""
    return layer(x.to(layer.bias.dtype))


def timestep_embedding(t: torch.Tensor, dim: int = TIME_EMBED_DIM, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding [B, dim] of already scaled `t` [B]: [cos(t f_i); sin(t f_i)],
    f_i = max_period^(-i / (dim/2)), computed in float32 (BFL's `timestep_embedding`)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_table(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: int) -> torch.Tensor:
    """ids [B, T, n_axes] -> [B, T, head_dim // 2, 2] float32 (cos, sin) of each channel pair.

    Axis a owns `axes_dim[a] // 2` consecutive pairs with frequencies theta^(-2j / axes_dim[a]);
    computed in float64 (as BFL and diffusers do) so large positions keep their precision.
    """
    angles = []
    for axis, dim in enumerate(axes_dim):
        omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)
        angles.append(ids[..., axis].to(torch.float64)[..., None] * omega)
    angle = torch.cat(angles, dim=-1)
    return torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1).float()


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent channel pair (2i, 2i+1) of x [B, T, heads, head_dim] by the angle of
    `table` [B, T, head_dim // 2, 2]; in float32, cast back to x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs.unbind(-1)
    cos, sin = table.unsqueeze(2).unbind(-1)
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (non-causal) attention; q/k/v [B, T, heads, head_dim] -> [B, T, heads * head_dim]."""
    out = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


class MLPEmbedder(nn.Module):
    """`out_layer(silu(in_layer(x)))`: the timestep, guidance and pooled-text embedders."""

    def __init__(self, in_dim: int, hidden_dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim)
        self.out_layer = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(_linear(self.in_layer, x)))


class Modulation(nn.Module):
    """adaLN: `lin(silu(vec))` split into `n` chunks of [B, 1, dim] (shift, scale, gate, ...)."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.n = n
        self.lin = nn.Linear(dim, n * dim)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.n, dim=-1)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(1 + scale) * LayerNorm(x) + shift, the LayerNorm without affine weights."""
    return (1 + scale) * F.layer_norm(x, x.shape[-1:], eps=NORM_EPS) + shift


class QKV(nn.Module):
    """Separate q/k/v projections, per-head RMSNorm on q and k, and an out-projection `wo`."""

    def __init__(self, dim: int, num_heads: int, *, qkv_bias: bool):
        super().__init__()
        self.head_dim = dim // num_heads
        self.wq = nn.Linear(dim, dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, dim, bias=qkv_bias)
        self.q_norm = RMSNorm(self.head_dim, eps=NORM_EPS)
        self.k_norm = RMSNorm(self.head_dim, eps=NORM_EPS)
        self.wo = nn.Linear(dim, dim)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, dim] -> q, k, v [B, T, local heads, head_dim], q and k normalised (before RoPE)."""
        q = self.q_norm(self.wq(x).unflatten(-1, (-1, self.head_dim)))
        k = self.k_norm(self.wk(x).unflatten(-1, (-1, self.head_dim)))
        v = self.wv(x).unflatten(-1, (-1, self.head_dim))
        return q, k, v


class MLP(nn.Module):
    """`w2(gelu_tanh(w1(x)))`."""

    def __init__(self, dim: int, hidden_dim: int, *, out_bias: bool = True):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim, bias=out_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class DoubleStreamBlock(nn.Module):
    """Image and text streams with their own weights, one joint attention over [txt; img]."""

    def __init__(self, args: FluxArgs):
        super().__init__()
        h = args.hidden_size
        self.img_mod = Modulation(h, 6)
        self.img_attn = QKV(h, args.num_heads, qkv_bias=args.qkv_bias)
        self.img_mlp = MLP(h, args.mlp_hidden_dim)
        self.txt_mod = Modulation(h, 6)
        self.txt_attn = QKV(h, args.num_heads, qkv_bias=args.qkv_bias)
        self.txt_mlp = MLP(h, args.mlp_hidden_dim)

    def forward(self, h: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor, txt_ids: torch.Tensor) -> torch.Tensor:
        """h [B, S+L, hidden] = [txt; img], vec [B, hidden], pe the RoPE table of [txt; img],
        txt_ids [B, S, 3] (only its length S is read)."""
        num_txt = txt_ids.shape[1]
        txt, img = h[:, :num_txt], h[:, num_txt:]
        img_shift1, img_scale1, img_gate1, img_shift2, img_scale2, img_gate2 = self.img_mod(vec)
        txt_shift1, txt_scale1, txt_gate1, txt_shift2, txt_scale2, txt_gate2 = self.txt_mod(vec)

        img_q, img_k, img_v = self.img_attn.qkv(_modulate(img, img_shift1, img_scale1))
        txt_q, txt_k, txt_v = self.txt_attn.qkv(_modulate(txt, txt_shift1, txt_scale1))
        q = apply_rope(torch.cat([txt_q, img_q], dim=1), pe)
        k = apply_rope(torch.cat([txt_k, img_k], dim=1), pe)
        out = attention(q, k, torch.cat([txt_v, img_v], dim=1))
        txt_out, img_out = out[:, :num_txt], out[:, num_txt:]

        img = img + img_gate1 * self.img_attn.wo(img_out)
        img = img + img_gate2 * self.img_mlp(_modulate(img, img_shift2, img_scale2))
        txt = txt + txt_gate1 * self.txt_attn.wo(txt_out)
        txt = txt + txt_gate2 * self.txt_mlp(_modulate(txt, txt_shift2, txt_scale2))
        return torch.cat([txt, img], dim=1)


class SingleStreamBlock(nn.Module):
    """Parallel attention + MLP over the joint sequence (BFL's `SingleStreamBlock`, with its
    `linear1` split into q/k/v and `mlp.w1`, and `linear2` into `attn.wo` + `mlp.w2`)."""

    def __init__(self, args: FluxArgs):
        super().__init__()
        h = args.hidden_size
        self.modulation = Modulation(h, 3)
        self.attn = QKV(h, args.num_heads, qkv_bias=True)
        # linear2's bias lives in attn.wo; the MLP half has none.
        self.mlp = MLP(h, args.mlp_hidden_dim, out_bias=False)

    def forward(self, h: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(vec)
        x = _modulate(h, shift, scale)
        q, k, v = self.attn.qkv(x)
        attn = attention(apply_rope(q, pe), apply_rope(k, pe), v)
        out = self.attn.wo(attn) + self.mlp(x)
        return h + gate * out


class LastLayer(nn.Module):
    """adaLN (shift, scale) of the image tokens, then a linear to the output channels."""

    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__()
        self.modulation = Modulation(hidden_size, 2)
        self.linear = nn.Linear(hidden_size, out_channels)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(vec)
        return self.linear(_modulate(x, shift, scale))


class FluxTransformer(nn.Module):
    """FLUX.1: `forward(img, img_ids, txt, txt_ids, timesteps, y, guidance=None) -> velocity`."""

    def __init__(self, args: FluxArgs):
        super().__init__()
        self.args = args
        h = args.hidden_size
        self.img_in = nn.Linear(args.in_channels, h)
        self.time_in = MLPEmbedder(TIME_EMBED_DIM, h)
        self.vector_in = MLPEmbedder(args.vec_in_dim, h)
        self.guidance_in = MLPEmbedder(TIME_EMBED_DIM, h) if args.guidance_embed else None
        self.txt_in = nn.Linear(args.context_in_dim, h)
        self.double_blocks = BlockStack(DoubleStreamBlock(args) for _ in range(args.depth))
        self.single_blocks = BlockStack(SingleStreamBlock(args) for _ in range(args.depth_single_blocks))
        self.final_layer = LastLayer(h, args.out_channels)

    def forward(
        self,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        timesteps: torch.Tensor,
        y: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """img [B, L, in_channels] packed latents, img_ids [B, L, 3], txt [B, S, context_in_dim],
        txt_ids [B, S, 3], timesteps [B] in [0, 1], y [B, vec_in_dim], guidance [B] (required
        iff `guidance_embed`) -> velocity [B, L, out_channels]. Times and guidance are scaled
        by 1000 here, as BFL and diffusers do."""
        if (guidance is None) == (self.guidance_in is not None):
            raise ValueError(
                "guidance: required by a guidance_embed model, and only by one; allowed: a guidance tensor "
                "exactly when guidance_embed is true"
            )
        img = _linear(self.img_in, img)
        txt = _linear(self.txt_in, txt)
        vec = self.time_in(timestep_embedding(1000 * timesteps))
        if self.guidance_in is not None:
            vec = vec + self.guidance_in(timestep_embedding(1000 * guidance))
        vec = vec + self.vector_in(y)
        pe = rope_table(torch.cat([txt_ids, img_ids], dim=1), self.args.axes_dim, self.args.theta)

        h = torch.cat([txt, img], dim=1)
        h = self.double_blocks(h, vec, pe, txt_ids)
        h = self.single_blocks(h, vec, pe)
        return self.final_layer(h[:, txt_ids.shape[1] :], vec)

    def pop_aux_loss(self) -> None:
        return None

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """DiT / TorchTitan-FLUX initialisation, in place (parameters may be sharded DTensors):

        - every linear of the blocks, `img_in` and `txt_in`: Xavier-uniform weight, zero bias;
        - the embedders `time_in`, `vector_in`, `guidance_in`: normal(0, 0.02) weights, zero bias;
        - adaLN-Zero: every modulation linear (blocks and final layer) and the final output
          linear are zero, so each block starts as the identity (gates 0) and the model
          predicts zero velocity; their gradients are not zero, so they learn from step one;
        - QK RMSNorm weights: ones.

        The model has no buffers (RoPE tables are computed from the ids in `forward`), so
        `buffer_device` is unused.
        """
        del buffer_device
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.init_weights()
        embedders = [self.time_in, self.vector_in] + ([self.guidance_in] if self.guidance_in is not None else [])
        for embedder in embedders:
            for linear in (embedder.in_layer, embedder.out_layer):
                nn.init.normal_(linear.weight, std=0.02)
        for module in self.modules():
            if isinstance(module, Modulation):
                nn.init.zeros_(module.lin.weight)
                nn.init.zeros_(module.lin.bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)
