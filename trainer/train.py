"""Entry point: `python -m trainer.train --config RECIPE.toml [--section.key=value ...]`.

Also launched by torchrun (one process per device). The job, in order:
  1. config (TOML -> dataclasses -> CLI overrides -> validation)
  2. device, process group, seed, ParallelDims and the named DeviceMesh
  3. the task (trainer/tasks.py: LM tokens or FLUX latents) and its data, checked before
     anything touches a checkpoint
  4. model on the meta device -> parallelize (TP, EP, AC, compile, SimpleFSDP) -> materialize -> init
  5. optimizer, lr schedule, checkpoint resume (or initial weights)
  6. the loop: step (eager / compile / graph), log, validate, profile, checkpoint
Exit codes: 0 success, 2 bad input (one `error:` line, no traceback), 75 preempted (SIGTERM: a
checkpoint of the current step was written; relaunch to resume), 1 anything else.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

from models.errors import ConfigError
from trainer.config import Config, build_config, resolve_model_args, split_cli, to_toml
from trainer.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionHandler
from trainer.step import StepPlan, build_step, plan_step
from trainer.watchdog import StartupTimeout, StepWatchdog, arrival_barrier


class NonFiniteLoss(RuntimeError):
    pass


def _dtype(name: str) -> torch.dtype:
    """A concrete dtype name -> torch dtype; `auto` must have been resolved first
    (trainer.device.resolve_compute_dtype, once per run, before the model is built)."""
    assert name != "auto", "resolve mixed_precision_param = auto before building the model"
    from trainer.device import PROBE_DTYPES

    return PROBE_DTYPES[name]


def build_model(family, args, *, step_plan: StepPlan, parallel_dims, mesh, device: torch.device,
                param_dtype: torch.dtype, reduce_dtype: torch.dtype):
    """Meta device -> parallelize -> materialize -> init_weights."""
    from parallelisms import parallelize_model

    # 1. Build on meta: no memory is touched, whatever the flavor's size.
    with torch.device("meta"):
        model = family.model_cls(args)
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
    )
    # 3. Materialize the (sharded) parameters on the device, 4. initialize them.
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    return model


def _global_mean(t: torch.Tensor) -> float:
    """Mean of a per-rank scalar over all ranks (TP replicas hold equal values); a host sync."""
    t = t.detach().float().reshape(1).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


class NonFiniteTracker:
    """Non-finite gradient norms, tracked on the device so that steps need no host sync.

    The steps skip a non-finite update on the device (fused AdamW's `found_inf`, or the graph
    step's gated update), so weights stay finite. This records the first such step and the
    count; `read()` (a host sync) runs only on logged steps and before a checkpoint is written.
    The gradient norm is global (equal on every rank), so every rank reaches the same verdict.
    """

    def __init__(self, device: torch.device):
        self.first_bad_step = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, step: int, grad_norm: torch.Tensor) -> None:
        bad = ~torch.isfinite(grad_norm.detach())
        self.first_bad_step = torch.where(bad & (self.first_bad_step == 0), step, self.first_bad_step)
        self.skipped = self.skipped + bad.to(torch.int64)

    def read(self) -> tuple[int, int]:
        """(first step with a non-finite gradient norm or 0, number of skipped updates)."""
        return int(self.first_bad_step.item()), int(self.skipped.item())


def _validate(model, *, build_loader, prepare, loss_fn, steps: int, device: torch.device,
              step_plan: StepPlan) -> float:
    from trainer.step import local_scalar

    # A held-out split may hold fewer than `steps` micro-batches per rank; every rank gets the
    # same count (samples are dealt in groups of dp_degree x batch), so collectives stay matched.
    total, count = torch.zeros(()), 0
    with torch.no_grad(), step_plan.loss_context():
        for _, batch in zip(range(steps), build_loader()):
            loss = loss_fn(model, *(x.to(device) for x in prepare(batch)))
            total += local_scalar(loss).float().cpu()
            count += 1
    return _global_mean(total / max(count, 1))


def batch_split(*, global_batch_size: int, local_batch_size: int, gradient_accumulation_steps: int,
                dp_degree: int) -> tuple[int, int]:
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
        raise ConfigError(f"training.global_batch_size: {global_batch_size} is not divisible by the "
                          f"data-parallel degree {dp_degree}; allowed: multiples of {dp_degree}")
    per_rank = global_batch_size // dp_degree
    for accum in range(gradient_accumulation_steps, per_rank + 1):
        if per_rank % accum == 0 and per_rank // accum <= local_batch_size:
            return per_rank // accum, accum
    raise ConfigError(f"training.global_batch_size: {global_batch_size} sequences over {dp_degree} "
                      f"data-parallel ranks leaves {per_rank} per rank, which no accumulation count >= "
                      f"{gradient_accumulation_steps} splits into micro-batches of at most local_batch_size "
                      f"({local_batch_size}); allowed: a global batch that is a multiple of {dp_degree}")


def train(cfg: Config) -> int:
    import kernels
    from parallelisms import ParallelDims, build_mesh
    from trainer import checkpoint as ckpt
    from trainer.device import (configure_host_malloc, init_distributed, pick_device, resolve_compute_dtype,
                                set_seed)
    from trainer.flops import best_peak_flops, peak_flops_per_device
    from trainer.metrics import MetricsLogger
    from trainer.optim import build_lr_scheduler, build_optimizer
    from trainer.tasks import build_task

    t_start = time.perf_counter()
    device = pick_device(cfg.device.type)
    host_malloc = configure_host_malloc(cfg.device.host_malloc, device)  # before any large tensor
    info = init_distributed(device)
    set_seed(cfg.training.seed)
    is_rank0 = info.rank == 0
    dump_folder = cfg.job.dump_folder
    # `auto` compute dtype -> bfloat16 | float32, once, the same on every rank (rank 0 probes the
    # CPU and broadcasts); from here on the config holds the concrete dtype (also in config.toml).
    compute = resolve_compute_dtype(cfg.training.mixed_precision_param, device)
    cfg.training.mixed_precision_param = compute.name

    # -- model args, the task (tokenizer checks here), parallel degrees, the step plan: all
    #    checked before building anything
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    task = build_task(cfg, family=family, args=args)
    shape = args.shape()
    p = cfg.parallelism
    parallel_dims = ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        tp=p.tensor_parallel_degree,
        ep=p.expert_parallel_degree,
        world_size=info.world_size,
    )
    parallel_dims.validate_for_model(shape, seq_len=task.seq_len_check)
    c = cfg.compile
    step_plan = plan_step(mode=c.mode, backend=c.backend, scan_layers=c.scan_layers,
                          ac_mode=cfg.activation_checkpoint.mode, loss_parallel=p.enable_loss_parallel,
                          tp_enabled=parallel_dims.tp_enabled, device_type=device.type, shape=shape,
                          fused_loss=cfg.training.fused_loss,
                          model_has_hidden=callable(getattr(family.model_cls, "hidden", None)))
    mesh = build_mesh(parallel_dims, device.type)
    dp_rank, dp_degree = parallel_dims.dp_rank(mesh), parallel_dims.dp_degree
    t = cfg.training
    local_batch, accum = batch_split(global_batch_size=t.global_batch_size, local_batch_size=t.local_batch_size,
                                     gradient_accumulation_steps=t.gradient_accumulation_steps,
                                     dp_degree=dp_degree)

    # -- data: bad paths fail here, before any checkpoint is read or written
    def loader_for(split: str):
        return task.build_loader(split=split, local_batch_size=local_batch, dp_rank=dp_rank, dp_degree=dp_degree)

    loader = loader_for("train")
    build_val_loader = None
    if cfg.validation.enable:
        build_val_loader = lambda: loader_for("validation")  # noqa: E731
        build_val_loader().check(cfg.validation.steps)  # read what validation reads: bad data fails before step 1

    # -- kernels, model, optimizer, schedule
    param_dtype = compute.dtype
    attention = kernels.select(attention=cfg.model.attn_backend, device=device, dtype=param_dtype,
                               head_dim=shape.head_dim)
    model = build_model(family, args, step_plan=step_plan, parallel_dims=parallel_dims, mesh=mesh,
                        device=device, param_dtype=param_dtype, reduce_dtype=_dtype(t.mixed_precision_reduce))
    o = cfg.optimizer
    optimizer = build_optimizer(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    s = cfg.lr_scheduler
    scheduler = build_lr_scheduler(optimizer, total_steps=t.steps, warmup_steps=s.warmup_steps,
                                   decay_type=s.decay_type, decay_ratio=s.decay_ratio, min_lr_factor=s.min_lr_factor)

    # -- checkpoint: resume from the run's own newest checkpoint, else optional initial weights
    ck = cfg.checkpoint
    manager = ckpt.CheckpointManager(
        folder=os.path.join(dump_folder, ck.folder), interval=ck.interval, keep_latest_k=ck.keep_latest_k,
        async_mode=ck.async_mode, enable=ck.enable, load_step=ck.load_step, fallback_on_corrupt=ck.fallback_on_corrupt,
    )
    train_state = ckpt.TrainState()
    states = {
        "model": ckpt.ModelState(model),
        "optimizer": ckpt.OptimizerState(model, optimizer),
        "lr_scheduler": scheduler,
        "dataloader": loader,
        "train_state": train_state,
    }
    start_step = manager.load(states)
    if start_step == 0 and ck.initial_load_path:
        ckpt.load_initial(model, path=ck.initial_load_path, fmt=ck.initial_load_format,
                          hf_adapter=family.hf_adapter, args=args, hf_config_mismatch=ck.hf_config_mismatch)
    if start_step >= t.steps:
        if is_rank0:
            print(f"already trained to step {start_step} (training.steps = {t.steps}); nothing to do")
        return 0

    if is_rank0:
        os.makedirs(dump_folder, exist_ok=True)
        with open(os.path.join(dump_folder, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
    # Every rank is built and resumed: meet before the first compile, so that a rank stuck in
    # data, checkpoint or set-up work is named instead of the others hanging in a collective.
    arrival_barrier("before-first-step", t.startup_timeout_s)

    dump = os.path.join(dump_folder, c.dump_graph) if c.dump_graph else None
    loss_fn = task.loss_fn(step_plan)
    step_fn = build_step(step_plan, model=model, optimizer=optimizer, max_norm=t.max_norm,
                         aux_loss_coef=t.aux_loss_coef, grad_accum_steps=accum, model_plan=family.plan,
                         dump_graph=dump, loss_fn=loss_fn, bucket_cap_mb=c.bucket_cap_mb,
                         gloo_all_to_all=c.gloo_all_to_all)

    # -- metrics, per device: TP ranks share their dp rank's tokens / samples (TorchTitan's convention)
    peak, peak_name = peak_flops_per_device(device, param_dtype)
    best_peak = best_peak_flops(device, peak)
    units_per_step = local_batch * task.units_per_sample * accum / parallel_dims.non_data_parallel_size
    logger = MetricsLogger(dump_folder=dump_folder, log_freq=cfg.metrics.log_freq,
                           enable_tensorboard=cfg.metrics.enable_tensorboard, total_steps=t.steps,
                           is_rank0=is_rank0, start_step=start_step, device=device, unit=task.unit,
                           flops_per_token=task.flops_per_unit(), peak_flops=peak, peak_name=peak_name)
    units = {task.unit: units_per_step}
    loss_name = "rectified flow" if task.name == "flow" else ("fused" if step_plan.fused_loss else "plain")
    if is_rank0:
        print(f"titan-tpu: {cfg.model.name} {cfg.model.flavor} ({args.num_params() / 1e6:.1f}M params, "
              f"task {task.name}) on "
              f"{info.world_size} x {device.type} ({peak_name}); mesh {parallel_dims}; "
              f"global batch {local_batch * dp_degree * accum} = {local_batch} x dp {dp_degree} x accum {accum}; "
              f"compile.mode={c.mode}; attention {attention}; loss {loss_name}; steps {start_step + 1}..{t.steps}", flush=True)
        print(f"titan-tpu: compute dtype {compute.name} ({compute.reason})", flush=True)
        print(f"titan-tpu: host malloc {host_malloc}", flush=True)

    # -- the loop. Host syncs happen only on logged, validated and checkpointed steps (and for
    #    the profiler): elsewhere the device runs ahead of Python (docs/training.md).
    nonfinite = NonFiniteTracker(device)
    extra_first = {"setup_s": round(time.perf_counter() - t_start, 3)}
    if peak is not None:  # the peak MFU is taken against, and the best compute dtype's (CPU: may differ)
        extra_first.update(peak_tflops=peak / 1e12, peak_tflops_best=best_peak / 1e12)
    preemption = PreemptionHandler()
    watchdog = (StepWatchdog(folder=dump_folder, rank=info.rank, factor=t.hang_dump_factor, min_s=t.hang_dump_min_s)
                if t.hang_dump_factor > 0 else None)
    try:
        for step in range(start_step + 1, t.steps + 1):
            if watchdog is not None:
                watchdog.step_started(step)
            profiling = cfg.profiling.enable and step % cfg.profiling.freq == 0
            with _profile(profiling, os.path.join(dump_folder, cfg.profiling.folder), step, info.rank):
                # data_s: host time for the batches only; a copy to an accelerator can wait for
                # the steps still queued on it, which is not the loader's time.
                t_data = time.perf_counter()
                batches = [task.prepare(loader.next_batch()) for _ in range(accum)]
                data_s = time.perf_counter() - t_data
                microbatches = [tuple(x.to(device) for x in batch) for batch in batches]
                lr = scheduler.get_last_lr()[0]
                out = step_fn(microbatches, lr)
                scheduler.step()
            train_state.step = step
            nonfinite.update(step, out.grad_norm)
            if watchdog is not None:
                watchdog.step_finished()
            # SIGTERM (preemptible VMs, spot): every rank stops after this same step and saves it.
            preempted = preemption.requested()
            last = step == t.steps
            validating = build_val_loader is not None and (step % cfg.validation.freq == 0 or last)
            saving = manager.enable and (step % manager.interval == 0 or last or preempted)
            logging = logger.should_log(step) or validating
            if not (logging or saving):
                logger.log(step, data_s=data_s, **units)
                continue
            first_bad, skipped = nonfinite.read()
            if first_bad and not t.skip_nonfinite_updates:
                raise NonFiniteLoss(
                    f"non-finite gradient norm at step {first_bad} (its update was skipped; stopped at step "
                    f"{step}); the newest checkpoint (if any) in {manager.folder} is from before it. Lower "
                    "optimizer.lr and resume, or set training.skip_nonfinite_updates = true")
            if logging:
                values = {"loss": _global_mean(out.loss), "grad_norm": out.grad_norm, "lr": lr}
                if t.skip_nonfinite_updates:
                    values["skipped_updates"] = skipped
                if out.aux_loss is not None:
                    values["moe_aux_loss"] = _global_mean(out.aux_loss)
                if extra_first is not None:
                    if step_fn.compile_s is not None:
                        extra_first.update(compile_s=round(step_fn.compile_s, 3), graph_nodes=step_fn.graph_nodes)
                    values.update(extra_first)
                    extra_first = None
                if validating:
                    grid = task.sample_grid(model)
                    if grid is not None:
                        logger.log_image("samples", grid, step)
                    values["val_loss"] = _validate(model, build_loader=build_val_loader, prepare=task.prepare,
                                                   loss_fn=loss_fn, steps=cfg.validation.steps, device=device,
                                                   step_plan=step_plan)
                logger.log(step, force=True, data_s=data_s, **units, **values)
            else:  # a checkpoint-only step: checked above, nothing to log
                logger.log(step, data_s=data_s, **units)
            if saving:
                if not ckpt.all_finite(model, optimizer):
                    raise NonFiniteLoss(f"non-finite weights or optimizer state at step {step}; no checkpoint "
                                        f"written. The newest checkpoint (if any) is in {manager.folder}")
                manager.maybe_save(step, states, force=last or preempted)
            if preempted:  # `finally` below completes an async save before the process exits
                raise Preempted(step, manager.folder if manager.enable else "nowhere (checkpoint.enable = false)")
    finally:
        preemption.close()
        if watchdog is not None:
            watchdog.close()
        manager.close()
        logger.close()
    return 0


@contextlib.contextmanager
def _profile(enabled: bool, folder: str, step: int, rank: int):
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    os.makedirs(os.path.join(folder, f"step-{step}"), exist_ok=True)
    prof.export_chrome_trace(os.path.join(folder, f"step-{step}", f"rank{rank}_trace.json"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        recipe, print_config, overrides = split_cli(argv)
        cfg = build_config(recipe, overrides)
        if print_config:
            print(to_toml(cfg), end="")
            return 0
        return train(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Preempted as e:
        print(e, file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except StartupTimeout as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        from trainer.device import shutdown_distributed

        shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
