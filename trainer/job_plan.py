"""Step 2 of `build_job` (trainer/job.py): what a run is, decided and checked before anything is
built. `plan_job` reads the recipe into model args, parallel degrees and the step plan, checked
against every rule (trainer/step/plan.py RULES); `step_request` is what those rules read (the
planner's search and the recipe check fill it in for layouts they try); `batch_split` splits the
global batch over the data-parallel ranks. Nothing here touches a device or the op table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

import titan_kernels
from models.errors import ConfigError
from parallelisms import ParallelDims
from parallelisms.device_order import RankOrder, resolve_rank_order
from parallelisms.parallel_dims import resolve_num_slices, tpu_mesh_layout
from parallelisms.quantize import QuantizePlan
from trainer.config import Config, resolve_model_args
from trainer.runtime.flops import tpu_generation
from trainer.runtime.tpu_env import detect_generation
from trainer.step import StepPlan, StepRequest, plan_step
from trainer.step.pipeline_rules import pipeline_capable  # re-exported by trainer.job
from trainer.step.quantize import QuantizeCensus, quantize_census
from trainer.tasks import TASK_CLASSES


@dataclass(frozen=True)
class JobPlan:
    """What a run is, decided and checked without building anything (step 2)."""

    family: Any
    """The model family (`models.FAMILIES[name]`)."""
    args: Any
    """The flavor's args with the recipe's `[model]` overrides and `max_seq_len` applied."""
    parallel_dims: ParallelDims
    step_plan: StepPlan
    tpu_mesh: Any = None
    """On a TPU whose slice is known now: torch-tpu's layout of the mesh (`tpu_mesh_layout`)."""
    quantize_census: QuantizeCensus | None = None
    """What `[quantize]` picks in the model (trainer/step/quantize.py); None without a recipe."""


def step_request(
    cfg: Config,
    family,
    *,
    tp_degree: int = 1,
    device_type: str = "cpu",
    caller_loss: bool = False,
    model_has_experts: bool = True,
    grad_accum: int = 1,
    num_slices: int = 1,
    device_generation: str = "",
    fsdp_shard_degree: int = 0,
    quantize_census: QuantizeCensus | None = None,
    mtp_depth: int = 0,
    indexer_loss: bool = False,
    linear_conv_halo: int = 0,
    n_layers: int = 0,
    local_batch: int = 0,
    tie_embeddings: bool = False,
) -> StepRequest:
    """What the step plan's rules read, from the recipe and the family (the planner fills in the
    degrees and device of each layout it tries; `model_has_experts` and `grad_accum` from the
    model args and the batch split when known; likewise `n_layers`, `local_batch` and
    `tie_embeddings`, which the pipeline rules read). Three parts: the recipe's step choices, its
    layout (degrees, slices, checkpoint tier, pipeline), the family's facts; then these arguments."""
    return StepRequest(
        **_recipe_step_facts(cfg),
        **_recipe_layout_facts(cfg),
        **_family_facts(cfg, family),
        tp_degree=tp_degree,
        device_type=device_type,
        caller_loss=caller_loss,
        model_has_experts=model_has_experts,
        grad_accum=grad_accum,
        num_slices=num_slices,
        fsdp_shard_degree=fsdp_shard_degree,
        device_generation=device_generation,
        quantize_census=quantize_census,
        mtp_depth=mtp_depth,
        indexer_loss=indexer_loss,
        linear_conv_halo=linear_conv_halo,
        n_layers=n_layers,
        local_batch=local_batch,
        tie_embeddings=tie_embeddings,
    )


def _recipe_step_facts(cfg: Config) -> dict[str, Any]:
    """The `StepRequest` fields of the recipe's step: compile, loss, data masks, optimizer, MoE,
    attention, flow, initial load and `[quantize]`."""
    return dict(
        mode=cfg.compile.mode,
        backend=cfg.compile.backend,
        scan_layers=cfg.compile.scan_layers,
        pp_scan_iterations=cfg.compile.scan_pipeline_iterations,
        ac_mode=cfg.activation_checkpoint.mode,
        ac_offload=cfg.activation_checkpoint.offload,
        loss_parallel=cfg.parallelism.enable_loss_parallel,
        fused_loss=cfg.training.fused_loss,
        document_mask=cfg.training.document_mask,
        document_positions=cfg.training.document_positions,
        seq_len=cfg.training.seq_len,
        qk_clip=cfg.optimizer.qk_clip_tau > 0,
        optimizer=cfg.optimizer.name,
        muon_exclude=tuple(cfg.optimizer.muon_exclude),
        moe_routing=cfg.moe.routing,
        moe_capacity_factor=cfg.moe.capacity_factor,
        moe_dispatch_chunks=cfg.moe.dispatch_chunks,
        routing_benchmark_only=cfg.moe.routing_benchmark_only,
        attn_backend=cfg.model.attn_backend,
        flow_shift=cfg.flow.shift,
        flow_resolution_shift=cfg.flow.resolution_shift,
        initial_load_format=cfg.checkpoint.initial_load_format if cfg.checkpoint.initial_load_path else "",
        quantize=cfg.quantize.recipe,
        fsdp_float8_all_gather=cfg.quantize.fsdp_float8_all_gather,
    )


def _recipe_layout_facts(cfg: Config) -> dict[str, Any]:
    """The `StepRequest` fields of the recipe's layout: cp / dp / ep degrees, DCN sharding, the
    local checkpoint tier, the replicate reduction, the pipeline and the device order."""
    p = cfg.parallelism
    return dict(
        cp_degree=p.context_parallel_degree,
        dp_replicate=p.data_parallel_replicate_degree,
        allow_dcn_sharding=p.allow_dcn_sharding,
        local_checkpoint=cfg.checkpoint.enable and bool(cfg.checkpoint.local_folder),
        replicate_reduce=cfg.training.replicate_reduce,
        replicate_reduce_dtype=cfg.training.replicate_reduce_dtype,
        pp_degree=p.pipeline_parallel_degree,
        pp_schedule=p.pipeline_schedule,
        pp_microbatches=p.pipeline_microbatches,
        pp_virtual_stages=p.pipeline_virtual_stages,
        pp_first_less=p.pipeline_first_stage_less_layers,
        pp_last_less=p.pipeline_last_stage_less_layers,
        ep_degree=p.expert_parallel_degree,
        recipe_num_slices=p.num_slices,
        target_num_slices=target_slices(cfg.job.target),
        device_order=",".join(map(str, p.device_order)) if isinstance(p.device_order, list) else str(p.device_order),
    )


def target_slices(target: str) -> int:
    """The slice count a `[job] target` names (`v6e-256x2`: 2, `v6e-256`: 1; planner.parse_target
    reads the whole name); 1 without a target."""
    m = re.fullmatch(r"[a-z0-9]+-\d+x(\d+)", target.strip().lower())
    return int(m.group(1)) if m else 1


def _family_facts(cfg: Config, family) -> dict[str, Any]:
    """The `StepRequest` fields the model family states: its task, its hooks (hidden states, the
    pipeline's `Decoder` forward, the HF adapter), its attention backends and TP refusal."""
    tp_refusal = getattr(family.model_cls, "tp_refusal", None)  # a family without a TP plan
    if cfg.model.name == "hf":  # its TP plan is translated from the transformers model's (models/hf/plan.py)
        from models.hf.plan import tp_refusal as hf_tp_refusal
        from trainer.config import model_args

        m = cfg.model
        tp_refusal = hf_tp_refusal(model_args(m.name, m.flavor, {**m.overrides, "hf_config": m.hf_config})[1])
    return dict(
        model_has_hidden=callable(getattr(family.model_cls, "hidden", None)),
        task=getattr(family, "task", "lm"),
        model_document_mask=bool(getattr(family, "document_mask", False)),
        tp_refusal=tp_refusal,
        model_has_hf_adapter=getattr(family, "hf_adapter", None) is not None,
        model_attn_backends=getattr(family.model_cls, "attn_backends", titan_kernels.ATTENTION_BACKENDS),
        model_pipeline=pipeline_capable(family.model_cls),
    )


def quantize_generation(cfg: Config, device_type: str) -> str:
    """The device generation the `[quantize]` rules read (StepRequest.device_generation): this
    host's TPU generation (else the recipe's `job.target`, for a check on another host) or CUDA
    compute capability (`sm90`); "" with no recipe or when nothing says."""
    if cfg.quantize.recipe == "none":
        return ""
    if device_type == "tpu":
        return detect_generation() or (tpu_generation(cfg.job.target) if cfg.job.target else None) or ""
    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm{major}{minor}"
    return ""


def parallel_dims_of(cfg: Config, *, world_size: int) -> ParallelDims:
    """The recipe's degrees on `world_size` ranks (ConfigError for degrees that do not divide it)."""
    p = cfg.parallelism
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        ep=p.expert_parallel_degree,
        num_slices=resolve_num_slices(p.num_slices),
        pp=p.pipeline_parallel_degree,
        world_size=world_size,
    )


def rank_order_of(cfg: Config, *, world_size: int, device_type: str) -> RankOrder:
    """Which launcher rank takes which place of the mesh (`[parallelism] device_order`,
    parallelisms/device_order.py), decided before the process group, which it renumbers."""
    dims = parallel_dims_of(cfg, world_size=world_size)
    return resolve_rank_order(
        cfg.parallelism.device_order,
        dims,
        device_type=device_type,
        tpu_layout=lambda: tpu_mesh_layout(dims, target=cfg.job.target, generation=detect_generation),
    )


def plan_job(cfg: Config, *, world_size: int, device_type: str, caller_loss: bool = False) -> JobPlan:
    """Model args, degrees and step plan of `cfg` on `world_size` devices of `device_type`.

    ConfigError for anything that cannot run: degrees that do not divide the world, the model
    or the sequence (`ParallelDims.validate_for_model`), and every rule of the step plan.
    `caller_loss`: the engine, which runs its caller's loss on the logits.
    """
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    shape = args.shape()
    parallel_dims = parallel_dims_of(cfg, world_size=world_size)
    # Benchmark routing is refused with gradient accumulation (the rule says why): the split is
    # only worked out for it here, so a learned-routing plan reads nothing new.
    t = cfg.training

    def split() -> tuple[int, int]:  # worked out only where a rule reads it
        return batch_split(
            global_batch_size=t.global_batch_size,
            local_batch_size=t.local_batch_size,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            dp_degree=parallel_dims.dp_degree,
        )

    grad_accum = 1 if cfg.moe.routing == "learned" else split()[1]
    # The pipeline rules read the local batch the schedule splits into micro-batches.
    local_batch = split()[0] if parallel_dims.pp_enabled else 0
    # What `[quantize]` picks in this model (counted on meta): the rules refuse a recipe that picks
    # nothing, the banner states the count.
    census = quantize_census(family, args, QuantizePlan.of(cfg.quantize)) if cfg.quantize.recipe != "none" else None
    request = step_request(
        cfg,
        family,
        tp_degree=parallel_dims.tp,
        device_type=device_type,
        caller_loss=caller_loss,
        model_has_experts=shape.num_experts > 0,
        grad_accum=grad_accum,
        num_slices=parallel_dims.num_slices,
        device_generation=quantize_generation(cfg, device_type),
        fsdp_shard_degree=parallel_dims.dp_shard * parallel_dims.cp,
        quantize_census=census,
        mtp_depth=getattr(args, "mtp_depth", 0),
        indexer_loss=bool(getattr(args, "trains_indexer", False)),
        linear_conv_halo=max(getattr(args, "linear_conv_kernel_dim", 1) - 1, 0),
        n_layers=shape.n_layers,
        local_batch=local_batch,
        tie_embeddings=bool(getattr(args, "tie_embeddings", False)),
    )
    step_plan = plan_step(request)  # the task name is checked here, before TASK_CLASSES is read
    parallel_dims.validate_for_model(shape, seq_len=TASK_CLASSES[request.task].seq_len_to_divide(cfg.training))
    # On a TPU, the mesh as torch-tpu will lay it out on the slice (when the slice is known now):
    # refused here when no layout exists, before anything is built (parallelisms/tpu_topology.py).
    tpu_mesh = (
        tpu_mesh_layout(parallel_dims, target=cfg.job.target, generation=detect_generation)
        if device_type == "tpu"
        else None
    )
    return JobPlan(
        family=family,
        args=args,
        parallel_dims=parallel_dims,
        step_plan=step_plan,
        tpu_mesh=tpu_mesh,
        quantize_census=census,
    )


def batch_split(
    *, global_batch_size: int, local_batch_size: int, gradient_accumulation_steps: int, dp_degree: int
) -> tuple[int, int]:
    """(local_batch_size, gradient_accumulation_steps) for this mesh.

    With `global_batch_size` > 0 the global batch is fixed and the split follows the
    data-parallel degree: local batch = global / (dp x accumulation), where accumulation is the
    smallest count >= the configured one that makes the local batch fit `local_batch_size` (its
    upper bound). So a recipe keeps its trajectory from 1 to 256 devices without an edit.
    Otherwise the configured values stand (global = local x dp x accumulation).
    """
    if global_batch_size <= 0:
        return local_batch_size, gradient_accumulation_steps
    if global_batch_size % dp_degree != 0:
        raise ConfigError(
            f"training.global_batch_size: {global_batch_size} is not divisible by the "
            f"data-parallel degree {dp_degree}; allowed: multiples of {dp_degree}"
        )
    per_rank = global_batch_size // dp_degree
    for accum in range(gradient_accumulation_steps, per_rank + 1):
        if per_rank % accum == 0 and per_rank // accum <= local_batch_size:
            return per_rank // accum, accum
    raise ConfigError(
        f"training.global_batch_size: {global_batch_size} sequences over {dp_degree} "
        f"data-parallel ranks leaves {per_rank} per rank, which no accumulation count >= "
        f"{gradient_accumulation_steps} splits into micro-batches of at most local_batch_size "
        f"({local_batch_size}); allowed: a global batch that is a multiple of {dp_degree}"
    )
