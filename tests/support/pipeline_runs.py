"""The pipeline-parallel tests' shared run shape (no tests here): tests/unit/test_pipeline_parallel.py
(eager schedules) and tests/unit/test_graph_pipeline.py (the pipeline in the captured step) run the
same model the same way on 2 or 4 gloo processes and compare with one process.

- `pp_model`: the Llama 3 debug model (narrowed by the caller's args) built by the trainer's
  `build_model` for a step plan (fp32 on CPU, from a seed; a pipeline plan keeps this pp rank's
  part) and its AdamW.
- `rank_run`: one rank's share of a run over global batches (its data-parallel rows, cut into
  `accum` micro-batches): the loop's global mean loss and the gradient norm of each step.
"""

from __future__ import annotations

import torch


def llama3_family():
    from models import FAMILIES

    return FAMILIES["llama3"]


def pp_model(args, plan, *, seed: int, lr: float, dims=None, mesh=None, family=None, **build):
    """(model, AdamW) of `family` (default: Llama 3) at `args` for the step plan `plan` on `dims` /
    `mesh` (default: one process), fp32 on CPU, initialised from `seed` (betas 0.9 / 0.95, eps 1e-6,
    weight decay 0.1); `build`: more of `build_model`'s keywords (e.g. `moe_capacity_factor`)."""
    from parallelisms import ParallelDims
    from trainer.job import build_model
    from trainer.optim import build_optimizer_for

    torch.manual_seed(seed)
    model = build_model(
        family if family is not None else llama3_family(),
        args,
        step_plan=plan,
        parallel_dims=dims if dims is not None else ParallelDims(world_size=1),
        mesh=mesh,
        device=torch.device("cpu"),
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        **build,
    )
    # eps 1e-6, not AdamW's 1e-8: an element whose gradient is at float-noise level (|g| ~ 1e-9, a
    # sum that nearly cancels) moves by up to lr per step at eps 1e-8 whatever the noise's sign, so
    # the runs' weights could differ by ~lr x steps on the order of summation alone. At 1e-6 Adam's
    # update is linear in such a gradient, d(update)/dg <= lr / eps, and fp32 summation noise
    # of a few 1e-9 moves an element by a few 1e-3 lr per step, under the 0.05 lr per step the
    # parity tests allow the weights (tests/support/graph_common.py argues the same).
    opt = build_optimizer_for(model, name="adamw", lr=lr, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    return model, opt


def rank_run(run_step, batches, *, dp_rank: int, dp_shard: int, accum: int) -> list[tuple[float, float]]:
    """This rank's steps over the global `batches` ((inputs, labels) of the same rows each):
    `run_step(micro_batches)` on rows `dp_rank` / `dp_shard` of each, cut into `accum`
    micro-batches; -> [(the loss averaged over every rank of the world, this rank's gradient norm)]."""
    import torch.distributed as dist

    losses = []
    for inputs, labels in batches:
        share = inputs.shape[0] // dp_shard
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        local = share // accum
        mine = (inputs[rows], labels[rows])
        micro = [(mine[0][i * local : (i + 1) * local], mine[1][i * local : (i + 1) * local]) for i in range(accum)]
        o = run_step(micro)
        loss = o.loss.detach().clone()
        dist.all_reduce(loss)  # the loop's global mean
        losses.append((loss.item() / dist.get_world_size(), o.grad_norm.item()))
    return losses


def full_state(model) -> dict[str, torch.Tensor]:
    """This rank's model state, each DTensor gathered whole."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def eager_pipeline_step(model, opt, plan, *, n_layers: int, pp_mesh, **moe):
    """The eager PP step (trainer/step/pipeline.py `PipelineStep`) of this pp rank's part of `model`
    for the step plan `plan`: clipping at 1.0 on the CPU, the block stack `layers`; `moe`: the MoE
    step's keywords (`moe=True`, `aux_loss_coef`, `balance`, `stage_mesh`)."""
    from parallelisms import clip_grad_norm_
    from trainer.step.pipeline import PipelineStep

    return PipelineStep(
        model=model,
        optimizer=opt,
        max_norm=1.0,
        clip_grad_norm=clip_grad_norm_,
        pipeline=plan.pipeline,
        block="layers",
        n_layers=n_layers,
        pp_mesh=pp_mesh,
        device=torch.device("cpu"),
        **moe,
    )
