"""The reports of scripts/estimate_xla.py: a compiled program's memory and cost beside the planner's.

- `format_table` (one row per term: the plan, per-device memory, FLOPs, loops, scan flips, timings),
  `verdict_line` / `oom_verdict` (fits or not, against the chip's HBM), `discrepancies` (terms where
  the compiler and the planner differ by more than 10 %, with `planner_breakdown`);
- `planner_terms` (the planner's figure split as the compiler's: arguments, outputs, temporaries),
  `compiler_total`;
- `CSV_FIELDS`, `csv_row`, `write_csv_row` (`--csv`: one row per recipe, appended).

`res` is the worker's result (tools/xla_estimate.py `worker`) with the outer process's fields
(`wall_s`, `n_layers`, `approximated`, `topology`); `est` the planner's Estimate of the recipe.
"""

from __future__ import annotations

from pathlib import Path


def oom_verdict(est, res: dict) -> str:
    """The verdict line of a program the compiler refused (CompileTimeHbmOom)."""
    oom = res["oom"]
    return (
        f"verdict (compiler, {res['n_layers']} layers): does not fit: the compiler refused the program "
        f"(CompileTimeHbmOom): {oom['required'] / GIB:.2f} GiB of temporaries for {oom['available'] / GIB:.2f} "
        f"GiB available; planner: {'fits' if est.fits else 'does not fit'} ({est.total / GIB:.2f} GiB of "
        f"{est.usable / GIB:.1f} usable); capture / lower / compile / wall s {res['capture_s']:.1f} / "
        f"{res['lower_s']:.1f} / {res['compile_s']:.1f} / {res['wall_s']:.1f}"
    )


GIB = 2.0**30


def compiler_total(res: dict) -> int:
    """Peak bytes the program needs on one device: arguments + outputs + temporaries, less what
    the outputs alias (donated inputs)."""
    from tools.tpu_compile import compiler_total as of_memory

    return of_memory(res["memory"])


def planner_terms(est) -> dict[str, int]:
    """The planner's figure, split where the compiler's is: the state the program reads
    (arguments: params + moments), the state an undonated update writes (outputs: the planner's
    `update` term where it has one; it takes the larger of it and the backward, not the sum),
    and the rest (temporaries: gradients plus the backward's peak)."""
    update = getattr(est, "update", 0)
    if hasattr(est, "backward_peak"):
        temporaries = est.grads + est.backward_peak
    else:
        temporaries = est.grads + est.saved_weights + est.activations.total + est.transient
    return {"arguments": est.params + est.optimizer, "outputs": update, "temporaries": temporaries}


def discrepancies(est, res: dict, limit: float = 0.10) -> list[str]:
    """Where the compiler and the planner differ by more than `limit`, term by term."""
    m = res["memory"]
    comp = {
        "arguments": m.get("argument_size_in_bytes", 0),
        "outputs": m.get("output_size_in_bytes", 0) - m.get("alias_size_in_bytes", 0),
        "temporaries": m.get("temp_size_in_bytes", 0),
    }
    plan = planner_terms(est)
    out = []
    total_p, total_c = est.total, compiler_total(res)
    if abs(total_c - total_p) > limit * max(total_p, 1):
        out.append(
            f"total {total_c / GIB:.2f} GiB vs planner {total_p / GIB:.2f} GiB "
            f"({(total_c - total_p) / max(total_p, 1):+.0%})"
        )
        for k in comp:
            diff = comp[k] - plan[k]
            out.append(
                f"  {k}: compiler {comp[k] / GIB:.2f} GiB, planner {plan[k] / GIB:.2f} GiB ({diff / GIB:+.2f} GiB)"
            )
        out.append("  " + planner_breakdown(est))
    return out


def planner_breakdown(est) -> str:
    flips = getattr(est, "scan_flips", 0)
    return (
        f"planner temporaries = grads {est.grads / GIB:.2f} + kept gathered weights "
        f"{est.saved_weights / GIB:.2f} + activations {est.activations.total / GIB:.2f} (blocks "
        f"{est.activations.blocks / GIB:.2f}, outside {est.activations.outside / GIB:.2f}, loss "
        f"{est.activations.loss / GIB:.2f}) + transient {est.transient / GIB:.2f} (loss "
        f"{est.transient_loss / GIB:.2f}, block {est.transient_block / GIB:.2f}, scan flips "
        f"{flips / GIB:.2f}) GiB; undonated update {getattr(est, 'update', 0) / GIB:.2f} GiB"
    )


def verdict_line(est, res: dict) -> str:
    hbm = est.target.hbm_bytes
    total = compiler_total(res)
    word = "fits" if total <= hbm else "does not fit"
    return (
        f"verdict (compiler, {res['n_layers']} layers): {word}: {total / GIB:.2f} GiB of "
        f"{hbm / GIB:.1f} GiB HBM per device; planner: {'fits' if est.fits else 'does not fit'} "
        f"({est.total / GIB:.2f} GiB of {est.usable / GIB:.1f} usable)"
    )


def format_table(est, res: dict, step_plan=None) -> str:
    """The planner's figures beside the compiler's, one row per term, then the approximations."""
    rows = _memory_rows(est, res, step_plan) + _program_rows(est, res)
    width = max(len(r[0]) for r in rows)
    out = [f"{'':{width}}  {'planner (analytic)':56}  XLA:TPU compiler (deviceless)"]
    out += [f"{a:{width}}  {b:56}  {c}" for a, b, c in rows]
    for note in res.get("approximated", []):
        out.append(f"approximated: {note}")
    if res.get("replicated_bytes"):
        out.append(f"replicated (no dim divides {res['devices']}): {res['replicated_bytes'] / GIB:.4f} GiB of inputs")
    return "\n".join(out)


def _memory_rows(est, res: dict, step_plan) -> list[tuple[str, str, str]]:
    """`format_table`'s plan and per-device memory rows: (term, planner, compiler)."""
    mem = res["memory"]
    plan = planner_terms(est)
    steps = (
        f"graph, {'scan (one body)' if step_plan and step_plan.scan else 'unrolled'}, AC {est.ac_mode}, "
        f"{'fused' if step_plan and step_plan.fused_loss else 'plain'} loss"
        if step_plan
        else ""
    )
    return [
        (
            "plan",
            f"dp_shard {est.dp_shard}, tp {est.tp}, ep {est.ep}, AC {est.ac_mode}",
            f"FSDP-style SPMD over {res['devices']} x {res['device_kind']}; {steps}",
        ),
        ("layers", f"{est.n_layers}", f"{res.get('n_layers', '?')} compiled"),
        (
            "arguments / device",
            f"{plan['arguments'] / GIB:.3f} GiB (params + moments)",
            f"{mem.get('argument_size_in_bytes', 0) / GIB:.3f} GiB (params, AdamW moments, step, batch)",
        ),
        (
            "outputs / aliased",
            f"{plan['outputs'] / GIB:.3f} GiB (undonated update)",
            f"{mem.get('output_size_in_bytes', 0) / GIB:.3f} / "
            f"{mem.get('alias_size_in_bytes', 0) / GIB:.3f} GiB ({'donated' if res.get('donated') else 'not donated'}: "
            f"{res.get('written_inputs', '?')} updated tensors)",
        ),
        (
            "temporaries / device",
            f"{plan['temporaries'] / GIB:.3f} GiB (grads, kept weights, acts, transient)",
            f"{mem.get('temp_size_in_bytes', 0) / GIB:.3f} GiB ({res.get('kernels', 'reference')} kernels)",
        ),
        (
            "total / device",
            f"{est.total / GIB:.3f} GiB of {est.usable / GIB:.1f} usable",
            f"{compiler_total(res) / GIB:.3f} GiB of {est.target.hbm_bytes / GIB:.1f} HBM (args + out + temp - alias)",
        ),
    ]


def _program_rows(est, res: dict) -> list[tuple[str, str, str]]:
    """`format_table`'s rows of the program: FLOPs, loops, scan flips, timings, the worker's memory."""
    cost = res["cost"]
    tokens = est.tokens_per_device_step
    planner_flops = tokens * est.flops_per_token * est.recompute_factor
    scan = res["stablehlo_while"] > 0
    flips = res.get("flips", 0)
    return [
        (
            "FLOPs / device / step",
            f"{planner_flops:.4g} (6N + 12LHQT per token x {tokens:g} tokens)",
            f"{cost.get('flops', 0):.4g}"
            + (" (one layer: XLA counts a while body once)" if scan else "")
            + (
                f" = XLA ops {res['compiler_cost'].get('flops', 0):.4g} + {res['kernel_cost']['calls']} kernel calls "
                f"{res['kernel_cost']['flops']:.4g}"
                if res.get("kernel_cost", {}).get("calls")
                else ""
            ),
        ),
        (
            "while loops (StableHLO / optimized)",
            "-",
            f"{res['stablehlo_while']} / {'unreadable' if res['while'] is None else res['while']}",
        ),
        (
            "scan flips in the captured graph",
            "-",
            f"{flips}"
            + (
                f" after tag_reverse_scans ({res['reverse_scan']} backward scans tagged reverse)"
                if res.get("reverse_scan")
                else " (torch 2.13's flipped scan backward"
                + (f"; the tagged graph failed to lower: {res['tag_error']}" if res.get("tag_error") else "")
                + ")"
                if flips
                else ""
            ),
        ),
        (
            "capture / lower / compile / wall s",
            "-",
            f"{res['capture_s']:.1f} / {res['lower_s']:.1f} / {res['compile_s']:.1f} / {res.get('wall_s', 0):.1f}",
        ),
        ("worker peak RSS", "-", f"{res.get('worker_peak_rss', 0) / GIB:.2f} GiB"),
    ]


CSV_FIELDS = (
    "recipe",
    "target",
    "topology",
    "layers",
    "scan",
    "ac",
    "fused_loss",
    "donated",
    "kernels",
    "arg_gib",
    "out_gib",
    "alias_gib",
    "temp_gib",
    "total_gib",
    "hbm_gib",
    "verdict",
    "planner_args_gib",
    "planner_temp_gib",
    "planner_total_gib",
    "planner_usable_gib",
    "planner_verdict",
    "total_diff_pct",
    "flips",
    "capture_s",
    "compile_s",
    "wall_s",
    "worker_peak_rss_gib",
    "approximated",
)


def csv_row(recipe, est, res: dict, step_plan) -> dict:
    m = res["memory"]
    plan = planner_terms(est)
    total = compiler_total(res)
    return dict(
        recipe=Path(recipe).name if recipe else "",
        target=est.target.name,
        topology=res.get("topology", ""),
        layers=res["n_layers"],
        scan=int(step_plan.scan),
        ac=est.ac_mode,
        fused_loss=int(step_plan.fused_loss),
        donated=int(res["donated"]),
        kernels=res["kernels"],
        arg_gib=f"{m.get('argument_size_in_bytes', 0) / GIB:.3f}",
        out_gib=f"{m.get('output_size_in_bytes', 0) / GIB:.3f}",
        alias_gib=f"{m.get('alias_size_in_bytes', 0) / GIB:.3f}",
        temp_gib=f"{m.get('temp_size_in_bytes', 0) / GIB:.3f}",
        total_gib=f"{total / GIB:.3f}",
        hbm_gib=f"{est.target.hbm_bytes / GIB:.1f}",
        verdict="fits" if total <= est.target.hbm_bytes else "does not fit",
        planner_args_gib=f"{plan['arguments'] / GIB:.3f}",
        planner_temp_gib=f"{plan['temporaries'] / GIB:.3f}",
        planner_total_gib=f"{est.total / GIB:.3f}",
        planner_usable_gib=f"{est.usable / GIB:.1f}",
        planner_verdict="fits" if est.fits else "does not fit",
        total_diff_pct=f"{100 * (total - est.total) / max(est.total, 1):+.1f}",
        flips=res.get("flips", 0),
        capture_s=f"{res['capture_s']:.1f}",
        compile_s=f"{res['compile_s']:.1f}",
        wall_s=f"{res['wall_s']:.1f}",
        worker_peak_rss_gib=f"{res.get('worker_peak_rss', 0) / GIB:.2f}",
        approximated="; ".join(res.get("approximated", [])),
    )


def write_csv_row(path: str, row: dict) -> None:
    import csv

    new = not Path(path).exists() or Path(path).stat().st_size == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            w.writeheader()
        w.writerow(row)
