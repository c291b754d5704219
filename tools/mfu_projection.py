"""The projections of scripts/mfu_suite.py (`--project`, `--weak-scaling`): a pod recipe's step-time
bound from its compiled per-device program, without a TPU (docs/benchmarks.md, "Projections").

- the FSDP projection's arithmetic: `roofline` of the compiler's totals, `extrapolate_layers`
  from the 1- and 2-layer programs, `hlo_bound` from their optimized HLO (tools/xla_projection.py);
- the trainer's own program (the expert-parallel recipes): `program_compile` (tools/tpu_compile.py,
  the HLO dump kept, cached), `program_bound` (XLA ops, kernels at the routed rows, collectives on
  torch-tpu's placement, the EP dispatch's share), `program_row`;
- `weak_scaling`: the bound at other device counts, a few compiles, the rest scaled.

The compile of the FSDP projection (scripts/estimate_xla.py) and the choice of what to project stay
in the script.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class InputError(Exception):
    """Bad input: printed as one `error:` line, exit 2."""


def recipe_path(name: str) -> Path:
    """`llama3_debug` or a path -> the recipe file; InputError when there is none."""
    path = Path(name) if name.endswith(".toml") else ROOT / "configs" / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))
        raise InputError(f"--recipes: no recipe {name!r} ({path}); allowed: {', '.join(known)} or a .toml path")
    return path


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


def override_tag(overrides: list[tuple[str, str]]) -> str:
    """A folder-safe tag of a compile's overrides ('' without any): the cache key's part; a long
    one (a folder name has 255 bytes) becomes a hash of itself."""
    tag = "".join(f"+{k}={v}" for k, v in overrides).replace("/", "_")
    return tag if len(tag) <= 120 else "+" + hashlib.sha1(tag.encode()).hexdigest()[:16]


def recipe_key(recipe: Path) -> str:
    """What a kept compile is keyed by: the recipe's values (its TOML parsed, keys sorted), not its
    bytes, so a header comment quoting the compile's own figures does not make it stale."""
    import tomllib

    values = tomllib.loads(recipe.read_text())
    return hashlib.sha1(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:12]


def program_compile(recipe: Path, overrides: list[tuple[str, str]], timeout: float, cache: Path | None = None) -> dict:
    """The per-device program the trainer emits for `recipe` on its `[job] target` (with
    `overrides`, e.g. job.target=v7x-16 or moe.routing=random), compiled deviceless by
    tools/tpu_compile.py at full depth (layer scan as the recipe has it: XLA's loops carry their
    trip counts, so nothing is extrapolated), with XLA's dump of the optimized HLO kept.
    With `cache`, a compile already under cache/<recipe><tag>/ is read back, not redone."""
    from tools.deviceless_env import with_xla_flags
    from tools.tpu_compile import compile_flags, compile_recipe

    base = cache or Path(os.environ.get("TMPDIR", "/tmp")) / "titan_mfu_hlo"
    folder = base / f"{recipe.stem}{override_tag(overrides)}"
    result, hlo_path = folder / "program.json", folder / "program.after_optimizations.txt"
    sha, file_sha = recipe_key(recipe), hashlib.sha1(recipe.read_bytes()).hexdigest()[:12]
    stale = False
    if result.is_file():  # a kept compile of other recipe values, or under other flags, is redone
        kept = json.loads(result.read_text())  # (one kept before either was recorded is read back;
        stale = kept.get("recipe_sha", sha) not in (sha, file_sha)  # one keyed by the file's bytes too)
        stale = stale or ("flags" in kept and kept["flags"] != compile_flags(str(recipe), overrides))
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
        data["recipe_sha"] = sha
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


def recipe_facts(recipe: Path) -> dict:
    """From a recipe: generation, layers, FLOPs per token (both conventions), and the host bytes
    the 2-layer compile's capture needs."""
    from trainer.config import build_config, resolve_model_args
    from trainer.runtime.flops import model_flops_per_token, tpu_generation

    cfg = build_config(str(recipe), [])
    _, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    shape = args.shape()
    gen = tpu_generation(recipe.stem.rsplit("_", 1)[-1])
    fpt = model_flops_per_token(args, cfg.training.seq_len)
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


ROUTINGS = {"learned": [], "random": [("moe.routing", "random"), ("moe.routing_benchmark_only", "true")]}


def expert_parallel(recipe: Path) -> bool:
    """The recipe runs its experts over an expert-parallel mesh (ep > 1)."""
    from trainer.config import build_config

    return build_config(str(recipe), []).parallelism.expert_parallel_degree > 1


def program_times(
    costs: dict, *, peak: float, hbm: float, ici: dict, target_devices: int | None, generation: str = ""
) -> dict:
    """One compiled program (one layer count): compute seconds (per-op roofline of the XLA ops,
    plus the Pallas kernels) and collective seconds per mesh axis, from its optimized HLO."""
    from tools import xla_hlo
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
    # the scheduled prediction (docs/maxtext_calibration.md): the program walked in XLA's schedule,
    # each FLOP at MXU_EFFICIENCY of the peak, the collectives at the target's axis size
    eff = peak * xp.MXU_EFFICIENCY
    kernel_eff = max(kernel_flops / eff, kernel_bytes / hbm)
    hlo = xp.parse_hlo(Path(costs["hlo"]).read_text())
    tile = 256 if generation in ("v6e", "v7x") else 128
    from tools.mfu_report import load_anchors

    rates = xla_hlo.peak_rates(load_anchors(), generation)
    sched = xp.scheduled(
        hlo,
        colls=summary["collectives"],
        ici=ici,
        placement=None,
        seconds=schedule_seconds(ops, kernel_eff, peak=eff, hbm=hbm, tile=tile, hlo=hlo, rates=rates),
        host_bytes_per_s=xp.host_link_bytes_per_s(generation, ici),
        price=lambda c: sum(
            xp.comm_by_axis([c], ici=ici, axis_dims={"fsdp": ici["torus_dims"]}, axis_size=axis_size).values()
        ),
    )
    kernel_calls = any(o.kind in ("kernel", "kernel-unestimated") for o in ops)
    return {
        "step_scheduled_s": sched.step_s + (0.0 if kernel_calls else kernel_eff),
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


def schedule_seconds(
    ops: list, kernel_s: float, *, peak: float, hbm: float, tile: int, hlo=None, rates: dict | None = None
) -> dict:
    """Seconds of one run of each op for the scheduled walk: XLA ops at max(MXU FLOPs / peak, bytes /
    HBM) (`peak` already the efficient rate, the bf16 one; a float8 / int8 dot's MXU FLOPs over its
    rate, `rates`: xla_hlo.peak_rates), the kernels' `kernel_s` an equal share per call."""
    from tools import xla_hlo

    mxu = xla_hlo.mxu_flops(hlo, tile, rates) if hlo is not None else {}
    seconds = {o.name: max(mxu.get(o.name, o.flops) / peak, o.bytes / hbm) for o in ops if o.kind == "xla"}
    calls = [o for o in ops if o.kind in ("kernel", "kernel-unestimated")]
    n = sum(o.times for o in calls)
    for o in calls:
        seconds[o.name] = kernel_s / n
    return seconds


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

    a, b = (
        program_times(c, peak=peak, hbm=hbm, ici=ici, target_devices=target_devices, generation=generation)
        for c in (one, two)
    )
    compute = extrapolate_layers(a["compute_s"], b["compute_s"], n_layers)
    axes = sorted(set(a["comm"]) | set(b["comm"]))
    comm = {ax: extrapolate_layers(a["comm"].get(ax, 0.0), b["comm"].get(ax, 0.0), n_layers) for ax in axes}
    res = xp.bound(compute_s=compute, comm_s=sum(comm.values()), model_flops=model_flops, peak_flops=peak)
    tokens = one["tokens"]
    palm_over_causal = flops_per_token["palm"] / flops_per_token["causal"]
    step = max(extrapolate_layers(a["step_scheduled_s"], b["step_scheduled_s"], n_layers), model_flops / peak)
    out = {
        # the headline: one step time, the programs walked in XLA's schedule (bounds: below)
        "step_scheduled_s": step,
        "mfu_causal_scheduled": 100.0 * model_flops / (peak * step),
        "mfu_palm_scheduled": min(100.0, 100.0 * model_flops / (peak * step) * palm_over_causal),
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
    from trainer.runtime.flops import TPU_PEAK_TFLOPS, model_flops_per_token

    cfg = build_config(str(recipe), list(overrides))
    _, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    shape = args.shape()
    target = planner.parse_target(cfg.job.target)
    gen = target.generation.name
    # a context-parallel group shares its sequences (each device trains on seq_len / cp of them), and
    # so does a tensor-parallel group (local_batch_size is per dp rank: its tp devices split the work)
    cp, tp = cfg.parallelism.context_parallel_degree, cfg.parallelism.tensor_parallel_degree
    tokens = (
        cfg.training.local_batch_size * cfg.training.seq_len * cfg.training.gradient_accumulation_steps // (cp * tp)
    )
    return {
        "generation": gen,
        "target": target.name,
        "devices": target.devices,
        # (query-key, value) head dims: the splash kernels' MXU fill (MLA: 192 / 128)
        "head_dims": (getattr(args, "qk_head_dim", shape.head_dim), getattr(args, "v_head_dim", shape.head_dim)),
        "chips": target.devices // (2 if gen == "v7x" else 1),
        "topology": topology_of(target),
        "peak": TPU_PEAK_TFLOPS[gen] * 1e12,
        "seq_len": cfg.training.seq_len,
        "tokens": tokens,
        "routed_rows": tokens * (getattr(shape, "top_k", 0) or 0),
        "ep": cfg.parallelism.expert_parallel_degree,
        "params": args.num_params(),
        "flops_per_token": model_flops_per_token(args, cfg.training.seq_len),
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
    from tools import xla_hlo
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
    text = Path(res["hlo"]).read_text()
    summary = xp.summarize(text, mesh=own.mesh)
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
    sched = {}
    if compute_s is None:  # the program's own compute: the scheduled prediction follows its schedule
        sched = scheduled_prediction(
            text,
            ops,
            colls,
            kernels,
            ici=ici,
            placement=placement or own,
            gen=gen,
            peak=peak,
            hbm=hbm,
            head_dims=facts.get("head_dims"),
            rates=xla_hlo.peak_rates(anchors, gen),
        )
        if sched:
            sched["mfu_causal_scheduled"] = min(100.0, 100.0 * model_flops / (peak * sched["step_scheduled_s"]))
            sched["mfu_palm_scheduled"] = min(100.0, sched["mfu_causal_scheduled"] * palm)
    return {
        **sched,
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


def splash_mxu_factor(kernel: str, head_dims: tuple[int, int] | None, tile: int) -> float:
    """The TPU run's splash kernel FLOPs at the MXU over the capture's count, for a splash op
    (`splash_fwd`, `splash_bwd`, the `_seg`, `_full` and `_cp` ones; the sink pair is priced as
    captured). Two corrections, both to charge what a TPU run executes:

    - the matmuls that contract a head dim below the MXU's `tile` fill d / tile of the array, as the
      calibration charges MaxText's splash (scripts/bench/maxtext_compile.py `attention_kernel_seconds`);
    - the capture's backward op re-runs the forward for its residuals (titan_kernels/tpu/capture.py
      `splash_cost`, `forward_again`), the run's does not: titan_kernels/tpu/register.py's
      `splash_fwd` returns (out, lse) and `splash_bwd` takes them ("not the forward again").

    Of `splash_cost`'s terms: the forward's q k^T (contracts d) and p v; the backward's q k^T again,
    dS k and dS^T q, dO v^T (contracts dv) and p^T dO (the re-run forward's q k^T and p v dropped).
    1.0 for other kernels or without head dims."""
    if not head_dims or not kernel.startswith("splash"):
        return 1.0
    from tools.xla_hlo import _pad

    d, dv = head_dims
    pd, pv = _pad(d, tile) / d, _pad(dv, tile) / dv  # 1 / fill of a matmul contracting d / dv
    if kernel.endswith("bwd"):
        return (d * pd + 2 * d + dv * pv + dv) / (d + dv + 3 * d + 2 * dv)
    return (d * pd + dv) / (d + dv)


def scheduled_prediction(
    text: str,
    ops: list,
    colls: list,
    kernels: dict,
    *,
    ici: dict,
    placement,
    gen: str,
    peak: float,
    hbm: float,
    head_dims: tuple[int, int] | None = None,
    rates: dict | None = None,
) -> dict:
    """One step time for the program, walked in XLA's schedule (tools/xla_schedule.py, as MaxText's
    programs are calibrated: docs/maxtext_calibration.md): the XLA ops at their MXU FLOPs (256-wide
    tiles on v6e / v7x; a float8 / int8 dot at the chip's rate for its operands, `rates`:
    xla_hlo.peak_rates) and bytes, every FLOP at xla_projection.MXU_EFFICIENCY of the peak; the kernels'
    time (`kernel_times`, at the same efficiency; the splash kernels at their MXU FLOPs for the model's
    `head_dims`, `splash_mxu_factor`) an equal share per kernel call; collectives and host copies on
    their links as scheduled. {} when the HLO cannot be walked."""
    from tools import xla_projection as xp

    hlo = xp.parse_hlo(text)
    eff = peak * xp.MXU_EFFICIENCY
    tile = 256 if gen in ("v6e", "v7x") else 128
    kernel_s = sum(
        max(k["flops"] * splash_mxu_factor(name, head_dims, tile) / eff, k["bytes"] / hbm)
        for name, k in kernels.items()
    )
    calls = [o for o in ops if o.kind in ("kernel", "kernel-unestimated")]
    seconds = schedule_seconds(ops, kernel_s, peak=eff, hbm=hbm, tile=tile, hlo=hlo, rates=rates)
    s = xp.scheduled(
        hlo,
        colls=colls,
        ici=ici,
        placement=placement,
        seconds=seconds,
        host_bytes_per_s=xp.host_link_bytes_per_s(gen, ici),
    )
    host = sum(v for k, v in s.exposed_by.items() if k.startswith("host"))
    return {
        "step_scheduled_s": s.step_s + (0.0 if calls else kernel_s),
        "sched_compute_s": s.compute_s + (0.0 if calls else kernel_s),
        "exposed_comm_s": s.exposed_s - host,
        "exposed_host_s": host,
        "host_busy_s": sum(v for k, v in s.busy_s.items() if k.startswith("host")),
        "ici_busy_s": sum(v for k, v in s.busy_s.items() if k.startswith("ici")),
        "exposed_by": ", ".join(f"{k} {v:.3g} s" for k, v in sorted(s.exposed_by.items())),
        "unmatched_done": s.unmatched_done,
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
    compile = compile or program_compile
    recipe = recipe_path(name)
    label = name + "".join(f" {k}={v}" for k, v in overrides)
    base = program_facts(recipe, list(overrides))
    want = sorted(set(compiled or [base["devices"]]))

    def at_size(n: int) -> list[tuple[str, str]]:  # the recipe's own target: its own cache entry
        return list(overrides) + ([] if n == base["devices"] else [("job.target", f"{base['generation']}-{n}")])

    progs = _compiled_sizes(name, recipe, sorted(set(sizes) | set(want)), want, at_size, timeout, cache, compile)
    rows = []
    for n in sorted(sizes):
        facts = program_facts(recipe, at_size(n))
        if n in progs:
            res, f = progs[n]
            b = program_bound(res, f, anchors=anchors)
            how = "compiled"
        else:
            scaled = _scaled_bound(n, progs, facts, base=base, anchors=anchors)
            if scaled is None:
                rows.append({"recipe": label, "devices": n, "error": "no compiled size to scale from"})
                continue
            b, how = scaled
        rows.append(_weak_row(label, n, facts, b, how))
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        for way in ("exposed", "overlapped"):
            r[f"efficiency_{way}"] = 100.0 * r[f"tokens_per_device_s_{way}"] / ok[0][f"tokens_per_device_s_{way}"]
    return rows


def _compiled_sizes(name, recipe: Path, sizes: list[int], want: list[int], at_size, timeout, cache, compile) -> dict:
    """The programs `weak_scaling` prices: {devices: (compile result, program_facts)} at the sizes in
    `want` and at every other size of `sizes` already in the cache; a failed compile is reported
    and left out."""
    progs: dict[int, tuple[dict, dict]] = {}
    for n in sizes:
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
    return progs


def _scaled_bound(n: int, progs: dict, facts: dict, *, base: dict, anchors: dict) -> tuple[dict, str] | None:
    """The bound at an uncompiled size `n` (`weak_scaling`'s docstring): compute fitted through two
    compiled sizes (or one's with the state pass rescaled), the nearest program's collectives priced
    on n's placement; (bound, how it was had), or None without a compiled size of the same mesh."""
    from tools import xla_projection as xp

    ep, gen = base["ep"], base["generation"]
    same = sorted(m for m, (r, _) in progs.items() if len(r["radices"]) == 2)
    if not same:
        return None
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
    return b, how


def _weak_row(label: str, n: int, facts: dict, b: dict, how: str) -> dict:
    """One size's row of the weak-scaling table (efficiency added by `weak_scaling`)."""
    return {
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


def topology_of_target(name: str):
    """parallelisms.tpu_topology's Topology of a planner target name (v7x-512)."""
    import planner
    from parallelisms.tpu_topology import topology_of

    return topology_of(planner.parse_target(name))
