"""Optimizer and learning-rate schedule.

AdamW keeps fp32 state for fp32 master parameters (SimpleFSDP casts to the compute dtype only
inside forward/backward). The schedule is a `LambdaLR`: linear warmup, then linear, cosine,
warmup-stable-decay (wsd) or constant. Its factor for optimizer step s (1-based) is `lr_factor(s)`.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


_FUSED_DEVICES = ("cpu", "cuda")


def build_optimizer(params, *, lr: float, betas, eps: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; fused where torch has the fused kernel for the parameters' device (CPU, CUDA).

    The fused kernel also takes `found_inf`, which the eager step uses to skip a non-finite
    update on the device with no host sync (trainer/step.py). The graph step does not call this
    optimizer's `step`: it updates parameters and this optimizer's state in its own graph.
    """
    params = list(params)
    first = params[0]
    device = (first.to_local() if hasattr(first, "to_local") else first).device
    fused = device.type in _FUSED_DEVICES
    return torch.optim.AdamW(
        params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
        fused=fused, foreach=None if fused else False,
    )


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, decay_type: str, decay_ratio: float,
              min_lr_factor: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (1-based)."""
    warmup = min(warmup_steps, total_steps)
    if step <= warmup:
        return step / warmup
    if decay_type == "constant":
        return 1.0
    if decay_type == "wsd":
        decay_steps = max(1, math.ceil(decay_ratio * total_steps))
        decay_start = max(warmup, total_steps - decay_steps)
        if step <= decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - min_lr_factor) * progress
    progress = (step - warmup) / max(1, total_steps - warmup)
    if decay_type == "linear":
        return 1.0 - (1.0 - min_lr_factor) * progress
    if decay_type == "cosine":
        return min_lr_factor + (1.0 - min_lr_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise AssertionError(decay_type)


def build_lr_scheduler(optimizer, *, total_steps: int, warmup_steps: int, decay_type: str,
                       decay_ratio: float, min_lr_factor: float) -> LambdaLR:
    # LambdaLR evaluates its lambda at 0 on construction (the lr of step 1), then at i for step i+1.
    def factor(i: int) -> float:
        return lr_factor(i + 1, total_steps=total_steps, warmup_steps=warmup_steps, decay_type=decay_type,
                         decay_ratio=decay_ratio, min_lr_factor=min_lr_factor)

    return LambdaLR(optimizer, factor)
