"""The MFU suite of scripts/mfu_suite.py: the command line's lists checked, the trainer runs measured,
the pod recipes projected, and the outputs written.

- `run(ns, extra, argv)`: the whole suite for the script's flags (`_selection`, `_jobs`, `_measure`,
  `_projections`, then tools/mfu_runs.py's outputs);
- `project`: the projections of pod recipes: the trainer's own program for the expert- and
  context-parallel ones (tools/mfu_projection.py `program_row`), else `_fsdp_projection`, the 1-
  and 2-layer FSDP compiles of scripts/estimate_xla.py on a small slice (`compile_costs`),
  extrapolated to the recipe's layers;
- `xla_venv`, `host_available_bytes`, `pod_recipes`, `trainer_program`: what it projects and whether
  it can.

The runs are tools/benchmark.py's, the projections' arithmetic tools/mfu_projection.py's, the
tables and plots tools/mfu_report.py's; the flags and their help scripts/mfu_suite.py's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tools import benchmark as bench
from tools.mfu_projection import (
    PROGRAM_KIND,
    ROUTINGS,
    WEAK_SCALING,
    InputError,
    extrapolate_layers,
    hlo_bound,
    program_row,
    recipe_facts,
    recipe_path,
    roofline,
    weak_scaling,
)
from tools.mfu_report import load_anchors
from tools.mfu_runs import add_best_mfu, complete, group_runs, report_lines, reread, run_dtype, write_outputs

ROOT = Path(__file__).resolve().parents[1]

# The compile-only slice a pod recipe's per-device program is compiled for (FSDP-style over its
# devices): per-device FLOPs and bytes of pure FSDP hardly depend on the device count.
PROJECTION_SLICE = {"v6e": "v6e-4", "v7x": "v7x-8", "v5e": "v5e-4", "v5p": "v5p-8"}


# ------------------------------------------------------------------------------ pure helpers


def pod_recipes() -> list[str]:
    """The LM pod recipes (configs/*_v6e.toml, *_v7x.toml; FLUX's are not projected)."""
    names = sorted(p.stem for pat in ("*_v6e.toml", "*_v7x.toml") for p in (ROOT / "configs").glob(pat))
    return [n for n in names if not n.startswith("flux")]


# ------------------------------------------------------------------------------ projections


def xla_venv() -> tuple[Path | None, str]:
    """The `ttpu` venv of scripts/xla_env.sh if it is complete, else (None, why)."""
    root = Path(os.environ.get("TITAN_XLA_VENV_ROOT", ROOT))
    venv = root / ".venv-ttpu"
    if not (venv / "bin" / "python").exists() or not list(venv.glob(".titan-*")):
        return None, (
            f"the XLA venv {venv} is absent or incomplete (make it with `scripts/xla_env.sh ttpu`: "
            "minutes, and the package registry)"
        )
    return venv, ""


def compile_costs(
    recipe: Path, target: str, n_layers: int, extra: list[str], timeout: float, cache: Path | None = None
) -> dict:
    """The deviceless compile's per-device FLOPs and bytes of one step at `n_layers`, scan off, and
    the path of its optimized HLO text (XLA's dump of the step's module: `XLA_FLAGS=--xla_dump_to`;
    None when the dump is missing). With `cache`, a compile whose result is already under
    cache/<recipe>-<target>-L<n>/ is read back, not redone."""
    from tools.deviceless_env import with_xla_flags

    folder = (cache or Path(os.environ.get("TMPDIR", "/tmp")) / "titan_mfu_hlo") / f"{recipe.stem}-{target}-L{n_layers}"
    result, hlo_path = folder / "result.json", folder / "step.after_optimizations.txt"
    if not (cache and result.is_file()):
        folder.mkdir(parents=True, exist_ok=True)
        dump = folder / "dump"
        cmd = [
            sys.executable,
            str(ROOT / "scripts" / "estimate_xla.py"),
            "--target",
            target,
            "--json",
            "--timeout",
            str(timeout),
            "--config",
            str(recipe),
            f"--model.n_layers={n_layers}",
            # the small slice cannot hold the recipe's expert-parallel degree; estimate_xla compiles
            # ep as FSDP anyway (experts sharded like every other weight)
            "--compile.scan_layers=false",
            "--parallelism.expert_parallel_degree=1",
            *extra,
        ]
        # estimate_xla hands its worker tools/deviceless_env.py's environment, these flags after the caller's
        env = dict(
            os.environ,
            **with_xla_flags(f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step_fn"),
        )
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 120, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"estimate_xla exited {proc.returncode}: {(proc.stderr or proc.stdout)[-400:]}")
        result.write_text(lines[-1])
        dumped = sorted(dump.glob("*jit_step_fn*.after_optimizations.txt"))
        if dumped:
            dumped[-1].replace(hlo_path)
        shutil.rmtree(dump, ignore_errors=True)  # buffer assignment and the other dumps: large, not read
    res = json.loads(result.read_text())
    cost = res.get("cost", {})
    if not cost.get("flops") or "bytes accessed" not in cost:
        raise RuntimeError(f"the compiler's cost analysis has no flops / bytes accessed: {cost}")
    return {
        "flops": cost["flops"],
        "bytes": cost["bytes accessed"],
        "tokens": res["tokens_per_device_step"],
        "compiler_cost": res.get("compiler_cost", {}),
        "kernel_cost": res.get("kernel_cost", {}),
        "devices": res.get("devices"),
        "hlo": str(hlo_path) if hlo_path.is_file() else None,
    }


HOST_MEMORY_SHARE = 0.6
"""The share of the host's available memory a projection's 2-layer capture may take
(`recipe_facts`' capture_bytes; tools/mfu_projection.py)."""


def host_available_bytes() -> float | None:
    """MemAvailable of /proc/meminfo (None off Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def project(
    names: list[str],
    *,
    anchors: dict,
    timeout: float,
    costs=None,
    cache: Path | None = None,
    overrides: list[tuple[str, str]] = (),
    routings: tuple[str, ...] = ("learned",),
    compile=None,
) -> tuple[list[dict], str]:
    """Projections of pod recipes; ([], reason) when there is nothing to project or no XLA venv.
    The expert-parallel recipes: the bound of the trainer's own per-device program (`program_row`,
    once per routing in `routings`, with `overrides`). The others: the 1- and 2-layer FSDP compile
    of scripts/estimate_xla.py (`costs`, default `compile_costs`), extrapolated."""
    if not names:
        return [], "no recipes to project (--project none)"
    rows = []
    why_program = {n: trainer_program(recipe_path(n)) for n in names}
    program_names = [n for n in names if why_program[n]]
    names = [n for n in names if n not in program_names]
    if (program_names and compile is None) or (names and costs is None):
        venv, why = xla_venv()
        if venv is None:
            return [], why
    for name in program_names:
        # the routing switches only mean something to a model with experts
        for routing in routings if why_program[name] == "ep" else ("learned",):
            rows.append(
                program_row(
                    name,
                    [*ROUTINGS[routing], *overrides],
                    anchors=anchors,
                    timeout=timeout,
                    cache=cache,
                    compile=compile,
                )
            )
    if costs is None:
        costs = (
            compile_costs
            if cache is None
            else (
                lambda recipe, target, n, extra, timeout: compile_costs(recipe, target, n, extra, timeout, cache=cache)
            )
        )
    for name in names:
        rows.append(_fsdp_projection(name, anchors=anchors, timeout=timeout, costs=costs))
    return rows, ""


def trainer_program(recipe: Path) -> str | None:
    """Why `recipe` is projected from the trainer's own per-device program at its target, not from
    the small-slice FSDP approximation: "ep" (expert parallel: the approximation has no dispatch),
    "cp" (context parallel: the approximation keeps the whole sequence on a device, and at 128k
    tokens its 1-layer program does not fit v6e-4 / v7x-8), or None."""
    from trainer.config import build_config

    par = build_config(str(recipe), []).parallelism
    if par.expert_parallel_degree > 1:
        return "ep"
    if par.context_parallel_degree > 1:
        return "cp"
    return None


def _fsdp_projection(name: str, *, anchors: dict, timeout: float, costs) -> dict:
    """One recipe's row from its 1- and 2-layer FSDP compiles on a small slice, extrapolated to its
    layers: the roofline of the compiler's totals and, from the HLO, the step-time bound; a row
    with `error` when the recipe has no generation, the host too little memory, or a compile failed."""
    from trainer.runtime.flops import TPU_PEAK_TFLOPS

    recipe = recipe_path(name)
    facts = recipe_facts(recipe)
    gen = facts["generation"]
    if gen not in PROJECTION_SLICE:
        return {"recipe": name, "error": f"no TPU generation in the recipe name {name!r}"}
    target = PROJECTION_SLICE[gen]
    avail = host_available_bytes()
    if avail is not None and facts["capture_bytes"] > HOST_MEMORY_SHARE * avail:
        # a machine shared with other jobs: never take more than a part of what is free
        return {
            "recipe": name,
            "target": target,
            "error": f"skipped: the 2-layer capture needs ~{facts['capture_bytes'] / 2**30:.0f} GiB of "
            f"host memory, more than {HOST_MEMORY_SHARE:.0%} of the "
            f"{avail / 2**30:.0f} GiB available",
        }
    print(f"projection: {name}: deviceless compile for {target} at 1 and 2 layers ...", file=sys.stderr, flush=True)
    try:
        one, two = (costs(recipe, target, n, [], timeout) for n in (1, 2))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {"recipe": name, "target": target, "error": "failed: " + str(e).splitlines()[0][:200]}
    n = facts["n_layers"]
    flops = extrapolate_layers(one["flops"], two["flops"], n)
    bytes_accessed = extrapolate_layers(one["bytes"], two["bytes"], n)
    peak = TPU_PEAK_TFLOPS[gen] * 1e12
    hbm = anchors["hbm_gbps_per_device"][gen] * 1e9
    # The compiler counts a loop body once; XLA:TPU turns large sharded matmuls into
    # collective-matmul loops (Llama 3 405B on v7x-8: 2.6e14 FLOPs per layer and device for
    # 3.1e14 of 6N alone), so its count can fall below the model's own FLOPs. The step cannot
    # do less than those (causal convention: what splash computes), so that is the floor.
    floor = facts["flops_per_token"]["causal"] * one["tokens"]
    roof = roofline(
        flops=max(flops, floor),
        bytes_accessed=bytes_accessed,
        peak_flops=peak,
        hbm_bytes_per_s=hbm,
        tokens=one["tokens"],
        flops_per_token=facts["flops_per_token"],
    )
    row = {
        "recipe": name,
        "kind": "projection",
        "target": target,
        "generation": gen,
        "seq_len": facts.get("seq_len"),
        "recipe_target": facts.get("target"),
        "flops_per_step": flops,
        "model_flops_per_step": floor,
        "flops_source": "compiler" if flops >= floor else f"model floor (compiler {flops / floor:.0%})",
        "bytes_per_step": bytes_accessed,
        "peak_tflops": peak / 1e12,
        **roof,
    }
    if one.get("compiler_cost") and two.get("compiler_cost"):
        for key, name_ in (("flops", "compiler_xla_flops"), ("bytes accessed", "compiler_xla_bytes")):
            row[name_] = extrapolate_layers(one["compiler_cost"].get(key, 0.0), two["compiler_cost"].get(key, 0.0), n)
    if one.get("hlo") and two.get("hlo"):
        row.update(
            hlo_bound(
                one,
                two,
                n_layers=n,
                generation=gen,
                peak=peak,
                hbm=hbm,
                model_flops=floor,
                flops_per_token=facts["flops_per_token"],
                target_devices=facts["target_devices"],
                ici=anchors["ici"][gen],
            )
        )
    else:
        row["bound_note"] = "no HLO dump from the compile: roofline only"
    return row


def run(ns: argparse.Namespace, extra: list[str], argv: list[str]) -> int:
    """The suite for the command line's namespace `ns` (scripts/mfu_suite.py's flags), the trainer
    arguments after `--` (`extra`) and the whole command line `argv` (quoted in <out>.md): 0, 1 if a
    run failed; InputError on a bad list."""
    sel = _selection(ns)
    if not ns.dry_run and importlib.util.find_spec("matplotlib") is None:  # before any run
        raise InputError(
            "scripts/mfu_suite.py: matplotlib is not installed (its plots need it); "
            "install the bench extra: pip install '.[bench]'"
        )
    out = Path(ns.out) if ns.out else ROOT / "outputs" / "mfu_suite" / time.strftime("%Y%m%d-%H%M%S") / "mfu_suite"
    out.parent.mkdir(parents=True, exist_ok=True)
    jobs = _jobs(ns, sel, extra, root=out.parent / f"{out.name}_runs")
    if ns.dry_run:
        for job in jobs:
            print(shlex.join(job["cmd"]))
        return 0

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = _measure(jobs, ns)
    rows = group_runs(runs)
    anchors = load_anchors()
    projections, programs, weak, skipped = _projections(ns, sel, anchors)
    pngs = write_outputs(out, rows=rows, runs=runs, projections=projections, programs=programs, weak=weak)
    md = report_lines(
        argv,
        steps=ns.steps,
        warmup=ns.warmup,
        repeats=ns.repeats,
        started=started,
        rows=rows,
        projections=projections,
        programs=programs,
        weak=weak,
        skipped=skipped,
        anchors=anchors,
        pngs=pngs,
    )
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"\nwrote {out.with_suffix('.csv')}, {out.with_suffix('.md')}, " + ", ".join(str(p) for p in pngs))
    return 0 if all(r["ok"] == r["runs"] for r in rows) else 1


def _comma_list(value: str) -> list[str]:
    return [r.strip() for r in value.split(",") if r.strip()]


def _selection(ns: argparse.Namespace) -> dict:
    """The command line's lists, checked (InputError on a bad one): recipes and their paths, modes,
    process counts, the recipes to project and to weak-scale, the overrides and routings."""
    recipes = _comma_list(ns.recipes)
    paths = {r: recipe_path(r) for r in recipes}
    modes = _comma_list(ns.modes)
    for m in modes:
        if m not in bench.VARIANTS:
            raise InputError(f"--modes: unknown mode {m!r}; allowed: {', '.join(bench.VARIANTS)}")
    try:
        nprocs = [int(n) for n in ns.nproc.split(",") if n.strip()]
    except ValueError:
        raise InputError(f"--nproc: {ns.nproc!r}; allowed: a comma list of positive integers") from None
    if not recipes or not modes or not nprocs or min(nprocs) < 1:
        raise InputError("--recipes, --modes, --nproc: each needs at least one value (nproc >= 1)")
    if ns.warmup >= ns.steps:
        raise InputError(f"--warmup: {ns.warmup} must be below --steps {ns.steps}")
    project_names = pod_recipes() if ns.project == "pods" else [] if ns.project == "none" else _comma_list(ns.project)
    for name in project_names:
        recipe_path(name)
    overrides = []
    for o in ns.override:
        key, eq, value = o.partition("=")
        if not eq or "." not in key:
            raise InputError(f"--override: {o!r}; allowed: section.key=value, e.g. moe.capacity_factor=1.25")
        overrides.append((key, value))
    routings = ("learned", "random") if ns.routing == "both" else (ns.routing,)
    if any(r not in ROUTINGS for r in routings):
        raise InputError(f"--routing: {ns.routing!r}; allowed: learned, random, both")
    weak_names = (
        list(WEAK_SCALING)
        if ns.weak_scaling == "default"
        else []
        if ns.weak_scaling == "none"
        else _comma_list(ns.weak_scaling)
    )
    for name in weak_names:
        if name not in WEAK_SCALING:
            raise InputError(f"--weak-scaling: {name!r}; allowed: default, none or {', '.join(WEAK_SCALING)}")
    return dict(
        recipes=recipes,
        paths=paths,
        modes=modes,
        nprocs=nprocs,
        project_names=project_names,
        overrides=overrides,
        routings=routings,
        weak_names=weak_names,
    )


def _jobs(ns: argparse.Namespace, sel: dict, extra: list[str], *, root: Path) -> list[dict]:
    """One trainer run per (repeat, recipe, mode, nproc), repeats interleaved: slow drift of the
    machine spreads over every group."""
    jobs = []
    for rep in range(ns.repeats):
        for recipe in sel["recipes"]:
            for mode in sel["modes"]:
                for nproc in sel["nprocs"]:
                    folder = root / f"{recipe}-{mode}-n{nproc}-r{rep}"
                    cmd = bench.build_command(
                        recipe=str(sel["paths"][recipe]),
                        overrides=bench.VARIANTS[mode],
                        nproc=nproc,
                        dump_folder=str(folder),
                        steps=ns.steps,
                        extra=extra,
                    )
                    jobs.append(
                        {"recipe": recipe, "mode": mode, "nproc": nproc, "repeat": rep, "cmd": cmd, "folder": folder}
                    )
    return jobs


def _measure(jobs: list[dict], ns: argparse.Namespace) -> list[dict]:
    """Run the jobs (with --resume, read back the finished ones): one row per run, with its compute
    dtype and its MFU against the best dtype's peak."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(ns.threads) if ns.threads else env.get("OMP_NUM_THREADS", "1")
    done = [ns.resume and complete(Path(job["folder"]), ns.steps) for job in jobs]
    fresh = iter(
        bench.execute(
            [j for j, d in zip(jobs, done) if not d],
            env=env,
            warmup=ns.warmup,
            timeout=ns.timeout,
            max_busy=ns.max_busy,
            max_wait=ns.max_wait,
        )
    )
    runs = [reread(job, ns.warmup) if d else next(fresh) for job, d in zip(jobs, done)]
    for job, run in zip(jobs, runs):
        run["dtype"] = run_dtype(Path(job["folder"]))
        add_best_mfu(run)
    return runs


def _projections(ns: argparse.Namespace, sel: dict, anchors: dict) -> tuple[list, list, list, str]:
    """(the FSDP projections, the trainer-program ones, the weak-scaling rows, why projections were
    skipped or '')."""
    cache = Path(ns.hlo_cache) if ns.hlo_cache else None
    projections, skipped = project(
        sel["project_names"],
        anchors=anchors,
        timeout=ns.timeout,
        cache=cache,
        overrides=sel["overrides"],
        routings=sel["routings"],
    )
    if skipped:
        print(f"projections skipped: {skipped}", file=sys.stderr)
    programs = [p for p in projections if p.get("kind") == PROGRAM_KIND]
    projections = [p for p in projections if p not in programs]
    weak = []
    if sel["weak_names"] and xla_venv()[0] is not None:
        for name in sel["weak_names"]:
            weak += weak_scaling(
                name, WEAK_SCALING[name], anchors=anchors, timeout=ns.timeout, cache=cache, overrides=sel["overrides"]
            )
    return projections, programs, weak, skipped
