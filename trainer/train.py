"""Entry point: `python -m trainer.train --config RECIPE.toml [--section.key=value ...]`.

Also launched by torchrun (one process per device). The run, in order:
  1. config (TOML -> dataclasses -> CLI overrides -> validation; trainer/config/)
  2. `build_job` (trainer/job.py): device, process group, every rule checked, task, mesh, data,
     model (meta -> parallelize -> materialize -> init), optimizer, schedule, checkpoint manager
  3. resume from the run's newest checkpoint (or load initial weights), meet every rank
  4. the loop: step (eager / compile / graph), log, validate, profile, checkpoint
Exit codes: 0 success, 2 bad input (one `error:` line, no traceback), 75 preempted (SIGTERM: a
checkpoint of the current step was written; relaunch to resume) or a lost peer (a collective
failed: a host or slice is gone; relaunch to resume from the newest complete checkpoint tier),
1 anything else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import torch

from models.errors import ConfigError, NonFiniteLoss
from trainer import checkpoint as ckpt
from trainer.callbacks import CacheMisses, Callback, FirstLogKeys, MoEKeys, MTPKeys, NonFiniteCheck, Watchdog
from trainer.config import Config, build_config, split_cli, to_toml
from trainer.config.placeholders import check_checkpoint_folder
from trainer.job import Job, build_job
from trainer.runtime import (
    PREEMPTED_EXIT_CODE,
    MetricsLogger,
    Preempted,
    PreemptionHandler,
    StartupTimeout,
    StepWatchdog,
    arrival_barrier,
    best_peak_flops,
    cli,
    global_mean,
    lost_peer,
    peak_flops_per_device,
    shutdown_distributed,
)
from trainer.runtime.atomic import WriteFailed, atomic_file
from trainer.runtime.profiler import profile_step, profiler_plan
from trainer.runtime.runlock import release_all
from trainer.step import StepPlan, local_scalar


def _validate(model, *, build_loader, prepare, loss_fn, steps: int, device: torch.device, step_plan: StepPlan) -> float:
    # A held-out split may hold fewer than `steps` micro-batches per rank; every rank gets the
    # same count (samples are dealt in groups of dp_degree x batch), so collectives stay matched.
    total, count = torch.zeros(()), 0
    with torch.no_grad(), step_plan.loss_context():
        for _, batch in zip(range(steps), build_loader()):
            loss = loss_fn(model, *(x.to(device) for x in prepare(batch)))
            total += local_scalar(loss).float().cpu()
            count += 1
    return global_mean(total / max(count, 1))


def train(cfg: Config) -> int:
    check_checkpoint_folder(cfg.checkpoint)  # a pod recipe's gs://YOUR_BUCKET/..., before anything starts
    job = build_job(cfg, purpose="train")
    t, c, manager = cfg.training, cfg.compile, job.manager
    dump_folder, is_rank0, task, step_plan = cfg.job.dump_folder, job.is_rank0, job.data.task, job.plan.step_plan

    # -- resume from the run's own newest checkpoint, else optional initial weights
    train_state = ckpt.TrainState()
    states = ckpt.run_states(
        model=job.model,
        optimizer=job.optimizer,
        scheduler=job.scheduler,
        train_state=train_state,
        dataloader=job.data.loader,
    )
    start_step = manager.load(states)
    if start_step == 0:
        job.load_initial()
    if start_step >= t.steps:
        if is_rank0:
            print(f"already trained to step {start_step} (training.steps = {t.steps}); nothing to do")
        return 0

    if is_rank0:  # the resolved config, published whole (a failed write: WriteFailed naming the cause),
        # with the compute dtype the run resolved (`auto` -> job.runtime.compute) in a copy: cfg is the user's
        resolved = dataclasses.replace(
            cfg, training=dataclasses.replace(t, mixed_precision_param=job.runtime.compute.name)
        )
        with atomic_file(os.path.join(dump_folder, "config.toml"), what="config") as f:
            f.write(to_toml(resolved).encode("utf-8"))
    # Every rank is built and resumed: meet before the first compile, so that a rank stuck in
    # data, checkpoint or set-up work is named instead of the others hanging in a collective.
    arrival_barrier("before-first-step", t.startup_timeout_s)
    loss_fn = task.loss_fn(step_plan)
    step_fn = job.build_step(
        loss_fn=loss_fn, dump_graph=os.path.join(dump_folder, c.dump_graph) if c.dump_graph else None
    )
    # The peak MFU is taken against (on the CPU a measured probe, a collective: every rank).
    peak, peak_name = peak_flops_per_device(job.runtime.device, job.runtime.compute.dtype)
    if is_rank0:
        _banner(job, start_step, peak_name)
    return _loop(
        job,
        step_fn=step_fn,
        loss_fn=loss_fn,
        states=states,
        train_state=train_state,
        start_step=start_step,
        peak=peak,
        peak_name=peak_name,
    )


def _banner(job: Job, start_step: int, peak_name: str) -> None:
    cfg, task, accum = job.cfg, job.data.task, job.data.grad_accum_steps
    loss_name = "rectified flow" if task.name == "flow" else ("fused" if job.plan.step_plan.fused_loss else "plain")
    print(
        f"titan-tpu: {cfg.model.name} {cfg.model.flavor} ({job.plan.args.num_params() / 1e6:.1f}M params, "
        f"task {task.name}) on {job.runtime.dist.world_size} x {job.runtime.device.type} ({peak_name}); mesh {job.plan.parallel_dims}; "
        f"global batch {job.data.local_batch_size * job.data.dp_degree * accum} = {job.data.local_batch_size} x dp "
        f"{job.data.dp_degree} x accum {accum}; compile.mode={cfg.compile.mode}; attention {job.attention}; "
        f"loss {loss_name}; steps {start_step + 1}..{cfg.training.steps}",
        flush=True,
    )
    print(f"titan-tpu: compute dtype {job.runtime.compute.name} ({job.runtime.compute.reason})", flush=True)
    print(f"titan-tpu: host malloc {job.runtime.host_malloc}", flush=True)
    if cfg.moe.routing != "learned":  # throughput only: label the run (docs/moe.md#benchmark-routing)
        print(
            f"titan-tpu: MoE routing {cfg.moe.routing} (benchmark only: the experts are not the router's "
            "choice, so the loss is not a trained model's)",
            flush=True,
        )
    for line in job.runtime_notes:
        print(line, flush=True)


def _loop(
    job: Job, *, step_fn, loss_fn, states: dict, train_state, start_step: int, peak: float | None, peak_name: str
) -> int:
    """The steps: data -> step -> lr, then the log / validate / save decisions. Side concerns are
    callbacks (trainer/callbacks.py). Host syncs happen only on logged, validated and
    checkpointed steps (and for the profiler): elsewhere the device runs ahead of Python
    (docs/training.md)."""
    cfg, t, task, manager = job.cfg, job.cfg.training, job.data.task, job.manager
    logger = _metrics_logger(job, start_step=start_step, peak=peak, peak_name=peak_name)
    # -- throughput, per device: TP ranks share their dp rank's tokens / samples (TorchTitan's convention)
    units = {
        task.unit: job.data.local_batch_size
        * task.units_per_sample
        * job.data.grad_accum_steps
        / job.plan.parallel_dims.non_data_parallel_size
    }
    callbacks = _callbacks(job, step_fn=step_fn, start_step=start_step, peak=peak)
    if job.plan.step_plan.pipeline is not None:  # the held-out loss through the schedule's forward
        loss_fn = _pipeline_eval_loss(step_fn)
    validation = _Validation(job, loss_fn=loss_fn, logger=logger) if job.data.build_val_loader is not None else None
    preemption = PreemptionHandler()
    try:
        for step in range(start_step + 1, t.steps + 1):
            for cb in callbacks:
                cb.on_step_start(step)
            with _profile(cfg.profiling, job.cfg.job.dump_folder, step, job.runtime.dist.rank, job.runtime.device):
                microbatches, data_s = _next_microbatches(job)
                lr = job.scheduler.get_last_lr()[0]
                job.before_step(step)
                out = step_fn(microbatches, lr)
                job.scheduler.step()
            train_state.step = step
            for cb in callbacks:
                cb.on_step_end(step, out)
            # SIGTERM (preemptible VMs, spot): every rank stops after this same step and saves it.
            preempted = preemption.requested()
            last = step == t.steps
            validating = validation is not None and validation.due(step, last)
            saving = manager.enable and (step % manager.interval == 0 or last or preempted)
            saving_local = manager.local_due(step)
            logging = logger.should_log(step) or validating
            if not (logging or saving or saving_local):
                logger.log(step, data_s=data_s, **units)
                continue
            for cb in callbacks:
                cb.on_sync(step)
            if logging:
                values = {"loss": global_mean(out.loss), "grad_norm": out.grad_norm, "lr": lr}
                for cb in callbacks:
                    cb.on_log(step, out, values)
                if validating:
                    values.update(validation.run(step))
                values.update(manager.take_save_seconds())  # the saves since the last record
                logger.log(step, force=True, data_s=data_s, **units, **values)
            else:  # a checkpoint-only step: checked above, nothing to log
                logger.log(step, data_s=data_s, **units)
            if saving_local:  # first: the tier that survives a lost slice is the newest one
                _save(job, step, states, force=False, local=True)
            if saving:
                _save(job, step, states, force=last or preempted)
            if preempted:  # `finally` below completes an async save before the process exits
                raise Preempted(step, manager.folder if manager.enable else "nowhere (checkpoint.enable = false)")
    finally:
        preemption.close()
        for cb in callbacks:
            cb.close()
        manager.close()
        logger.close()
    return 0


def _metrics_logger(job: Job, *, start_step: int, peak: float | None, peak_name: str) -> MetricsLogger:
    cfg, task = job.cfg, job.data.task
    return MetricsLogger(
        dump_folder=cfg.job.dump_folder,
        log_freq=cfg.metrics.log_freq,
        enable_tensorboard=cfg.metrics.enable_tensorboard,
        total_steps=cfg.training.steps,
        is_rank0=job.is_rank0,
        start_step=start_step,
        device=job.runtime.device,
        unit=task.unit,
        flops_per_token=task.flops_per_unit(),
        peak_flops=peak,
        peak_name=peak_name,
    )


def _callbacks(job: Job, *, step_fn, start_step: int, peak: float | None) -> list[Callback]:
    """The loop's side concerns, in the order their hooks run (and their log keys appear)."""
    t, device = job.cfg.training, job.runtime.device
    best_peak = best_peak_flops(device, peak)
    callbacks = [
        NonFiniteCheck(device, start_step, skip=t.skip_nonfinite_updates, folder=job.manager.folder),
        CacheMisses(device.type, is_rank0=job.is_rank0),
    ]  # TPU: torch-tpu's compilation cache misses
    if t.hang_dump_factor > 0:
        callbacks.append(
            Watchdog(
                StepWatchdog(
                    folder=job.cfg.job.dump_folder,
                    rank=job.runtime.dist.rank,
                    factor=t.hang_dump_factor,
                    min_s=t.hang_dump_min_s,
                )
            )
        )
    return [
        *callbacks,
        MoEKeys(),
        MTPKeys(),
        FirstLogKeys(t_start=job.t_start, peak=peak, best_peak=best_peak, step_fn=step_fn, resumed=job.manager.resumed),
    ]


def _next_microbatches(job: Job) -> tuple[list[tuple[torch.Tensor, ...]], float]:
    """The step's micro-batches on the device, and `data_s`: host time for the batches only (a
    copy to an accelerator can wait for the steps still queued on it, which is not the loader's)."""
    t_data = time.perf_counter()
    batches = [job.data.task.prepare(job.data.loader.next_batch()) for _ in range(job.data.grad_accum_steps)]
    data_s = time.perf_counter() - t_data
    return [tuple(x.to(job.runtime.device) for x in batch) for batch in batches], data_s


def _pipeline_eval_loss(step_fn):
    """With pipeline parallelism a rank holds some layers only: the validation loss of a micro-batch
    runs through the schedule (`PipelineStep.eval_loss`), the same on every pp rank."""

    def loss(model, inputs, labels, *extra):  # extra: the shard's positions with context parallelism
        return step_fn.eval_loss(inputs, labels, *extra)

    return loss


class _Validation:
    """`[validation]`: every `freq` steps and at the last, the held-out loss (`val_loss`) and the
    task's sample grid (FLUX), on every rank."""

    def __init__(self, job: Job, *, loss_fn, logger: MetricsLogger):
        self.job, self.loss_fn, self.logger = job, loss_fn, logger

    def due(self, step: int, last: bool) -> bool:
        return step % self.job.cfg.validation.freq == 0 or last

    def run(self, step: int) -> dict[str, float]:
        job = self.job
        grid = job.data.task.sample_grid(job.model)
        if grid is not None:
            self.logger.log_image("samples", grid, step)
        return {
            "val_loss": _validate(
                job.model,
                build_loader=job.data.build_val_loader,
                prepare=job.data.task.prepare,
                loss_fn=self.loss_fn,
                steps=job.cfg.validation.steps,
                device=job.runtime.device,
                step_plan=job.plan.step_plan,
            )
        }


def _save(job: Job, step: int, states: dict, *, force: bool, local: bool = False) -> None:
    """A checkpoint of `step` (the persistent tier, or with `local` this rank's local tier), after
    checking every weight and optimizer state is finite."""
    if not ckpt.all_finite(job.model, job.optimizer):
        raise NonFiniteLoss(
            f"non-finite weights or optimizer state at step {step}; no checkpoint "
            f"written. The newest checkpoint (if any) is in {job.manager.folder}"
        )
    if local:
        job.manager.save_local(step, states)
    else:
        job.manager.maybe_save(step, states, force=force)


@contextlib.contextmanager
def _profile(profiling, dump_folder: str, step: int, rank: int, device: torch.device):
    """`[profiling]`: every `freq` steps, profile the step into `dump_folder/folder/step-N/`: a
    Chrome trace per rank on cpu/cuda, torch-tpu's XPlane file on a TPU
    (`trainer.runtime.profiler.profiler_plan`)."""
    if not (profiling.enable and step % profiling.freq == 0):
        yield
        return
    step_folder = os.path.join(dump_folder, profiling.folder, f"step-{step}")
    plan = profiler_plan(device.type, folder=step_folder, rank=rank, cuda=device.type == "cuda")
    with profile_step(plan, trace_path=os.path.join(step_folder, f"rank{rank}_trace.json")):
        yield


def _parser() -> cli.ArgumentParser:
    """The options, for `--help` only: `split_cli` parses the command line (a recipe key override
    is any `--section.key=value`, which argparse cannot declare)."""
    from dataclasses import fields

    sections = ", ".join(f.name for f in fields(Config))
    p = cli.ArgumentParser(
        prog="python -m trainer.train",
        description="Train a model from a TOML recipe (one process per device).",
        usage="%(prog)s --config RECIPE.toml [--print-config] [--section.key=value ...]",
        epilog="--section.key=value (or --section.key VALUE) overrides one recipe key, e.g. "
        f"--training.steps=10; sections: {sections}. Every key: docs/config.md. "
        "Several processes: torchrun --nproc_per_node=N -m trainer.train ... or "
        "python -m trainer.launch. Exit codes: 0 done, 2 bad input, 75 preempted "
        "(relaunch to resume), 130 interrupted (Ctrl-C), 1 anything else.",
    )
    p.add_argument("--config", metavar="RECIPE.toml", help="the TOML recipe (configs/*.toml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    try:
        recipe, print_config, overrides = split_cli(argv)
        cfg = build_config(recipe, overrides)
        if print_config:
            print(to_toml(cfg), end="")
            return 0
        return train(cfg)
    except ConfigError as e:
        release_all(undo=True)  # bad input: the run folder's lock file as it was found
        cli.error_line(str(e))
        return cli.BAD_INPUT_EXIT_CODE
    except NonFiniteLoss as e:
        cli.error_line(str(e))
        return 1
    except Preempted as e:
        cli.stderr_line(str(e))
        return PREEMPTED_EXIT_CODE
    except StartupTimeout as e:
        cli.error_line(str(e))
        return 1
    except (ckpt.CheckpointSaveError, WriteFailed) as e:  # disk full, file too large, permission
        cli.error_line(str(e))
        return 1
    except Exception as e:
        if not lost_peer(e):
            raise
        # A rank of another host or slice is gone (killed, host lost, slice lost): exit 75 like a
        # preemption, so that the launchers ask for a relaunch, which resumes from the newest
        # complete checkpoint tier (the local tier of the surviving slices, docs/checkpointing.md).
        cli.stderr_line(
            f"lost a peer: a collective failed ({ckpt.short_error(e)}); exit {PREEMPTED_EXIT_CODE}: relaunch "
            "(on the hosts left) to resume from the newest complete checkpoint tier"
        )
        return PREEMPTED_EXIT_CODE
    except KeyboardInterrupt:  # Ctrl-C (torchrun passes the launcher's SIGINT to every rank): one line a rank
        cli.interrupted_line("stopped; this step was not saved (a relaunch resumes from the newest checkpoint, if any)")
        return cli.INTERRUPTED_EXIT_CODE
    finally:
        release_all()
        shutdown_distributed()


if __name__ == "__main__":
    code = main()
    # Everything is written and the process groups are gone; skip interpreter finalization.
    # Under load a 2-rank gloo run with expert parallelism aborted there 1 time in ~800 test runs
    # ("terminate called without an active exception", SIGABRT after its last step): native
    # collective state torn down after Python's. Exiting here leaves nothing to tear down.
    sys.stdout.flush()
    sys.stderr.flush()
    from trainer.runtime.exit_status import record_exit_status  # read by python -m trainer.launch

    record_exit_status(code)
    os._exit(code)
