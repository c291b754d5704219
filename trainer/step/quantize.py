"""The quantize plan of a run: which of the model's linears `[quantize]` picks, counted before
anything is built.

`quantize_census(family, args, plan)` builds the model on the meta device (no memory) and asks
parallelisms/quantize.py's own rule (`is_chosen`) about every `nn.Linear` and every MoE experts
module, as `apply_quantize` will. The step plan's rules read the result (`StepRequest.quantize_census`:
a recipe that quantizes nothing is refused, naming `quantize.min_dim` or `quantize.filter_fqns`),
and the start-up banner states it (`QuantizeCensus.line`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.common.moe import GroupedExperts
from parallelisms.quantize import ALIGN, QuantizePlan, is_chosen


@dataclass(frozen=True)
class QuantizeCensus:
    """What `[quantize]` picks in one model (module docstring)."""

    min_dim: int
    """`quantize.min_dim` counted against."""
    filter_fqns: tuple[str, ...]
    """`quantize.filter_fqns` counted against."""
    linears: int
    """The model's `nn.Linear` modules."""
    chosen: int
    """Of those, the ones quantized."""
    by_filter: int
    """Left in the compute dtype because their path contains one of `quantize.filter_fqns`."""
    by_min_dim: int
    """Left because a side is below `min_dim` or not a multiple of 16 (the filter let them through)."""
    experts: int = 0
    """MoE experts modules (grouped weights)."""
    experts_chosen: int = 0
    """Of those, the ones quantized (the same rule on (dim, moe hidden))."""
    fit_min_dim: int = 0
    """The largest `min_dim` that would quantize at least one linear or experts module the filter
    lets through (its smaller side; 0 when none has both sides multiples of 16)."""

    @property
    def quantizes_nothing(self) -> bool:
        return self.chosen == 0 and self.experts_chosen == 0

    def left_out(self, recipe: str) -> str:
        """What left every linear out, for the step plan's quantize rules (their message after the key)."""
        if self.by_min_dim:
            return (
                f"{self.min_dim} leaves none of this model's {self.linears} linears to {recipe} ({self.by_min_dim} "
                f"have a side below min_dim or not a multiple of {ALIGN}, {self.by_filter} match quantize.filter_fqns)"
            )
        filters = "[" + ", ".join(repr(f) for f in self.filter_fqns) + "]"
        return f"{filters} match all of this model's {self.linears} linears, so {recipe} quantizes none"

    @property
    def min_dim_allowed(self) -> str:
        """What `quantize.min_dim` may be for something to be quantized, for the rule's message."""
        if self.fit_min_dim == 0:
            return f"no min_dim helps (no linear outside filter_fqns has both sides multiples of {ALIGN})"
        return f"a min_dim of at most {self.fit_min_dim} (0 quantizes every linear filter_fqns lets through)"

    def line(self, recipe: str) -> str:
        """The banner's line, e.g. `quantize: float8_rowwise: 188 of 471 linears, 188 skipped by
        min_dim (1024), 95 by filter_fqns; MoE experts: 94 of 94 layers` (skipped by min_dim: a
        side below it or not a multiple of 16)."""
        text = (
            f"quantize: {recipe}: {self.chosen} of {self.linears} linears, {self.by_min_dim} skipped by "
            f"min_dim ({self.min_dim}), {self.by_filter} by filter_fqns"
        )
        if self.experts:
            text += f"; MoE experts: {self.experts_chosen} of {self.experts} layers"
        return text


def quantize_census(family, args, plan: QuantizePlan) -> QuantizeCensus:
    """Count what `plan` quantizes in `family.model_cls(args)` (built on meta, then dropped)."""
    with torch.device("meta"):
        model = family.model_cls(args)
    filters = tuple(plan.filter_fqns)
    counts = dict(linears=0, chosen=0, by_filter=0, by_min_dim=0, experts=0, experts_chosen=0)
    fit = 0
    for fqn, module in model.named_modules():
        if type(module) is nn.Linear:
            dims, kind = (module.in_features, module.out_features), "linears"
        elif isinstance(module, GroupedExperts):
            hidden, dim = module.w1.shape[1:]
            dims, kind = (dim, hidden), "experts"
        else:
            continue
        counts[kind] += 1
        filtered = any(f and f in fqn for f in filters)
        if is_chosen(fqn, dims, filters, plan.min_dim):
            counts["chosen" if kind == "linears" else "experts_chosen"] += 1
        elif kind == "linears":
            counts["by_filter" if filtered else "by_min_dim"] += 1
        if not filtered and all(d % ALIGN == 0 for d in dims):
            fit = max(fit, min(dims))
    return QuantizeCensus(min_dim=plan.min_dim, filter_fqns=filters, fit_min_dim=fit, **counts)
