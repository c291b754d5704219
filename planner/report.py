"""The pod planner's reports: what `scripts/estimate.py` prints and writes.

- the text reports: `format_estimate` (one plan's per-device breakdown and verdict),
  `format_summary` (one row per plan), `format_fixes` (what would make a plan fit), `target_table`;
- the files: `write_csv` (one row per evaluated plan, `CSV_FIELDS`), `recipe_snippet` (the recipe
  keys of a plan);
- the command's runs, each printing its report and returning the exit status: `plan_report` (the
  recipe's layout on a target), `recommend_report` (`--recommend`), `weak_scaling`
  (`--weak-scaling`).

The planner computes (`planner.search`, `planner.memory`, `planner.multislice`); this module only
formats and prints.
"""

from __future__ import annotations

import csv
import dataclasses

from planner.memory import Estimate
from planner.multislice import dcn_cost, describe
from planner.search import (
    Fixes,
    PlanInputs,
    best_per_layout,
    devices_needed,
    plan_estimate,
    recommend,
    suggest_fixes,
)
from planner.targets import GENERATIONS, GiB, Target, parse_target

# ================================================================================ reports


def gib(n: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / GiB:.2f}"


def describe_target(target: Target) -> str:
    g = target.generation
    unit = "TensorCores" if g.kind == "tpu" else "GPUs"
    slices = f" x {target.num_slices} slices over DCN" if target.num_slices > 1 else ""
    return (
        f"{target.name}: {target.size} {unit}{slices} = {target.chips} chips = {target.devices} devices, "
        f"{g.hbm_gib_per_device:.1f} GiB HBM and {g.peak_tflops:g} TFLOP/s bf16 per device, "
        f"{g.devices_per_host} devices per host"
    )


def target_table() -> str:
    """A printable table of the generations (per device)."""
    rows = [
        "generation  device                      HBM/device GiB  peak bf16 TFLOP/s  devices/host  FSDP tokens",
        "----------  --------------------------  --------------  -----------------  ------------  -----------",
    ]
    for g in GENERATIONS.values():
        if g.kind == "gpu":
            device = "1 GPU"
        elif g.cores_per_device == 2:
            device = "1 chip (megacore, 2 TC)"
        else:
            device = f"1 TensorCore ({g.cores_per_chip}/chip)"
        rows.append(
            f"{g.name:<10}  {device:<26}  {g.hbm_gib_per_device:>14.1f}  {g.peak_tflops:>17g}  "
            f"{g.devices_per_host:>12}  {g.fsdp_min_tokens or '-':>11}"
        )
    return "\n".join(rows)


def plan_str(est: Estimate) -> str:
    ep = f" x ep {est.ep}" if est.ep > 1 else ""
    cp = f" x cp {est.cp}" if est.cp > 1 else ""
    return (
        f"dp_replicate {est.dp_replicate} x dp_shard {est.dp_shard}{cp} x tp {est.tp}{ep}, AC {est.ac_mode}, "
        f"local batch {est.local_batch_size} x seq {est.seq_len}"
        + (f" x accum {est.grad_accum}" if est.grad_accum > 1 else "")
        + (", loss parallel" if est.loss_parallel and est.tp > 1 else "")
    )


def format_estimate(est: Estimate, *, flow: tuple[int, int] | None = None) -> str:
    """A per-device breakdown with the verdict; `flow` = (image, text) tokens of a FLUX sample."""
    lines = [
        f"{est.model} on {describe_target(est.target)}",
        f"plan: {plan_str(est)}",
        "per device (rank 0)" + (" [blocks probed: 1 block x n_layers]" if est.probed else "") + ":",
    ]
    rows = _memory_rows(est, flow=flow)
    width = max(len(r[0]) for r in rows) + 2
    for label, value in rows:
        lines.append(f"  {label:<{width}}{gib(value):>9} GiB")
    lines.append(f"  {'total':<{width}}{gib(est.total):>9} GiB")
    lines.append(
        f"  {'HBM / usable (' + format(est.headroom, '.0%') + ' headroom)':<{width}}"
        f"{gib(est.target.hbm_bytes):>9} / {gib(est.usable)} GiB"
    )
    lines += _verdict_and_throughput(est, flow=flow)
    lines.extend(f"note: {n}" for n in est.notes)
    return "\n".join(lines)


def _memory_rows(est: Estimate, *, flow: tuple[int, int] | None) -> list[tuple[str, int]]:
    """(label, bytes) of each per-device memory term of `format_estimate`."""
    a = est.activations
    rows = [
        ("parameters (fp32 master shards)", est.params),
        ("gradients (fp32 shards)", est.grads),
        (
            "optimizer state (Muon momentum on the matrices, AdamW exp_avg + exp_avg_sq on the rest, fp32)"
            if est.optimizer_name == "muon"
            else "optimizer state (AdamW exp_avg + exp_avg_sq, fp32)",
            est.optimizer,
        ),
        ("bf16 weights kept for backward (SimpleFSDP gathers)", est.saved_weights),
        (
            f"activations: blocks ({est.n_layers} x {gib(a.per_block)} GiB, AC {est.ac_mode})"
            if a.blocks == est.n_layers * a.per_block
            # two block kinds (DeepSeek-V3: dense + MoE)
            else f"activations: blocks ({est.n_layers}, the largest {gib(a.per_block)} GiB, AC {est.ac_mode})",
            a.blocks,
        ),
        *(
            [
                (
                    f"  less offloaded to pinned host memory ({gib(est.offloaded)} GiB; "
                    f"the row the backward reads kept, {gib(est.offload_kept)})",
                    est.offload_kept - est.offloaded,
                )
            ]
            if est.offloaded
            else []
        ),
        (
            "activations: final norm, LM-head input, token ids"
            if flow is None
            else "activations: embedders' inputs, RoPE table, final layer",
            a.outside,
        ),
        (
            "loss: fp32 log-sum-exp per token (fused loss)"
            if est.fused_loss
            else f"loss: fp32 log-probs ({'vocab/tp' if est.loss_parallel else 'full vocab'})"
            if flow is None
            else "loss: fp32 velocity prediction and target",
            a.loss,
        ),
        (
            f"transient peak (max of loss/LM head {gib(est.transient_loss)}, block backward "
            f"{gib(est.transient_block)}"
            + (f" + scan flips {gib(est.scan_flips)}" if est.scan_flips else "")
            + (f", Muon update {gib(est.muon_update)}" if est.muon_update else "")
            + (
                f", of which {est.quantize_recipe} copies {gib(est.quantize_transient)}"
                if est.quantize_transient
                else ""
            )
            + ")",
            est.transient,
        ),
    ]
    if est.embedding_backward > est.loop_peak:
        rows.append(
            (
                f"embedding backward above the layers' peak (fp32 scatter-add + fp32 copy, "
                f"{gib(est.embedding_backward)} GiB, after the loops)",
                est.embedding_backward - est.loop_peak,
            )
        )
    if est.update:
        rows.append(("undonated update: new params + moments (program outputs beside the temporaries)", est.update))
    return rows


def _verdict_and_throughput(est: Estimate, *, flow: tuple[int, int] | None) -> list[str]:
    """The verdict line, the throughput line and (FLUX) the per-sample figures of `format_estimate`."""
    lines = []
    if est.fits:
        lines.append(
            f"verdict: FITS with {gib(est.spare)} GiB to spare ({est.total / est.target.hbm_bytes:.0%} of HBM)"
        )
    else:
        over = -est.spare
        lines.append(
            f"verdict: DOES NOT FIT: needs {gib(est.total)} GiB, usable {gib(est.usable)} GiB; "
            f"over by {gib(over)} GiB ({over / est.usable:.0%})"
        )
    lines.append(
        f"throughput (estimate): {est.tokens_per_device_step:,.0f} tokens/device/step, global batch "
        f"{est.global_batch_tokens:,} tokens; step {est.step_time_s:.2f} s at an assumed "
        f"{est.assumed_mfu:.0%} MFU without recompute"
        + (
            f" (x{est.recompute_factor:.2f} FLOPs for AC {est.ac_mode}: MFU {est.mfu:.0%})"
            if est.recompute_factor != 1.0
            else ""
        )
        + f" -> {est.tokens_per_s:,.0f} tokens/s/device"
    )
    # The count the step time (and the trainer's MFU) divide by: the family's own token mixing
    # (gpt-oss's windows, Qwen 3.5's delta rule) included (trainer/runtime/flops.py).
    lines.append(
        f"model FLOPs per token: {est.flops_per_token / 1e9:,.2f} GFLOP (training, PaLM convention: "
        "6 x active non-embedding params + token mixing; trainer/runtime/flops.py)"
    )
    if flow is not None:
        img, txt = flow
        per_sample = img + txt
        lines.append(
            f"FLUX: {img} image + {txt} text tokens per sample; {est.tokens_per_device_step / per_sample:,.2f} "
            f"samples/device/step, global batch {est.global_batch_tokens // per_sample:,} samples; "
            f"{est.tokens_per_s / per_sample:,.3f} samples/s/device = "
            f"{per_sample / est.tokens_per_s:,.2f} device-s/sample"
        )
    return lines


SUMMARY_HEADER = (
    "dp_rep  dp_shard  cp  tp  ep  AC         batch  tok/dev/step   params+opt  kept-wts  activ.  "
    "transient  total GiB  fits  step s  tok/s/dev"
)


def format_summary_row(est: Estimate) -> str:
    static = est.params + est.grads + est.optimizer
    return (
        f"{est.dp_replicate:>6}  {est.dp_shard:>8}  {est.cp:>2}  {est.tp:>2}  {est.ep:>2}  {est.ac_mode:<9}  "
        f"{est.local_batch_size:>5}  "
        f"{est.tokens_per_device_step:>12,.0f}  {gib(static):>10}  {gib(est.saved_weights):>8}  "
        f"{gib(est.activations.total):>6}  {gib(est.transient):>9}  {gib(est.total):>9}  "
        f"{'yes' if est.fits else 'NO':>4}  {est.step_time_s:>6.2f}  {est.tokens_per_s:>9,.0f}"
    )


def format_summary(estimates: list[Estimate]) -> str:
    return "\n".join([SUMMARY_HEADER, *(format_summary_row(e) for e in estimates)])


def format_fixes(est: Estimate, fixes: Fixes) -> list[str]:
    """`suggest_fixes`'s findings for `est`, one line each."""

    def changes(c: Estimate) -> str:
        out = []
        if c.ac_mode != est.ac_mode:
            out.append(f"activation_checkpoint.mode = {c.ac_mode}")
        if c.local_batch_size != est.local_batch_size:
            out.append(f"training.local_batch_size = {c.local_batch_size}")
        if c.tp != est.tp:
            out.append(f"parallelism.tensor_parallel_degree = {c.tp}")
        if c.cp != est.cp:
            out.append(f"parallelism.context_parallel_degree = {c.cp}")
        if c.ep != est.ep:
            out.append(f"parallelism.expert_parallel_degree = {c.ep}")
        if c.loss_parallel != est.loss_parallel:
            out.append("parallelism.enable_loss_parallel = true")
        return f"{', '.join(out)}: {gib(c.total)} GiB (fits)"

    name = est.target.name
    lines = [changes(c) for c in fixes.single_changes]
    if fixes.best is not None:
        lines.append(
            f"the planner's choice for {name} (--recommend): {plan_str(fixes.best)}: {gib(fixes.best.total)} GiB"
        )
    elif fixes.devices_needed:
        lines.append(
            f"no plan fits {name}; about {fixes.devices_needed} devices would fit "
            f"{plan_str(fixes.devices_needed_plan)} "
            f"(its parameters, gradients and optimizer state shrink with more FSDP shards)"
        )
    else:
        lines.append(
            f"no plan fits {name}, and more devices would not help: activations alone exceed HBM; "
            "shorten training.seq_len"
        )
    return lines


CSV_FIELDS = (
    "model",
    "target",
    "devices",
    "hbm_bytes",
    "dp_replicate",
    "dp_shard",
    "cp",
    "tp",
    "ep",
    "ac_mode",
    "local_batch_size",
    "seq_len",
    "grad_accum",
    "loss_parallel",
    "params_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "saved_weights_bytes",
    "block_activation_bytes",
    "outside_activation_bytes",
    "loss_bytes",
    "transient_bytes",
    "total_bytes",
    "usable_bytes",
    "fits",
    "tokens_per_device_step",
    "global_batch_tokens",
    "est_step_s",
    "est_tokens_per_s_per_device",
    "est_mfu_pct",
    "assumed_mfu_pct",
)


def csv_row(est: Estimate) -> dict:
    a = est.activations
    return {
        "model": est.model,
        "target": est.target.name,
        "devices": est.target.devices,
        "hbm_bytes": est.target.hbm_bytes,
        "dp_replicate": est.dp_replicate,
        "dp_shard": est.dp_shard,
        "cp": est.cp,
        "tp": est.tp,
        "ep": est.ep,
        "ac_mode": est.ac_mode,
        "local_batch_size": est.local_batch_size,
        "seq_len": est.seq_len,
        "grad_accum": est.grad_accum,
        "loss_parallel": est.loss_parallel,
        "params_bytes": est.params,
        "grads_bytes": est.grads,
        "optimizer_bytes": est.optimizer,
        "saved_weights_bytes": est.saved_weights,
        "block_activation_bytes": a.blocks,
        "outside_activation_bytes": a.outside,
        "loss_bytes": a.loss,
        "transient_bytes": est.transient,
        "total_bytes": est.total,
        "usable_bytes": est.usable,
        "fits": est.fits,
        "tokens_per_device_step": round(est.tokens_per_device_step, 3),
        "global_batch_tokens": est.global_batch_tokens,
        "est_step_s": round(est.step_time_s, 4),
        "est_tokens_per_s_per_device": round(est.tokens_per_s, 1),
        "est_mfu_pct": round(100 * est.mfu, 2),
        "assumed_mfu_pct": round(100 * est.assumed_mfu, 2),
    }


def write_csv(estimates: list[Estimate], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for est in estimates:
            writer.writerow(csv_row(est))


def recipe_snippet(est: Estimate) -> str:
    """The recipe keys that select this plan."""
    return "\n".join(
        [
            "[training]",
            f"local_batch_size = {est.local_batch_size}",
            f"seq_len = {est.seq_len}",
            "[parallelism]",
            f"data_parallel_replicate_degree = {est.dp_replicate}",
            f"data_parallel_shard_degree = {est.dp_shard}",
            f"context_parallel_degree = {est.cp}",
            f"tensor_parallel_degree = {est.tp}",
            *([f"expert_parallel_degree = {est.ep}"] if est.ep > 1 else []),
            f"pipeline_parallel_degree = {est.pp}",
            *(
                [
                    f'pipeline_schedule = "{est.pipeline.spec.schedule}"',
                    f"pipeline_microbatches = {est.pipeline.spec.microbatches}",
                ]
                if est.pp > 1 and est.pipeline is not None
                else []
            ),
            f"enable_loss_parallel = {'true' if est.loss_parallel else 'false'}",
            "[activation_checkpoint]",
            f'mode = "{est.ac_mode}"',
        ]
    )


TARGETS_NOTE = (
    "A TPU target's size counts TensorCores, as Cloud TPU accelerator types do: "
    "v6e-256 = 256 devices, v5p-1024 = 512 chips = 512 devices, v7x-1024 = 512 chips = 1024 devices."
)
"""The line `--list-targets` prints below `target_table`."""


# ================================================================================ the command's runs


def recommend_report(
    inputs: PlanInputs, target: Target, *, max_global_tokens: int, top: int, csv_path: str | None = None, **kw
) -> int:
    """`--recommend`: search the layouts, print the best ones (`top` rows) and re-check the choice on the
    full model; exit status 0 when a plan fits, else 1. `kw`: `headroom`, `assumed_mfu`."""
    flow, seq_len = inputs.flow_tokens, inputs.seq_len
    candidates = recommend(inputs, target, max_global_tokens=max_global_tokens, **kw)
    if csv_path:
        write_csv(candidates, csv_path)
    fitting = [c for c in candidates if c.fits]
    shown = best_per_layout(fitting or candidates)[:top]
    print(
        f"{inputs.model_name} on {describe_target(target)}; seq_len {seq_len}; "
        f"{len(candidates)} plans evaluated, {len(fitting)} fit"
    )
    print(format_summary(shown))
    print()
    if not fitting:
        print(format_estimate(candidates[0], flow=flow))
        print(f"verdict: no plan fits {target.name}; the smallest needs {gib(candidates[0].total)} GiB per device")
        need = devices_needed(candidates[0])
        if need:
            print(f"suggestion: about {need} devices for that plan")
        return 1
    best = fitting[0]
    # Re-check the choice on the full model (every block sharded, not one block x n_layers).
    inputs = dataclasses.replace(inputs, local_batch_size=best.local_batch_size, grad_accum=1)
    est = plan_estimate(
        inputs,
        target,
        dp_replicate=best.dp_replicate,
        tp=best.tp,
        cp=best.cp,
        ep=best.ep,
        pp=best.pp,  # the choice's pipeline degree, not the recipe's (a PP recipe may be told pp 1)
        ac_mode=best.ac_mode,
        loss_parallel=best.loss_parallel,
        **kw,
    )
    assert est.total == best.total, "one-block probe and full model disagree"
    print(
        "recommended (heuristic in docs/planner.md: pure FSDP first, then CP, then TP; least recompute; most tokens):"
    )
    print(format_estimate(est, flow=flow))
    print("\nrecipe keys:\n" + recipe_snippet(est))
    return 0


def plan_report(inputs: PlanInputs, target: Target, cfg, *, csv_path: str | None = None, **kw) -> int:
    """The recipe's own layout on the target (HSDP across slices unless the recipe shards over DCN):
    its estimate, the DCN cost of a multislice target, and fixes when it does not fit; exit status
    0 when it fits, else 1. `kw`: `headroom`, `assumed_mfu`."""
    p = cfg.parallelism
    dp_replicate = p.data_parallel_replicate_degree
    slices_left = max(1, target.num_slices // p.pipeline_parallel_degree)  # pipeline stages take the slices first
    if slices_left > 1 and dp_replicate == 1 and not p.allow_dcn_sharding:
        dp_replicate = slices_left  # HSDP across the slices: the recipe's layout inside each slice
        print(f"note: {target.num_slices} slices: dp_replicate {dp_replicate} (one replica per slice)")
    est = plan_estimate(
        inputs,
        target,
        dp_replicate=dp_replicate,
        dp_shard=p.data_parallel_shard_degree,
        tp=p.tensor_parallel_degree,
        ep=p.expert_parallel_degree,
        cp=p.context_parallel_degree,
        ac_mode=cfg.activation_checkpoint.mode,
        loss_parallel=p.enable_loss_parallel,
        **kw,
    )
    if csv_path:
        write_csv([est], csv_path)
    print(format_estimate(est, flow=inputs.flow_tokens))
    if target.num_slices > 1:
        cost = dcn_cost(est, target, **replicate_reduction(cfg))
        print(describe(cost) if cost else f"multislice: no published DCN bandwidth for {target.generation.name}")
    if est.fits:
        return 0
    print("suggestions:")
    for line in format_fixes(est, suggest_fixes(inputs, est)):
        print(f"  - {line}")
    return 1


def replicate_reduction(cfg) -> dict:
    """`dcn_cost` keywords from the recipe: how often and in what dtype dp_replicate is reduced."""
    t = cfg.training
    bf16 = t.mixed_precision_reduce == "bfloat16" or (
        t.replicate_reduce == "step" and t.replicate_reduce_dtype == "bfloat16"
    )
    return {"reduce_bytes": 2 if bf16 else 4, "once_per_step": t.replicate_reduce == "step"}


def weak_scaling(inputs: PlanInputs, target: Target, cfg, slices: list[int], **kw) -> int:
    """The recipe's plan on 1, 2, 4, ... (`slices`) slices of `target`'s slice: the DCN all-reduce and
    the weak-scaling efficiency (planner/multislice.py), fp32 and bf16 reductions."""
    p = cfg.parallelism
    base = target.name.split("x")[0] if target.num_slices > 1 else target.name
    print(
        f"{inputs.model_name}, weak scaling over slices of {base} (the recipe's per-device batch; "
        f"{parse_target(base).dcn_bytes_per_s_per_host or 0:.3g} B/s DCN per host, "
        "docs/planner.md 'Several slices')"
    )
    print(
        "slices  devices  dp_rep  fits  step s  grad GiB/dev  DCN s fp32  eff fp32 overl/serial  DCN s bf16  eff bf16"
    )
    for n in slices:
        t = parse_target(f"{base}x{n}" if n > 1 else base)
        est = plan_estimate(
            inputs,
            t,
            dp_replicate=p.data_parallel_replicate_degree * n,
            dp_shard=p.data_parallel_shard_degree,
            tp=p.tensor_parallel_degree,
            ep=p.expert_parallel_degree,
            cp=p.context_parallel_degree,
            ac_mode=cfg.activation_checkpoint.mode,
            loss_parallel=p.enable_loss_parallel,
            **kw,
        )
        once = cfg.training.replicate_reduce == "step"
        fp32 = dcn_cost(est, t, reduce_bytes=4, once_per_step=once)
        bf16 = dcn_cost(est, t, reduce_bytes=2, once_per_step=once)
        if fp32 is None:
            print(f"{n:>6}  no published DCN bandwidth for {t.generation.name}")
            continue
        print(
            f"{n:>6}  {t.devices:>7}  {est.dp_replicate:>6}  {'yes' if est.fits else 'NO':>4}  {fp32.compute_s:>6.2f}  "
            f"{fp32.bytes_per_device / GiB:>12.2f}  {fp32.dcn_s:>10.3f}  "
            f"{fp32.efficiency_overlapped:>10.1%} / {fp32.efficiency_serial:>6.1%}  {bf16.dcn_s:>10.3f}  "
            f"{bf16.efficiency_overlapped:>8.1%}"
        )
    return 0
