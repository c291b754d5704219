"""The one entry point that applies every parallelism to a model, in a fixed order.

Order (each step relies on the previous ones):
0. Low-precision linears (`apply_quantize`, `[quantize]`): the chosen `nn.Linear`s become
   `QuantizedLinear` (a class swap: paths, parameters and state-dict keys unchanged), so TP's
   styles still apply to them and SimpleFSDP still shards and gathers their fp32 weights.
1. Tensor parallelism (`apply_tp`): parameters become TP DTensors on the `tp` axis.
2. Expert parallelism (`parallelisms.expert_parallel.apply_ep`, when `ep > 1`, or with
   `tp > 1` when the plan has EP entries: they also make MoE layers TP-aware).
   MoE layers ("moe" style) then sum their expert counts over the world for the global-batch
   load-balancing loss (`apply_global_load_balance`).
   Context parallelism (`cp > 1`) wraps no module: its attention serves the op
   `causal_attention` (`parallelisms.context_parallel.apply_cp`, applied where the op table is
   filled, trainer/job.py `serve_ops`), the task shards each window (given the cp group at
   construction), and its parameter sharding is step 5's.
3. Activation checkpointing (`apply_ac`): wraps each block's forward.
4. Per-block torch.compile (`apply_compile`): compiles the (checkpointed) blocks; the
   compile is lazy, so it traces the SimpleFSDP gathers added next.
5. SimpleFSDP (`data_parallel`): parameters become dp-sharded DTensors (2-D with TP) and
   are gathered at use, cast to `param_dtype`; gradients are reduced in `reduce_dtype`.
   With `[quantize] fsdp_float8_all_gather`, float8_tensorwise weights are gathered as e4m3.
   With context parallelism (`cp > 1`) the shard axis is `dp_shard x cp` (`dp_shard_cp`).

The model goes in on the meta device and comes out still on meta; the caller then runs
`model.to_empty(device=...)` and `model.init_weights(buffer_device=...)`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models.common.plan import ModelPlan
from models.errors import ConfigError
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import apply_compile
from parallelisms.parallel_dims import ParallelDims, fsdp_cp_mesh
from parallelisms.quantize import QuantizePlan, apply_quantize
from parallelisms.simple_fsdp import data_parallel
from parallelisms.tensor_parallel import apply_tp

__all__ = ["parallelize_model"]


def parallelize_model(
    model: nn.Module,
    *,
    plan: ModelPlan,
    parallel_dims: ParallelDims,
    mesh: DeviceMesh | None,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    ac_mode: str = "none",
    compile_backend: str | None = None,
    enable_loss_parallel: bool = False,
    quantize: QuantizePlan | None = None,
    replicate_reduce: str = "micro_batch",
) -> nn.Module:
    """Apply quantize -> TP -> EP -> AC -> compile -> SimpleFSDP to `model` in place and return it.

    `mesh` is the world mesh from `build_mesh` (None only for a single process).
    `compile_backend=None` leaves the blocks eager. `enable_loss_parallel` keeps the
    logits vocab-sharded (compute the loss under `loss_parallel_context(True)`).
    `quantize`: the low-precision linears (`[quantize]`; None: none).
    `replicate_reduce`: when gradients are averaged over `dp_replicate` ("micro_batch": in each
    backward; "step": once per step by parallelisms/replicate_reduce.py).
    """
    if mesh is None and parallel_dims.world_size != 1:
        raise AssertionError("a mesh is required when world_size > 1")
    if enable_loss_parallel and not parallel_dims.tp_enabled:
        enable_loss_parallel = False  # nothing is vocab-sharded without TP
    if quantize is not None:
        apply_quantize(model, recipe=quantize.recipe, filter_fqns=quantize.filter_fqns, min_dim=quantize.min_dim)
    if parallel_dims.tp_enabled:
        apply_tp(model, plan=plan, tp_mesh=mesh["tp"], enable_loss_parallel=enable_loss_parallel)
    # EP styles also carry the MoE layers' TP handling, so they apply with ep = 1 under TP.
    if parallel_dims.ep_enabled or (parallel_dims.tp_enabled and plan.ep_block):
        from parallelisms.expert_parallel import apply_ep

        apply_ep(
            model,
            plan=plan,
            parallel_dims=parallel_dims,
            mesh=mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            replicate_reduce=replicate_reduce,
        )
    if parallel_dims.tp_enabled:
        _check_block_params_sharded(model, plan)
    if plan.ep_block and parallel_dims.world_size > 1:
        from parallelisms.expert_parallel import apply_global_load_balance

        apply_global_load_balance(model, plan=plan, mesh=mesh)
    apply_ac(model, plan=plan, mode=ac_mode)
    if compile_backend is not None:
        apply_compile(model, plan=plan, backend=compile_backend)
    # `[quantize] fsdp_float8_all_gather`: float8_tensorwise weights are all-gathered as e4m3.
    float8 = quantize.float8_weights if quantize is not None and quantize.fsdp_float8_all_gather else None
    # With context parallelism the cp ranks hold the same parameters: shard them over dp x cp.
    if parallel_dims.cp_enabled:
        data_parallel(
            model,
            mesh=fsdp_cp_mesh(mesh),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            shard_axis="dp_shard_cp",
            float8_weights=float8,
            replicate_reduce=replicate_reduce,
        )
    else:
        data_parallel(
            model,
            mesh=mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            float8_weights=float8,
            replicate_reduce=replicate_reduce,
        )
    return model


def _check_block_params_sharded(model: nn.Module, plan: ModelPlan) -> None:
    """With TP, a block parameter left out of the plan would silently miss the TP gradient sum.

    Inside a block the activations are sequence- or head-sharded, so every parameter there
    must be a DTensor that TP (or EP) placed; e.g. MoE layers need expert parallelism.
    """
    from torch.distributed.tensor import DTensor

    for prefix, block in plan.iter_blocks(model):
        for name, param in block.named_parameters(prefix=prefix):
            if not isinstance(param, DTensor):
                raise ConfigError(
                    f"parallelism.tensor_parallel_degree: the model's plan has no tensor-parallel "
                    f"or expert-parallel style for {name}, so its gradient would miss the TP sum; "
                    f"allowed for this model: 1 (or give {name} a style in the model's plan)"
                )
