"""Low-precision linear layers (`[quantize]`): the model's `nn.Linear` modules compute through the
op `quantized_linear` under a recipe (float8 tensorwise / rowwise / blockwise, int8).

`apply_quantize(model, recipe=..., filter_fqns=..., min_dim=...)` is step 0 of
`parallelize_model`, before TP and SimpleFSDP: it swaps the class of each chosen `nn.Linear` for
`QuantizedLinear` (a subclass, like SimpleFSDP's swap), so module paths, parameters and state-dict
keys do not change, TP's styles still see an `nn.Linear`, and SimpleFSDP then shards the same
fp32 master weight and gathers it in `param_dtype` as before. Only the matmuls change: each call
quantizes the gathered weight and the activation with fresh (dynamic) scales, and the backward
quantizes the gradient the same way (models/common/quantize.py). Master weights, optimizer state
and the gradient reduction keep their precision.

Which linears: every `nn.Linear` whose module path contains none of `filter_fqns` (substrings;
the default leaves out the output head and the MoE router) and whose in and out features are
both at least `min_dim` and multiples of 16 (the float8 / int8 kernels' alignment; smaller
layers gain less than the quantization costs). MoE experts are not `nn.Linear` (grouped weights,
the op `grouped_mm`) and stay in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.common import ops
from models.common.moe import GroupedExperts
from models.common.quantize import RECIPES

__all__ = [
    "QuantizedLinear",
    "QuantizePlan",
    "apply_quantize",
    "is_chosen",
    "quantized_modules",
    "DEFAULT_FILTER_FQNS",
    "DEFAULT_MIN_DIM",
]

DEFAULT_FILTER_FQNS = ("output", "router.gate", "lm_head")
"""Module-path substrings never quantized by default: the output head (the logits feed the loss
directly: TorchTitan's default float8 filter) and the MoE router (its top-k choice is discrete)."""

DEFAULT_MIN_DIM = 1024
"""Linears with in or out features below this stay in the compute dtype (module docstring)."""

ALIGN = 16
"""in / out features must be multiples of this (torch._scaled_mm's and the MXU's tiling)."""


@dataclass(frozen=True)
class QuantizePlan:
    """What `parallelize_model` quantizes: the `[quantize]` section's values."""

    recipe: str = "none"
    filter_fqns: tuple[str, ...] = DEFAULT_FILTER_FQNS
    min_dim: int = DEFAULT_MIN_DIM
    fsdp_float8_all_gather: bool = False
    """SimpleFSDP all-gathers float8_tensorwise weights as e4m3 (parallelisms/simple_fsdp.py)."""

    @classmethod
    def of(cls, section) -> QuantizePlan:
        """From a `[quantize]` section (trainer/config/schema.py: QuantizeConfig)."""
        return cls(section.recipe, tuple(section.filter_fqns), section.min_dim, section.fsdp_float8_all_gather)

    def float8_weights(self, module: nn.Module) -> bool:
        """Whether SimpleFSDP all-gathers `module`'s weight in float8 (`data_parallel(float8_weights=)`)."""
        return (
            self.fsdp_float8_all_gather and isinstance(module, QuantizedLinear) and module.recipe == "float8_tensorwise"
        )


SCAN_FLOAT8 = ("scan_float8_values", "scan_float8_scale")
"""The attributes through which a layer-scan body hands a float8-gathered `QuantizedLinear` its
e4m3 values and scale (parallelisms/scan.py: `functional_call` sets them beside the weight)."""


class QuantizedLinear(nn.Linear):
    """An `nn.Linear` whose matmul is the op `quantized_linear` under `self.recipe`; the bias, if
    any, is added in the compute dtype. Made by `apply_quantize` (a class swap), never built."""

    recipe: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered = self.float8_weight()
        if gathered is None:
            y = ops.quantized_linear(x, self.weight, self.recipe)
        else:
            values, scale, carrier = gathered
            y = ops.quantized_linear(x, values, self.recipe, scale, carrier)
        return y if self.bias is None else y + self.bias

    def float8_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The weight already quantized, (e4m3 values as float8_e4m3fn, tensorwise scale, the
        carrier of its gradient), when SimpleFSDP all-gathers it in float8
        (`data_parallel(float8_weights=...)` overrides this; in a layer-scan body the body's
        `functional_call` sets the values and scale as attributes and the carrier as
        `self.weight`: parallelisms/scan.py `Float8GatherShard`); None: the op quantizes
        `self.weight` itself."""
        values = self.__dict__.get(SCAN_FLOAT8[0])
        if values is not None:
            return values, self.__dict__[SCAN_FLOAT8[1]], self.weight
        return None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def is_chosen(fqn: str, dims: tuple[int, int], filter_fqns: tuple[str, ...], min_dim: int) -> bool:
    """Whether the linear at module path `fqn` with (in or out) features `dims` is quantized (the
    module docstring's rule; the planner asks it too, planner/low_precision.py)."""
    if any(f and f in fqn for f in filter_fqns):
        return False
    return all(d >= min_dim and d % ALIGN == 0 for d in dims)


def _chosen(fqn: str, module: nn.Linear, filter_fqns: tuple[str, ...], min_dim: int) -> bool:
    return is_chosen(fqn, (module.in_features, module.out_features), filter_fqns, min_dim)


def apply_quantize(
    model: nn.Module,
    *,
    recipe: str,
    filter_fqns: tuple[str, ...] | list[str] = DEFAULT_FILTER_FQNS,
    min_dim: int = DEFAULT_MIN_DIM,
) -> list[str]:
    """Swap the chosen `nn.Linear`s of `model` to `QuantizedLinear` under `recipe`, in place (on
    the meta device or any other); return their module paths. `recipe = "none"` changes nothing."""
    assert recipe in RECIPES, f"unknown recipe {recipe!r}; recipes: {RECIPES}"
    if recipe == "none":
        return []
    swapped = []
    for fqn, module in model.named_modules():
        if type(module) is nn.Linear and _chosen(fqn, module, tuple(filter_fqns), min_dim):
            module.__class__ = QuantizedLinear
            module.recipe = recipe
            swapped.append(fqn)
        elif isinstance(module, GroupedExperts) and _experts_chosen(fqn, module, tuple(filter_fqns), min_dim):
            module.recipe = recipe  # the op quantized_grouped_mm; "experts" in filter_fqns leaves them bf16
    return swapped


def _experts_chosen(fqn: str, module: GroupedExperts, filter_fqns: tuple[str, ...], min_dim: int) -> bool:
    hidden, dim = module.w1.shape[1:]
    return is_chosen(fqn, (dim, hidden), filter_fqns, min_dim)


def quantized_modules(model: nn.Module) -> dict[str, str]:
    """{module path: recipe} of the model's quantized linears (SimpleFSDP's subclasses included)."""
    return {fqn: m.recipe for fqn, m in model.named_modules() if isinstance(m, QuantizedLinear)}
