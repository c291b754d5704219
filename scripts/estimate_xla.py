#!/usr/bin/env python
"""Ask the real XLA:TPU compiler, without a TPU, whether a recipe's step fits one device; print its
memory (and FLOP) analysis beside the analytic planner's (scripts/estimate.py) for the same plan.

    python scripts/estimate_xla.py --config configs/llama3_70b_v6e.toml          # the recipe's [job] target
    python scripts/estimate_xla.py --config configs/llama3_debug.toml --target v6e-4 --csv rows.csv
    python scripts/estimate_xla.py --config configs/llama3_405b_v7x.toml --dump-hlo /tmp/405b.hlo

How (docs/tpu.md, "Compiler-backed pod check"): in the XLA tier's `ttpu` venv (torch + torchax +
jax 0.10.2 + libtpu 0.0.52; scripts/xla_env.sh), a worker process (tools/xla_estimate.py) builds the
recipe's model on the meta device (no host copy: parameters, AdamW moments and tokens are shapes
only; layer scan stacks meta tensors, models.common.stack.abstract_model), and captures the graph step the trainer
would run on a TPU (`trainer.step.plan_step` with device tpu): full depth, `[compile] scan_layers`
(scan: one body), `[activation_checkpoint] mode` where the trainer applies it, the
`mixed_precision_param` cast, the global batch (local batch x devices), and the Pallas kernels a
TPU run calls as opaque ops (`--kernels pallas`, the default: splash attention, with sinks and a
sliding window for gpt-oss, megablox gmm for MoE experts, the fused linear + cross-entropy when
`[training] fused_loss` selects it, which `auto` does on TPU, Qwen 3.5's gated delta rule;
titan_kernels/tpu/capture.py). torchax lowers it; it is compiled for a compile-only
topology of the target (`jax.experimental.topologies`) with every tensor sharded over all devices
(parameters and optimizer state: SimpleFSDP's Shard(0) where dim 0 divides, else the largest dim
that divides; tokens: data parallel). XLA's SPMD partitioner turns that into the per-device
program, whose `memory_analysis()` and `cost_analysis()` are printed.

Modelled on torch-tpu's backend (docs/tpu.md): the updated parameters and moments are outputs of
the program, not donated (torch-tpu's AOT keeps no input mutations and donates nothing, so they
are new buffers: +12 bytes per local parameter at the update); `--donate` donates them instead.
The scan backward is the one torch-tpu lowers: `trainer.graph.passes.tag_reverse_scans` drops
torch 2.13's `flip` copies and tags the backward body reverse (torchax lowers it as
`jax.lax.scan(reverse=True)`); `--keep-flips` compiles the flipped graph instead. The flips left
in the compiled graph are counted and printed (and the error, if the tagged graph failed to lower
and the flipped one was compiled instead).

Per device: arguments, outputs, temporaries and their total (args + outputs + temp - aliased)
against the chip's HBM (planner/targets.py), the planner's figure for the recipe's own degrees
(planner.plan_estimate, as scripts/estimate.py) split the same way, a verdict "fits" / "does not
fit", and each term where the two totals differ by more than 10 %. `--csv PATH` appends one row.
`--dump-hlo PATH` writes the compiled program's text for tools that read it.

Expert parallelism: a recipe with `expert_parallel_degree > 1` is compiled as the trainer's own
per-device program (tools/tpu_compile.py, what `scripts/check_recipe.py --compile` runs: the EP
all-to-alls, the expert mesh, the recipe's full target), not as the approximation below, whose
verdict for such a recipe is wrong (Qwen3-235B: "does not fit, 2.06 TiB of temporaries", where
the EP program fits in 68 GiB); `--fsdp-approximation` compiles the approximation anyway.
Approximated otherwise: tensor parallelism and HSDP. The recipe's mesh is compiled as FSDP over
all devices (every pod recipe has tp 1), and the output says so. Not trustworthy, by
construction: the kernels' FLOPs and bytes (a model of each, capture.py; libtpu counts a Mosaic
call as 0 FLOPs); FLOPs of scanned programs (XLA counts a `while` body once); the schedule
(XLA's SPMD choice from input shardings, not SimpleFSDP's explicit collectives nor torch-tpu's
lowering). Trustworthy: the argument and output bytes, and that the program compiles for the chip.
The temporaries are the compiler's for this program (deviceless clients report 0 for some
single-device programs; never seen for these SPMD ones).
`--json`: one JSON line, the last on stdout, whatever the outcome: the compiler's numbers (none for
a refusal or a failure), `target`, `topology`, `tokens_per_device_step`, and `verdict` ("fits",
"does not fit": the compiler refused the program (`oom`) or its total exceeds the HBM, "failed":
the worker died (libtpu's check lines in `reason`) or ran out of time, "refused": bad input) with
its `reason` (None for "fits").
Exit status: 0 compiled (fits or does not fit), 1 the compile failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from models.errors import ConfigError
from tools.deviceless_env import deviceless_env
from tools.tpu_compile import recipe_flag_env, worker_failure
from tools.xla_estimate import hbm_oom, worker  # noqa: F401  (hbm_oom: read here by tests)
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
from trainer.runtime import cli

ROOT = Path(__file__).resolve().parents[1]


def topology_name(target) -> str:
    """The jax topology name of a planner Target (e.g. v6e-16 -> v6e:4x4, v7x-8 -> tpu7x:2x2x1)."""
    from tools.tpu_compile import topology_name as of_target

    return of_target(target, key="--target")


# ---------------------------------------------------------------------------------------------
# Outer process (project venv): planner, worker launch, table.


def _parser() -> cli.ArgumentParser:
    """The command line: the recipe's keys, the target and the compile's switches."""
    p = cli.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Recipe keys: --section.key=value, as in training (docs/config.md).",
    )
    p.add_argument("--target", help="e.g. v6e-256, v7x-512 (planner names); default: the recipe's [job] target")
    p.add_argument("--topology", help="jax topology name instead of the one derived from the target")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for capture + compile (default 3600)")
    p.add_argument(
        "--kernels",
        choices=("pallas", "reference"),
        default="pallas",
        help="attention (with sinks), MoE experts, the fused loss and the delta rule in the captured step: "
        "the TPU run's Pallas kernels (default) or the torch references (math SDPA, chunked CE, the "
        "chunked delta rule)",
    )
    p.add_argument(
        "--donate",
        action="store_true",
        help="donate the updated state's input buffers (torch-tpu's backend does not: off by default)",
    )
    p.add_argument(
        "--dump-hlo",
        metavar="PATH",
        help="write the compiled program's text (optimized HLO, or the "
        "StableHLO where jaxlib cannot read the optimized one back) to PATH",
    )
    p.add_argument(
        "--keep-flips",
        action="store_true",
        help="compile the scan backward as torch 2.13 builds it "
        "(flipped copies) instead of the reverse-scan graph torch-tpu lowers (tag_reverse_scans)",
    )
    p.add_argument(
        "--fsdp-approximation",
        action="store_true",
        help="an expert-parallel recipe: compile the FSDP-only approximation (experts gathered like every "
        "weight, the dropless dispatch on the global batch) instead of the trainer's own EP program",
    )
    p.add_argument("--csv", metavar="PATH", help="append one row for this recipe to PATH (header when new)")
    p.add_argument(
        "--json",
        action="store_true",
        help="also print one JSON line (the last on stdout; scripts/mfu_suite.py reads it) for every outcome: "
        "the compiler's numbers and `verdict` (fits, does not fit, failed, refused) with its `reason`",
    )
    return p


def _run(argv: list[str]) -> int:
    from trainer.config import build_config, resolve_model_args, split_cli

    ns, rest = _parser().parse_known_args(argv)
    recipe, _, overrides = split_cli(rest)
    cfg = build_config(recipe, overrides)
    target = _target(cfg, ns.target)
    topology = ns.topology or topology_name(target)
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    if getattr(family, "task", "lm") != "lm":
        raise ConfigError(
            f"model.name: {cfg.model.name} (task {family.task}): the compile check captures the "
            "LM step only; FLUX recipes are not supported; allowed: a language-model recipe"
        )
    inputs, est, step_plan = _planner_estimate(cfg, family, args, target)
    if est.ep > 1 and not ns.fsdp_approximation:
        return _expert_parallel_program(recipe, overrides, ns, target, est)
    approximated = _approximations(est, args, target)
    spec = _worker_spec(cfg, args, step_plan, ns=ns, target=target, topology=topology)
    print(
        f"{inputs.model_name} on {target.name} ({target.devices} devices, {target.chips} chips), "
        f"{args.shape().n_layers} layers\ncompiling for {topology} (deviceless) ...",
        flush=True,
    )
    about = dict(target=target.name, topology=topology, tokens_per_device_step=est.tokens_per_device_step)
    try:
        flags = recipe_flag_env(cfg, target.generation.name)  # the run's bundle < recipe < environment
        proc, wall = _compile_in_worker(spec, topology, flags=flags, timeout=ns.timeout)
    except subprocess.TimeoutExpired:
        return _failed(ns, f"the compile took longer than {ns.timeout:.0f} s", about)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"compile worker exited {proc.returncode} after {wall:.0f} s:\n{proc.stderr[-6000:]}", file=sys.stderr)
        return _failed(ns, f"compile worker: {worker_failure(proc.stderr, proc.returncode)}", about)
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
        return _outcome(ns, "does not fit", reason, {**res, **about}, code=0)
    print(format_table(est, res, step_plan))
    print(verdict_line(est, res))
    for line in discrepancies(est, res):
        print(f"planner vs compiler: {line}")
    if ns.csv:
        write_csv_row(ns.csv, csv_row(recipe, est, res, step_plan))
    total, hbm = compiler_total(res), est.target.hbm_bytes
    word = "fits" if total <= hbm else "does not fit"
    reason = None if word == "fits" else f"{total / GIB:.2f} GiB of {hbm / GIB:.1f} GiB HBM per device"
    return _outcome(ns, word, reason, {**res, **about}, code=0)


def _outcome(ns, verdict: str, reason: str | None, fields: dict, *, code: int) -> int:
    """`code`, after the `--json` line: `fields` with the verdict ("fits", "does not fit",
    "failed", "refused") and its reason (None for "fits")."""
    if ns.json:
        print(json.dumps({**fields, "verdict": verdict, "reason": reason}), flush=True)
    return code


def _failed(ns, reason: str, fields: dict) -> int:
    """A compile that gave no verdict (the worker died, or ran out of time): exit 1."""
    return _outcome(ns, "failed", reason, fields, code=1)


def _target(cfg, name: str | None):
    """The planner Target of `--target`, else of the recipe's `[job] target`."""
    import planner

    if not (name or cfg.job.target):
        raise ConfigError(
            "job.target: the recipe names no target; allowed: a [job] target in the recipe or "
            "--target, e.g. --target v6e-16"
        )
    return planner.parse_target(name) if name else planner.parse_target(cfg.job.target, key="job.target")


def _planner_estimate(cfg, family, args, target):
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


def _expert_parallel_program(recipe: str, overrides: list, ns, target, est) -> int:
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


def _approximations(est, args, target) -> list[str]:
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


def _worker_spec(cfg, args, step_plan, *, ns, target, topology: str) -> dict:
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


def _compile_in_worker(spec: dict, topology: str, *, flags: dict[str, str], timeout: float):
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
        [str(Path(venv) / "bin" / "python"), __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    return proc, time.perf_counter() - wall


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(json.loads(argv[1]))))
        return 0
    as_json = argparse.Namespace(json="--json" in argv)
    try:
        return _run(argv)
    except ConfigError as e:
        cli.error_line(str(e))
        return _outcome(as_json, "refused", str(e), {}, code=2)
    except Exception as e:  # noqa: BLE001  (the traceback follows: --json still ends with the verdict)
        _failed(as_json, f"{type(e).__name__}: {' '.join(str(e).split())[:400]}", {})
        raise


if __name__ == "__main__":
    from trainer.runtime.quiet import quiet_capture

    quiet_capture()  # third-party warnings of capture-only jobs, which a user cannot act on
    sys.exit(cli.run(main))
