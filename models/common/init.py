"""Weight-initialisation helpers shared by the models (in place, so DTensor and meta work)."""

import torch
from torch import nn


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Normal(0, std) truncated at +-3 std, in place (DTensor and meta tensors supported)."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def depth_scaled_std(layer_id: int, base_std: float = 0.02) -> float:
    """Std of a block's output projections: `base_std / sqrt(2 * (layer_id + 1))` (TorchTitan's depth init).

    Each block adds two residual branches; shrinking deeper blocks' output projections keeps
    the residual stream's variance from growing with depth at initialisation.
    """
    return base_std / (2 * (layer_id + 1)) ** 0.5
