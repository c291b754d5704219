"""The train step: forward, loss, backward, clipping, optimizer update.

`EagerStep` is the step of `[compile] mode = eager | compile` (compile only changes the blocks).
The graph trainer (`trainer/graph/`) replaces this object, not the loop: both take the step's
micro-batches and the learning rate, and return the mean LM loss and the gradient norm as
0-dim tensors without forcing a host sync.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all tokens of the micro-batch, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def local_scalar(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallel is a replicated DTensor; logging wants a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def has_moe(model) -> bool:
    return any(getattr(block, "is_moe", False) for block in model.layers.values())


def model_loss(model, inputs: torch.Tensor, labels: torch.Tensor, *, aux_loss_coef: float, moe: bool):
    """(loss to differentiate, LM loss, MoE aux loss or None) for one micro-batch."""
    logits = model(inputs)
    lm = lm_loss(logits, labels)
    if not moe:
        return lm, lm, None
    aux = model.moe_aux_loss()
    return lm + aux_loss_coef * aux, lm, aux


class EagerStep:
    """Plain PyTorch step with gradient accumulation over the given micro-batches."""

    compile_s = None
    graph_nodes = None

    def __init__(self, *, model, optimizer, max_norm: float, aux_loss_coef: float, clip_grad_norm,
                 loss_context=contextlib.nullcontext):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.aux_loss_coef = aux_loss_coef
        self.clip_grad_norm = clip_grad_norm
        # With TP loss parallel the loss and its backward run on vocab-sharded logits inside
        # this context (parallelisms.loss_parallel_context).
        self.loss_context = loss_context
        self.last_aux_loss = None
        self.moe = has_moe(model)

    def __call__(self, microbatches, lr: float | None = None):
        # The lr scheduler already wrote `lr` into the optimizer's param groups.
        self.optimizer.zero_grad(set_to_none=True)
        n = len(microbatches)
        lm_sum, aux_sum = 0.0, None
        for inputs, labels in microbatches:
            with self.loss_context():
                loss, lm, aux = model_loss(self.model, inputs, labels, aux_loss_coef=self.aux_loss_coef,
                                           moe=self.moe)
                (loss / n).backward()
            lm_sum = lm_sum + local_scalar(lm.detach())
            if aux is not None:
                aux = local_scalar(aux.detach())
                aux_sum = aux if aux_sum is None else aux_sum + aux
        max_norm = self.max_norm if self.max_norm > 0 else float("inf")
        grad_norm = self.clip_grad_norm([p for p in self.model.parameters() if p.grad is not None], max_norm)
        self.optimizer.step()
        self.last_aux_loss = None if aux_sum is None else aux_sum / n
        return lm_sum / n, grad_norm
