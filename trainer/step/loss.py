"""The LM loss, in every form a step takes it, and what a step returns: shared by the eager and the
graph step, the tasks (trainer/tasks/) and the RL engine (trainer/engine.py).

- `lm_loss(logits, labels)`: next-token cross entropy in fp32 (the mean, or the sum);
- `plain_loss(model, inputs, labels)`: `lm_loss` of the model's logits (the steps' default);
- `model_lm_loss(model, inputs, labels, segment_ids, positions, fused=...)`: plain, or fused
  (`ops.linear_cross_entropy` on `model.hidden`, never forming the logits); the step plan's
  `fused_loss` picks (`StepPlan.lm_loss` delegates here);
- `cp_scaled_lm_loss(...)`: with context parallelism, this rank's token sum scaled by
  cp / the cp group's token count;
- `lm_loss_fn(fused=, document_mask=, cp=)`: the task's loss function, one of the two above;
- `MTPLoss(fused=, depth=, weight=)`: the task's loss function for a model with multi-token
  prediction (DeepSeek-V3's `mtp_depth` > 0): the next-token loss plus `weight / depth` times the
  MTP modules' losses, and `mtp_targets(labels, k)` the depth-k targets;
- `token_logprobs(logits, targets)` / `nll_loss(logprobs, batch)`: the engine's forms, the same
  fp32 cross entropy per token, and its (masked) mean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models.common.ops import IGNORE_INDEX


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy over the micro-batch's tokens, computed in fp32: the mean over
    the labels that are not ignored (-100), or with `reduction="sum"` their sum."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction)


def plain_loss(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(inputs), labels)


def model_lm_loss(
    model,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    *,
    fused: bool,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean next-token cross entropy of `model` on one micro-batch (fp32, 0-dim). With document
    masking the micro-batch also holds `segment_ids` (and `positions`), passed to the model;
    the loss itself is the same mean over every token. `reduction="sum"`: the sum over the
    labels that are not ignored (context parallelism divides it by the global count).
    `fused`: `ops.linear_cross_entropy(model.hidden(x), model.output.weight, y)`."""
    extra = {}
    if segment_ids is not None:
        extra["segment_ids"] = segment_ids
    if positions is not None:
        extra["positions"] = positions
    if fused:
        from models.common import ops

        # The weight is read here, after the forward, on every call: under SimpleFSDP the
        # access is the all-gather, which must not be cached across steps.
        mean = ops.linear_cross_entropy(
            model.hidden(inputs, **extra).flatten(0, 1), model.output.weight, labels.flatten()
        )
        return mean if reduction == "mean" else mean * (labels != ops.IGNORE_INDEX).sum()
    return lm_loss(model(inputs, **extra), labels, reduction)


def cp_scaled_lm_loss(
    model, inputs: torch.Tensor, labels: torch.Tensor, *extra: torch.Tensor, cp, fused: bool, document_mask: bool
) -> torch.Tensor:
    """This rank's token sum x cp / the cp group's token count (`cp`: a `CPGroup`; `extra`:
    (segment_ids, positions) with document masking, else (positions,)): SimpleFSDP's gradient
    mean over dp_shard x cp then gives each data-parallel group's mean over all its tokens,
    whatever number of labels each shard ignores; the mean of the logged per-rank values over
    cp is that group's mean loss."""
    segment_ids, positions = (extra[0], extra[1]) if document_mask else (None, extra[0])
    total = model_lm_loss(model, inputs, labels, segment_ids, positions, fused=fused, reduction="sum")
    return cp_token_mean(total, labels, cp)


def cp_token_mean(total: torch.Tensor, labels: torch.Tensor, cp) -> torch.Tensor:
    """`total` (this cp rank's token-sum loss over `labels`) x cp / the cp group's token count, the
    CP loss every step uses (`cp_scaled_lm_loss`, and the eager and graph-mode pipelines' last
    stage); a replicated DTensor under loss parallel stays one."""
    count = (labels != IGNORE_INDEX).sum().to(torch.float32)
    # A functional collective: traced into graph mode's one graph like the k/v gathers.
    scale = cp.size / funcol.all_reduce(count, "sum", cp.group)
    if isinstance(total, DTensor):  # loss parallel: a replicated DTensor over tp
        scale = DTensor.from_local(scale, total.device_mesh, total.placements, run_check=False)
    return total * scale


def lm_loss_fn(*, fused: bool, document_mask: bool = False, cp=None) -> Callable:
    """The LM task's `loss(model, *micro_batch)`: `model_lm_loss` (plain or `fused`), or with
    context parallelism (`cp`, a `CPGroup`, else None) `cp_scaled_lm_loss`."""
    if cp is None:

        def loss(model, inputs, labels, segment_ids=None, positions=None):
            return model_lm_loss(model, inputs, labels, segment_ids, positions, fused=fused)
    else:

        def loss(model, inputs, labels, *extra):
            return cp_scaled_lm_loss(model, inputs, labels, *extra, cp=cp, fused=fused, document_mask=document_mask)

    return loss


def mtp_targets(labels: torch.Tensor, k: int) -> torch.Tensor:
    """The targets of MTP depth k: position i predicts token i + k + 1 = `labels[:, i + k]`; the
    last k positions, whose target lies beyond the window, are ignored (-100)."""
    return torch.cat([labels[:, k:], labels.new_full((labels.shape[0], k), IGNORE_INDEX)], dim=1)


class MTPLoss:
    """The LM loss of a model with multi-token prediction (`model.mtp_hidden`; DeepSeek-V3 section 2.2).

    `loss(model, inputs, labels, segment_ids=None, positions=None)` runs the main model and the
    `depth` MTP modules once; with L_main the next-token cross entropy and L_k depth k's (the
    mean over its valid positions, `mtp_targets`; both through the shared output head, plain or
    `fused` like `model_lm_loss`), the training loss is L = L_main + weight / depth * sum_k L_k.
    The returned value is L_main (what `loss` and `val_loss` log, comparable with a run without
    MTP) and its gradient is L's: `L_main + (T - T.detach())` with T the weighted MTP term.
    `pop_mtp_losses()` gives the last call's [L_1, ..., L_D] (detached float32 [depth]; the eager
    step logs them as `mtp_loss_k`). Without autograd (validation) only L_main is computed.
    """

    def __init__(self, *, fused: bool, depth: int, weight: float):
        assert depth > 0, depth
        self.fused, self.depth, self.weight = fused, depth, float(weight)
        self._last: torch.Tensor | None = None

    def __call__(self, model, inputs, labels, segment_ids=None, positions=None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return model_lm_loss(model, inputs, labels, segment_ids, positions, fused=self.fused)
        loss, self._last = self.with_depths(model, inputs, labels, segment_ids, positions)
        return loss

    def with_depths(self, model, inputs, labels, segment_ids=None, positions=None):
        """(the loss `__call__` returns, [L_1, ..., L_D] detached) without keeping state: what the
        graph step calls inside its captured step (trainer/graph/step.py)."""
        extra = {}
        if segment_ids is not None:
            extra["segment_ids"] = segment_ids
        if positions is not None:
            extra["positions"] = positions
        hidden = model.mtp_hidden(inputs, **extra)
        assert len(hidden) == self.depth + 1, (len(hidden), self.depth)
        losses = [self._ce(model, h, mtp_targets(labels, k) if k else labels) for k, h in enumerate(hidden)]
        main, mtp = losses[0], torch.stack(losses[1:])
        term = mtp.sum() * (self.weight / self.depth)
        return main + (term - term.detach()), mtp.detach()

    def _ce(self, model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from models.common import ops

            # Read the weight at each use (under SimpleFSDP the access is the all-gather).
            return ops.linear_cross_entropy(hidden.flatten(0, 1), model.output.weight, targets.flatten())
        return lm_loss(model.output(hidden), targets)

    def pop_mtp_losses(self) -> torch.Tensor | None:
        """[L_1, ..., L_depth] of the last call with autograd (detached float32), then None until the next."""
        last, self._last = self._last, None
        return last


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log p(targets[b, t] | prefix) in fp32, [B, T], from logits [B, T, V] (divided by `temperature`).

    Written as a cross entropy with no reduction: the same fp32 log-softmax `lm_loss` computes,
    and one that loss parallel (vocab-sharded logits under TP) also supports.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    if isinstance(nll, DTensor):
        # Loss parallel: each rank holds the whole (replicated) per-token values; hand the loss
        # function a plain tensor that mixes with the batch's masks and advantages.
        assert all(p.is_replicate() for p in nll.placements), nll.placements
        nll = nll.to_local()
    return -nll.view(targets.shape)


def nll_loss(logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The engine's default loss: mean next-token NLL over the tokens, or over `batch["loss_mask"]`
    ([B, T-1])."""
    mask = batch.get("loss_mask")
    if mask is None:
        return -logprobs.mean()
    mask = mask.to(logprobs.dtype)
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1)


def with_aux_loss(lm: torch.Tensor, aux: torch.Tensor | None, coef: float) -> torch.Tensor:
    """The loss a step differentiates: `lm + coef * aux` (`lm` alone without an aux loss). Under
    loss parallel `lm` is a replicated DTensor and the MoE's aux loss a plain tensor (the rank's
    own tokens'): they are added as local tensors (mixed, they met in the backward's mul: MoE +
    TP + loss parallel failed there, in the eager and the graph step)."""
    if aux is None:
        return lm
    return (lm.to_local() if isinstance(lm, DTensor) else lm) + coef * aux


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
    moe_dropped: torch.Tensor | None = None
    """MoE with `[moe] capacity_factor`: token copies dropped over capacity in the step (all layers,
    the global batch); None when dropless."""
    moe_dropped_pct: torch.Tensor | None = None
    """`moe_dropped` in % of the step's routed token copies."""
    mtp_losses: torch.Tensor | None = None
    """Multi-token prediction (`MTPLoss`): each depth's loss [depth], the mean over the micro-batches
    (this rank's values); None without MTP. `loss` is then the main next-token loss. A loss with
    other such terms (trainer/tasks/lm.py `IndexerLoss`) returns them here too, named by `term_names`."""
    term_names: tuple[str, ...] | None = None
    """The metrics.jsonl keys of `mtp_losses`' entries (the loss function's `term_names`); None:
    `mtp_loss_1`, `mtp_loss_2`, ..."""


def moe_outputs(stats) -> dict[str, torch.Tensor | None]:
    """The StepOutput fields of `ExpertBalance.finish`'s `BalanceStats` (None: not an MoE model)."""
    if stats is None:
        return {}
    return dict(moe_max_vio=stats.max_vio, moe_dropped=stats.dropped, moe_dropped_pct=stats.dropped_pct)
