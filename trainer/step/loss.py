"""The step's loss and what a step returns: shared by the eager and the graph step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy over the micro-batch's tokens, computed in fp32: the mean over
    the labels that are not ignored (-100), or with `reduction="sum"` their sum."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction)


def plain_loss(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(inputs), labels)


def local_scalar(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallel is a replicated DTensor; logging wants a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class StepOutput:
    """What one step returns: device tensors, never read by the step itself."""

    loss: torch.Tensor
    """Mean loss (LM cross entropy, or the task's loss) over the step's micro-batches (0-dim,
    this rank's value)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping (0-dim, equal on every rank)."""
    aux_loss: torch.Tensor | None = None
    """Mean auxiliary (MoE load-balancing) loss over the micro-batches, unscaled; None without."""
    moe_max_vio: torch.Tensor | None = None
    """MoE models: the step's expert-load imbalance over the global batch, DeepSeek's MaxVio
    averaged over the MoE layers (0-dim, equal on every rank; trainer/optim/expert_balance.py)."""
