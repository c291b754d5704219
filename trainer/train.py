"""Entry point: `python -m trainer.train --config RECIPE.toml [--section.key=value ...]`.

Also launched by torchrun (one process per device). The job, in order:
  1. config (TOML -> dataclasses -> CLI overrides -> validation)
  2. device, process group, seed, ParallelDims and the named DeviceMesh
  3. tokenizer and data (checked before anything touches a checkpoint)
  4. model on the meta device -> parallelize (TP, EP, AC, compile, SimpleFSDP) -> materialize -> init
  5. optimizer, lr schedule, checkpoint resume (or initial weights)
  6. the loop: step (eager / compile / graph), log, validate, profile, checkpoint
Exit codes: 0 success, 2 bad input (one `error:` line, no traceback), 1 anything else.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time

import torch
import torch.distributed as dist

from trainer.config import Config, build_config, resolve_model_args, split_cli, to_toml
from models.errors import ConfigError


class NonFiniteLoss(RuntimeError):
    pass


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def build_model(family, args, *, cfg: Config, parallel_dims, mesh, device: torch.device):
    """Meta device -> parallelize -> materialize -> init_weights."""
    from parallelisms import parallelize_model

    # 1. Build on meta: no memory is touched, whatever the flavor's size.
    with torch.device("meta"):
        model = family.model_cls(args)
    # 2. Apply the model's plan: TP, EP, activation checkpointing, per-block compile, SimpleFSDP.
    plan = importlib.import_module(family.plan_module_name).PLAN
    compile_backend = None
    if cfg.compile.mode == "compile":
        compile_backend = resolve_backend(cfg.compile.backend, device)
    model = parallelize_model(
        model,
        plan=plan,
        parallel_dims=parallel_dims,
        mesh=mesh,
        param_dtype=_dtype(cfg.training.mixed_precision_param),
        reduce_dtype=_dtype(cfg.training.mixed_precision_reduce),
        ac_mode=cfg.activation_checkpoint.mode if cfg.compile.mode != "graph" else "none",
        compile_backend=compile_backend,
        enable_loss_parallel=cfg.parallelism.enable_loss_parallel,
    )
    # 3. Materialize the (sharded) parameters on the device, 4. initialize them.
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    return model, plan


def prepare_attention(backend: str, device: torch.device) -> str:
    """Build the CPU attention kernel before any step or trace needs it; describe the choice for the banner."""
    if backend == "cpu_kernel" and device.type != "cpu":
        raise ConfigError(f"model.attn_backend: cpu_kernel runs on the CPU only, not on {device.type}; "
                          "allowed here: auto, sdpa")
    if device.type != "cpu" or backend == "sdpa":
        return "sdpa"
    from models.common import cpu_attention

    if cpu_attention.load():
        return f"{backend} (cpu kernel loaded; sdpa where it does not apply)" if backend == "auto" else backend
    if backend == "cpu_kernel":
        raise ConfigError(f"model.attn_backend: cpu_kernel cannot be built here ({cpu_attention.load_error()}); "
                          "allowed: auto, sdpa")
    return f"sdpa (cpu kernel unavailable: {cpu_attention.load_error()})"


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "tpu" if device.type == "tpu" else "inductor"
    if backend == "tpu" and device.type != "tpu":
        raise ConfigError("compile.backend: tpu needs a TPU device; allowed here: auto, inductor, aot_eager, eager")
    return backend


def loss_context(loss_parallel: bool):
    from parallelisms import loss_parallel_context

    return loss_parallel_context(loss_parallel)


def build_step(model, optimizer, *, cfg: Config, plan, device: torch.device, dump_folder: str,
               loss_parallel: bool):
    from parallelisms import clip_grad_norm_
    from trainer.step import EagerStep

    if cfg.compile.mode != "graph":
        return EagerStep(model=model, optimizer=optimizer, max_norm=cfg.training.max_norm,
                         aux_loss_coef=cfg.training.aux_loss_coef, clip_grad_norm=clip_grad_norm_,
                         loss_context=lambda: loss_context(loss_parallel))
    from trainer.graph import build_graph_step

    dump = os.path.join(dump_folder, cfg.compile.dump_graph) if cfg.compile.dump_graph else None
    return build_graph_step(
        model=model,
        optimizer=optimizer,
        plan=plan,
        max_norm=cfg.training.max_norm,
        aux_loss_coef=cfg.training.aux_loss_coef,
        backend=resolve_backend(cfg.compile.backend, device),
        scan_layers=cfg.compile.scan_layers,
        ac_mode=cfg.activation_checkpoint.mode,
        dump_graph=dump,
        grad_accum_steps=cfg.training.gradient_accumulation_steps,
    )


def _global_mean(t: torch.Tensor) -> float:
    """Mean of a per-rank scalar over all ranks (TP replicas hold equal values)."""
    t = t.detach().float().reshape(1).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def _validate(model, *, build_loader, steps: int, device: torch.device, loss_parallel: bool) -> float:
    from trainer.step import lm_loss, local_scalar

    # A held-out split may hold fewer than `steps` micro-batches per rank; every rank gets the
    # same count (windows are dealt in groups of dp_degree x batch), so collectives stay matched.
    total, count = torch.zeros(()), 0
    with torch.no_grad(), loss_context(loss_parallel):
        for _, (inputs, labels) in zip(range(steps), build_loader()):
            loss = lm_loss(model(inputs.to(device)), labels.to(device))
            total += local_scalar(loss).float().cpu()
            count += 1
    return _global_mean(total / max(count, 1))


def train(cfg: Config) -> int:
    from parallelisms import ParallelDims, build_mesh
    from trainer import checkpoint as ckpt
    from trainer.data import build_dataloader
    from trainer.device import init_distributed, pick_device, set_seed
    from trainer.flops import flops_per_token, peak_flops_per_device
    from trainer.metrics import MetricsLogger
    from trainer.optim import build_lr_scheduler, build_optimizer
    from trainer.tokenizer import build_tokenizer

    t_start = time.perf_counter()
    device = pick_device(cfg.device.type)
    info = init_distributed(device)
    set_seed(cfg.training.seed)
    is_rank0 = info.rank == 0
    dump_folder = cfg.job.dump_folder

    # -- model args, parallel degrees (checked against the model before building anything)
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    p = cfg.parallelism
    parallel_dims = ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        tp=p.tensor_parallel_degree,
        ep=p.expert_parallel_degree,
        world_size=info.world_size,
    )
    parallel_dims.validate_for_model(args, seq_len=cfg.training.seq_len)
    mesh = build_mesh(parallel_dims, device.type)
    dp_rank, dp_degree = parallel_dims.dp_rank(mesh), parallel_dims.dp_degree

    # -- tokenizer and data: bad paths fail here, before any checkpoint is read or written
    tokenizer = build_tokenizer(cfg.model.tokenizer)
    if tokenizer.n_vocab > args.vocab_size:
        raise ConfigError(
            f"model.tokenizer: {cfg.model.tokenizer} has {tokenizer.n_vocab} tokens but the model's "
            f"vocab_size is {args.vocab_size}; set model.vocab_size >= {tokenizer.n_vocab}"
        )

    def loader_for(dataset: str, split: str, seed: int):
        return build_dataloader(
            dataset=dataset, tokenizer=tokenizer, seq_len=cfg.training.seq_len,
            local_batch_size=cfg.training.local_batch_size, dp_rank=dp_rank, dp_degree=dp_degree,
            seed=seed, split=split, text_field=cfg.training.dataset_text_field,
        )

    loader = loader_for(cfg.training.dataset, "train", cfg.training.seed)
    build_val_loader = None
    if cfg.validation.enable:
        build_val_loader = lambda: loader_for(cfg.validation.dataset, "validation", cfg.training.seed)  # noqa: E731
        build_val_loader().check(cfg.validation.steps)  # read what validation reads: bad data fails before step 1

    # -- model, optimizer, schedule
    attention = prepare_attention(args.attn_backend, device)
    model, plan = build_model(family, args, cfg=cfg, parallel_dims=parallel_dims, mesh=mesh, device=device)
    o = cfg.optimizer
    optimizer = build_optimizer(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    s = cfg.lr_scheduler
    scheduler = build_lr_scheduler(optimizer, total_steps=cfg.training.steps, warmup_steps=s.warmup_steps,
                                   decay_type=s.decay_type, decay_ratio=s.decay_ratio, min_lr_factor=s.min_lr_factor)

    # -- checkpoint: resume from the run's own newest checkpoint, else optional initial weights
    c = cfg.checkpoint
    manager = ckpt.CheckpointManager(
        folder=os.path.join(dump_folder, c.folder), interval=c.interval, keep_latest_k=c.keep_latest_k,
        async_mode=c.async_mode, enable=c.enable, load_step=c.load_step, fallback_on_corrupt=c.fallback_on_corrupt,
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
    if start_step == 0 and c.initial_load_path:
        ckpt.load_initial(model, path=c.initial_load_path, fmt=c.initial_load_format,
                          hf_adapter=family.hf_adapter, args=args, hf_config_mismatch=c.hf_config_mismatch)
    if start_step >= cfg.training.steps:
        if is_rank0:
            print(f"already trained to step {start_step} (training.steps = {cfg.training.steps}); nothing to do")
        return 0

    if is_rank0:
        os.makedirs(dump_folder, exist_ok=True)
        with open(os.path.join(dump_folder, "config.toml"), "w") as f:
            f.write(to_toml(cfg))

    loss_parallel = cfg.parallelism.enable_loss_parallel and parallel_dims.tp_enabled
    step_fn = build_step(model, optimizer, cfg=cfg, plan=plan, device=device, dump_folder=dump_folder,
                         loss_parallel=loss_parallel)

    # -- metrics
    num_matmul = args.num_active_params(exclude_embedding=True) if hasattr(args, "num_active_params") \
        else args.num_params(exclude_embedding=True)
    fpt = flops_per_token(num_matmul_params=num_matmul, n_layers=args.n_layers, n_heads=args.n_heads,
                          head_dim=args.head_dim, seq_len=cfg.training.seq_len)
    peak, peak_name = peak_flops_per_device(device, _dtype(cfg.training.mixed_precision_param))
    # Per device: TP ranks share their dp rank's tokens (TorchTitan's convention).
    tokens_per_step = (cfg.training.local_batch_size * cfg.training.seq_len
                       * cfg.training.gradient_accumulation_steps / parallel_dims.non_data_parallel_size)
    logger = MetricsLogger(dump_folder=dump_folder, log_freq=cfg.metrics.log_freq,
                           enable_tensorboard=cfg.metrics.enable_tensorboard, total_steps=cfg.training.steps,
                           is_rank0=is_rank0, start_step=start_step, device=device,
                           dtype=_dtype(cfg.training.mixed_precision_param))
    logger.set_flops(flops_per_token=fpt, peak_flops=peak, peak_name=peak_name)
    if is_rank0:
        n_params = args.num_params()
        print(f"titan-tpu: {cfg.model.name} {cfg.model.flavor} ({n_params / 1e6:.1f}M params) on "
              f"{info.world_size} x {device.type} ({peak_name}); mesh {parallel_dims}; "
              f"compile.mode={cfg.compile.mode}; attention {attention}; steps {start_step + 1}..{cfg.training.steps}", flush=True)

    # -- the loop
    accum = cfg.training.gradient_accumulation_steps
    extra_first = {"setup_s": round(time.perf_counter() - t_start, 3)}
    try:
        for step in range(start_step + 1, cfg.training.steps + 1):
            profiling = cfg.profiling.enable and step % cfg.profiling.freq == 0
            with _profile(profiling, os.path.join(dump_folder, cfg.profiling.folder), step, info.rank):
                microbatches = [tuple(t.to(device) for t in loader.next_batch()) for _ in range(accum)]
                lr = scheduler.get_last_lr()[0]
                loss, grad_norm = step_fn(microbatches, lr)
                scheduler.step()
            train_state.step = step
            loss_value = _global_mean(loss)
            if not torch.isfinite(torch.tensor(loss_value)):
                raise NonFiniteLoss(
                    f"non-finite loss ({loss_value}) at step {step}; stopping. The newest checkpoint "
                    f"(if any) is left untouched in {manager.folder}"
                )
            values = {"loss": loss_value, "grad_norm": float(grad_norm), "lr": lr}
            aux = getattr(step_fn, "last_aux_loss", None)
            if aux is not None:
                values["moe_aux_loss"] = _global_mean(aux)
            if step_fn.compile_s is not None and extra_first is not None:
                extra_first.update(compile_s=round(step_fn.compile_s, 3), graph_nodes=step_fn.graph_nodes)
            if extra_first is not None:
                values.update(extra_first)
                extra_first = None
            if build_val_loader is not None and (step % cfg.validation.freq == 0 or step == cfg.training.steps):
                values["val_loss"] = _validate(model, build_loader=build_val_loader, steps=cfg.validation.steps,
                                               device=device, loss_parallel=loss_parallel)
            logger.log(step, tokens=tokens_per_step, **values)
            manager.maybe_save(step, states, force=step == cfg.training.steps)
    finally:
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
    finally:
        from trainer.device import shutdown_distributed

        shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
