"""FLUX.1 (Black Forest Labs' rectified-flow MM-DiT): args and flavors, the transformer,
latent packing (`latents`), the parallel plan (`plan`), the diffusers adapter (`hf_adapter`) and
training FLOPs per sample (`flops`). Text/VAE conditioning lives in `conditioning`."""

from models.flux.args import FLAVORS, FluxArgs
from models.flux.model import FluxTransformer

__all__ = ["FLAVORS", "FluxArgs", "FluxTransformer"]
