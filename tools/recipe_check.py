"""Would a recipe start on its target? The trainer's own start-up, on a fake world, without a TPU.

`check_recipe(path)` runs, for the recipe's `[job] target` (e.g. `v7x-512`: 512 devices of type
tpu) inside PyTorch's fake process group at that world size:
  1. `build_job(cfg, purpose="check")` (trainer/job.py): the config, model args, parallel
     degrees and the step plan checked against every rule (trainer/step/plan.py RULES), the
     task (its tokenizer), the named DeviceMesh, the batch split, the model on the meta device
     at full depth parallelized by the real plan (TP, EP, AC, SimpleFSDP), the optimizer;
  2. the step the trainer would build (`Job.build_step`), called once on a meta micro-batch of
     the recipe's shapes: in graph mode that is the whole capture (Dynamo, AOTAutograd, the
     graph passes, layer scan), with `aot_eager` in place of the target's compiler;
  3. the planner's per-device memory for the same plan and step plan (planner.plan_estimate),
     against the target's HBM.
A recipe without a target runs at the world its degrees multiply to, as a CPU run.

The rules are the trainer's: a refusal here is the `ConfigError` the trainer would raise, with
the key to change. `scripts/check_recipe.py` prints one row per recipe; tests/test_recipes.py
runs it over every recipe in configs/.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

import planner
from models.errors import ConfigError
from trainer.config import Config, build_config

GiB = planner.GiB


@dataclass
class RecipeCheck:
    """What `check_recipe` found for one recipe."""

    recipe: str
    target: str = "-"
    devices: int = 0
    mesh: str = "-"
    step: str = "-"
    """The step plan: mode, backend, scan, AC, loss."""
    planned_gib: float | None = None
    """The planner's per-device total (rank 0) for this plan."""
    hbm_gib: float | None = None
    """The usable HBM per device (after the planner's headroom); None for a CPU recipe."""
    capture: str = "-"
    """What the capture produced (graph nodes, collectives, scans) or the eager step's loss."""
    flips_gib: float | None = None
    """Bytes of `aten.flip` outputs in the captured graph (the scan backward's copies)."""
    planned_flips_gib: float | None = None
    seconds: float = 0.0
    error: str | None = None
    """The refusal (the trainer's `ConfigError`) or the failure; None: it would start."""
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        if self.planned_gib is None or self.hbm_gib is None:
            return None
        return self.planned_gib <= self.hbm_gib

    @property
    def ok(self) -> bool:
        return self.error is None and self.fits is not False


def world_of(cfg: Config) -> tuple[int, str, planner.Target | None]:
    """(devices, device type, target) a recipe declares: its `[job] target`, else the CPU world
    its explicit degrees multiply to."""
    if cfg.job.target:
        target = planner.parse_target(cfg.job.target)
        return target.devices, target.device_type, target
    p = cfg.parallelism
    degrees = (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.context_parallel_degree,
               p.tensor_parallel_degree)
    return math.prod(d for d in degrees if d > 0), "cpu", None


def plan_inputs(cfg: Config) -> planner.PlanInputs:
    """The planner's inputs for a recipe (model, batch, step settings), as scripts/estimate.py reads it."""
    from trainer.config import resolve_model_args
    from trainer.job import step_request

    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    t = cfg.training
    flow = None
    seq_len = t.seq_len
    if getattr(family, "task", "lm") == "flow":
        from planner.flux import flux_tokens

        flow = flux_tokens(cfg.flow)
        seq_len = sum(flow)
    return planner.PlanInputs(family=family, args=args, model_name=f"{cfg.model.name} {cfg.model.flavor}",
                              seq_len=seq_len, local_batch_size=t.local_batch_size,
                              grad_accum=t.gradient_accumulation_steps, flow_tokens=flow,
                              step=step_request(cfg, family))


def planned(cfg: Config, target: planner.Target, *, headroom: float = 0.1) -> planner.Estimate:
    """The planner's estimate of the recipe's own plan on `target`."""
    p = cfg.parallelism
    return planner.plan_estimate(
        plan_inputs(cfg), target, dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
        tp=p.tensor_parallel_degree, ep=p.expert_parallel_degree, cp=p.context_parallel_degree,
        ac_mode=cfg.activation_checkpoint.mode,
        loss_parallel=p.enable_loss_parallel, headroom=headroom)


def _step_summary(plan) -> str:
    parts = [plan.mode]
    if plan.backend:
        parts.append(plan.backend)
    if plan.scan:
        parts.append(f"scan (AC {plan.scan_ac})")
    elif plan.block_ac != "none":
        parts.append(f"AC {plan.block_ac}")
    parts.append("fused loss" if plan.fused_loss else "loss parallel" if plan.loss_parallel else "plain loss")
    return ", ".join(parts)


def _mesh_summary(dims) -> str:
    axes = [f"{name} {size}" for name, size in (("dp_rep", dims.dp_replicate), ("fsdp", dims.dp_shard),
                                                  ("cp", dims.cp), ("tp", dims.tp), ("ep", dims.ep)) if size > 1]
    return " x ".join(axes) or "1"


def _flip_bytes(graph_module) -> int:
    total = 0
    for node in graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.flip.default):
        val = node.meta.get("val")
        if val is not None:
            total += val.numel() * val.element_size()
    return total


def _with_tokenizer(cfg: Config, report: RecipeCheck) -> Config:
    """Pod recipes name a tokenizer file their user supplies (Llama 3's and Qwen's are not shipped):
    when it is absent here the start-up goes on with the bundled one, and the row says so."""
    path = cfg.model.tokenizer
    if path != "bundled" and not os.path.exists(path):
        report.notes.append(f"model.tokenizer {path} is not here (user-supplied): checked with the bundled one")
        cfg.model.tokenizer = "bundled"
    return cfg


def start_up(cfg: Config, *, devices: int, device_type: str, report: RecipeCheck) -> None:
    """The trainer's start-up of `cfg` on `devices` fake ranks of `device_type` (module docstring)."""
    import torch._dynamo

    from models.common.stack import abstract_model
    from trainer.job import build_job

    torch._dynamo.reset()
    with planner.fake_process_group(devices), abstract_model():
        job = build_job(cfg, purpose="check", device_type=device_type)
        report.mesh = _mesh_summary(job.parallel_dims)
        report.step = _step_summary(job.step_plan)
        step = job.build_step(loss_fn=job.task.loss_fn(job.step_plan))
        batch = job.task.example_batch(job.local_batch_size, device=job.device)
        out = step([batch] * job.grad_accum_steps, job.cfg.optimizer.lr)
        graph_module = getattr(step, "graph_module", None)
        if graph_module is not None:
            stats = step.stats
            report.capture = (f"{stats.nodes} nodes, {sum(stats.collectives.values())} collectives, "
                              f"{stats.scans} scans")
            report.flips_gib = _flip_bytes(graph_module) / GiB
        else:
            report.capture = f"eager step, loss {tuple(out.loss.shape)} on {out.loss.device.type}"
    torch._dynamo.reset()


def check_recipe(path: str, *, capture: bool = True, overrides=()) -> RecipeCheck:
    """Check one recipe (module docstring); never raises for the recipe's own faults."""
    t0 = time.perf_counter()
    report = RecipeCheck(recipe=path)
    try:
        cfg = build_config(path, list(overrides))
        devices, device_type, target = world_of(cfg)
        report.devices = devices
        report.target = target.name if target else f"cpu-{devices}"
        if target is not None:
            est = planned(cfg, target)
            report.planned_gib = est.total / GiB
            report.hbm_gib = est.usable / GiB
            report.planned_flips_gib = est.scan_flips / GiB if est.scan_flips else None
        if capture:  # after the planner: the start-up resolves `auto` settings in `cfg`
            start_up(_with_tokenizer(cfg, report), devices=devices, device_type=device_type, report=report)
        else:
            from trainer.job import plan_job

            plan = plan_job(cfg, world_size=devices, device_type=device_type)
            report.mesh = _mesh_summary(plan.parallel_dims)
            report.step = _step_summary(plan.step_plan)
    except ConfigError as e:
        report.error = str(e)
    except Exception as e:  # noqa: BLE001  (a check reports every failure as a row)
        report.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    report.seconds = time.perf_counter() - t0
    return report
