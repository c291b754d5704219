"""The eager step with pipeline parallelism: each accumulation micro-batch through the schedule.

`PipelineStep(microbatches, lr)` is `EagerStep`'s contract (trainer/step/eager.py) on a pp rank's
part of the model (parallelisms/pipeline_parallel.py): for each accumulation micro-batch
`(inputs, labels)` the schedule splits the rows into `pipeline_microbatches` chunks and runs its
forwards and backwards across the pp ranks; the last stage computes each chunk's mean next-token
loss. The loss function carries the factor 1 / (chunks x accumulation micro-batches) and the
schedule does not rescale (scale_grads=False), so the gradients summed over all of them are the
mean over the step's chunks, as `EagerStep`'s `(loss / n).backward()` sums them: with equal token
counts per chunk, the gradient of the global batch's mean loss. Then the gradient norm over every
stage (the squared norms summed over the pp axis), clipping and the update, as in the eager step.
The loss returned is the same mean on every rank (the last stage's, summed over the pp axis).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallelisms.pipeline_parallel import PipelinePlan, build_schedule
from trainer.step.eager import step_if_finite
from trainer.step.loss import StepOutput, lm_loss


class PipelineStep:
    """The step of a pp rank (module docstring)."""

    compile_s = None
    graph_nodes = None

    def __init__(
        self,
        *,
        model,
        optimizer,
        max_norm: float,
        clip_grad_norm,
        pipeline: PipelinePlan,
        block: str,
        n_layers: int,
        pp_mesh,
        device: torch.device,
        positions: tuple[int, int] | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.clip_grad_norm = clip_grad_norm
        self.pp_mesh = pp_mesh
        self.device = device
        self._scale = 1.0
        pp_rank = pp_mesh.get_local_rank()
        self.has_first, self.has_last = pipeline.rank_has_first_last(pp_rank)
        self.schedule, self.stages = build_schedule(
            model,
            block=block,
            n_layers=n_layers,
            schedule=pipeline.schedule,
            pp_rank=pp_rank,
            pp=pipeline.pp,
            num_virtual=pipeline.num_virtual,
            microbatches=pipeline.microbatches,
            pp_group=pp_mesh.get_group(),
            device=device,
            loss_fn=self._loss,
            first_stage_less=pipeline.first_stage_less,
            last_stage_less=pipeline.last_stage_less,
        )
        self.microbatches = pipeline.microbatches
        # `positions` = (local batch, seq_len), with tensor parallelism: a stage's input is then a
        # sequence shard (sequence parallel), so every stage gets the RoPE positions of the whole
        # window ([local batch, seq_len], chunked with the micro-batches) instead of reading its length.
        self.positions = (
            torch.arange(positions[1], device=device).expand(positions[0], positions[1]).contiguous()
            if positions is not None
            else None
        )

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, labels) * self._scale

    def _run(self, call, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """One schedule call (`step` or `eval`) on a micro-batch; the last stage's scaled chunk
        losses (the schedule replaces a list's contents per call; no logits are kept)."""
        chunk_losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": chunk_losses} if self.has_last else {}
        if self.positions is not None:
            kwargs["positions"] = self.positions
        if self.has_first:
            call(inputs, return_outputs=False, **kwargs)
        else:
            call(return_outputs=False, **kwargs)
        return chunk_losses

    def _pp_sum(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the last stage's scaled chunk losses, the same on every pp rank (the other
        ranks add zero over the pp axis)."""
        loss = (
            torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros((), device=self.device)
        )
        dist.all_reduce(loss, group=self.pp_mesh.get_group())
        return loss

    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss of one micro-batch through the schedule's forward only (`schedule.eval`;
        validation), the same on every rank of the pp axis."""
        self._scale = 1.0 / self.microbatches
        return self._pp_sum(self._run(self.schedule.eval, inputs, labels))

    def __call__(self, microbatches, lr: float | None = None) -> StepOutput:
        self.optimizer.zero_grad(set_to_none=True)
        n = len(microbatches)
        self._scale = 1.0 / (n * self.microbatches)
        losses: list[torch.Tensor] = []
        for microbatch in microbatches:
            assert len(microbatch) == 2, "the pipeline step takes (inputs, labels) micro-batches"
            inputs, labels = microbatch
            losses.extend(self._run(self.schedule.step, inputs, labels))
        loss = self._pp_sum(losses)  # the step's mean loss
        max_norm = self.max_norm if self.max_norm > 0 else float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = self.clip_grad_norm(params, max_norm, pp_mesh=self.pp_mesh)
        step_if_finite(self.optimizer, grad_norm)
        return StepOutput(loss=loss, grad_norm=grad_norm)
