#!/usr/bin/env python
"""MFU suite: sweep recipes x compile modes x process counts, write CSV, a markdown table and
PNG plots, in both MFU conventions, with the published anchors printed beside ours.

    python scripts/mfu_suite.py                       # the default CPU sweep (a few minutes)
    python scripts/mfu_suite.py --recipes llama3_debug,qwen3_debug --modes eager,graph,graph_scan \
        --nproc 1,2 --repeats 2 --steps 8 --warmup 3 --out outputs/mfu_suite/run -- --training.seq_len=256

Measured part: every (recipe, mode, nproc, repeat) is one `python -m trainer.train` run, through
scripts/benchmark.py's runner (interleaved repeats, quiet-machine wait, metrics.jsonl parsing).
Per group: median tokens/s per device over the steps after --warmup and over the repeats,
TFLOP/s, MFU in the PaLM/TorchTitan convention (6N + 12·L·H·Q·T, `mfu_pct`), in MaxText's
causal-halved one (`mfu_pct_causal`), and against the faster compute dtype's peak on the CPU
(`mfu_pct_best`, docs/metrics.md). On a TPU the same command measures the pod recipes.

Projections (`--project`, default: the LM pod recipes, configs/*_v6e.toml and *_v7x.toml):
without a TPU, the deviceless XLA:TPU compile of scripts/estimate_xla.py (its `ttpu` venv,
scripts/xla_env.sh) at 1 and 2 layers, scan off, for a small slice of the generation, with
XLA's dump of the optimized per-device HLO (`XLA_FLAGS=--xla_dump_to`). tools/xla_projection.py
reads each program: compute time = per executed op max(FLOPs / peak, HBM bytes / bandwidth),
loop bodies times their trip count, plus the Pallas kernels (capture model; a kernel's own
CostEstimate bytes where the HLO carries one), never below the model's FLOPs; collective time
= each collective's bytes over the ICI bandwidth of its mesh axis at the recipe's target slice
(ring (n-1)/n; assets/anchors.toml [ici]). Both extrapolated to the recipe's layers; step time
fully exposed (compute + collectives) and perfectly overlapped (max): an upper bound on MFU
either way, never above 100 %. The old roofline of the compiler's totals is printed beside it.
Every such row is labeled "projection". Without that venv the projections are skipped with the
reason printed. `--hlo-cache DIR` keeps the compiles and reads them back (by recipe name and
overrides; a trainer-program compile also by the recipe file's hash).

The expert-parallel recipes (ep > 1) are projected from the trainer's own per-device program
instead: tools/tpu_compile.py (the real plan with EP on the target's fake world, the dispatch over
its all-to-alls, every collective as the trainer writes it, the Pallas kernels) compiled at full
depth with the recipe's layer scan, XLA's optimized HLO dumped and read by tools/xla_projection.py,
each collective priced where torch-tpu's layout puts its group on the torus; the table adds the EP
all-to-alls' and the dispatch ops' share. `--override KEY=VALUE` (repeatable, e.g.
moe.capacity_factor=1.25) and `--routing learned|random|both` change what is compiled.
`--weak-scaling default` projects Qwen3-235B on v7x from 8 to 1,024 chips and Qwen3-30B-A3B on
v6e from 8 to 256 at the recipe's per-device batch (`weak_scaling`: a few compiles, the rest
scaled), a table and <out>_weak_scaling.png.

Anchors: assets/anchors.toml (MaxText v6e/v7x, the TorchTitan TPU fork, torchax, TorchTitan on
H100, each with its source), printed beside our row for the same recipe.

Output: <out>.csv (one row per group), <out>_runs.csv (per run), <out>.md, <out>_vs_devices.png,
<out>_vs_mode.png. Needs matplotlib (`pip install '.[bench]'`). Exit: 0, 1 if a run failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from trainer.runtime import cli  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ANCHORS = ROOT / "assets" / "anchors.toml"
DEFAULT_RECIPES = "llama3_debug,qwen3_debug"
DEFAULT_MODES = "eager,graph_scan"
# The compile-only slice a pod recipe's per-device program is compiled for (FSDP-style over its
# devices): per-device FLOPs and bytes of pure FSDP hardly depend on the device count.
PROJECTION_SLICE = {"v6e": "v6e-4", "v7x": "v7x-8", "v5e": "v5e-4", "v5p": "v5p-8"}


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("titan_benchmark", ROOT / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()


class InputError(Exception):
    """Bad input: printed as one `error:` line, exit 2."""


# ------------------------------------------------------------------------------ pure helpers


def recipe_path(name: str) -> Path:
    """`llama3_debug` or a path -> the recipe file; InputError when there is none."""
    path = Path(name) if name.endswith(".toml") else ROOT / "configs" / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))
        raise InputError(f"--recipes: no recipe {name!r} ({path}); allowed: {', '.join(known)} or a .toml path")
    return path


def pod_recipes() -> list[str]:
    """The LM pod recipes (configs/*_v6e.toml, *_v7x.toml; FLUX's are not projected)."""
    names = sorted(p.stem for pat in ("*_v6e.toml", "*_v7x.toml") for p in (ROOT / "configs").glob(pat))
    return [n for n in names if not n.startswith("flux")]


def roofline(
    *,
    flops: float,
    bytes_accessed: float,
    peak_flops: float,
    hbm_bytes_per_s: float,
    tokens: float,
    flops_per_token: dict[str, float],
) -> dict:
    """One step on one device, bounded by compute or by HBM traffic, whichever is slower.

    flops, bytes_accessed: the device's FLOPs and HBM bytes of one step (hardware FLOPs: what
        the compiled program executes, recompute included). tokens: tokens the device trains per
        step. flops_per_token: model FLOPs per token, {"palm", "causal"} (trainer.runtime.flops).
    Returns step_s, the bound ("compute" | "memory"), tokens/s and MFU in both conventions: an
    upper bound, since collectives, kernel efficiency and host overheads are left out.
    """
    assert flops > 0 and bytes_accessed >= 0 and peak_flops > 0 and hbm_bytes_per_s > 0 and tokens > 0
    compute_s, memory_s = flops / peak_flops, bytes_accessed / hbm_bytes_per_s
    step_s = max(compute_s, memory_s)
    tokens_per_sec = tokens / step_s
    return {
        "step_s": step_s,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "tokens_per_sec": tokens_per_sec,
        "tflops": tokens_per_sec * flops_per_token["palm"] / 1e12,
        "mfu_pct": 100.0 * tokens_per_sec * flops_per_token["palm"] / peak_flops,
        "mfu_pct_causal": 100.0 * tokens_per_sec * flops_per_token["causal"] / peak_flops,
    }


def extrapolate_layers(at_1: float, at_2: float, n_layers: int) -> float:
    """A per-step count measured at 1 and 2 layers (everything else equal) -> at n_layers:
    the embedding, loss and optimizer-scalar part once, the per-layer part n_layers times."""
    per_layer = at_2 - at_1
    return at_1 + (n_layers - 1) * per_layer


def load_anchors(path: Path = ANCHORS) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def anchor_per_device(anchor: dict) -> float | None:
    """An anchor's tokens/s per device (a v7x chip is two devices; other chips are one)."""
    tps = anchor.get("tokens_per_sec")
    if tps is None:
        return None
    return tps / 2 if anchor.get("per") == "chip" and anchor["hardware"] == "v7x" else tps


def group_runs(runs: list[dict]) -> list[dict]:
    """Runs -> one row per (recipe, mode, nproc): medians over the successful repeats."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["recipe"], run["mode"], run["nproc"]), []).append(run)
    rows = []
    for (recipe, mode, nproc), group in groups.items():
        ok = [r for r in group if r["rc"] == 0 and r.get("steady_steps")]
        row = {"recipe": recipe, "mode": mode, "nproc": nproc, "runs": len(group), "ok": len(ok)}
        for key in (
            "tokens_per_sec",
            "tflops",
            "mfu_pct",
            "mfu_pct_causal",
            "mfu_pct_best",
            "peak_tflops",
            "peak_tflops_best",
            "mem_gib",
            "compile_s",
            "busy_before",
        ):
            row[key] = bench._median([r.get(key) for r in ok])
        dtypes = sorted({r["dtype"] for r in ok if r.get("dtype")})
        row["dtype"] = "/".join(dtypes) or None
        row["tokens_per_sec_total"] = row["tokens_per_sec"] * nproc if row["tokens_per_sec"] is not None else None
        rows.append(row)
    return rows


def add_best_mfu(run: dict) -> dict:
    """mfu_pct against the faster compute dtype's peak (equal to mfu_pct where the run uses it)."""
    mfu, peak, best = run.get("mfu_pct"), run.get("peak_tflops"), run.get("peak_tflops_best")
    run["mfu_pct_best"] = mfu * peak / best if None not in (mfu, peak, best) and best > 0 else mfu
    return run


def run_dtype(folder: Path) -> str | None:
    """The compute dtype a run printed in its start-up lines (`titan-tpu: compute dtype X (...)`)."""
    try:
        text = (folder / "stdout.log").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"compute dtype (\w+)", text)
    return m.group(1) if m else None


def complete(folder: Path, steps: int) -> bool:
    """Whether a run folder holds a metrics.jsonl record of its last step (--resume)."""
    records = bench.read_records(folder / "metrics.jsonl")
    return bool(records) and records[-1]["step"] == steps


def reread(job: dict, warmup: int) -> dict:
    """The row `benchmark.execute` would have made for a finished run (--resume): rc 0, no timing."""
    labels = {k: v for k, v in job.items() if k not in ("cmd", "folder")}
    return {
        **labels,
        "rc": 0,
        "wall_s": None,
        "busy_before": None,
        **bench.summarize_run(bench.read_records(Path(job["folder"]) / "metrics.jsonl"), warmup),
    }


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


def override_tag(overrides: list[tuple[str, str]]) -> str:
    """A folder-safe tag of a compile's overrides ('' without any): the cache key's part; a long
    one (a folder name has 255 bytes) becomes a hash of itself."""
    tag = "".join(f"+{k}={v}" for k, v in overrides).replace("/", "_")
    return tag if len(tag) <= 120 else "+" + hashlib.sha1(tag.encode()).hexdigest()[:16]


def program_compile(recipe: Path, overrides: list[tuple[str, str]], timeout: float, cache: Path | None = None) -> dict:
    """The per-device program the trainer emits for `recipe` on its `[job] target` (with
    `overrides`, e.g. job.target=v7x-16 or moe.routing=random), compiled deviceless by
    tools/tpu_compile.py at full depth (layer scan as the recipe has it: XLA's loops carry their
    trip counts, so nothing is extrapolated), with XLA's dump of the optimized HLO kept.
    With `cache`, a compile already under cache/<recipe><tag>/ is read back, not redone."""
    from tools.deviceless_env import with_xla_flags
    from tools.tpu_compile import compile_recipe

    base = cache or Path(os.environ.get("TMPDIR", "/tmp")) / "titan_mfu_hlo"
    folder = base / f"{recipe.stem}{override_tag(overrides)}"
    result, hlo_path = folder / "program.json", folder / "program.after_optimizations.txt"
    sha = hashlib.sha1(recipe.read_bytes()).hexdigest()[:12]
    stale = result.is_file() and json.loads(result.read_text()).get("recipe_sha", sha) != sha
    if not (cache and result.is_file() and hlo_path.is_file()) or stale:
        folder.mkdir(parents=True, exist_ok=True)
        dump = folder / "dump"
        flags = with_xla_flags(f"--xla_dump_to={dump} --xla_dump_hlo_as_text")  # tools/deviceless_env.py
        rep = compile_recipe(str(recipe), overrides=overrides, timeout=timeout, extra_env=flags)
        dumped = sorted(
            (q for q in dump.glob("*after_optimizations.txt") if "cpu_after" not in q.name),
            key=lambda q: q.stat().st_size,
        )
        if dumped:
            dumped[-1].replace(hlo_path)  # the step's module: the largest one
        shutil.rmtree(dump, ignore_errors=True)  # buffer assignment and the other dumps: large, not read
        data = {k: getattr(rep, k) for k in rep.__dataclass_fields__}
        data["verdict"] = rep.verdict
        data["recipe_sha"] = sha  # a cached compile of an older recipe file is redone
        result.write_text(json.dumps(data, default=str))
    res = json.loads(result.read_text())
    if not hlo_path.is_file() or not hlo_path.stat().st_size:
        raise RuntimeError(f"no optimized HLO from the compile ({res.get('error') or res.get('oom') or 'no dump'})")
    if not res.get("kernel_cost") and res.get("kernels"):  # a compile from before tpu_compile priced kernels
        rep = compile_recipe(str(recipe), overrides=overrides, timeout=timeout, capture_only=True)
        res["kernel_cost"] = rep.kernel_cost
        result.write_text(json.dumps(res, default=str))
    res["hlo"] = str(hlo_path)
    return res


# The compile worker allocates the model and the AdamW moments on the host but never writes them
# (scripts/estimate_xla.py): measured peak resident 1.56 GB at 1.27 B parameters and 1.76 GB at
# 1.49 B (Llama 3 8B at 1 and 2 layers, v6e-4), i.e. ~0.4 GB plus ~0.9 byte per parameter.
CAPTURE_BASE_BYTES = 2**30
CAPTURE_BYTES_PER_PARAM = 1
HOST_MEMORY_SHARE = 0.6


def recipe_facts(recipe: Path) -> dict:
    """From a recipe: generation, layers, FLOPs per token (both conventions), and the host bytes
    the 2-layer compile's capture needs."""
    from trainer.config import build_config, resolve_model_args
    from trainer.runtime.flops import flops_per_token, tpu_generation

    cfg = build_config(str(recipe), [])
    _, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    shape = args.shape()
    gen = tpu_generation(recipe.stem.rsplit("_", 1)[-1])
    fpt = flops_per_token(
        num_matmul_params=args.num_active_params(exclude_embedding=True),
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        head_dim=shape.head_dim,
        seq_len=cfg.training.seq_len,
    )
    cfg.model.overrides["n_layers"] = 2
    _, two = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    target = getattr(cfg.job, "target", None)
    try:
        import planner

        target_devices = planner.parse_target(target).devices if target else None
    except Exception:  # noqa: BLE001 - a recipe without a known target: the compiled slice's size
        target_devices = None
    return {
        "generation": gen,
        "n_layers": shape.n_layers,
        "flops_per_token": fpt,
        "target": target,
        "seq_len": cfg.training.seq_len,
        "target_devices": target_devices,
        "capture_bytes": CAPTURE_BASE_BYTES + CAPTURE_BYTES_PER_PARAM * two.num_params(),
    }


def host_available_bytes() -> float | None:
    """MemAvailable of /proc/meminfo (None off Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


ROUTINGS = {"learned": [], "random": [("moe.routing", "random"), ("moe.routing_benchmark_only", "true")]}


def expert_parallel(recipe: Path) -> bool:
    """The recipe runs its experts over an expert-parallel mesh (ep > 1)."""
    from trainer.config import build_config

    return build_config(str(recipe), []).parallelism.expert_parallel_degree > 1


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
    from trainer.runtime.flops import TPU_PEAK_TFLOPS

    if not names:
        return [], "no recipes to project (--project none)"
    rows = []
    program_names = [n for n in names if expert_parallel(recipe_path(n))]
    names = [n for n in names if n not in program_names]
    if (program_names and compile is None) or (names and costs is None):
        venv, why = xla_venv()
        if venv is None:
            return [], why
    for name in program_names:
        for routing in routings:
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
        recipe = recipe_path(name)
        facts = recipe_facts(recipe)
        gen = facts["generation"]
        if gen not in PROJECTION_SLICE:
            rows.append({"recipe": name, "error": f"no TPU generation in the recipe name {name!r}"})
            continue
        target = PROJECTION_SLICE[gen]
        avail = host_available_bytes()
        if avail is not None and facts["capture_bytes"] > HOST_MEMORY_SHARE * avail:
            # a machine shared with other jobs: never take more than a part of what is free
            rows.append(
                {
                    "recipe": name,
                    "target": target,
                    "error": f"skipped: the 2-layer capture needs ~{facts['capture_bytes'] / 2**30:.0f} GiB of "
                    f"host memory, more than {HOST_MEMORY_SHARE:.0%} of the "
                    f"{avail / 2**30:.0f} GiB available",
                }
            )
            continue
        print(f"projection: {name}: deviceless compile for {target} at 1 and 2 layers ...", file=sys.stderr, flush=True)
        try:
            one, two = (costs(recipe, target, n, [], timeout) for n in (1, 2))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            rows.append({"recipe": name, "target": target, "error": "failed: " + str(e).splitlines()[0][:200]})
            continue
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
                row[name_] = extrapolate_layers(
                    one["compiler_cost"].get(key, 0.0), two["compiler_cost"].get(key, 0.0), n
                )
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
        rows.append(row)
    return rows, ""


def program_times(costs: dict, *, peak: float, hbm: float, ici: dict, target_devices: int | None) -> dict:
    """One compiled program (one layer count): compute seconds (per-op roofline of the XLA ops,
    plus the Pallas kernels) and collective seconds per mesh axis, from its optimized HLO."""
    from tools import xla_projection as xp

    devices = costs.get("devices") or 1
    summary = xp.summarize(Path(costs["hlo"]).read_text(), mesh={"fsdp": devices})
    ops = summary["ops"]
    xla_s = xp.compute_time(ops, peak_flops=peak, hbm_bytes_per_s=hbm, kinds=("xla",))
    # Kernels: the capture's model (titan_kernels/tpu/capture.py) for every kernel call, with the bytes of
    # the calls that carry their own CostEstimate (megablox gmm / tgmm) replaced by it.
    model = costs.get("kernel_cost") or {}
    est = [o for o in ops if o.kind == "kernel"]
    est_bytes = sum(o.times * o.bytes for o in est)
    est_flops = sum(o.times * o.flops for o in est)
    est_io = sum(o.times * o.io for o in est)
    kernel_flops = max(model.get("flops", 0.0), est_flops)
    kernel_bytes = max(model.get("bytes", 0.0) - est_io, 0.0) + est_bytes
    kernel_s = max(kernel_flops / peak, kernel_bytes / hbm)
    # FSDP over the recipe's whole target slice: the compile's one axis spans every torus dim there
    axis_size = {"fsdp": target_devices or devices}
    comm = xp.comm_by_axis(summary["collectives"], ici=ici, axis_dims={"fsdp": ici["torus_dims"]}, axis_size=axis_size)
    return {
        "compute_s": xla_s + kernel_s,
        "xla_s": xla_s,
        "kernel_s": kernel_s,
        "comm": comm,
        "xla_flops": sum(o.times * o.flops for o in ops if o.kind == "xla"),
        "xla_bytes": sum(o.times * o.bytes for o in ops if o.kind == "xla"),
        "kernel_flops": kernel_flops,
        "kernel_bytes": kernel_bytes,
        "estimated_kernel_calls": len(est),
        "unknown_trips": len(summary["unknown_trips"]),
        "collective_bytes": sum(c.times * c.bytes for c in summary["collectives"]),
    }


def hlo_bound(
    one: dict,
    two: dict,
    *,
    n_layers: int,
    generation: str,
    peak: float,
    hbm: float,
    model_flops: float,
    flops_per_token: dict,
    target_devices: int | None,
    ici: dict,
) -> dict:
    """The step-time bound of a recipe from its 1- and 2-layer programs: compute and each axis's
    collective time extrapolated to n_layers; step time fully exposed (compute + comm) and
    perfectly overlapped (max); MFU (palm, causal) against both, never above 100 %."""
    from tools import xla_projection as xp

    a, b = (program_times(c, peak=peak, hbm=hbm, ici=ici, target_devices=target_devices) for c in (one, two))
    compute = extrapolate_layers(a["compute_s"], b["compute_s"], n_layers)
    axes = sorted(set(a["comm"]) | set(b["comm"]))
    comm = {ax: extrapolate_layers(a["comm"].get(ax, 0.0), b["comm"].get(ax, 0.0), n_layers) for ax in axes}
    res = xp.bound(compute_s=compute, comm_s=sum(comm.values()), model_flops=model_flops, peak_flops=peak)
    tokens = one["tokens"]
    palm_over_causal = flops_per_token["palm"] / flops_per_token["causal"]
    out = {
        "hlo_compute_s": res["compute_s"],
        "hlo_compute_raw_s": compute,
        "comm_s": res["comm_s"],
        "comm_by_axis": ", ".join(f"{ax} {t:.3g} s" for ax, t in comm.items()) or "none",
        "step_exposed_s": res["step_exposed_s"],
        "step_overlapped_s": res["step_overlapped_s"],
        "mfu_causal_exposed": res["mfu_exposed_pct"],
        "mfu_causal_overlapped": res["mfu_overlapped_pct"],
        # the palm convention counts more FLOPs per token for the same step: capped at 100 %
        "mfu_palm_exposed": min(100.0, res["mfu_exposed_pct"] * palm_over_causal),
        "mfu_palm_overlapped": min(100.0, res["mfu_overlapped_pct"] * palm_over_causal),
        "tokens_per_sec_exposed": tokens / res["step_exposed_s"],
        "tokens_per_sec_overlapped": tokens / res["step_overlapped_s"],
        "fsdp_devices": target_devices,
        "hlo_xla_flops": extrapolate_layers(a["xla_flops"], b["xla_flops"], n_layers),
        "hlo_xla_bytes": extrapolate_layers(a["xla_bytes"], b["xla_bytes"], n_layers),
        "hlo_kernel_bytes": extrapolate_layers(a["kernel_bytes"], b["kernel_bytes"], n_layers),
        "hlo_collective_bytes": extrapolate_layers(a["collective_bytes"], b["collective_bytes"], n_layers),
        "kernel_calls_with_estimate": b["estimated_kernel_calls"],
        "loops_without_trip_count": b["unknown_trips"],
    }
    return out


# ------------------------------------------------------------------------------ the trainer's program

# The ATen ops of the expert-parallel dispatch and combine (parallelisms/expert_parallel.py
# `dispatch_combine_static`: the permutation of the routed rows by peer and by expert, their
# inverse, the counts), as jax names them in the HLO metadata's op_name, outside the kernels.
DISPATCH_SOURCES = re.compile(
    r"titan_program::ragged_all_to_all|aten::(?:index|index_put|_index_put_impl|scatter|scatter_add|gather|sort|"
    r"argsort|cumsum|bincount|histc|repeat_interleave|searchsorted)[.:/]"
)


def is_dispatch_op(op) -> bool:
    """An XLA op of the EP dispatch / combine: a permutation, scatter or count op
    (DISPATCH_SOURCES: index, gather, scatter, sort, cumsum ... as the HLO metadata names the ATen
    op) outside the kernels. Both dispatches build their buffers with them (the dropless one's
    sorted rows and worst-case receive buffer, the capacity one's [experts, batch x capacity]
    slots); the model's other ops are matmuls, elementwise and reductions."""
    return op.kind == "xla" and "titan_capture::" not in op.source and bool(DISPATCH_SOURCES.search(op.source))


def program_facts(recipe: Path, overrides: list[tuple[str, str]]) -> dict:
    """What the bound needs from a recipe with overrides: generation, peak, FLOPs per token,
    routed rows per device (tokens x top-k), the target's topology."""
    import planner
    from parallelisms.tpu_topology import topology_of
    from trainer.config import build_config, resolve_model_args
    from trainer.runtime.flops import TPU_PEAK_TFLOPS, flops_per_token

    cfg = build_config(str(recipe), list(overrides))
    _, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    shape = args.shape()
    target = planner.parse_target(cfg.job.target)
    gen = target.generation.name
    tokens = cfg.training.local_batch_size * cfg.training.seq_len * cfg.training.gradient_accumulation_steps
    return {
        "generation": gen,
        "target": target.name,
        "devices": target.devices,
        "chips": target.devices // (2 if gen == "v7x" else 1),
        "topology": topology_of(target),
        "peak": TPU_PEAK_TFLOPS[gen] * 1e12,
        "seq_len": cfg.training.seq_len,
        "tokens": tokens,
        "routed_rows": tokens * (getattr(shape, "top_k", 0) or 0),
        "ep": cfg.parallelism.expert_parallel_degree,
        "params": args.num_params(),
        "flops_per_token": flops_per_token(
            num_matmul_params=args.num_active_params(exclude_embedding=True),
            n_layers=shape.n_layers,
            n_heads=shape.n_heads,
            head_dim=shape.head_dim,
            seq_len=cfg.training.seq_len,
        ),
    }


def kernel_times(kernel_cost: dict, est_ops: list, *, routed_rows: int, peak: float, hbm: float) -> dict:
    """Seconds of the Pallas kernels per step, per kernel op. The capture model's count
    (tpu_compile's `kernel_cost`), with the grouped matmuls' FLOPs and bytes taken from megablox's
    own CostEstimate in the HLO where it has one (`est_ops`), and scaled from the worst-case buffer
    the program is compiled for (`rows`: every routed row of every peer landing here) to the rows a
    balanced routing brings (`routed_rows`): megablox's grid is sized on the device from the group
    sizes (its first operand, a scalar), so the tiles past the routed rows never run."""
    out = {}
    est_flops = sum(o.times * o.flops for o in est_ops)
    est_bytes = sum(o.times * o.bytes for o in est_ops)
    gmm_model = {k: v for k, v in kernel_cost.items() if k.startswith("gmm")}
    model_flops = sum(v["flops"] for v in gmm_model.values())
    for op, c in kernel_cost.items():
        flops, nbytes = c["flops"], c["bytes"]
        if op.startswith("gmm"):
            if est_ops and model_flops:  # megablox's estimate, split over gmm / gmm_bwd as the model splits
                share = flops / model_flops
                flops, nbytes = est_flops * share, est_bytes * share
            scale = min(1.0, routed_rows / c["rows"]) if c.get("rows") and routed_rows else 1.0
            flops, nbytes = flops * scale, nbytes * scale
        out[op] = {"flops": flops, "bytes": nbytes, "s": max(flops / peak, nbytes / hbm)}
    return out


def program_bound(res: dict, facts: dict, *, anchors: dict, placement=None, compute_s: float | None = None) -> dict:
    """The step-time bound of one compiled per-device program (`program_compile`'s result):
    compute = XLA ops (per-op roofline) + kernels (`kernel_times`), floored at the model's FLOPs;
    collectives priced where the mesh puts their groups on the torus (`placement`: default the
    compile's own; another size's for the weak scaling); the EP dispatch's share."""
    from tools import xla_projection as xp

    gen, peak = facts["generation"], facts["peak"]
    hbm = anchors["hbm_gbps_per_device"][gen] * 1e9
    ici = anchors["ici"][gen]
    topo = facts["topology"]
    own = xp.Placement(
        radices=list(res["radices"]),
        coords=[tuple(c) for c in res["device_coords"]],
        chips=topo.chips,
        wrap=topo.wrap[:3],
    )
    summary = xp.summarize(Path(res["hlo"]).read_text(), mesh=own.mesh)
    ops = summary["ops"]
    xla_s = xp.compute_time(ops, peak_flops=peak, hbm_bytes_per_s=hbm, kinds=("xla",))
    est = [o for o in ops if o.kind == "kernel"]
    kernels = kernel_times(res.get("kernel_cost", {}), est, routed_rows=facts["routed_rows"], peak=peak, hbm=hbm)
    kernel_s = sum(k["s"] for k in kernels.values())
    colls = summary["collectives"]
    comm = xp.comm_on_placement(colls, ici=ici, placement=placement or own)
    model_flops = facts["flops_per_token"]["causal"] * facts["tokens"]
    compute = xla_s + kernel_s if compute_s is None else compute_s
    b = xp.bound(compute_s=compute, comm_s=sum(comm.values()), model_flops=model_flops, peak_flops=peak)
    palm = facts["flops_per_token"]["palm"] / facts["flops_per_token"]["causal"]
    # the dispatch: its all-to-alls (ragged token exchange and the counts) and its permutation ops
    a2a = [c for c in colls if c.kind == "all-to-all"]
    a2a_s = sum(xp.comm_on_placement([c], ici=ici, placement=placement or own).get("+".join(c.axes), 0.0) for c in a2a)
    disp = [o for o in ops if is_dispatch_op(o)]
    disp_s = xp.compute_time(disp, peak_flops=peak, hbm_bytes_per_s=hbm, kinds=("xla",))
    return {
        "compute_s": b["compute_s"],
        "xla_s": xla_s,
        "kernel_s": kernel_s,
        "kernels": {k: v["s"] for k, v in kernels.items()},
        "comm_s": b["comm_s"],
        "comm_by_axis": comm,
        "step_exposed_s": b["step_exposed_s"],
        "step_overlapped_s": b["step_overlapped_s"],
        "mfu_causal_exposed": b["mfu_exposed_pct"],
        "mfu_causal_overlapped": b["mfu_overlapped_pct"],
        "mfu_palm_exposed": min(100.0, b["mfu_exposed_pct"] * palm),
        "mfu_palm_overlapped": min(100.0, b["mfu_overlapped_pct"] * palm),
        "tokens_per_s_exposed": facts["tokens"] / b["step_exposed_s"],
        "tokens_per_s_overlapped": facts["tokens"] / b["step_overlapped_s"],
        "a2a_bytes": sum(c.times * c.bytes for c in a2a),
        "a2a_s": a2a_s,
        "a2a_count": sum(c.times for c in a2a),
        "dispatch_ops_bytes": sum(o.times * o.bytes for o in disp),
        "dispatch_ops_s": disp_s,
        "collective_bytes": sum(c.times * c.bytes for c in colls),
        "loops_without_trip_count": len(summary["unknown_trips"]),
        "xla_bytes": sum(o.times * o.bytes for o in ops if o.kind == "xla"),
        "_collectives": colls,
        "_xla_ops": ops,
    }


PROGRAM_KIND = "projection (trainer's program)"


def program_row(
    name: str, overrides: list[tuple[str, str]], *, anchors: dict, timeout: float, cache: Path | None, compile=None
) -> dict:
    """One recipe's bound from the trainer's own per-device program (`program_compile`) with
    `overrides`; a row with `error` when it cannot be had."""
    compile = compile or program_compile
    recipe = recipe_path(name)
    label = name + "".join(f" {k}={v}" for k, v in overrides)
    try:
        facts = program_facts(recipe, overrides)
    except Exception as e:  # noqa: BLE001 - a row per recipe
        return {"recipe": label, "kind": PROGRAM_KIND, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    print(f"projection: {label}: the trainer's program for {facts['target']} ...", file=sys.stderr, flush=True)
    try:
        res = compile(recipe, overrides, timeout, cache)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {
            "recipe": label,
            "kind": PROGRAM_KIND,
            "target": facts["target"],
            "error": "failed: " + str(e).splitlines()[0][:200],
        }
    b = program_bound(res, facts, anchors=anchors)
    row = {
        "recipe": label,
        "base_recipe": name,
        "kind": PROGRAM_KIND,
        "target": facts["target"],
        "generation": facts["generation"],
        "seq_len": facts["seq_len"],
        "devices": facts["devices"],
        "chips": facts["chips"],
        "mesh": res.get("mesh"),
        "program": res.get("program"),
        "compile_s": res.get("compile_s"),
        "compiler_gib": res.get("compiler_gib"),
        "verdict": res.get("verdict"),
        "tokens": facts["tokens"],
        "routed_rows": facts["routed_rows"],
        **{k: v for k, v in b.items() if not k.startswith("_")},
    }
    row["comm_by_axis"] = ", ".join(f"{ax} {t:.3g} s" for ax, t in b["comm_by_axis"].items()) or "none"
    row["kernels"] = ", ".join(f"{k} {t:.3g} s" for k, t in b["kernels"].items())
    return row


WEAK_SCALING = {
    # recipe: device counts (a v7x chip is 2 devices): 8 .. 1,024 chips on v7x, 8 .. 256 on v6e
    "qwen3_235b_a22b_v7x": [16, 32, 64, 128, 256, 512, 1024, 2048],
    "qwen3_30b_a3b_v6e": [8, 16, 32, 64, 128, 256],
}


OPTIMIZER_BYTES_PER_PARAM = 34
"""HBM bytes per parameter of the step's state pass, over the devices that shard it: AdamW reads
the fp32 parameter, gradient and two moments and writes three of them back (28), the gradient
norm reads the gradient (4), the bf16 parameter copy is written (2)."""


def shard_compute(compute_at: float, at: int, n: int, *, params: int, hbm: float) -> float:
    """Compute seconds at n devices from one compiled size `at`: only the state's pass changes
    (`OPTIMIZER_BYTES_PER_PARAM` x params / devices at the HBM bandwidth)."""
    return compute_at + OPTIMIZER_BYTES_PER_PARAM * params * (1 / n - 1 / at) / hbm


def scale_compute(at: dict[int, float], n: int) -> float:
    """Compute seconds at n devices from two compiled sizes {m1: t1, m2: t2} of the same mesh
    structure: t = C + D / n (the state's shard scales as 1/n, the rest does not)."""
    (m1, t1), (m2, t2) = sorted(at.items())
    d = (t1 - t2) / (1 / m1 - 1 / m2)
    return t2 - d / m2 + d / n


def weak_scaling(
    name: str,
    sizes: list[int],
    *,
    anchors: dict,
    timeout: float,
    cache: Path | None,
    overrides: list[tuple[str, str]] = (),
    compiled: list[int] | None = None,
    compile=None,
) -> list[dict]:
    """Per-chip throughput bound of `name` at each device count in `sizes`, same per-device batch.

    The program is compiled at `compiled` sizes (default: the recipe's own; any other size already
    in the cache is read back and used). Between sizes nothing in the per-device program changes
    but the state's shard (parameters, gradients and moments over N devices: the optimizer's
    elementwise pass scales as 1/N) and the groups' sizes: the gathered and unsharded buffers, the
    activations, the dispatch (ep fixed) are the same bytes at every N. So at an uncompiled N:
    compute = the nearest compiled program's, with the state pass rescaled (`shard_compute`; or
    C + D / N fitted through two compiled sizes, `scale_compute`), and that program's collectives
    priced on N's own placement (torch-tpu's layout of the trainer's mesh on N's slice: the
    groups' sizes, the torus dims they span, the all-to-all's hops; a mesh axis of one device
    moves nothing). Efficiency: tokens/s per chip over the smallest size's."""
    from tools import xla_projection as xp

    compile = compile or program_compile
    recipe = recipe_path(name)
    label = name + "".join(f" {k}={v}" for k, v in overrides)
    base = program_facts(recipe, list(overrides))
    ep, gen = base["ep"], base["generation"]
    want = sorted(set(compiled or [base["devices"]]))

    def at_size(n: int) -> list[tuple[str, str]]:  # the recipe's own target: its own cache entry
        return list(overrides) + ([] if n == base["devices"] else [("job.target", f"{gen}-{n}")])

    progs: dict[int, tuple[dict, dict]] = {}
    for n in sorted(set(sizes) | set(want)):
        ovs = at_size(n)
        cached = cache is not None and (cache / f"{recipe.stem}{override_tag(ovs)}" / "program.json").is_file()
        if n not in want and not cached:
            continue
        try:
            res = compile(recipe, ovs, timeout, cache)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"weak scaling: {name} at {n}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
            continue
        progs[n] = (res, program_facts(recipe, ovs))
    rows = []
    for n in sorted(sizes):
        facts = program_facts(recipe, at_size(n))
        if n in progs:
            res, f = progs[n]
            b = program_bound(res, f, anchors=anchors)
            how = "compiled"
        else:
            same = sorted(m for m, (r, _) in progs.items() if len(r["radices"]) == 2)
            if not same:
                rows.append({"recipe": label, "devices": n, "error": "no compiled size to scale from"})
                continue
            raw = {}
            for m in same:
                b_ = program_bound(*progs[m], anchors=anchors)
                raw[m] = b_["xla_s"] + b_["kernel_s"]
            near = min(same, key=lambda m: abs(m - n))
            if len(same) >= 2:
                lo = max([m for m in same if m < n] or same[:1])
                hi = min([m for m in same if m > n] or same[-1:])
                if lo == hi:
                    lo, hi = same[-2], same[-1]
                compute = scale_compute({lo: raw[lo], hi: raw[hi]}, n)
                how = f"compute fitted through {lo} and {hi}"
            else:
                hbm = anchors["hbm_gbps_per_device"][gen] * 1e9
                compute = shard_compute(raw[near], near, n, params=base["params"], hbm=hbm)
                how = f"compute of {near} + the state pass at 1/{n}"
            place = xp.placement_of(topology_of_target(f"{gen}-{n}"), (1, n, 1, 1), [max(n // ep, 1), ep], ep=ep)
            b = program_bound(progs[near][0], facts, anchors=anchors, placement=place, compute_s=compute)
            how += f"; collectives of {near} priced on {n}'s placement"
        rows.append(
            {
                "recipe": label,
                "devices": n,
                "chips": facts["chips"],
                "how": how,
                "compute_s": b["compute_s"],
                "comm_s": b["comm_s"],
                "comm_by_axis": ", ".join(f"{ax} {t:.3g}" for ax, t in b["comm_by_axis"].items()),
                "step_exposed_s": b["step_exposed_s"],
                "step_overlapped_s": b["step_overlapped_s"],
                "tokens_per_device_s_exposed": b["tokens_per_s_exposed"],
                "tokens_per_device_s_overlapped": b["tokens_per_s_overlapped"],
                "mfu_palm_exposed": b["mfu_palm_exposed"],
                "mfu_palm_overlapped": b["mfu_palm_overlapped"],
            }
        )
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        for way in ("exposed", "overlapped"):
            r[f"efficiency_{way}"] = 100.0 * r[f"tokens_per_device_s_{way}"] / ok[0][f"tokens_per_device_s_{way}"]
    return rows


def topology_of_target(name: str):
    """parallelisms.tpu_topology's Topology of a planner target name (v7x-512)."""
    import planner
    from parallelisms.tpu_topology import topology_of

    return topology_of(planner.parse_target(name))


# ------------------------------------------------------------------------------ output

PROJECTION_NOTE = [
    'Method (docs/benchmarks.md, "Projections"): the recipe\'s step compiled for a small slice (1 and 2 layers, '
    "scan off, FSDP-style over one mesh axis) and extrapolated to its layers. Compute: per executed op of the "
    "optimized HLO, max(FLOPs / peak, HBM bytes / bandwidth), loop bodies times their trip count, plus the Pallas "
    "kernels (capture model; megablox's own CostEstimate bytes where the HLO carries one), floored at the model's "
    "FLOPs (causal). Collectives: each one's bytes over the ICI bandwidth of the torus dims its mesh axis spans "
    "at the recipe's target slice (FSDP over all of it), ring (n-1)/n with n the target's axis size "
    "(tools/xla_projection.py; ICI table in assets/anchors.toml). Overlap is an assumption, shown both ways: "
    "exposed = compute + collectives, overlapped = max(compute, collectives). Every number is an upper bound on "
    "MFU: rated bandwidths, ideal rings, no kernel inefficiency, no host overhead; the palm convention is capped "
    "at 100 %.",
]


PROGRAM_NOTE = [
    'Method (docs/benchmarks.md, "Projections"): the per-device program the trainer emits on the recipe\'s '
    "target (tools/tpu_compile.py: the fake world at the target's size, the real plan with expert parallelism, "
    "the EP dispatch and its all-to-alls (ragged when dropless, equal-split with a capacity), every collective as the trainer writes it, the Pallas kernels), "
    "compiled deviceless at full depth with the recipe's layer scan (loop bodies times their trip counts: "
    "nothing extrapolated). Compute: XLA ops per-op roofline + kernels (capture model; megablox's CostEstimate "
    "scaled from the worst-case receive buffer to the routed rows, its grid being sized on the device); "
    "collectives priced where torch-tpu's layout puts each group on the torus (groups' sizes, torus dims, "
    "all-to-all mean hops, a chip's links shared by its cores). Routing: the program's shapes are static and "
    "worst-case, so learned and random routing compile to the same buffers; the bound prices the gmm at the "
    "balanced rows, which random routing gives and learned routing only approaches.",
]


def anchor_for(anchors: dict, recipe: str) -> dict | None:
    return next((a for a in anchors.get("anchor", []) if a.get("recipe") == recipe), None)


def program_table(rows: list[dict], anchors: dict) -> list[str]:
    """The bound of each MoE recipe from the trainer's program, beside MaxText's run."""
    out = [
        "| recipe (projection, trainer's program) | target (chips) | compute s (XLA ops + kernels) | collectives s "
        "(per mesh axis) | step s exposed / overlapped | MFU % palm, exposed / overlapped | MFU % causal, exposed / "
        "overlapped | published | ratio ours / published, exposed / overlapped | EP all-to-all GB / s | dispatch "
        "ops GB / s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['recipe']} | {r.get('target', '-')} | {r['error']} |" + " - |" * 8)
            continue
        a = anchor_for(anchors, r.get("base_recipe", r["recipe"]))
        pub, ratio = "-", "-"
        if a:
            conv = a.get("convention")
            ref = a.get("mfu_pct_palm") if a.get("mfu_pct_palm") else a.get("mfu_pct")
            conv = "palm" if a.get("mfu_pct_palm") else conv
            pub = f"{ref} % {conv} ({a['framework']}, {a.get('chips', '?')} chips, seq {a.get('seq_len', '?')})"
            if conv in ("palm", "causal"):
                ratio = f"{r[f'mfu_{conv}_exposed'] / ref:.2f} / {r[f'mfu_{conv}_overlapped'] / ref:.2f}"
        out.append(
            f"| {r['recipe']} | {r['target']} ({r['chips']}) | {r['compute_s']:.3g} ({r['xla_s']:.3g} + "
            f"{r['kernel_s']:.3g}) | {r['comm_s']:.3g} ({r['comm_by_axis']}) | {r['step_exposed_s']:.3g} / "
            f"{r['step_overlapped_s']:.3g} | {r['mfu_palm_exposed']:.1f} / {r['mfu_palm_overlapped']:.1f} | "
            f"{r['mfu_causal_exposed']:.1f} / {r['mfu_causal_overlapped']:.1f} | {pub} | {ratio} | "
            f"{r['a2a_bytes'] / 1e9:.3g} / {r['a2a_s']:.3g} | {r['dispatch_ops_bytes'] / 1e9:.3g} / "
            f"{r['dispatch_ops_s']:.3g} |"
        )
    return out


def weak_table(rows: list[dict]) -> list[str]:
    out = [
        "| recipe | chips (devices) | how | compute s | collectives s (per axis) | step s exposed / overlapped | "
        "tokens/s per chip, exposed / overlapped | weak-scaling efficiency %, exposed / overlapped | "
        "MFU % palm, exposed / overlapped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['recipe']} | - ({r['devices']}) | {r['error']} |" + " - |" * 6)
            continue
        per_chip = r["devices"] / r["chips"]
        out.append(
            f"| {r['recipe']} | {r['chips']} ({r['devices']}) | {r['how']} | {r['compute_s']:.3g} | "
            f"{r['comm_s']:.3g} ({r['comm_by_axis']}) | {r['step_exposed_s']:.3g} / {r['step_overlapped_s']:.3g} | "
            f"{r['tokens_per_device_s_exposed'] * per_chip:.0f} / {r['tokens_per_device_s_overlapped'] * per_chip:.0f} | "
            f"{r['efficiency_exposed']:.1f} / {r['efficiency_overlapped']:.1f} | {r['mfu_palm_exposed']:.1f} / "
            f"{r['mfu_palm_overlapped']:.1f} |"
        )
    return out


ANNOUNCED_WEAK_SCALING = (8, 1024, 93.0)
"""The TorchTitan-on-TPU launch announcement's Qwen3-235B weak scaling, 8 -> 1,024 chips, in % (no
stored primary source: /work/shared/reference/anchors.md section 3.6 marks it unverified)."""


def write_weak_plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        pts = sorted(
            (r["chips"], r["efficiency_exposed"], r["efficiency_overlapped"])
            for r in rows
            if r["recipe"] == recipe and "error" not in r
        )
        if not pts:
            continue
        xs = [p[0] for p in pts]
        (line,) = ax.plot(xs, [p[2] for p in pts], marker="o", label=f"{recipe} (overlapped)")
        ax.plot(xs, [p[1] for p in pts], marker="x", ls="--", color=line.get_color(), label=f"{recipe} (exposed)")
    lo, hi, pct = ANNOUNCED_WEAK_SCALING
    ax.scatter(
        [hi],
        [pct],
        marker="*",
        s=150,
        color="black",
        zorder=3,
        label=f"announced {pct:.0f} % ({lo}->{hi} chips, unverified)",
    )
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="chips",
        ylabel="tokens/s per chip, % of the smallest size",
        title="weak scaling, projected (upper bound)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out.with_name(out.name + "_weak_scaling.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def measured_table(rows: list[dict]) -> list[str]:
    lines = [
        "| recipe | mode | nproc | ok | dtype | tok/s/dev | tok/s total | TFLOP/s/dev | MFU % (palm) | "
        "MFU % (causal) | MFU % vs best dtype | peak / best TFLOP/s | cpu busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['mode']} | {r['nproc']} | {r['ok']}/{r['runs']} | {r['dtype'] or '-'} | "
            f"{_fmt(r['tokens_per_sec'], ',.0f')} | {_fmt(r['tokens_per_sec_total'], ',.0f')} | "
            f"{_fmt(r['tflops'], '.3g')} | {_fmt(r['mfu_pct'], '.2f')} | {_fmt(r['mfu_pct_causal'], '.2f')} | "
            f"{_fmt(r['mfu_pct_best'], '.2f')} | {_fmt(r['peak_tflops'], '.3g')} / "
            f"{_fmt(r['peak_tflops_best'], '.3g')} | {_fmt(r['busy_before'], '.2f')} |"
        )
    return lines


def projection_table(rows: list[dict]) -> list[str]:
    """The step-time bound per recipe (compute + collectives from the compiled HLO), beside the
    plain roofline it replaces."""
    lines = [
        "| recipe (projection) | compiled for -> FSDP over | compute s | collectives s (per axis) | "
        "step s exposed / overlapped | tok/s/dev exposed / overlapped | upper bound on MFU % causal, "
        "exposed / overlapped | upper bound on MFU % palm, exposed / overlapped | roofline MFU % palm (old) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r.get('target', '-')} | {r['error']} |  |  |  |  |  |  |")
            continue
        if "step_exposed_s" not in r:
            lines.append(
                f"| {r['recipe']} | {r['target']} | {r.get('bound_note', '-')} |  |  |  |  |  | {r['mfu_pct']:.1f} |"
            )
            continue
        lines.append(
            f"| {r['recipe']} | {r['target']} -> {r.get('fsdp_devices') or '-'} devices | {r['hlo_compute_s']:.3g} | "
            f"{r['comm_s']:.3g} ({r['comm_by_axis']}) | {r['step_exposed_s']:.3g} / {r['step_overlapped_s']:.3g} | "
            f"{r['tokens_per_sec_exposed']:,.0f} / {r['tokens_per_sec_overlapped']:,.0f} | "
            f"{r['mfu_causal_exposed']:.1f} / {r['mfu_causal_overlapped']:.1f} | "
            f"{r['mfu_palm_exposed']:.1f} / {r['mfu_palm_overlapped']:.1f} | {r['mfu_pct']:.1f} |"
        )
    return lines


def counts_table(rows: list[dict]) -> list[str]:
    """What the bound was made of, per recipe (per device and step, at the recipe's layers)."""
    lines = [
        "| recipe | XLA-op FLOPs (HLO / compiler) | XLA-op HBM bytes (HLO / compiler) | kernel bytes "
        "(CostEstimate where carried) | collective bytes | calls with a CostEstimate | loops without a trip "
        "count | model FLOPs (causal) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "step_exposed_s" not in r:
            continue
        lines.append(
            f"| {r['recipe']} | {r['hlo_xla_flops']:.3e} / {_fmt(r.get('compiler_xla_flops'), '.3e')} | "
            f"{r['hlo_xla_bytes']:.3e} / {_fmt(r.get('compiler_xla_bytes'), '.3e')} | {r['hlo_kernel_bytes']:.3e} | "
            f"{r['hlo_collective_bytes']:.3e} | {r['kernel_calls_with_estimate']} | "
            f"{r['loops_without_trip_count']} | {r['model_flops_per_step']:.3e} |"
        )
    return lines


def anchor_match(anchor: dict, mine: dict, ici: dict) -> bool:
    """Whether a published run has our projection's model, chip count and sequence length."""
    if mine.get("kind") != "projection" or anchor.get("recipe") != mine.get("recipe"):
        return False
    per_chip = ici.get(anchor["hardware"], {}).get("devices_per_chip", 1)
    chips_ok = anchor.get("chips") is not None and mine.get("fsdp_devices") == anchor["chips"] * per_chip
    return chips_ok and anchor.get("seq_len") == mine.get("seq_len")


def anchor_table(anchors: dict, ours: dict[str, dict]) -> list[str]:
    """Each published anchor beside our row for its recipe (measured or projection); for a
    projection of the same model, chip count and sequence length, the ratio of our bound's
    tokens/s per device to the published (overlapped / exposed)."""
    lines = [
        "| published | framework | hardware | size | seq | tok/s/dev | MFU % (as published) | MFU % (palm) | "
        "ours (recipe) | ours tok/s/dev (overlapped / exposed) | ours MFU % (palm / causal, overlapped) | "
        "ratio ours / published (overlapped / exposed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ici = anchors.get("ici", {})
    for a in anchors.get("anchor", []):
        size = a.get("slice") or f"{a.get('chips', '?')} chips"
        mine = ours.get(a.get("recipe", ""), {})
        label = a.get("recipe", "-")
        if mine:
            label += f" ({mine.get('kind', 'measured')})"
        published = anchor_per_device(a)
        if "tokens_per_sec_overlapped" in mine:
            tps = f"{mine['tokens_per_sec_overlapped']:,.0f} / {mine['tokens_per_sec_exposed']:,.0f}"
            mfu = f"{mine['mfu_palm_overlapped']:.1f} / {mine['mfu_causal_overlapped']:.1f}"
            if published and anchor_match(a, mine, ici):
                ratio = (
                    f"{mine['tokens_per_sec_overlapped'] / published:.2f} / "
                    f"{mine['tokens_per_sec_exposed'] / published:.2f}"
                )
            else:
                ratio = "not the same chips / seq"
        else:
            tps = _fmt(mine.get("tokens_per_sec"), ",.0f")
            mfu = f"{_fmt(mine.get('mfu_pct'), '.1f')} / {_fmt(mine.get('mfu_pct_causal'), '.1f')}"
            ratio = "-"
        lines.append(
            f"| {a['model']} | {a['framework']} | {a['hardware']} | {size} | {a.get('seq_len', '-')} | "
            f"{_fmt(published, ',.0f')} | {a['mfu_pct']:g} ({a['convention']}) | "
            f"{_fmt(a.get('mfu_pct_palm'), 'g')} | {label} | {tps} | {mfu} | {ratio} |"
        )
    lines.append("")
    lines.append(
        "Sources: assets/anchors.toml (each anchor's `source` and `note`). v7x per-chip numbers are halved "
        "to per device; MFU is the same either way. The ratio is printed only where the published run has "
        "the recipe's model, chip count and sequence length (batch per device and parallelism may differ: "
        "see each anchor's note); tokens/s per device, so no MFU convention enters it."
    )
    return lines


def write_plots(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for recipe, mode in dict.fromkeys((r["recipe"], r["mode"]) for r in rows):
        pts = sorted(
            (r["nproc"], r["tokens_per_sec_total"], r["mfu_pct"], r["mfu_pct_causal"])
            for r in rows
            if r["recipe"] == recipe and r["mode"] == mode and r["tokens_per_sec"] is not None
        )
        if not pts:
            continue
        xs = [p[0] for p in pts]
        (line,) = ax_t.plot(xs, [p[1] for p in pts], marker="o", label=f"{recipe} {mode}")
        ax_m.plot(xs, [p[2] for p in pts], marker="o", color=line.get_color(), label=f"{recipe} {mode} (palm)")
        ax_m.plot(
            xs, [p[3] for p in pts], marker="x", ls="--", color=line.get_color(), label=f"{recipe} {mode} (causal)"
        )
    for ax in (ax_t, ax_m):
        ax.set_xticks(sorted({r["nproc"] for r in rows}))
    ax_t.set(xlabel="devices (processes)", ylabel="tokens/s, all devices", title="throughput vs devices")
    ax_m.set(xlabel="devices (processes)", ylabel="MFU % per device", title="MFU vs devices")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out.with_name(out.name + "_vs_devices.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    nmin = min((r["nproc"] for r in rows), default=1)
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        sel = [
            next((r for r in rows if r["recipe"] == rc and r["mode"] == mode and r["nproc"] == nmin), None)
            for rc in recipes
        ]
        xs = [j + i * width for j in range(len(recipes))]
        ax_t.bar(xs, [(r or {}).get("tokens_per_sec") or 0 for r in sel], width, label=mode)
        ax_m.bar(xs, [(r or {}).get("mfu_pct") or 0 for r in sel], width, label=f"{mode} (palm)")
        ax_m.scatter(
            xs,
            [(r or {}).get("mfu_pct_causal") or 0 for r in sel],
            marker="_",
            s=200,
            color="black",
            zorder=3,
            label="causal" if i == 0 else None,
        )
    for ax, ylabel in ((ax_t, "tokens/s per device"), (ax_m, "MFU % per device")):
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(recipes))], recipes)
        ax.set(ylabel=ylabel, title=f"{ylabel.split(' per')[0]} vs mode ({nmin} process{'es' if nmin > 1 else ''})")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out.with_name(out.name + "_vs_mode.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def machine_line() -> str:
    import torch

    from trainer.runtime.device import cpu_model

    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    load = f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"
    return f"{cpu_model()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={threads}, torch {torch.__version__}, load average {load}"


def git_commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


# ------------------------------------------------------------------------------ main


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma list of recipe names (configs/) or paths")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list of {', '.join(bench.VARIANTS)}")
    p.add_argument("--nproc", default="1,2", help="comma list of process counts (devices)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps dropped (compile, caches)")
    p.add_argument(
        "--project",
        default="pods",
        help="recipes to project from the deviceless compile: 'pods' (LM *_v6e/*_v7x), a comma list, or 'none'",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the projections from the trainer's program (repeatable), e.g. "
        "moe.capacity_factor=1.25",
    )
    p.add_argument(
        "--routing",
        default="learned",
        help="routing of the expert-parallel projections: learned, random (the benchmark routing) or both",
    )
    p.add_argument(
        "--weak-scaling",
        default="none",
        help="recipes whose weak scaling to project (same per-device batch, device counts of WEAK_SCALING): "
        "'default' (" + ", ".join(WEAK_SCALING) + "), a comma list of those, or 'none'",
    )
    p.add_argument(
        "--hlo-cache",
        default=None,
        help="folder for the projections' compiles (JSON + optimized HLO per recipe, slice and layer "
        "count); a compile found there is read back, not redone",
    )
    p.add_argument("--out", default=None, help="output stem (default outputs/mfu_suite/<time>/mfu_suite)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per process (default: inherited, else 1)")
    p.add_argument("--max-busy", type=float, default=0.25)
    p.add_argument("--max-wait", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run and per compile")
    p.add_argument("--dry-run", action="store_true", help="print the trainer commands only")
    p.add_argument(
        "--resume",
        action="store_true",
        help="read, not rerun, the runs whose folder under --out already holds a record of the last step",
    )
    return p.parse_args(argv), extra


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except InputError as e:  # a bad flag: ConfigError, through cli.run
        cli.error_line(str(e))
        return 2


def _main(argv: list[str]) -> int:
    ns, extra = parse(argv)
    recipes = [r.strip() for r in ns.recipes.split(",") if r.strip()]
    paths = {r: recipe_path(r) for r in recipes}
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
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
    project_names = (
        pod_recipes()
        if ns.project == "pods"
        else []
        if ns.project == "none"
        else [r.strip() for r in ns.project.split(",") if r.strip()]
    )
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
        else [r.strip() for r in ns.weak_scaling.split(",") if r.strip()]
    )
    for name in weak_names:
        if name not in WEAK_SCALING:
            raise InputError(f"--weak-scaling: {name!r}; allowed: default, none or {', '.join(WEAK_SCALING)}")
    if not ns.dry_run and importlib.util.find_spec("matplotlib") is None:  # before any run
        raise InputError(
            "scripts/mfu_suite.py: matplotlib is not installed (its plots need it); "
            "install the bench extra: pip install '.[bench]'"
        )
    out = Path(ns.out) if ns.out else ROOT / "outputs" / "mfu_suite" / time.strftime("%Y%m%d-%H%M%S") / "mfu_suite"
    out.parent.mkdir(parents=True, exist_ok=True)
    root = out.parent / f"{out.name}_runs"

    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(ns.threads) if ns.threads else env.get("OMP_NUM_THREADS", "1")
    jobs = []
    for rep in range(ns.repeats):  # interleaved: slow drift of the machine spreads over every group
        for recipe in recipes:
            for mode in modes:
                for nproc in nprocs:
                    folder = root / f"{recipe}-{mode}-n{nproc}-r{rep}"
                    cmd = bench.build_command(
                        recipe=str(paths[recipe]),
                        overrides=bench.VARIANTS[mode],
                        nproc=nproc,
                        dump_folder=str(folder),
                        steps=ns.steps,
                        extra=extra,
                    )
                    jobs.append(
                        {"recipe": recipe, "mode": mode, "nproc": nproc, "repeat": rep, "cmd": cmd, "folder": folder}
                    )
    if ns.dry_run:
        for job in jobs:
            print(shlex.join(job["cmd"]))
        return 0

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
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
    rows = group_runs(runs)

    anchors = load_anchors()
    cache = Path(ns.hlo_cache) if ns.hlo_cache else None
    projections, skipped = project(
        project_names, anchors=anchors, timeout=ns.timeout, cache=cache, overrides=overrides, routings=routings
    )
    if skipped:
        print(f"projections skipped: {skipped}", file=sys.stderr)
    programs = [p for p in projections if p.get("kind") == PROGRAM_KIND]
    projections = [p for p in projections if p not in programs]
    weak = []
    if weak_names and xla_venv()[0] is not None:
        for name in weak_names:
            weak += weak_scaling(
                name, WEAK_SCALING[name], anchors=anchors, timeout=ns.timeout, cache=cache, overrides=overrides
            )

    ours: dict[str, dict] = {}
    for p in projections:
        if "error" not in p:
            ours[p["recipe"]] = p
    for r in rows:  # a measured row (the largest process count) wins over a projection
        if r["tokens_per_sec"] is not None:
            ours[r["recipe"]] = {**r, "kind": f"measured, {r['mode']}, {r['nproc']} dev"}

    bench.write_csv(out.with_suffix(".csv"), rows + [{**p, "mode": "projection"} for p in projections])
    if programs:
        bench.write_csv(out.with_name(out.name + "_programs.csv"), programs)
    if weak:
        bench.write_csv(out.with_name(out.name + "_weak_scaling.csv"), weak)
    bench.write_csv(out.with_name(out.name + "_runs.csv"), runs)
    pngs = write_plots(rows, out)
    if weak:
        pngs.append(write_weak_plot(weak, out))
    command = "python scripts/mfu_suite.py " + shlex.join(argv)
    md = [
        f"# MFU suite, {started}",
        "",
        f"- machine: {machine_line()}",
        f"- commit: {git_commit()}",
        f"- command: `{command}`",
        f"- {ns.steps} steps per run, first {ns.warmup} dropped; median over steps, then over {ns.repeats} "
        "repeat(s) (interleaved)",
        "- MFU conventions: palm = 6N + 12·L·H·Q·T per token (TorchTitan; `mfu_pct`), causal = attention halved "
        "(MaxText; `mfu_pct_causal`); 'vs best dtype' divides by the faster CPU compute dtype's peak "
        "(docs/metrics.md)",
        "",
        "## Measured",
        "",
        *measured_table(rows),
        "",
        "## Projections: upper bounds on MFU from the compiled program (deviceless XLA:TPU compile; not measured)",
        "",
    ]
    if projections:
        md += [
            *projection_table(projections),
            "",
            *PROJECTION_NOTE,
            "",
            "What the bound is made of (per device and step):",
            "",
            *counts_table(projections),
            "",
        ]
    elif not programs:
        md.append(f"Skipped: {skipped}.")
    if programs:
        md += [
            "### Expert parallelism in the bound: the trainer's own per-device program",
            "",
            *program_table(programs, anchors),
            "",
            *PROGRAM_NOTE,
            "",
        ]
    if weak:
        md += ["### Weak scaling, projected (same per-device batch)", "", *weak_table(weak), ""]
    md += [
        "",
        "## Published anchors beside ours",
        "",
        *anchor_table(anchors, ours),
        "",
        *[f"![{p.stem}]({p.name})" for p in pngs],
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"\nwrote {out.with_suffix('.csv')}, {out.with_suffix('.md')}, " + ", ".join(str(p) for p in pngs))
    return 0 if all(r["ok"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
