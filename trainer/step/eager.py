"""The step of the eager and compile modes: forward, loss, backward per micro-batch, then clip
and update (the graph step, trainer/graph, captures the same work as one graph)."""

from __future__ import annotations

import contextlib

import torch

from trainer.step.loss import StepOutput, local_scalar, moe_outputs, plain_loss, with_aux_loss


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
    """Apply the update unless the (global) gradient norm is not finite; the non-finite flag.

    A fused AdamW skips on the device (`found_inf`: parameters, moments and step counts keep
    their values); other optimizers need the verdict on the host, one sync per step. The
    trainer's eager step and the engine's `optimizer_step` both update through here.
    """
    nonfinite = ~torch.isfinite(grad_norm)
    if all(group.get("fused") for group in optimizer.param_groups):
        optimizer.found_inf = nonfinite.to(torch.float32)
        optimizer.step()
    elif grad_norm.device.type == "meta" or not bool(nonfinite):  # meta: a check job, no values
        optimizer.step()
    return nonfinite


class EagerStep:
    """Plain PyTorch step with gradient accumulation over the given micro-batches."""

    compile_s = None
    graph_nodes = None

    def __init__(
        self,
        *,
        model,
        optimizer,
        max_norm: float,
        aux_loss_coef: float,
        clip_grad_norm,
        loss_context=contextlib.nullcontext,
        loss_fn=None,
        balance=None,
        replicate=None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.aux_loss_coef = aux_loss_coef
        self.clip_grad_norm = clip_grad_norm
        # With TP loss parallel the loss and its backward run on vocab-sharded logits inside
        # this context (parallelisms.loss_parallel_context).
        self.loss_context = loss_context
        # loss_fn(model, *micro_batch) -> the micro-batch's mean loss (trainer/tasks/); default:
        # an LM micro-batch (inputs, labels): logits, then lm_loss.
        self.loss_fn = loss_fn if loss_fn is not None else plain_loss
        # MoE models: the expert loads and the selection-bias update (trainer/optim/expert_balance.py).
        self.balance = balance
        # `training.replicate_reduce = "step"`: the ReplicateReducer that averages over dp_replicate
        # once, issuing buckets during the last micro-batch's backward (parallelisms/replicate_reduce.py).
        self.replicate = replicate

    def __call__(self, microbatches, lr: float | None = None) -> StepOutput:
        # The lr scheduler already wrote `lr` into the optimizer's param groups.
        self.optimizer.zero_grad(set_to_none=True)
        n = len(microbatches)
        lm_sum, aux_sum, load, mtp_sum = 0.0, None, None, None
        # Multi-token prediction (trainer/step/loss.py `MTPLoss`): each depth's loss, for the log.
        pop_mtp = getattr(self.loss_fn, "pop_mtp_losses", None)
        for i, microbatch in enumerate(microbatches):
            if self.replicate is not None and i == n - 1:
                self.replicate.arm()
            with self.loss_context():
                lm = self.loss_fn(self.model, *microbatch)
                aux = self.model.pop_aux_loss()
                if self.balance is not None:
                    mb_load = self.balance.pop()
                    load = mb_load if load is None else load + mb_load
                (with_aux_loss(lm, aux, self.aux_loss_coef) / n).backward()
            lm_sum = lm_sum + local_scalar(lm.detach())
            if pop_mtp is not None:
                mtp = pop_mtp()
                mtp_sum = mtp if mtp_sum is None else mtp_sum + mtp
            if aux is not None:
                aux = local_scalar(aux.detach())
                aux_sum = aux if aux_sum is None else aux_sum + aux
        if self.replicate is not None:
            self.replicate.finish()
        max_norm = self.max_norm if self.max_norm > 0 else float("inf")
        grad_norm = self.clip_grad_norm([p for p in self.model.parameters() if p.grad is not None], max_norm)
        nonfinite = step_if_finite(self.optimizer, grad_norm)
        stats = None if self.balance is None else self.balance.finish(load, apply=~nonfinite)
        return StepOutput(
            loss=lm_sum / n,
            grad_norm=grad_norm,
            aux_loss=None if aux_sum is None else aux_sum / n,
            mtp_losses=None if mtp_sum is None else mtp_sum / n,
            term_names=getattr(self.loss_fn, "term_names", None),
            **moe_outputs(stats),
        )
