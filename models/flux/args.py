"""FLUX.1 transformer arguments and flavors (field names as in BFL's `FluxParams` / TorchTitan).

The parameter count is computed from the shape (`param_counts`) without building a module;
`tests/unit/test_flux_model.py` checks it against a built model, a diffusers
`FluxTransformer2DModel` built on the meta device, and the published FLUX.1-dev figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from models.contract import ModelShape

TIME_EMBED_DIM = 256
"""Width of the sinusoidal timestep / guidance embedding fed to `time_in` / `guidance_in`."""


class FluxParamCounts(NamedTuple):
    total: int
    """Every parameter."""
    matmul: int
    """Weights of the linear layers that every image/text token goes through (FLOPs 2x per token)."""
    per_sample: int
    """Weights of the linears applied once per sample: the timestep / guidance / pooled-text
    embedders and the modulation linears (they act on the [B, hidden] conditioning vector)."""


@dataclass
class FluxArgs:
    in_channels: int = 64
    """Packed latent channels per image token (16 VAE channels x a 2x2 patch)."""
    out_channels: int = 64
    """Predicted velocity channels per image token."""
    vec_in_dim: int = 768
    """Width of the pooled text embedding `y` (CLIP-L pooled output)."""
    context_in_dim: int = 4096
    """Width of the text token embeddings `txt` (T5-XXL hidden size)."""
    hidden_size: int = 3072
    """Residual-stream width of both block kinds."""
    mlp_ratio: float = 4.0
    """MLP width = int(hidden_size * mlp_ratio)."""
    num_heads: int = 24
    """Attention heads; head_dim = hidden_size // num_heads = sum(axes_dim)."""
    depth: int = 19
    """Double-stream blocks (separate image/text weights, joint attention)."""
    depth_single_blocks: int = 38
    """Single-stream (parallel attention + MLP) blocks over the joint sequence."""
    axes_dim: tuple[int, int, int] = (16, 56, 56)
    """RoPE dims per position axis (text index, image row, image column); sums to head_dim."""
    theta: int = 10000
    """RoPE base frequency."""
    qkv_bias: bool = True
    """Biases on the double blocks' q/k/v projections (single blocks always have them)."""
    guidance_embed: bool = True
    """Embed a guidance scale into the conditioning vector (guidance-distilled FLUX.1-dev)."""

    def __post_init__(self) -> None:
        axes = self.axes_dim
        if (
            not isinstance(axes, (tuple, list))
            or len(axes) != 3
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 and d % 2 == 0 for d in axes)
        ):
            raise ValueError(f"axes_dim: {axes!r}; allowed: three positive even integers, e.g. [16, 56, 56]")
        self.axes_dim = tuple(axes)
        for name in (
            "in_channels",
            "out_channels",
            "vec_in_dim",
            "context_in_dim",
            "hidden_size",
            "num_heads",
            "depth",
            "theta",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}; allowed: >= 1")
        if self.depth_single_blocks < 0:
            raise ValueError(f"depth_single_blocks: must be >= 0, got {self.depth_single_blocks}; allowed: >= 0")
        if self.mlp_ratio <= 0 or self.mlp_hidden_dim <= 0:
            raise ValueError(
                f"mlp_ratio: must give a positive MLP width, got {self.mlp_ratio}; allowed: a ratio > 0 "
                "(hidden_size x mlp_ratio >= 1)"
            )
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"num_heads: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "allowed: a divisor of hidden_size"
            )
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(
                f"axes_dim: must sum to head_dim = hidden_size // num_heads = {self.head_dim}, got {self.axes_dim}; "
                f"allowed: three even sizes that sum to {self.head_dim}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def n_layers(self) -> int:
        """Repeated blocks of both kinds (what `ModelShape.n_layers` reports)."""
        return self.depth + self.depth_single_blocks

    @property
    def vocab_size(self) -> int:
        return 0

    def shape(self) -> ModelShape:
        return ModelShape(
            n_layers=self.n_layers,
            dim=self.hidden_size,
            n_heads=self.num_heads,
            n_kv_heads=self.num_heads,
            head_dim=self.head_dim,
            vocab_size=0,
            qk_norm=True,
            ffn_hidden=self.mlp_hidden_dim,
        )

    def param_counts(self) -> FluxParamCounts:
        """Counts by kind, from the shape alone (see `FluxParamCounts`)."""
        h, m = self.hidden_size, self.mlp_hidden_dim

        def linear(n_in: int, n_out: int, bias: bool = True) -> int:
            return n_in * n_out + (n_out if bias else 0)

        qk_norms = 2 * self.head_dim
        # Per stream of a double block: q/k/v, out-projection, MLP in/out.
        stream = 3 * linear(h, h, self.qkv_bias) + linear(h, h) + linear(h, m) + linear(m, h)
        double_tokens = self.depth * 2 * stream
        double_mod = self.depth * 2 * linear(h, 6 * h)
        # Single block: q/k/v, MLP in, and the out-projection over [attn; mlp] (one bias).
        single_tokens = self.depth_single_blocks * (3 * linear(h, h) + linear(h, m) + linear(h + m, h))
        single_mod = self.depth_single_blocks * linear(h, 3 * h)
        norms = (2 * self.depth + self.depth_single_blocks) * qk_norms
        embed_tokens = linear(self.in_channels, h) + linear(self.context_in_dim, h)
        embedders = (linear(TIME_EMBED_DIM, h) + linear(h, h)) * (2 if self.guidance_embed else 1)
        embedders += linear(self.vec_in_dim, h) + linear(h, h)
        final_tokens, final_mod = linear(h, self.out_channels), linear(h, 2 * h)
        matmul = double_tokens + single_tokens + embed_tokens + final_tokens
        per_sample = double_mod + single_mod + embedders + final_mod
        return FluxParamCounts(total=matmul + per_sample + norms, matmul=matmul, per_sample=per_sample)

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Every parameter (FLUX has no token-embedding table, so `exclude_embedding` changes nothing)."""
        del exclude_embedding
        return self.param_counts().total

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters used per sample: all of them (a dense model)."""
        return self.num_params(exclude_embedding=exclude_embedding)


FLAVORS: dict[str, FluxArgs] = {
    # CPU-sized; the text widths match the debug T5/CLIP encoders of models/flux/conditioning.py.
    # No guidance embedding: trained from scratch with classifier-free guidance, as schnell.
    "debugmodel": FluxArgs(
        vec_in_dim=64,
        context_in_dim=64,
        hidden_size=256,
        num_heads=4,
        depth=2,
        depth_single_blocks=2,
        axes_dim=(16, 24, 24),
        guidance_embed=False,
    ),
    # FLUX.1-schnell: the 12B shape without the guidance embedder.
    "flux-schnell": FluxArgs(guidance_embed=False),
    # FLUX.1-dev: 19 double + 38 single blocks, hidden 3072, 24 heads, RoPE axes 16/56/56.
    "flux-dev": FluxArgs(guidance_embed=True),
}
