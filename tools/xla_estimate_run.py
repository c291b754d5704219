"""The outer process of scripts/estimate_xla.py (the project venv): the recipe's target and plan,
the planner's estimate, the worker's spec and launch, and the verdict printed beside the planner's.

- `estimate(ns, argv)`: the whole check for the command line's namespace `ns` (the script's flags)
  and the recipe's `--config` / `--section.key=value` arguments `argv`; the exit status;
- `expert_parallel_program`: an EP recipe compiled as the trainer's own per-device program
  (tools/tpu_compile.py), not the FSDP approximation;
- `worker_spec` / `compile_in_worker`: what the worker (tools/xla_estimate.py, in the `ttpu` venv)
  builds, and its launch with the deviceless environment (tools/deviceless_env.py);
- `outcome` / `failed`: the `--json` line every outcome ends with.

The reports are tools/xla_estimate_report.py's; the flags and their help scripts/estimate_xla.py's.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from models.errors import ConfigError
from tools.deviceless_env import deviceless_env
from tools.tpu_compile import recipe_flag_env, worker_failure
from tools.xla_estimate_report import (
    GIB,
    compiler_total,
    csv_row,
    discrepancies,
    format_table,
    oom_verdict,
    verdict_line,
    write_csv_row,
)

ROOT = Path(__file__).resolve().parents[1]


def topology_name(target) -> str:
    """The jax topology name of a planner Target (e.g. v6e-16 -> v6e:4x4, v7x-8 -> tpu7x:2x2x1)."""
    from tools.tpu_compile import topology_name as of_target

    return of_target(target, key="--target")


def estimate(ns, argv: list[str]) -> int:
    """The check of `argv`'s recipe (`--config PATH`, `--section.key=value`) with the script's flags
    `ns` (module docstring): 0 compiled (fits or not), 1 the compile failed; ConfigError on bad input."""
    from trainer.config import build_config, resolve_model_args, split_cli

    recipe, _, overrides = split_cli(argv)
    cfg = build_config(recipe, overrides)
    target = recipe_target(cfg, ns.target)
    topology = ns.topology or topology_name(target)
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    if getattr(family, "task", "lm") != "lm":
        raise ConfigError(
            f"model.name: {cfg.model.name} (task {family.task}): the compile check captures the "
            "LM step only; FLUX recipes are not supported; allowed: a language-model recipe"
        )
    inputs, est, step_plan = planner_estimate(cfg, family, args, target)
    if est.ep > 1 and not ns.fsdp_approximation:
        return expert_parallel_program(recipe, overrides, ns, target, est)
    approximated = approximations(est, args, target)
    spec = worker_spec(cfg, args, step_plan, ns=ns, target=target, topology=topology)
    print(
        f"{inputs.model_name} on {target.name} ({target.devices} devices, {target.chips} chips), "
        f"{args.shape().n_layers} layers\ncompiling for {topology} (deviceless) ...",
        flush=True,
    )
    about = dict(target=target.name, topology=topology, tokens_per_device_step=est.tokens_per_device_step)
    try:
        flags = recipe_flag_env(cfg, target.generation.name)  # the run's bundle < recipe < environment
        proc, wall = compile_in_worker(spec, topology, flags=flags, timeout=ns.timeout)
    except subprocess.TimeoutExpired:
        return failed(ns, f"the compile took longer than {ns.timeout:.0f} s", about)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"compile worker exited {proc.returncode} after {wall:.0f} s:\n{proc.stderr[-6000:]}", file=sys.stderr)
        return failed(ns, f"compile worker: {worker_failure(proc.stderr, proc.returncode)}", about)
    res = json.loads(lines[-1])
    res.update(wall_s=wall, n_layers=args.shape().n_layers, approximated=approximated, topology=topology)
    if res.get("oom"):
        print(oom_verdict(est, res))
        for note in approximated:
            print(f"approximated: {note}")
        oom = res["oom"]
        reason = (
            f"the compiler refused the program (CompileTimeHbmOom): {oom['required'] / GIB:.2f} GiB of "
            f"temporaries for {oom['available'] / GIB:.2f} GiB available"
        )
        return outcome(ns, "does not fit", reason, {**res, **about}, code=0)
    print(format_table(est, res, step_plan))
    print(verdict_line(est, res))
    for line in discrepancies(est, res):
        print(f"planner vs compiler: {line}")
    if ns.csv:
        write_csv_row(ns.csv, csv_row(recipe, est, res, step_plan))
    total, hbm = compiler_total(res), est.target.hbm_bytes
    word = "fits" if total <= hbm else "does not fit"
    reason = None if word == "fits" else f"{total / GIB:.2f} GiB of {hbm / GIB:.1f} GiB HBM per device"
    return outcome(ns, word, reason, {**res, **about}, code=0)


def outcome(ns, verdict: str, reason: str | None, fields: dict, *, code: int) -> int:
    """`code`, after the `--json` line: `fields` with the verdict ("fits", "does not fit",
    "failed", "refused") and its reason (None for "fits")."""
    if ns.json:
        print(json.dumps({**fields, "verdict": verdict, "reason": reason}), flush=True)
    return code


def failed(ns, reason: str, fields: dict) -> int:
    """A compile that gave no verdict (the worker died, or ran out of time): exit 1."""
    return outcome(ns, "failed", reason, fields, code=1)


def recipe_target(cfg, name: str | None):
    """The planner Target of `--target`, else of the recipe's `[job] target`."""
    import planner

    if not (name or cfg.job.target):
        raise ConfigError(
            "job.target: the recipe names no target; allowed: a [job] target in the recipe or "
            "--target, e.g. --target v6e-16"
        )
    return planner.parse_target(name) if name else planner.parse_target(cfg.job.target, key="job.target")


def planner_estimate(cfg, family, args, target):
    """The trainer's step plan on a TPU (scan, AC placement, fused loss: auto fuses on TPU) and the
    planner's estimate of the recipe's own degrees: (PlanInputs, Estimate, StepPlan)."""
    import planner
    from trainer.job import step_request
    from trainer.step.plan import plan_step

    t, par = cfg.training, cfg.parallelism
    step = step_request(cfg, family, tp_degree=par.tensor_parallel_degree, device_type="tpu")
    step_plan = plan_step(step)
    inputs = planner.PlanInputs(
        family=family,
        args=args,
        model_name=f"{cfg.model.name} {cfg.model.flavor}",
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        grad_accum=t.gradient_accumulation_steps,
        step=step,
    )
    est = planner.plan_estimate(
        inputs,
        target,
        dp_replicate=par.data_parallel_replicate_degree,
        dp_shard=par.data_parallel_shard_degree,
        tp=par.tensor_parallel_degree,
        ep=par.expert_parallel_degree,
        ac_mode=cfg.activation_checkpoint.mode,
        loss_parallel=par.enable_loss_parallel,
    )
    return inputs, est, step_plan


EP_PROGRAM_FLAGS = ("topology", "dump_hlo", "keep_flips", "csv", "json", "donate")
"""Switches of the approximated compile that the trainer's EP program does not take."""


def expert_parallel_program(recipe: str, overrides: list, ns, target, est) -> int:
    """An EP recipe: the trainer's own per-device program at the full target (tools/tpu_compile.py,
    as `check_recipe.py --compile`); prints the program, the memory and the verdict. Exit status
    as the approximated compile's: 0 compiled (fits or not), 1 the compile failed."""
    from tools.tpu_compile import BAND, compile_recipe

    given = [f for f in EP_PROGRAM_FLAGS if getattr(ns, f)] + (["kernels"] if ns.kernels != "pallas" else [])
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(
            f"{flag}: not taken for an expert-parallel recipe (expert_parallel_degree {est.ep}), whose "
            "trainer program is compiled as check_recipe.py --compile does; allowed: drop it, or add "
            "--fsdp-approximation to compile the FSDP-only approximation"
        )
    if ns.target:
        overrides = [*overrides, ("job.target", target.name)]
    print(
        f"expert parallelism (ep {est.ep}): compiling the trainer's own per-device program for "
        f"{target.name} (deviceless; as scripts/check_recipe.py --compile) ...",
        flush=True,
    )
    r = compile_recipe(recipe, overrides=overrides, timeout=ns.timeout)
    if r.verdict == "failed":
        print(f"compile failed after {r.wall_s:.0f} s: {r.error}", file=sys.stderr)
        return 1
    print(f"program: {r.program} over mesh {r.mesh}")
    if r.oom:
        print(f"verdict (compiler): does not fit: {r.oom}; planner: {r.planned_gib:.2f} GiB")
        return 0
    m = {k: r.memory.get(f"{k}_size_in_bytes", 0) / GIB for k in ("argument", "output", "temp", "alias")}
    print(
        f"per device (GiB): arguments {m['argument']:.2f}, outputs {m['output']:.2f}, temporaries "
        f"{m['temp']:.2f}, aliased {m['alias']:.2f}"
    )
    word = "fits" if r.compiler_gib <= r.hbm_gib else "does not fit"
    band = "within" if abs(r.compiler_gib - r.planned_gib) <= BAND * r.planned_gib else "outside"
    print(
        f"verdict (compiler, {r.target}): {word}: {r.compiler_gib:.2f} GiB of {r.hbm_gib:.1f} GiB HBM per device; "
        f"planner: {r.planned_gib:.2f} GiB ({band} the {BAND:.0%} band); compiled in {r.wall_s:.0f} s"
    )
    return 0


def approximations(est, args, target) -> list[str]:
    """What the compiled program approximates of the recipe's plan (printed as `approximated:`)."""
    approximated = []
    if est.tp > 1 or est.ep > 1 or est.dp_replicate > 1:
        approximated.append(
            f"the recipe's mesh (dp_replicate {est.dp_replicate}, dp_shard {est.dp_shard}, "
            f"tp {est.tp}, ep {est.ep}) is compiled as FSDP over all {target.devices} devices: "
            "every tensor sharded once, experts' weights gathered like the rest (no all-to-all)"
        )
    if getattr(args, "num_experts", 0):
        approximated.append(
            "the MoE layers run the dropless dispatch (whatever [moe] capacity_factor) on the global batch, "
            "whose sort and gathers over every token copy XLA's SPMD partitioner does not shard: each device "
            "holds the whole batch's routed copies (Qwen3-235B: 2.06 TiB of temporaries); the trainer's own "
            "EP program is `scripts/check_recipe.py RECIPE --compile`"
        )
    return approximated


def worker_spec(cfg, args, step_plan, *, ns, target, topology: str) -> dict:
    """What the worker builds and compiles (tools/xla_estimate.py `worker`), as JSON-able values."""
    t = cfg.training
    spec = dict(
        family=cfg.model.name,
        args=dataclasses.asdict(args),
        seq_len=t.seq_len,
        global_batch=t.local_batch_size * target.devices,
        grad_accum=t.gradient_accumulation_steps,
        # `auto` is bfloat16 on a TPU (trainer.runtime.device.resolve_compute_dtype)
        param_dtype="bfloat16" if t.mixed_precision_param == "auto" else t.mixed_precision_param,
        reduce_dtype=t.mixed_precision_reduce,
        scan_layers=step_plan.scan,
        scan_ac=step_plan.scan_ac,
        block_ac=step_plan.block_ac,
        fused_loss=step_plan.fused_loss and ns.kernels == "pallas",
        aux_loss_coef=t.aux_loss_coef,
        max_norm=t.max_norm,
        optimizer=dict(
            lr=cfg.optimizer.lr,
            betas=list(cfg.optimizer.betas),
            eps=cfg.optimizer.eps,
            weight_decay=cfg.optimizer.weight_decay,
        ),
        topology=topology,
        kernels=ns.kernels,
        donate=ns.donate,
        keep_flips=ns.keep_flips,
        dump_hlo=str(Path(ns.dump_hlo).resolve()) if ns.dump_hlo else None,
    )
    if step_plan.fused_loss and ns.kernels != "pallas":
        spec["fused_loss"] = True  # the chunked torch reference stands in for the kernel
    return spec


def compile_in_worker(spec: dict, topology: str, *, flags: dict[str, str], timeout: float):
    """Run the worker in the `ttpu` venv with the deviceless environment (tools/deviceless_env.py: the
    one set-up of every deviceless compile) and `flags` (LIBTPU_INIT_ARGS / XLA_FLAGS as the run
    layers them, tools/tpu_compile.py `recipe_flag_env`): (the CompletedProcess, wall seconds)."""
    venv = (
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "xla_env.sh"), "ttpu"], check=True, capture_output=True, text=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    env = deviceless_env(topology, extra=flags)
    wall = time.perf_counter()
    proc = subprocess.run(
        [str(Path(venv) / "bin" / "python"), "-m", "tools.xla_estimate", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(ROOT),
    )
    return proc, time.perf_counter() - wall
