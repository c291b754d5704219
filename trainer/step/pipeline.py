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

Context parallelism (`cp`, a `CPGroup`; docs/pipeline_parallel.md "Context parallelism with PP"):
the cp axis lives inside each stage like dp_shard and tp. A micro-batch is then this cp rank's
load-balanced shard `(inputs, labels, positions)` (`LMTask.prepare`: chunks r and 2 cp - 1 - r of
each window, with their global RoPE positions), the schedule sends hidden states `[b, s / cp, d]`
between the stages, every stage's attention is the job's CP attention (the op `causal_attention`,
`apply_cp`) and the positions go to every stage with the chunk. The last stage's chunk loss is the
non-PP CP path's (`cp_scaled_lm_loss`): this rank's token sum x cp / the cp group's token count of
the chunk, so SimpleFSDP's gradient mean over dp_shard x cp gives the chunk's mean over all its
tokens, and the per-rank losses averaged over the world are the global mean.

TP's loss parallel (`loss_parallel`, `[parallelism] enable_loss_parallel` with TP; docs/pipeline_parallel.md
"The step"): the last stage's head returns vocab-sharded logits (a DTensor sharded on the
vocabulary), and the loss function the schedule calls on them is the same `lm_loss`, which a
DTensor computes as the loss-parallel cross entropy only inside `loss_parallel_context`. The step
enters it around its schedule calls (the loss function and the backward through it both run inside
`schedule.step`), as `EagerStep` enters the step plan's `loss_context`; `eval_loss` is entered by its
caller (validation runs every loss function inside the step plan's `loss_context`; the context does
not nest). The chunk losses are then replicated DTensors, made local before the sum over the pp
axis (`local_scalar`); with context parallelism the count scale joins them as a replicated DTensor
(as `cp_scaled_lm_loss`).

MoE models (`moe=True`; docs/pipeline_parallel.md "MoE and expert parallelism with PP"). Each
stage runs wrapped (`_MoETap`): after its blocks' forward on a chunk the step takes the stage's
summed load-balancing loss and its layers' expert loads off the stage's block stack.

- The auxiliary loss. Only the last stage runs the loss function, so an earlier stage's routers
  get the aux-loss gradient through `AttachAux` (Megatron's MoEAuxLossAutoScaler): the stage's
  output is returned unchanged, and in the backward the stage's aux loss receives the constant
  gradient `aux_loss_coef / (chunks x accumulation micro-batches)`, which is what
  `EagerStep`'s `(lm + coef x aux) / n` gives each micro-batch's aux term. The chunk is the unit:
  like the one-process step with `n x chunks` accumulation micro-batches of the same rows, the
  global-batch load-balancing loss counts each chunk's tokens (over the stage's data-parallel
  and expert-parallel ranks, parallelisms/expert_parallel.py `apply_global_load_balance`),
  whatever stage holds the layer. The reported aux loss is the stages' parts summed over the pp
  axis, divided by `n x chunks`.
- The expert loads (`expert_bias` recipes, trainer/optim/expert_balance.py): each stage adds its
  layers' loads per chunk into this rank's per-layer sums, so a rank holding several stages
  (Interleaved1F1B, ZBVZeroBubble) or only some layers counts each of its layers over every
  chunk; `ExpertBalance.finish` sums them over the stage's ranks (not the world: the other pp
  ranks hold other layers) and moves each layer's bias, and MaxVio and the dropped copies combine
  over the pp axis.
- Metadata inference: `torch.distributed.pipelining` runs a stage forward outside the chunks
  before a first step and after a train <-> eval switch; the tap pops and drops what that
  forward leaves (`in_chunk_forward`).
- A pp rank without MoE layers (a dense first stage, DeepSeek style): it adds no aux loss and no
  expert load, and when the other ranks' `ExpertBalance.finish` combines MaxVio and the dropped
  copies over the pp axis it joins that reduction with zeros (`ExpertBalance.join_without_layers`), so
  every rank returns the same statistics.

Zero-bubble schedules in compile mode (`InterleavedZeroBubble`, `ZBVZeroBubble` over per-block
compiled stages; docs/pipeline_parallel.md "Compile mode"). These schedules split a stage's backward
into the input gradient (`torch.autograd.grad` with `retain_graph=True`) and, later, the weight
gradient, so a compiled block's backward (one AOTAutograd node for the whole block) runs twice per
forward. AOTAutograd compiles that backward with donated buffers by default (saved activations
the backward may overwrite, legal only for a single backward call) and refuses a second call
(pytorch/pytorch#161904). Every schedule call of a zero-bubble schedule therefore runs under
`torch._functorch.config.donated_buffer = False` (`split_backward_config`): the blocks compile
(lazily, at their first forward, inside the call) with no donated buffers, and the backward's check
(also inside the call) passes. Only these schedules' calls see the patch; the per-block compile
itself (parallelisms/compile.py) is unchanged. The cost: the second call recomputes the whole
block backward (the weight pass cannot reuse the input pass's work inside one compiled node), and
the backward allocates its buffers instead of reusing the saved activations'.

Graph-mode PP (trainer/graph/pipeline.py) runs MoE models too, within its one program: the stage's
aux terms and loads masked over the bubble iterations (`PipelinedLoss.terms`), the statistics
through `StageBalance` (trainer/optim/expert_balance.py), whose rank without MoE layers joins the
same reduction (`ExpertBalance.join_without_layers`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from models.common.moe import MoE
from parallelisms.pipeline_parallel import ZERO_BUBBLE_SCHEDULES, PipelinePlan, build_schedule, in_chunk_forward
from parallelisms.tensor_parallel import loss_parallel_context
from trainer.step.eager import step_if_finite
from trainer.step.loss import StepOutput, cp_token_mean, lm_loss, local_scalar, moe_outputs


def split_backward_config(schedule: str):
    """The context a schedule call of `schedule` runs in: for a zero-bubble schedule AOTAutograd's
    donated buffers off (module docstring, "Zero-bubble schedules in compile mode"), else nothing.
    Read when a compiled block's joint graph is partitioned (its first forward, inside the call) and
    when its backward runs, both inside the call; without a compiled block it changes nothing."""
    if schedule in ZERO_BUBBLE_SCHEDULES:
        from torch._functorch import config as functorch_config

        return functorch_config.patch(donated_buffer=False)
    return contextlib.nullcontext()


class AttachAux(torch.autograd.Function):
    """`attach_aux(x, aux, scale)`: x unchanged; in the backward x's gradient passes through and
    `aux` (a 0-dim loss computed from this stage's parameters and input) receives the constant
    gradient `scale`, as if `scale x aux` had been added to the loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = float(scale)
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        # The same storage, not a view (the schedule detaches stage outputs in place).
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_aux(x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    return AttachAux.apply(x, aux, scale)


def moe_block_keys(stack: nn.Module) -> list[str]:
    """The keys of the blocks of a block stack that hold an MoE layer, in the stack's order (the
    order `ExpertBalance` lists their layers)."""
    return [key for key, block in stack.items() if any(isinstance(m, MoE) for m in block.modules())]


class _MoETap(nn.Module):
    """A stage's view run by the schedule: its forward, then `tap(view, output, keys)` (module
    docstring); `keys`: the view's MoE blocks (`moe_block_keys`), listed once, not per chunk."""

    def __init__(self, view: nn.Module, tap, block: str):
        super().__init__()
        self.view = view
        self._tap = tap
        self._keys = moe_block_keys(getattr(view, block))

    def forward(self, *args, **kwargs):
        return self._tap(self.view, self.view(*args, **kwargs), self._keys)


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
        moe: bool = False,
        aux_loss_coef: float = 0.0,
        balance=None,
        stage_mesh=None,
        moe_capacity: bool = False,
        cp=None,
        loss_parallel: bool = False,
    ):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.clip_grad_norm = clip_grad_norm
        self.pp_mesh = pp_mesh
        self.device = device
        self._scale = 1.0
        # MoE (module docstring): `moe` is the model's (every pp rank says the same: the pp-axis
        # reductions below run on all of them); `balance` the ExpertBalance of this rank's layers.
        self.moe = moe
        self.aux_loss_coef = float(aux_loss_coef)
        self.block = block
        self._moe_keys = moe_block_keys(getattr(model, block)) if moe else []
        # A rank without MoE layers (module docstring): `balance` is then its empty ExpertBalance
        # (falsy), which joins the other ranks' statistics with zeros; `moe_capacity` says whether
        # their layers drop copies.
        self._empty_balance = balance if moe and not self._moe_keys and balance is not None else None
        self.moe_capacity = moe_capacity
        if balance is not None and not balance:
            balance = None
        self.balance = balance
        # Context parallelism (module docstring): the cp group of this rank's stage, None without.
        self.cp = cp if cp is not None and cp.size > 1 else None
        # TP's loss parallel (module docstring): the last stage's logits vocab-sharded DTensors.
        self.loss_parallel = loss_parallel
        self._collect = False
        self._aux_parts: list[torch.Tensor] = []
        self._loads: dict[str, torch.Tensor] = {}
        self._stage_group = None
        if balance is not None:
            assert stage_mesh is not None, "PP with expert loads: the stage mesh sums them (not the world)"
            from parallelisms.parallel_dims import stage_group_mesh

            self._stage_group = stage_group_mesh(stage_mesh).get_group()
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
            stage_module=(lambda view: _MoETap(view, self._tap, block)) if moe else None,
        )
        self.microbatches = pipeline.microbatches
        self._schedule_name = pipeline.schedule
        # `positions` = (local batch, seq_len), with tensor parallelism: a stage's input is then a
        # sequence shard (sequence parallel), so every stage gets the RoPE positions of the whole
        # window ([local batch, seq_len], chunked with the micro-batches) instead of reading its length.
        self.positions = (
            torch.arange(positions[1], device=device).expand(positions[0], positions[1]).contiguous()
            if positions is not None
            else None
        )

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.cp is None:
            return lm_loss(logits, labels) * self._scale
        # The non-PP CP loss (trainer/step/loss.py `cp_scaled_lm_loss`) on the chunk's shard: every cp
        # rank of the last stage computes its loss on the same chunk at once, so the count's
        # all-reduce over cp pairs up like the attention's k/v gathers.
        return cp_token_mean(lm_loss(logits, labels, reduction="sum"), labels, self.cp) * self._scale

    def _tap(self, view: nn.Module, out: torch.Tensor, keys: list[str]) -> torch.Tensor:
        """After a stage's forward: take its aux loss and expert loads off its block stack (always,
        so none is left over); in a training chunk keep them (the loads by `keys`, the view's MoE
        blocks) and attach the aux loss's gradient."""
        stack = getattr(view, self.block)
        aux = stack.pop_aux_loss()
        load = stack.pop_expert_load()
        if not (self._collect and in_chunk_forward()):
            return out
        if load is not None:
            assert len(keys) == load.shape[0], (keys, tuple(load.shape))
            for key, row in zip(keys, load.detach().float()):
                self._loads[key] = row if key not in self._loads else self._loads[key] + row
        if aux is None:
            return out
        self._aux_parts.append(local_scalar(aux.detach()).float())
        if self.aux_loss_coef != 0.0 and torch.is_grad_enabled() and aux.requires_grad:
            out = attach_aux(out, aux, self.aux_loss_coef * self._scale)
        return out

    def _run(self, call, inputs: torch.Tensor, labels: torch.Tensor, positions=None) -> list[torch.Tensor]:
        """One schedule call (`step` or `eval`) on a micro-batch; the last stage's scaled chunk
        losses (the schedule replaces a list's contents per call; no logits are kept). `positions`:
        the micro-batch's RoPE positions (context parallelism: the shard's global positions, which
        every stage takes with the chunk), else TP's whole-window positions, else none."""
        chunk_losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": chunk_losses} if self.has_last else {}
        positions = positions if positions is not None else self.positions
        if positions is not None:
            kwargs["positions"] = positions
        args = (inputs,) if self.has_first else ()
        with split_backward_config(self._schedule_name):
            call(*args, return_outputs=False, **kwargs)
        return chunk_losses

    def _pp_sum(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the last stage's scaled chunk losses, the same on every pp rank (the other
        ranks add zero over the pp axis)."""
        loss = (
            torch.stack([local_scalar(x.detach()).float() for x in losses]).sum()
            if losses
            else torch.zeros((), device=self.device)
        )
        dist.all_reduce(loss, group=self.pp_mesh.get_group())
        return loss

    def _unpack(self, microbatch) -> tuple:
        """(inputs, labels, positions or None) of a micro-batch: (inputs, labels), or with context
        parallelism this rank's shard (inputs, labels, positions)."""
        want = 3 if self.cp is not None else 2
        assert len(microbatch) == want, (
            f"the pipeline step takes {'(inputs, labels, positions)' if want == 3 else '(inputs, labels)'} micro-batches"
        )
        return (*microbatch, None) if want == 2 else tuple(microbatch)

    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        """The mean loss of one micro-batch through the schedule's forward only (`schedule.eval`;
        validation), the same on every rank of the pp axis (with CP, `extra` is the positions and the
        value is this cp rank's part, whose mean over the cp ranks is the micro-batch's mean). With TP's
        loss parallel the caller runs it inside `loss_parallel_context` (validation does: the step
        plan's `loss_context`), as every loss function of a vocab-sharded model."""
        self._scale = 1.0 / self.microbatches
        return self._pp_sum(self._run(self.schedule.eval, *self._unpack((inputs, labels, *extra))))

    def __call__(self, microbatches, lr: float | None = None) -> StepOutput:
        self.optimizer.zero_grad(set_to_none=True)
        n = len(microbatches)
        self._scale = 1.0 / (n * self.microbatches)
        losses: list[torch.Tensor] = []
        self._aux_parts, self._loads, self._collect = [], {}, True
        try:
            # TP's loss parallel (module docstring): the forwards and the backwards of the last
            # stage's loss inside the schedule's call; validation's caller enters it for `eval_loss`.
            with loss_parallel_context(self.loss_parallel):
                for microbatch in microbatches:
                    losses.extend(self._run(self.schedule.step, *self._unpack(microbatch)))
        finally:
            self._collect = False
        loss = self._pp_sum(losses)  # the step's mean loss
        aux = None
        if self.moe:  # this rank's stages' aux terms over the chunks, summed over the pp axis: the step's mean
            aux = self._pp_sum(self._aux_parts) * self._scale
        max_norm = self.max_norm if self.max_norm > 0 else float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = self.clip_grad_norm(params, max_norm, pp_mesh=self.pp_mesh)
        nonfinite = step_if_finite(self.optimizer, grad_norm)
        moe_stats = {}
        if self.balance is not None:
            load = torch.cat([self._loads[key] for key in self._moe_keys])
            stats = self.balance.finish(
                load, apply=~nonfinite, group=self._stage_group, pp_group=self.pp_mesh.get_group()
            )
            moe_stats = moe_outputs(stats)
        elif self._empty_balance is not None:
            moe_stats = self._join_balance_without_layers()
        self._aux_parts, self._loads = [], {}
        return StepOutput(loss=loss, grad_norm=grad_norm, aux_loss=aux, **moe_stats)

    def _join_balance_without_layers(self) -> dict[str, torch.Tensor | None]:
        """On a pp rank without MoE layers: `ExpertBalance.join_without_layers`'s statistics as the
        StepOutput fields the ranks with layers return (`moe_outputs` of their statistics)."""
        stats = self._empty_balance.join_without_layers(self.pp_mesh.get_group(), self.device, self.moe_capacity)
        return moe_outputs(stats)
