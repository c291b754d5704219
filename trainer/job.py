"""`build_job(cfg)`: everything a run needs, built once, in one order, for the trainer and the engine.

The phases, in order, each a function returning one object (the trainer's loop and the RL engine
both start here; nothing else builds a run). What a purpose needs is declared in `PURPOSES`
(`Purpose`: a task, data, saving, capture only, the caller's loss); the phases read its fields.
  1. `start_runtime`: device, host heap policy, the TPU runtime's flags and compilation cache
     (before the first device request), process group, run lock (training), seed, the compute
     dtype (`auto` resolved once; it travels as `Job.runtime.compute`, the config is never written)
  2. `plan_job` (trainer/job_plan.py): model args, parallel degrees and the step plan, checked
     against every rule (trainer/step/plan.py RULES) before anything is built; the recipe tests call
     `plan_job` alone at a recipe's declared world size, and the planner's search reads the
     same RULES through `refusals`
  3. `build_data`: the named DeviceMesh, the task (LM tokens or FLUX latents; the tokenizer is
     checked here; told the cp group at construction), the batch split, and (training) the data
     loaders: bad data fails before any checkpoint
  4. `choose_attention`: which attention the job asks for, at which kernel shapes (nothing
     registered)
  5. `serve_ops`: the op table filled, the one phase that writes it: every op's kernel for the
     device (`titan_kernels.select`), and context parallelism's attention (`apply_cp`)
  6. `build_job_model`: meta -> parallelize (TP, EP, CP, AC, compile, SimpleFSDP) ->
     materialize -> init_weights
  7. `build_optimization`: optimizer and lr schedule; 8. (training) `build_checkpoint_manager`
The caller then resumes or loads initial weights (`Job.load_initial`) and builds the step
(`Job.build_step`), which captures the graph on its first call in graph mode.

A third purpose, `check`, is the recipe check's (tools/recipe_check.py, scripts/check_recipe.py):
the same steps for a run on a target's devices, inside the process group its caller opened
(PyTorch's fake backend at the target's world size), with every tensor on the meta device: the
task is built (its tokenizer checked) but no data is read, the model is parallelized but never
materialized, there is no checkpoint manager, and compilers are replaced by `aot_eager` (the
step is captured, not compiled for the target: that is tools/tpu_compile.py, which serves the ops
with the TPU kernels' capture ops after this build and compiles the captured program). Every job
starts from a clean op table (`models.common.ops`, `serve_ops`): the recipe check builds many in
one process.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import titan_kernels
from models.common import ops
from models.common.moe import set_routing_key, use_capacity, use_routing
from models.errors import ConfigError
from parallelisms import ParallelDims, build_mesh, clip_grad_norm_, parallelize_model
from parallelisms.context_parallel import CPGroup, apply_cp, cp_group
from parallelisms.context_parallel_linear import apply_linear_cp
from parallelisms.device_order import RankOrder
from parallelisms.parallel_dims import pp_mesh
from parallelisms.pipeline_parallel import init_weights_as_whole, prune_model
from parallelisms.quantize import QuantizePlan
from parallelisms.replicate_reduce import ReplicateReducer
from trainer import checkpoint as ckpt
from trainer.config import Config
from trainer.job_plan import (  # step 2, and the names callers import from here
    JobPlan,
    batch_split,
    parallel_dims_of,
    pipeline_capable,
    plan_job,
    quantize_generation,
    rank_order_of,
    step_request,
)
from trainer.optim import build_lr_scheduler, build_optimizer_for
from trainer.optim.expert_balance import ExpertBalance
from trainer.runtime.device import (
    ComputeDtype,
    DistInfo,
    configure_host_malloc,
    cpu_backend,
    init_distributed,
    pick_device,
    resolve_compute_dtype,
    set_seed,
    torch_dtype,
)
from trainer.runtime.quiet import quiet_device_mesh_pickling
from trainer.runtime.runlock import lock_run, released_on_error
from trainer.runtime.storage import check_shared_folder, check_storage_paths, is_remote
from trainer.runtime.tpu_env import detect_generation, tpu_runtime_env
from trainer.runtime.watchdog import arrival_barrier
from trainer.step import EagerStep, StepPlan
from trainer.tasks import build_task

__all__ = [  # the phases and their results; step 2's names live in trainer/job_plan.py
    "AttentionChoice",
    "Job",
    "JobData",
    "JobPlan",
    "PURPOSES",
    "Purpose",
    "Runtime",
    "batch_split",
    "build_checkpoint_manager",
    "build_data",
    "build_job",
    "build_job_model",
    "build_model",
    "build_optimization",
    "choose_attention",
    "parallel_dims_of",
    "pipeline_capable",
    "plan_job",
    "quantize_generation",
    "rank_order_of",
    "serve_ops",
    "start_runtime",
    "step_request",
]


@dataclass(frozen=True)
class Purpose:
    """What a job is built for: the phases read these fields, never the purpose's name."""

    name: str
    has_task: bool = True
    """A task is built (its tokenizer checked); the engine's caller brings its own tokens and loss."""
    reads_data: bool = False
    """The train (and validation) loaders are built, and validation's data read, before step 1."""
    saves: bool = False
    """The run folders are locked and a checkpoint manager is built."""
    captures_only: bool = False
    """Meta tensors in the caller's (fake) process group, compilers replaced by `aot_eager`."""
    caller_loss: bool = False
    """The step runs its caller's loss on the logits (the step plan's rules read it)."""


PURPOSES = {
    "train": Purpose("train", reads_data=True, saves=True),
    "engine": Purpose("engine", has_task=False, caller_loss=True),
    "check": Purpose("check", captures_only=True),
}
"""`build_job`'s purposes: the training loop, the RL engine, the recipe check (module docstring)."""


def build_model(
    family,
    args,
    *,
    step_plan: StepPlan,
    parallel_dims,
    mesh,
    device: torch.device,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    moe_routing: str = "learned",
    moe_capacity_factor: float = 0.0,
    moe_dispatch_chunks: int = 1,
    quantize: QuantizePlan | None = None,
    replicate_reduce: str = "micro_batch",
):
    """Meta device -> parallelize -> materialize -> init_weights (`quantize`: `[quantize]`;
    `replicate_reduce`: `training.replicate_reduce`). With pipeline parallelism
    (`step_plan.pipeline`) the model is this pp rank's part: its blocks, the embedding on the first
    stage, the norm and head on the last (parallelisms/pipeline_parallel.py `prune_model`)."""
    # 1. Build on meta: no memory is touched, whatever the flavor's size. Benchmark routing
    #    (`[moe] routing`, allowed by the step plan's rules) is set on the model as built, so its
    #    `routing_key` buffers travel through the parallelisms like any buffer.
    with torch.device("meta"):
        model = family.model_cls(args)
    whole = None
    if step_plan.pipeline is not None:
        # 1b. Keep this pp rank's layers (names unchanged); `whole` (meta) replays the one-process init.
        whole = copy.deepcopy(model)
        pipe, pp_rank = step_plan.pipeline, pp_mesh(mesh).get_local_rank()
        first, last = pipe.rank_has_first_last(pp_rank)
        layers = pipe.rank_layers(args.shape().n_layers, pp_rank)
        prune_model(model, block=family.plan.block, layers=layers, first=first, last=last)
    if moe_routing != "learned":
        use_routing(model, moe_routing)
    if moe_capacity_factor > 0:  # the capacity-bounded dispatch (`[moe] capacity_factor`)
        use_capacity(model, moe_capacity_factor, chunks=moe_dispatch_chunks)
    # 2. Apply the model's plan: TP, EP, activation checkpointing, per-block compile, SimpleFSDP
    #    (the step plan says which AC and compile apply; the order is the same in every mode).
    model = parallelize_model(
        model,
        plan=family.plan,
        parallel_dims=parallel_dims,
        mesh=mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        ac_mode=step_plan.block_ac,
        compile_backend=step_plan.block_compile,
        enable_loss_parallel=step_plan.loss_parallel,
        quantize=quantize,
        replicate_reduce=replicate_reduce,
    )
    # 3. Materialize the (sharded) parameters on the device, 4. initialize them (a pipeline part
    #    with the values the whole model gets from the same seed: the trajectory is the mesh's own).
    model.to_empty(device=device)
    with torch.no_grad():
        if whole is None:
            model.init_weights(buffer_device=device)
        else:
            init_weights_as_whole(model, whole, device=device)
    model.train()
    return model


@dataclass
class Job:
    """A built run (see the module docstring): the phases' results, each held whole and read
    through (`job.runtime.device`, `job.plan.step_plan`, `job.data.loader`), never copied."""

    cfg: Config
    runtime: Runtime
    """Phase 1: device, heap policy, process group (`runtime.dist`), the resolved compute dtype
    (`runtime.compute`: the config keeps what the user wrote, e.g. `auto`)."""
    plan: JobPlan
    """Phase 2: the family, model args, parallel degrees and step plan."""
    data: JobData
    """Phase 3: the task (None for the engine, whose caller owns the data and the loss), the mesh,
    the batch split and the loaders (purpose "train"; `build_val_loader` with `[validation] enable`)."""
    attention: str
    """The banner's line on attention (`serve_ops`)."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    manager: ckpt.CheckpointManager | None = None
    """The run's checkpoint manager (purpose "train")."""
    t_start: float = 0.0
    runtime_notes: tuple[str, ...] = ()
    """Banner lines on the TPU runtime environment set at start-up (flags, compilation cache), or
    on the `[device]` / `[compile]` TPU settings not applied on this device, the mesh's TPU layout
    and what `[quantize]` picked."""

    @property
    def is_rank0(self) -> bool:
        return self.runtime.dist.rank == 0

    def load_initial(self) -> None:
        """`[checkpoint] initial_load_path` into the model (DCP or HF safetensors), if set."""
        ck = self.cfg.checkpoint
        if ck.initial_load_path:
            ckpt.load_initial(
                self.model,
                path=ck.initial_load_path,
                fmt=ck.initial_load_format,
                hf_adapter=self.plan.family.hf_adapter,
                args=self.plan.args,
                hf_config_mismatch=ck.hf_config_mismatch,
            )

    def before_step(self, step: int) -> None:
        """Per-step model state the step reads: the benchmark routing's key (`[moe] routing`
        random / balanced; nothing for learned routing). Rank `r`'s first token in the step's
        global batch is `r x local_batch_size x seq_len` (trainer/data/text.py's window order)."""
        if self.cfg.moe.routing != "learned":
            set_routing_key(
                self.model,
                seed=self.cfg.training.seed,
                step=step,
                first_token=self.data.dp_rank * self.data.local_batch_size * self.cfg.training.seq_len,
            )

    def build_step(self, *, loss_fn: Callable, dump_graph: str | None = None):
        """The step of this job's plan: `step(microbatches, lr) -> StepOutput`.

        A micro-batch is a tuple of tensors; `loss_fn(model, *micro_batch)` is its mean loss (the
        task's, `task.loss_fn(step_plan)`). Pipeline parallelism gets `PipelineStep` (the schedule
        computes the LM loss on the last stage); eager and compile modes `EagerStep`; graph mode
        the captured step (trainer/graph, loaded only then). A `check` job captures with
        `aot_eager` in place of the plan's compiler.
        """
        plan, c, t = self.plan.step_plan, self.cfg.compile, self.cfg.training
        passes_as = None
        if self.runtime.device.type == "meta":
            passes_as, plan = plan.backend, _capture_only(plan)
        balance = ExpertBalance(self.model, rate=t.expert_bias_rate) or None
        if plan.pipeline is not None and plan.mode != "graph":  # pp > 1: the schedule runs the micro-batches
            from trainer.step.pipeline import PipelineStep

            return PipelineStep(
                model=self.model,
                optimizer=self.optimizer,
                max_norm=t.max_norm,
                clip_grad_norm=clip_grad_norm_,
                pipeline=plan.pipeline,
                block=self.plan.family.plan.block,
                n_layers=self.plan.args.shape().n_layers,
                pp_mesh=pp_mesh(self.data.mesh),
                device=self.runtime.device,
                positions=(self.data.local_batch_size, t.seq_len) if self.plan.parallel_dims.tp_enabled else None,
                moe=self.plan.args.shape().num_experts > 0,
                aux_loss_coef=t.aux_loss_coef,
                # this rank's layers' (empty on a rank without MoE layers, which then joins the
                # other ranks' statistics with zeros: trainer/step/pipeline.py)
                balance=ExpertBalance(self.model, rate=t.expert_bias_rate),
                stage_mesh=self.data.mesh,
                moe_capacity=self.cfg.moe.capacity_factor > 0,
                cp=getattr(self.data.task, "cp", None),
                loss_parallel=plan.loss_parallel,
            )
        if plan.mode != "graph":
            # `training.replicate_reduce = "step"`: the dp_replicate mean once per step (falsy: none deferred).
            replicate = ReplicateReducer(self.model, dtype=torch_dtype(t.replicate_reduce_dtype)) or None
            return EagerStep(
                model=self.model,
                optimizer=self.optimizer,
                max_norm=t.max_norm,
                aux_loss_coef=t.aux_loss_coef,
                clip_grad_norm=clip_grad_norm_,
                loss_context=plan.loss_context,
                loss_fn=loss_fn,
                balance=balance,
                replicate=replicate,
            )
        from trainer.graph import build_graph_step

        pp = pp_mesh(self.data.mesh) if plan.pipeline is not None else None
        if pp is not None:  # graph mode: the pipeline inside the captured step (trainer/graph/pipeline.py)
            from trainer.graph.pipeline import PipelinedLoss

            moe = self.plan.args.shape().num_experts > 0
            if moe:  # this rank's layers' balance; a rank without MoE layers joins with zeros
                from trainer.optim.expert_balance import StageBalance

                balance = StageBalance(
                    ExpertBalance(self.model, rate=t.expert_bias_rate),
                    stage_mesh=self.data.mesh,
                    pp_group=pp.get_group(),
                    device=self.runtime.device,
                    capacity=self.cfg.moe.capacity_factor > 0,
                )
            loss_fn = PipelinedLoss(
                pp_rank=pp.get_local_rank(),
                pp=plan.pipeline.pp,
                group_name=pp.get_group().group_name,
                microbatches=plan.pipeline.microbatches,
                dim=self.plan.args.shape().dim,
                dtype=self.runtime.compute.dtype,
                device=self.runtime.device,
                fused=plan.fused_loss,
                scan=plan.pipeline.scan_iterations,
                moe=moe,
                cp=getattr(self.data.task, "cp", None),
            )
        step = build_graph_step(
            model=self.model,
            optimizer=self.optimizer,
            plan=self.plan.family.plan,
            max_norm=t.max_norm,
            aux_loss_coef=t.aux_loss_coef,
            backend=plan.backend,
            scan_layers=plan.scan,
            ac_mode=plan.scan_ac,
            dump_graph=dump_graph,
            grad_accum_steps=self.data.grad_accum_steps,
            loss_context=plan.loss_context,
            loss_fn=loss_fn,
            bucket_cap_mb=c.bucket_cap_mb,
            gloo_all_to_all=c.gloo_all_to_all,
            passes_as=passes_as,
            balance=balance,
            replicate_dtype=torch_dtype(t.replicate_reduce_dtype),
            pp_mesh=pp,
        )
        step.capture.offload = plan.scan_offload  # `[activation_checkpoint] offload` (a graph pass)
        return step


def _capture_only(plan: StepPlan) -> StepPlan:
    """`plan` with `aot_eager` wherever it compiles (a `check` job captures on meta tensors)."""
    return dataclasses.replace(
        plan, backend=plan.backend and "aot_eager", block_compile=plan.block_compile and "aot_eager"
    )


def build_job(cfg: Config, *, purpose: str = "train", device_type: str | None = None) -> Job:
    """Build the run of `cfg` (module docstring); `purpose`: train (the loop) | engine (RL) |
    check (the start-up of a run on `device_type` devices, on meta tensors, in the caller's
    process group). A training run's folder lock is released again if the build fails."""
    assert purpose in PURPOSES, purpose
    quiet_device_mesh_pickling()  # torch's warning on meshes of earlier jobs (trainer/runtime/quiet.py)
    why = PURPOSES[purpose]
    assert why.captures_only == (device_type is not None), "device_type is the check's target device type"
    with released_on_error():
        t_start = time.perf_counter()
        rt = start_runtime(cfg, why, device_type=device_type)
        plan = plan_job(cfg, world_size=rt.dist.world_size, device_type=rt.device_type, caller_loss=why.caller_loss)
        data = build_data(cfg, plan, rt, why)
        attention = serve_ops(choose_attention(cfg, plan, rt, data, why))
        model = build_job_model(cfg, plan, rt, data, why)
        optimizer, scheduler = build_optimization(cfg, model)
        manager = build_checkpoint_manager(cfg, plan.parallel_dims, rank=rt.dist.rank) if why.saves else None
        notes = (*rt.runtime_notes, *(plan.tpu_mesh.banner() if plan.tpu_mesh is not None else ()))
        if plan.quantize_census is not None:  # what [quantize] picked, beside what the recipe asked
            notes += (f"titan-tpu: {plan.quantize_census.line(cfg.quantize.recipe)}",)
        return Job(
            cfg=cfg,
            runtime=rt,
            plan=plan,
            data=data,
            attention=attention,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            manager=manager,
            t_start=t_start,
            runtime_notes=tuple(notes),
        )


@dataclass(frozen=True)
class Runtime:
    """Phase 1's result: where and how this process computes."""

    device: torch.device
    device_type: str
    """The device type the run is planned for (a check's target; else `device.type`)."""
    host_malloc: str
    runtime_notes: tuple[str, ...]
    dist: DistInfo
    compute: ComputeDtype
    order: RankOrder | None = None
    """Which launcher rank took which place of the mesh (None: the launcher's order, unchecked)."""


def start_runtime(cfg: Config, purpose: Purpose, *, device_type: str | None) -> Runtime:
    """Phase 1: device, heap policy (before any large tensor), the TPU runtime's environment,
    process group, run lock, seed, compute dtype (`auto` -> bfloat16 | float32 once, the same on
    every rank; it travels as `Job.runtime.compute`, the config keeps what the user wrote)."""
    if purpose.captures_only:
        assert torch.distributed.is_initialized(), "a check job runs in its caller's (fake) process group"
        device, host_malloc, notes = torch.device("meta"), "not applied (check)", ()
    else:
        device = pick_device(cfg.device.type)
        host_malloc = configure_host_malloc(cfg.device.host_malloc, device)
        device_type = device.type
        # XLA / libtpu flags and torch-tpu's compilation cache: set before the first device
        # request (the process group's), when the TPU runtime reads them (trainer/runtime/tpu_env.py).
        runtime_env = tpu_runtime_env(
            device_type=device_type,
            generation=detect_generation() if device_type == "tpu" else None,
            flag_bundle=cfg.device.flag_bundle,
            libtpu_init_args=cfg.device.libtpu_init_args,
            xla_flags=cfg.device.xla_flags,
            cache_dir=cfg.compile.cache_dir,
            host_cache=cfg.compile.host_cache,
        )
        runtime_env.apply()
        notes = tuple(runtime_env.notes)
    check_storage_paths(cfg)
    # The device order renumbers the processes (the mesh itself is always in rank order); a check
    # job's fake group is made by its caller (the recipe check reports the order itself).
    order = None
    if not purpose.captures_only and "WORLD_SIZE" in os.environ:
        order = rank_order_of(cfg, world_size=int(os.environ["WORLD_SIZE"]), device_type=device_type)
        if order.world_size > 1:
            notes = (*notes, f"titan-tpu: {order.summary()}")
    info = init_distributed(device, timeout_s=cfg.training.collective_timeout_s, order=order)
    # The first collective: a rank frozen before it is named within training.startup_timeout_s
    # (lock_run's broadcast would otherwise wait for the backend's default timeout).
    if not purpose.captures_only:  # a check job's (fake) process group has no store
        arrival_barrier("process-group", cfg.training.startup_timeout_s)
    if purpose.saves:
        _lock_run_folders(cfg)
        _lock_local_folder(cfg)
        if cfg.checkpoint.enable:
            check_shared_folder(
                _checkpoint_folder(cfg), key="checkpoint.folder", timeout_s=cfg.training.startup_timeout_s
            )
    set_seed(cfg.training.seed)
    compute = resolve_compute_dtype(cfg.training.mixed_precision_param, device_type)
    return Runtime(
        device=device,
        device_type=device_type,
        host_malloc=host_malloc,
        runtime_notes=notes,
        dist=info,
        compute=compute,
        order=order,
    )


def _checkpoint_folder(cfg: Config) -> str:
    """checkpoint.folder: a gs:// URL as it is, a local path under job.dump_folder."""
    ck = cfg.checkpoint.folder
    return ck if is_remote(ck) else os.path.join(cfg.job.dump_folder, ck)


def _lock_run_folders(cfg: Config) -> None:
    """One writer per run folder (trainer/runtime/runlock.py): rank 0 locks the dump folder (and a
    checkpoint folder outside it; one inside is checked against other runs' locks first, by its
    own key) and checks both are writable, before anything in them is read or written; a lock
    covers the folders below it; a refusal reaches every rank (exit 2)."""
    ck_folder = _checkpoint_folder(cfg)
    inside = not is_remote(ck_folder) and os.path.realpath(ck_folder).startswith(
        os.path.realpath(cfg.job.dump_folder) + os.sep
    )
    ck = [("checkpoint.folder", ck_folder)] if cfg.checkpoint.enable else []
    lock_run(
        locks=[("job.dump_folder", cfg.job.dump_folder), *([] if inside else ck)],
        claims=ck if inside else [],
        writable=ck,
    )


def _lock_local_folder(cfg: Config) -> None:
    """The local tier's folder is per host: the first process of each host (LOCAL_RANK 0) locks
    it (one run per host folder, as rank 0 does for the shared ones); a refusal on any host
    reaches every rank (exit 2). A collective."""
    ck = cfg.checkpoint
    if not (ck.enable and ck.local_folder):
        return
    import torch.distributed as dist

    from models.common import distributed
    from trainer.runtime.atomic import WriteFailed
    from trainer.runtime.runlock import RunLock

    problem = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            RunLock(ck.local_folder, key="checkpoint.local_folder").acquire()
        except (ConfigError, WriteFailed) as e:  # WriteFailed: a full disk under the lock file (exit 1)
            problem = (type(e) is WriteFailed, str(e))
    if distributed.multi_rank():
        on_cpu = dist.get_backend() in ("gloo", cpu_backend())
        group = dist.group.WORLD if on_cpu else dist.new_group(backend=cpu_backend())
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, problem, group=group)
        problem = next((p for p in every if p is not None), None)
        if not on_cpu:
            dist.destroy_process_group(group)
    if problem is not None:
        raise (WriteFailed if problem[0] else ConfigError)(problem[1])


@dataclass(frozen=True)
class JobData:
    """Phase 3's result: the task, the mesh, the batch split and the loaders."""

    task: Any
    mesh: Any
    cp: CPGroup | None
    """The context-parallel group (`cp > 1`), else None."""
    dp_rank: int
    dp_degree: int
    local_batch_size: int
    grad_accum_steps: int
    loader: Any = None
    build_val_loader: Callable[[], Any] | None = None


def build_data(cfg: Config, plan: JobPlan, rt: Runtime, purpose: Purpose) -> JobData:
    """Phase 3: the named mesh, the task (none for the engine, whose caller brings its own tokens
    and loss; told the cp group when the windows are split over context-parallel ranks), the
    batch split and (purpose `reads_data`) the loaders: bad data fails before any checkpoint."""
    mesh = build_mesh(
        plan.parallel_dims, "cpu" if purpose.captures_only else rt.device.type, target=cfg.job.target, order=rt.order
    )
    cp = cp_group(mesh["cp"]) if plan.parallel_dims.cp_enabled else None
    task = (
        build_task(
            cfg, family=plan.family, args=plan.args, step_plan=plan.step_plan, compute_dtype=rt.compute.dtype, cp=cp
        )
        if purpose.has_task
        else None
    )
    dp_rank, dp_degree = plan.parallel_dims.dp_rank(mesh), plan.parallel_dims.dp_degree
    t = cfg.training
    local_batch, accum = batch_split(
        global_batch_size=t.global_batch_size,
        local_batch_size=t.local_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        dp_degree=dp_degree,
    )
    loader = build_val_loader = None
    if purpose.reads_data:

        def loader_for(split: str):
            return task.build_loader(split=split, local_batch_size=local_batch, dp_rank=dp_rank, dp_degree=dp_degree)

        loader = loader_for("train")
        if cfg.validation.enable:
            build_val_loader = lambda: loader_for("validation")  # noqa: E731
            build_val_loader().check(cfg.validation.steps)  # read what validation reads, before step 1
    return JobData(
        task=task,
        mesh=mesh,
        cp=cp,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        local_batch_size=local_batch,
        grad_accum_steps=accum,
        loader=loader,
        build_val_loader=build_val_loader,
    )


@dataclass(frozen=True)
class AttentionChoice:
    """Phase 4's result: what serves this job's attention, decided without touching the op table."""

    backend: str
    """`[model] attn_backend` as asked (checked against the device)."""
    device: torch.device
    device_type: str
    """The device type the run is planned for (a check's target; else `device.type`)."""
    dtype: torch.dtype
    head_dim: int
    shapes: titan_kernels.KernelShapes | None
    """The widths the kernels are called at (their TPU self-check runs there); None for a check
    job, which captures with the ops' references."""
    cp: CPGroup | None
    """With context parallelism, the group whose attention serves `causal_attention`."""
    document_mask: bool
    """Calls carry segment ids (splash takes them; elsewhere SDPA with a block-diagonal mask)."""


def choose_attention(cfg: Config, plan: JobPlan, rt: Runtime, data: JobData, purpose: Purpose) -> AttentionChoice:
    """Phase 4: which attention this job asks for and at which shapes (no op is registered here:
    `serve_ops` does that). A check job captures with the ops' references (the TPU kernels are
    the compile's: tools/tpu_compile.py), so it only checks the backend against its target."""
    device_type, cp, dims = rt.device_type, data.cp, plan.parallel_dims
    shapes = None
    if purpose.captures_only:
        titan_kernels.check_attention_for(cfg.model.attn_backend, device_type)
    else:
        shapes = titan_kernels.KernelShapes.of(
            plan.args,
            cp=dims.cp,
            cp_rank=0 if cp is None else cp.rank,
            tokens=data.local_batch_size * cfg.training.seq_len // dims.cp,
        )
    return AttentionChoice(
        backend=cfg.model.attn_backend,
        device=rt.device,
        device_type=device_type,
        dtype=rt.compute.dtype,
        head_dim=plan.args.shape().head_dim,
        shapes=shapes,
        cp=cp,
        document_mask=plan.step_plan.document_mask,
    )


def serve_ops(choice: AttentionChoice) -> str:
    """Phase 5: the op table (`models.common.ops`) filled for this job, the one place a job writes
    it; returns the banner's line on attention.

    It starts clean: a previous job in this process (the recipe check runs many) may have served
    `causal_attention` with a closure bound to its own process group. `titan_kernels.select` then
    registers every op's kernel for the device (on TPU those passing their start-up self-check).
    With context parallelism `causal_attention` is served by the cp attention (k/v all-gathered
    over cp; the local product is splash with this rank's causal offsets on TPU, dense-mask SDPA
    elsewhere: `parallelisms.context_parallel.apply_cp`) in place of the kernel picked for a whole
    sequence, and the ops of linear attention that read earlier tokens (`causal_conv1d`,
    `segment_starts`, `gated_delta_rule` wrapping the kernel chosen) by
    `parallelisms.context_parallel_linear.apply_linear_cp`.
    """
    for op in ops.OPS + ops.SEQUENCE_OPS:
        ops.register(op, None)
    captured = choice.shapes is None
    if captured:
        attention = f"{choice.backend} on {choice.device_type} (captured with the references)"
    else:
        attention = titan_kernels.select(
            attention=choice.backend,
            device=choice.device,
            dtype=choice.dtype,
            head_dim=choice.head_dim,
            shapes=choice.shapes,
        )
    if choice.document_mask:  # calls with segment ids: splash takes them, the CPU kernel does not
        attention += (
            "; document mask: segment ids"
            if choice.device_type == "tpu"
            else "; document mask: SDPA with a block-diagonal causal mask"
        )
    if choice.cp is None:
        return attention
    line = apply_cp(choice.cp, choice.device_type, replacing=attention, references=captured)
    apply_linear_cp(choice.cp)  # linear attention's ops that read earlier tokens, the delta rule on the kernel chosen
    return line


def build_job_model(cfg: Config, plan: JobPlan, rt: Runtime, data: JobData, purpose: Purpose) -> torch.nn.Module:
    """Phase 6: the model, meta -> parallelize -> materialize -> init (`build_model`; a check job
    stays on meta and captures with `aot_eager`), with a defined benchmark-routing key."""
    t = cfg.training
    model = build_model(
        plan.family,
        plan.args,
        step_plan=_capture_only(plan.step_plan) if purpose.captures_only else plan.step_plan,
        parallel_dims=plan.parallel_dims,
        mesh=data.mesh,
        device=rt.device,
        param_dtype=rt.compute.dtype,
        reduce_dtype=torch_dtype(t.mixed_precision_reduce),
        moe_routing=cfg.moe.routing,
        moe_capacity_factor=cfg.moe.capacity_factor,
        moe_dispatch_chunks=cfg.moe.dispatch_chunks,
        quantize=QuantizePlan.of(cfg.quantize),
        replicate_reduce=t.replicate_reduce,
    )
    if cfg.moe.routing != "learned" and not purpose.captures_only:  # a defined key before any step sets it
        set_routing_key(model, seed=t.seed, step=0, first_token=data.dp_rank * data.local_batch_size * t.seq_len)
    return model


def build_optimization(cfg: Config, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """Phase 7: the optimizer and its lr schedule (over `training.steps` optimizer steps)."""
    o, s = cfg.optimizer, cfg.lr_scheduler
    optimizer = build_optimizer_for(
        model,
        name=o.name,
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
        muon_momentum=o.muon_momentum,
        muon_nesterov=o.muon_nesterov,
        muon_ns_steps=o.muon_ns_steps,
        muon_ns_dtype=o.muon_ns_dtype,
        muon_exclude=o.muon_exclude,
        qk_clip_tau=o.qk_clip_tau,
    )
    scheduler = build_lr_scheduler(
        optimizer,
        total_steps=cfg.training.steps,
        warmup_steps=s.warmup_steps,
        decay_type=s.decay_type,
        decay_ratio=s.decay_ratio,
        min_lr_factor=s.min_lr_factor,
    )
    return optimizer, scheduler


def build_checkpoint_manager(cfg: Config, parallel_dims: ParallelDims, *, rank: int) -> ckpt.CheckpointManager:
    """Phase 8 (purpose `saves`): the run's checkpoint manager, with the local tier
    (`checkpoint.local_folder`) placed by this rank's place inside its slice."""
    ck, dims = cfg.checkpoint, parallel_dims
    # The slices holding a whole replica each: the step plan's rule refused the rest (`RULES`).
    assert not (ck.enable and ck.local_folder and dims.dcn_mesh_shape[1] > 1), dims.dcn_mesh_shape
    ranks_per_slice = dims.world_size // dims.num_slices
    layout = ckpt.slice_layout(
        mesh_shape=dims.mesh_shape,
        dcn_mesh_shape=dims.dcn_mesh_shape,
        ep=dims.ep,
        world_size=dims.world_size,
        num_slices=dims.num_slices,
    )
    return ckpt.CheckpointManager(
        local_folder=ck.local_folder,
        local_interval=ck.local_interval,
        slice_rank=rank % ranks_per_slice,
        layout=layout,
        folder=_checkpoint_folder(cfg),
        interval=ck.interval,
        keep_latest_k=ck.keep_latest_k,
        async_mode=ck.async_mode,
        enable=ck.enable,
        load_step=ck.load_step,
        fallback_on_corrupt=ck.fallback_on_corrupt,
        entries_per_rank=dims.pp_enabled,
    )
