#!/usr/bin/env python
"""MaxText's own train step compiled deviceless here and projected by our projector: the
calibration of tools/xla_projection.py against MaxText's published TPU runs (docs/maxtext_calibration.md).

    scripts/xla_env.sh maxtext                     # once: maxtext[tpu] 0.2.5, jax 0.11.1, libtpu 0.0.46
    nice python scripts/bench/maxtext_compile.py --until hlo      # all five runs, stopped at the optimized HLO
    nice python scripts/bench/maxtext_compile.py --runs llama3.1-8b_v6e-256   # one run, the whole compile
    python scripts/bench/maxtext_compile.py --table-only           # re-read the kept compiles (--keep)

Per run (`RUNS`: each published MaxText run at its published settings: per-device batch, remat
policy and offloads, splash blocks, XLA flags, from AI-Hypercomputer/tpu-recipes), a worker in the
`maxtext` venv (scripts/bench/maxtext_worker.py) calls MaxText's AOT path,
`maxtext.trainers.pre_train.train_compile` with `compile_topology=<slice>` and
`compile_topology_num_slices=1`, in tools/deviceless_env.py's environment, the run's XLA flags in
LIBTPU_INIT_ARGS (as the recipe sets them on the TPU VMs) and XLA's dump of the optimized HLO
(`XLA_FLAGS=--xla_dump_to`, as scripts/mfu_suite.py's projections). The dumped per-device program
goes through the same bound as the trainer's own program (tools/mfu_projection.py `program_bound`:
per-op roofline of the XLA ops, loop bodies times their trip counts, each collective priced where
MaxText's mesh puts its group on the torus), with two MaxText-specific inputs: the model FLOPs are
MaxText's own (`calculate_tflops_training_per_device`, what its TFLOP/s log line and the published
MFU count: causal attention halved), and its attention kernels (Mosaic custom calls) are charged
MaxText's attention FLOPs x 7/6 (the fused backward recomputes the scores: 7 matmuls per 6 counted),
whatever estimate the kernel carries; the MoE runs' gmm kernels by their own cost estimate. The
predicted step time and MFU, both ways (exposed = compute + collectives, overlapped = the larger),
are set beside the published MFU, as printed and re-expressed at the compiled MaxText's FLOPs. The
headline is one predicted step (`project_run`'s `step_s`): the program walked in XLA's schedule
(tools/xla_schedule.py via tools/xla_projection.scheduled: async collectives and host offload on
their links, overlapped as scheduled), each op at MXU_EFFICIENCY of the peak (docs/maxtext_calibration.md).

Output (under --out, default docs/results/maxtext_calibration_<date>_<commit>): .csv and .md, the
table with versions, the CPU and each compile's wall time. Exit 0; 1 when a run failed to compile
(its row says why); 2 bad input.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------ the published runs

# benchmarks/xla_flags_library.py of AI-Hypercomputer/maxtext (e591f30cb): the v6e recipes name these
DENSE_VMEM_LIMIT_FLAG = "--xla_tpu_scoped_vmem_limit_kib=98304"
LAYOUT_FOR_ALL_REDUCE_SCATTER = (
    "--xla_tpu_use_minor_sharding_for_major_trivial_input=true "
    "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1 "
    "--xla_tpu_assign_all_reduce_scatter_layout=true"
)
DATA_PARALLEL_OVERLAP = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true"
)
CF_FOR_ALL_GATHER = (
    "--xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
    "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
)
# libtpu 0.0.46 refuses the continuation fusion of CF_FOR_ALL_GATHER on v6e ("Continuation fusion for
# AllGather is enabled on platform ghostlite ... not supported/recommended on platforms other than
# Viperlite ... Please disable it with xla_tpu_enable_async_collective_fusion=false"): the v6e runs
# keep the async all-gather and the compute/collective overlap and drop the fusion (Run.deviation)
CF_FOR_ALL_GATHER_LIBTPU_0046 = "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
MOE_DEVIATION = (
    "learned routing (use_random_routing=False): MaxText 0.2.5 refuses the published random routing "
    "without expert parallelism ('When EP rank is 1, use_random_routing must be False'); the compiled "
    "program differs in how the router's scores are made, not in the dropless dispatch's buffers"
)
V6E_DEVIATION = (
    "CF_FOR_ALL_GATHER's async collective fusion flags dropped: libtpu 0.0.46 refuses them on v6e "
    "(the published run: MaxText tpu-recipes-v0.1.4, JAX 0.6.1)"
)
ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE = (
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false "
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
    "--xla_tpu_enable_all_reduce_offload_tracing=true "
    "--xla_tpu_use_tc_device_shape_on_sc=true --xla_sc_enable_instruction_fusion=false "
    "--xla_sc_disjoint_spmem=false --xla_sc_disable_megacore_partitioning=true"
)
HOST_OFFLOAD_FLAGS = (
    "--xla_tpu_enable_all_experimental_scheduler_features=true "
    "--xla_tpu_enable_scheduler_memory_pressure_tracking=true --xla_tpu_host_transfer_overlap_limit=24 "
    "--xla_tpu_aggressive_opt_barrier_removal=ENABLED --xla_lhs_prioritize_async_depth_over_stall=ENABLED "
    "--xla_tpu_enable_ag_backward_pipelining=true --xla_should_allow_loop_variant_parameter_in_chain=ENABLED "
    "--xla_should_add_loop_invariant_op_in_chain=ENABLED --xla_max_concurrent_host_send_recv=100 "
    "--xla_tpu_scheduler_percent_shared_memory_limit=100 --xla_latency_hiding_scheduler_rerun=2"
)

SPLASH_2048 = [
    f"sa_block_{b}=2048" for b in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute", "q_dq", "kv_dq")
]
TRILLIUM_COMMON = [
    "ici_fsdp_parallelism=-1",
    "remat_policy=custom",
    "decoder_layer_input=offload",
    "query_proj=offload",
    "key_proj=offload",
    "value_proj=offload",
    "max_target_length=8192",
    "attention=flash",
    "use_iota_embed=True",
    "dataset_type=synthetic",
    "enable_checkpointing=False",
    *SPLASH_2048,
    "sa_use_fused_bwd_kernel=True",
]


@dataclass(frozen=True)
class Run:
    """One published MaxText run: its anchor in assets/anchors.toml, the slice MaxText compiles for
    (`compile_topology`), our target name for it (planner.parse_target), MaxText's arguments and the
    recipe's XLA flags, and where they were read."""

    anchor: str
    topology: str
    target: str
    args: list[str]
    xla_flags: str
    source: str
    note: str = ""
    deviation: str = ""
    head_dims: tuple[int, int] = (128, 128)
    """(query-key, value) head dim: MaxText's configs/models/<model>.yml (head_dim; DeepSeek-V3:
    qk_nope 128 + qk_rope 64, v 128)."""


RUNS: dict[str, Run] = {
    "llama3.1-8b_v6e-256": Run(
        anchor="maxtext-v6e-llama3.1-8b",
        topology="v6e-256",
        target="v6e-256",
        args=["model_name=llama3.1-8b", "per_device_batch_size=4", "out_proj=offload", *TRILLIUM_COMMON],
        xla_flags=" ".join(
            [
                DENSE_VMEM_LIMIT_FLAG,
                LAYOUT_FOR_ALL_REDUCE_SCATTER,
                DATA_PARALLEL_OVERLAP,
                CF_FOR_ALL_GATHER_LIBTPU_0046,
                ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE,
                HOST_OFFLOAD_FLAGS,
            ]
        ),
        source="tpu-recipes c8cfe2f training/trillium/Llama3.1-8B-MaxText/v6e-256/README.md (llama3_1_8b_8192)",
        deviation=V6E_DEVIATION,
    ),
    "llama3.1-70b_v6e-256": Run(
        anchor="maxtext-v6e-llama3.1-70b",
        topology="v6e-256",
        target="v6e-256",
        args=["model_name=llama3.1-70b", "per_device_batch_size=5", *TRILLIUM_COMMON],
        xla_flags=" ".join(
            [
                DENSE_VMEM_LIMIT_FLAG,
                LAYOUT_FOR_ALL_REDUCE_SCATTER,
                DATA_PARALLEL_OVERLAP,
                CF_FOR_ALL_GATHER_LIBTPU_0046,
                HOST_OFFLOAD_FLAGS,
            ]
        ),
        source="tpu-recipes c8cfe2f training/trillium/Llama3.1-70B-MaxText/v6e-256/README.md (llama3_1_70b_8192)",
        deviation=V6E_DEVIATION,
    ),
    "llama3.1-405b_v7x-512": Run(
        anchor="maxtext-v7x-llama3.1-405b",
        topology="tpu7x-512",
        target="v7x-512",
        args=[
            "model_name=llama3.1-405b",
            "dtype=bfloat16",
            "per_device_batch_size=3",
            "use_iota_embed=True",
            "ici_fsdp_parallelism=-1",
            "remat_policy=custom",
            "decoder_layer_input=offload",
            "mlpwo=offload",
            "key_proj=device",
            "value_proj=device",
            "attention=flash",
            "sa_block_q=2048",
            "sa_block_kv=2048",
            "sa_block_kv_compute=1024",
            "sa_block_q_dkv=2048",
            "sa_block_kv_dkv=2048",
            "sa_block_kv_dkv_compute=512",
            "sa_use_fused_bwd_kernel=True",
            "sa_q_layout=SEQ_MINOR",
            "sa_k_layout=SEQ_MINOR",
            "sa_v_layout=HEAD_DIM_MINOR",
            "use_splash_scheduler=True",
            "use_tokamax_splash=True",
            "dataset_type=synthetic",
            "opt_type=adamw",
            "mu_dtype=bfloat16",
            "num_vocab_tiling=4",
            "max_target_length=8192",
            "enable_checkpointing=False",
        ],
        xla_flags=(
            "--xla_tpu_bf16_emission_mode=NATIVE_EMISSION --xla_tpu_enable_sparse_core_reduce_scatter_v2=true "
            "--xla_tpu_use_single_sparse_core_for_all_gather_offload=true "
            "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true "
            "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true "
            "--xla_tpu_enable_sparse_core_collective_offload_3d_all_gather=true "
            "--xla_tpu_enable_all_gather_offload_tracing=true --xla_tpu_use_tc_device_shape_on_sc=True "
            "--xla_sc_disable_megacore_partitioning=True --xla_tpu_enable_async_collective_fusion_fuse_all_gather=false "
            "--xla_enable_async_all_gather=true --xla_tpu_prefer_async_allgather_to_allreduce=true "
            "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
            "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true --xla_tpu_scoped_vmem_limit_kib=65536 "
            "--xla_tpu_enable_sparse_core_offload_queuing_in_lhs=true --xla_tpu_enable_ici_ar_pipelining=true"
        ),
        source="tpu-recipes c8cfe2f training/ironwood/llama3.1-405b/8k-bf16-tpu7x-4x8x8/run_recipe.sh",
    ),
    "qwen3-235b-a22b_v7x-512": Run(
        anchor="maxtext-v7x-qwen3-235b-a22b",
        topology="tpu7x-512",
        target="v7x-512",
        args=[
            "model_name=qwen3-235b-a22b",
            "per_device_batch_size=16.0",
            "max_target_length=4096",
            "dtype=bfloat16",
            "weight_dtype=float32",
            "opt_type=adamw",
            "enable_checkpointing=False",
            "remat_policy=custom",
            "decoder_layer_input=offload",
            "use_custom_sort_vjp=True",
            "use_random_routing=False",  # MOE_DEVIATION
            "shard_exp_on_fsdp=False",
            "megablox=False",
            "sparse_matmul=True",
            "use_tokamax_gmm=True",
            "use_tokamax_splash=True",
            "sa_use_fused_bwd_kernel=True",
            "attention=flash",
            "sa_block_q=1024",
            "sa_block_kv=1024",
            "sa_block_kv_compute=512",
            "sa_block_q_dkv=2048",
            "sa_block_kv_dkv=2048",
            "sa_block_kv_dkv_compute=1024",
            "sa_block_q_dq=1024",
            "sa_block_kv_dq=1024",
            "sa_q_layout=HEAD_DIM_MINOR",
            "sa_k_layout=SEQ_MINOR",
            "sa_v_layout=HEAD_DIM_MINOR",
            "dcn_pipeline_parallelism=1",
            "dcn_data_parallelism=-1",
            "ici_pipeline_parallelism=1",
            "ici_fsdp_transpose_parallelism=1",
            "ici_fsdp_parallelism=-1",
            "dataset_type=synthetic",
        ],
        xla_flags=(
            "--xla_tpu_scoped_vmem_limit_kib=61440 --xla_tpu_enable_sparse_core_collective_offload_all_gather=true "
            "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
            "--xla_tpu_use_single_sparse_core_for_all_gather_offload=true " + HOST_OFFLOAD_FLAGS
        ),
        source="tpu-recipes c8cfe2f training/ironwood/qwen3-235b-a22b/4k-bf16-tpu7x-4x8x8/xpk/run_recipe.sh",
        note="published with random routing (use_random_routing=True)",
        deviation=MOE_DEVIATION,
    ),
    "deepseek3-671b_v7x-512": Run(
        anchor="maxtext-v7x-deepseek-v3",
        topology="tpu7x-512",
        target="v7x-512",
        args=[
            "model_name=deepseek3-671b-2dfsdp",
            "per_device_batch_size=8.0",
            "max_target_length=4096",
            "dcn_pipeline_parallelism=1",
            "dcn_data_parallelism=-1",
            "ici_pipeline_parallelism=1",
            "ici_fsdp_transpose_parallelism=2",
            "ici_fsdp_parallelism=-1",
            "allow_split_physical_axes=True",
            "use_iota_embed=True",
            "remat_policy=custom",
            "decoder_layer_input=offload",
            "opt_type=adamw",
            "mu_dtype=bfloat16",
            "grad_dtype=bfloat16",
            "use_random_routing=False",  # MOE_DEVIATION
            "megablox=True",
            "sparse_matmul=True",
            "use_custom_sort_vjp=True",
            "shard_exp_on_fsdp=False",
            "use_2d_fsdp_sharding=True",
            "sa_use_fused_bwd_kernel=True",
            "sa_block_q=2048",
            "sa_block_kv=2048",
            "sa_block_q_dkv=2048",
            "sa_block_kv_dkv=2048",
            "sa_block_kv_dkv_compute=2048",
            "sa_block_kv_dq=2048",
            "sa_block_q_dq=2048",
            "attention=flash",
            "use_tokamax_splash=True",
            "use_max_logit_estimate=-1",
            "cost_estimate_flops_fwd=5000000000000",
            "cost_estimate_flops_bwd=5000000000000",
            "float32_weight_sum=False",
            "use_tokamax_gmm=True",
            "dataset_type=synthetic",
            "enable_checkpointing=False",
        ],
        xla_flags=(
            "--xla_tpu_scoped_vmem_limit_kib=65536 --xla_tpu_bf16_emission_mode=NATIVE_EMISSION "
            "--xla_tpu_enable_sparse_core_reduce_scatter_v2=true "
            "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true "
            "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true "
            "--xla_tpu_enable_all_gather_offload_tracing=true --xla_tpu_use_tc_device_shape_on_sc=True "
            "--xla_sc_disable_megacore_partitioning=True --xla_tpu_enable_async_collective_fusion_fuse_all_gather=false "
            "--xla_enable_async_all_gather=true --xla_tpu_prefer_async_allgather_to_allreduce=true "
            "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
            "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true "
            "--xla_tpu_enable_sparse_core_collective_offload_3d_all_gather=true "
            "--xla_tpu_use_single_sparse_core_for_all_gather_offload=true "
            "--xla_tpu_enable_concurrent_sparse_core_offloading=true --xla_tpu_aggressive_opt_barrier_removal=true "
            "--xla_tpu_enable_offloading_gather_to_sparsecore=true "
            "--xla_tpu_sparse_core_all_gather_latency_multiplier=1 "
            "--xla_tpu_sparse_core_reduce_scatter_latency_multiplier=3 "
            "--xla_tpu_enable_sparse_core_collective_aggregator=true "
            "--xla_tpu_enable_latency_hiding_layer_scheduler=true --xla_tpu_scheduler_percent_shared_memory_limit=150 "
            "--xla_tpu_enable_layer_scheduler_for_dependent_collectives=true --xla_tpu_pcie_bandwidth_multiplier=0.03 "
            "--xla_tpu_enable_multi_compute_overlap_in_layer_scheduler=false "
            "--xla_tpu_enable_sparse_core_offload_queuing_in_lhs=true "
            "--xla_tpu_enable_sparse_core_collective_offload_nd_reduce_scatter=true "
            "--xla_tpu_enable_3d_reduce_scatter_decomposer=false"
        ),
        source="tpu-recipes c8cfe2f training/ironwood/deepseek3-671b/4k-bf16-tpu7x-4x8x8/xpk/run_recipe.sh",
        note="published with random routing (use_random_routing=True)",
        deviation=MOE_DEVIATION,
        head_dims=(192, 128),
    ),
}
"""In order of compile cost (the smallest first)."""

MAXTEXT_VENV_KIND = "maxtext"
ATTENTION_KERNEL_FACTOR = 7 / 6
"""Splash's FLOPs over MaxText's count of attention (3 x forward): forward 2 matmuls, fused backward 5
(the scores recomputed, dP, dV, dQ, dK), against the 2 + 4 of the 3 x forward convention."""


# ------------------------------------------------------------------------------ pure parts (tested)


def pick_hlo(dump: Path) -> Path | None:
    """The train step's optimized HLO in an XLA dump folder: the largest `*.after_optimizations.txt`
    whose module name has `train_step` (else the largest of all); None when there is none."""
    found = sorted(dump.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size, reverse=True)
    step = [p for p in found if "train_step" in p.name]
    return (step or found or [None])[0]


def hlo_mesh(text: str) -> list[int] | None:
    """The axis sizes of the `replica_groups=mesh[...]` declaration most of the program's collectives
    name (XLA numbers its axes `axis_0`, `axis_1`, ... over the logical device ids, row-major, which
    are the MaxText mesh's devices in flat order); None when there is none. A collective over another
    declaration (the 405B program: 4 of 70) is priced on its group size over one torus dim."""
    decls = re.findall(r"replica_groups=mesh\[([^\]]*)\]", text)
    if not decls:
        return None
    most = max(set(decls), key=decls.count)
    sizes = re.findall(r"'axis_(\d+)'=(\d+)", most)
    return [int(n) for _, n in sorted(sizes, key=lambda t: int(t[0]))] or None


def host_transfer_bytes(hlo) -> float:
    """Bytes per step between HBM and host memory (layout memory space S(5)): the slices the
    offloaded activations' dynamic-update-slices write to host buffers and the dynamic-slices read
    back, times their loop's trips. The projector's compute counts neither (not HBM traffic); they
    ride on PCIe, which it does not price."""
    from tools import xla_hlo

    total = 0.0
    for comp, times in xla_hlo.executed(hlo):
        for ins in comp.instrs:
            if ins.opcode == "dynamic-update-slice" and "S(5)" in ins.shape and len(ins.operands) > 1:
                total += times * xla_hlo.array_bytes(xla_hlo._operand_shape(comp, ins.operands[1]))
            elif ins.opcode == "dynamic-slice" and ins.operands:
                if "S(5)" in xla_hlo._operand_shape(comp, ins.operands[0]):
                    total += times * xla_hlo.array_bytes(ins.shape)
    return total


def compiler_gib(memory: dict) -> float:
    """Peak HBM bytes on one device (arguments + outputs + temporaries - aliased), GiB: the same sum as
    tools/tpu_compile.py's `compiler_total`."""
    total = (
        memory.get("argument_size_in_bytes", 0)
        + memory.get("output_size_in_bytes", 0)
        + memory.get("temp_size_in_bytes", 0)
        - memory.get("alias_size_in_bytes", 0)
    )
    return total / 2**30


def published(anchor: dict, tokens_per_device: float) -> dict:
    """A published anchor's step time (s) and MFU (MaxText's convention, % of the bf16 peak) per device."""
    per_device = anchor["tokens_per_sec"] / (2 if anchor.get("per") == "chip" and anchor["hardware"] == "v7x" else 1)
    return {
        "published_tokens_per_s_per_device": per_device,
        "published_step_s": tokens_per_device / per_device,
        "published_mfu_pct": anchor["mfu_pct"],
    }


def calibration_row(
    name: str, run: Run, worker: dict, bound: dict | None, anchor: dict, error: str = "", *, peak_tflops: float = 0.0
) -> dict:
    """One row of the calibration table: the published run beside the projector's bound of MaxText's
    compiled program. The published MFU is shown as printed (`published_mfu_pct`: the FLOPs count of
    the MaxText that ran it; the v6e runs' older MaxText counted causal attention in full) and at the
    FLOPs the compiled MaxText counts (`published_mfu_same_flops_pct` = its FLOPs per device and step /
    (peak x the published step time)); error: predicted minus the latter (points), and the predicted
    step over the published one."""
    row = {
        "run": name,
        "target": run.target,
        "compile_topology": run.topology,
        "published_source": anchor.get("source", ""),
        "settings_source": run.source,
        "deviation": run.deviation,
        "note": run.note,
    }
    if worker:
        row.update(
            compile_s=round(worker["compile_s"], 1) if worker.get("compile_s") is not None else None,
            hlo_s=round(worker["hlo_s"], 1) if worker.get("hlo_s") is not None else None,
            compiler_gib=round(compiler_gib(worker["memory"]), 2) if worker.get("memory") else None,
            buffer_assignment_gib=(
                round(worker["memory_report_bytes"] / 2**30, 2) if worker.get("memory_report_bytes") else None
            ),
            host_gib=round(
                (
                    worker["memory"].get("host_temp_size_in_bytes", 0)
                    + worker["memory"].get("host_argument_size_in_bytes", 0)
                )
                / 2**30,
                2,
            ),
            mesh=" ".join(f"{a}={s}" for a, s in zip(worker["mesh_axes"], worker["mesh_shape"]) if s > 1),
            tokens_per_device=worker["tokens_per_device"],
            maxtext_tflops_per_device_step=round(worker["maxtext_tflops_per_device_step"], 2),
        )
        row.update({k: round(v, 4) for k, v in published(anchor, worker["tokens_per_device"]).items()})
        if peak_tflops:
            row["published_mfu_same_flops_pct"] = round(
                100 * worker["maxtext_tflops_per_device_step"] / (peak_tflops * row["published_step_s"]), 2
            )
    if bound:
        row.update(
            compute_s=round(bound["compute_s"], 4),
            xla_s=round(bound["xla_s"], 4),
            kernel_s=round(bound["kernel_s"], 4),
            comm_s=round(bound["comm_s"], 4),
            comm_by_axis=bound["comm_by_axis"],
            step_exposed_s=round(bound["step_exposed_s"], 4),
            step_overlapped_s=round(bound["step_overlapped_s"], 4),
            mfu_exposed_pct=round(bound["mfu_causal_exposed"], 2),
            mfu_overlapped_pct=round(bound["mfu_causal_overlapped"], 2),
            error_exposed_pts=round(
                bound["mfu_causal_exposed"] - row.get("published_mfu_same_flops_pct", anchor["mfu_pct"]), 2
            ),
            error_overlapped_pts=round(
                bound["mfu_causal_overlapped"] - row.get("published_mfu_same_flops_pct", anchor["mfu_pct"]), 2
            ),
            step_ratio_exposed=round(bound["step_exposed_s"] / row["published_step_s"], 3) if worker else None,
            step_ratio_overlapped=round(bound["step_overlapped_s"] / row["published_step_s"], 3) if worker else None,
            loops_without_trip_count=bound.get("loops_without_trip_count", 0),
            kernel_calls_unestimated=bound.get("kernel_calls_unestimated", 0),
            host_transfer_gb=round(bound.get("host_transfer_gb", 0.0), 2),
            attention_kernel_s=round(bound.get("attention_kernel_s", 0.0), 3),
            gmm_s=round(bound.get("gmm_s", 0.0), 3),
            gmm_flops_s=round(bound.get("gmm_flops_s", 0.0), 3),
        )
        if bound.get("step_s"):
            pub = row.get("published_mfu_same_flops_pct", anchor["mfu_pct"])
            row.update(
                step_s=round(bound["step_s"], 4),
                mfu_pct=round(bound["mfu_pct"], 2),
                error_pct=round(100.0 * (bound["mfu_pct"] - pub) / pub, 1),
                step_ratio=round(bound["step_s"] / row["published_step_s"], 3) if worker else None,
                sched_compute_s=round(bound["sched_compute_s"], 4),
                exposed_comm_s=round(bound["exposed_comm_s"], 4),
                exposed_host_s=round(bound["exposed_host_s"], 4),
                host_s=round(bound["host_s"], 4),
                ici_busy_s=round(bound["ici_busy_s"], 4),
                exposed_by=bound["exposed_by"],
                unmatched_done=bound["unmatched_done"],
            )
    if error:
        row["error"] = error
    return row


COLUMNS = [
    "run",
    "target",
    "compile_topology",
    "compile_s",
    "hlo_s",
    "compiler_gib",
    "buffer_assignment_gib",
    "host_gib",
    "mesh",
    "tokens_per_device",
    "maxtext_tflops_per_device_step",
    "published_tokens_per_s_per_device",
    "published_step_s",
    "published_mfu_pct",
    "published_mfu_same_flops_pct",
    "compute_s",
    "xla_s",
    "kernel_s",
    "attention_kernel_s",
    "gmm_s",
    "gmm_flops_s",
    "comm_s",
    "comm_by_axis",
    "step_exposed_s",
    "step_overlapped_s",
    "mfu_exposed_pct",
    "mfu_overlapped_pct",
    "error_exposed_pts",
    "error_overlapped_pts",
    "step_ratio_exposed",
    "step_ratio_overlapped",
    "loops_without_trip_count",
    "kernel_calls_unestimated",
    "host_transfer_gb",
    "step_s",
    "mfu_pct",
    "error_pct",
    "step_ratio",
    "sched_compute_s",
    "exposed_comm_s",
    "exposed_host_s",
    "host_s",
    "ici_busy_s",
    "exposed_by",
    "unmatched_done",
    "error",
    "deviation",
    "note",
    "settings_source",
    "published_source",
]


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def _fmt(v, digits: int = 1) -> str:
    if v is None or v == "":
        return "—"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown(rows: list[dict], header_lines: list[str]) -> str:
    """The calibration table as markdown, with the header lines (versions, CPU) first. GiB/device:
    memory_analysis() of the whole compile, else (`b`) the buffer assignment's report of a compile
    stopped at the HLO; wall s: the whole compile, else (`h`) up to the optimized HLO."""
    out = [*header_lines, ""]
    if any(r.get("step_s") for r in rows):
        out.append(
            "**The prediction** (tools/xla_schedule.py: the program walked in XLA's schedule; error = "
            "(predicted - published) / published, MFU at the compiled MaxText's FLOPs):"
        )
        out.append("")
        out.append(
            "| run | published MFU % | predicted MFU % | error % | published step s | predicted step s "
            "| compute s | exposed collectives s | exposed host transfers s (of busy) | old bound MFU % exposed / overlapped |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if not r.get("step_s"):
                out.append(f"| {r['run']} | — | — | — | — | — | — | — | — | {r.get('error', '')} |")
                continue
            out.append(
                f"| {r['run']} | {_fmt(r.get('published_mfu_same_flops_pct'))} | {_fmt(r.get('mfu_pct'))} "
                f"| {r['error_pct']:+.1f} | {_fmt(r.get('published_step_s'), 2)} | {_fmt(r.get('step_s'), 2)} "
                f"| {_fmt(r.get('sched_compute_s'), 2)} | {_fmt(r.get('exposed_comm_s'), 2)} "
                f"| {_fmt(r.get('exposed_host_s'), 2)} ({_fmt(r.get('host_s'), 2)}) "
                f"| {_fmt(r.get('mfu_exposed_pct'))} / {_fmt(r.get('mfu_overlapped_pct'))} |"
            )
        out.append("")
        out.append(
            "The bounds (every op at its roofline; exposed = compute + every collective, overlapped = the larger):"
        )
        out.append("")
    out.append(
        "| run | target | compiled? | GiB/device | wall s | published MFU % (as printed / at these FLOPs) "
        "| predicted MFU % exposed / overlapped | error, pts exposed / overlapped | published step s "
        "| predicted step s exposed / overlapped | predicted / published step | collectives s | host transfer GB |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        compiled = "no: " + r["error"] if r.get("error") and "tokens_per_device" not in r else "yes"
        gib = _fmt(r.get("compiler_gib")) if r.get("compiler_gib") is not None else _fmt(r.get("buffer_assignment_gib"))
        gib += " b" if r.get("compiler_gib") is None and r.get("buffer_assignment_gib") is not None else ""
        wall = _fmt(r.get("compile_s"), 0) if r.get("compile_s") is not None else _fmt(r.get("hlo_s"), 0)
        wall += " h" if r.get("compile_s") is None and r.get("hlo_s") is not None else ""
        out.append(
            f"| {r['run']} | {r['target']} | {compiled} | {gib} | {wall} "
            f"| {_fmt(r.get('published_mfu_pct'))} / {_fmt(r.get('published_mfu_same_flops_pct'))} "
            f"| {_fmt(r.get('mfu_exposed_pct'))} / {_fmt(r.get('mfu_overlapped_pct'))} "
            f"| {_fmt(r.get('error_exposed_pts'))} / {_fmt(r.get('error_overlapped_pts'))} "
            f"| {_fmt(r.get('published_step_s'), 2)} "
            f"| {_fmt(r.get('step_exposed_s'), 2)} / {_fmt(r.get('step_overlapped_s'), 2)} "
            f"| {_fmt(r.get('step_ratio_exposed'), 2)} / {_fmt(r.get('step_ratio_overlapped'), 2)} "
            f"| {_fmt(r.get('comm_s'), 2)} | {_fmt(r.get('host_transfer_gb'))} |"
        )
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ compile and project


def maxtext_python() -> Path:
    """The `maxtext` venv's interpreter (made on first use by scripts/xla_env.sh: minutes, the registry)."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "xla_env.sh"), MAXTEXT_VENV_KIND], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"scripts/xla_env.sh maxtext exited {out.returncode}: {out.stderr[-600:]}")
    return Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python"


def versions(python: Path) -> dict:
    code = (
        "import importlib.metadata as m, json;"
        "print(json.dumps({p: m.version(p) for p in ('maxtext', 'jax', 'jaxlib', 'libtpu', 'flax', 'tokamax')}))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def memory_report_bytes(text: str) -> float | None:
    """HBM bytes of a buffer assignment's memory-usage report (`Total bytes:` of the default memory
    space, the first section): the peak the compiler assigned on one device."""
    m = re.search(r"Memory Space: default.*?\nTotal bytes: (\d+)", text, re.S)
    return float(m.group(1)) if m else None


def _hlo_ready(dump: Path) -> bool:
    """The train step's optimized HLO and its buffer assignment are written (their sizes stable)."""
    hlo = pick_hlo(dump)
    if hlo is None:
        return False
    report = hlo.with_name(hlo.name.replace(".txt", "-memory-usage-report.txt"))
    if not report.is_file():
        return False
    size = hlo.stat().st_size
    time.sleep(2)
    return hlo.stat().st_size == size


def compile_run(name: str, run: Run, *, python: Path, folder: Path, timeout: float, until: str = "full") -> dict:
    """The worker's result for one run (compiling unless folder/result.json exists), with `hlo`: the
    optimized HLO's path under folder (the rest of the dump removed). until="hlo": stop the worker
    once XLA has written the optimized HLO and its buffer assignment (the backend's code generation,
    most of a compile's wall time here, changes neither); the memory is then the buffer assignment's
    report and compile_s is None (hlo_s: seconds from the compile's start to that dump)."""
    from tools.deviceless_env import deviceless_env, with_xla_flags

    result, hlo = folder / "result.json", folder / "train_step.after_optimizations.txt"
    if not result.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        dump = folder / "dump"
        shutil.rmtree(dump, ignore_errors=True)
        pre = Path(f"{result}.pre.json")
        pre.unlink(missing_ok=True)
        topo = run.topology.replace("tpu7x-512", "tpu7x:4x8x8").replace("v6e-256", "v6e:16x16")
        env = deviceless_env(
            topo,
            extra={
                **with_xla_flags(
                    f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"
                ),
                "LIBTPU_INIT_ARGS": run.xla_flags,
            },
        )
        env.pop("PYTHONPATH", None)  # the worker imports MaxText only (the checkout's packages not needed)
        cmd = [
            str(python),
            str(ROOT / "scripts" / "bench" / "maxtext_worker.py"),
            str(result),
            *run.args,
            f"compile_topology={run.topology}",
            "compile_topology_num_slices=1",
            f"base_output_directory={folder / 'out'}",
            f"run_name={name}",
        ]
        print(f"maxtext_compile: {name}: compiling for {run.topology} (until {until}) ...", file=sys.stderr, flush=True)
        start = time.time()
        log = open(folder / "worker.log", "w")
        proc = subprocess.Popen(cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        stopped = False
        try:
            while proc.poll() is None:
                if time.time() - start > timeout:
                    proc.kill()
                    proc.wait()
                    raise subprocess.TimeoutExpired(cmd, timeout)
                if until == "hlo" and pre.is_file() and dump.is_dir() and _hlo_ready(dump):
                    proc.kill()  # our own child: the codegen that follows changes neither the HLO nor the memory
                    proc.wait()
                    stopped = True
                    break
                time.sleep(5)
        finally:
            log.close()
        if stopped:
            facts = json.loads(pre.read_text())
            found = pick_hlo(dump)
            report = found.with_name(found.name.replace(".txt", "-memory-usage-report.txt"))
            facts.update(
                compile_s=None,
                hlo_s=found.stat().st_mtime - facts.pop("compile_started"),
                memory={},
                memory_report_bytes=memory_report_bytes(report.read_text()),
                stopped_at="hlo",
            )
            result.write_text(json.dumps(facts))
        elif proc.returncode != 0 or not result.is_file():
            tail = [ln for ln in (folder / "worker.log").read_text().splitlines() if ln.strip()][-3:]
            raise RuntimeError(
                f"worker exited {proc.returncode} after {time.time() - start:.0f} s: {' | '.join(tail)[-500:]}"
            )
        else:
            found = pick_hlo(dump)
            report = found.with_name(found.name.replace(".txt", "-memory-usage-report.txt")) if found else None
            res = json.loads(result.read_text())
            if report is not None and report.is_file():
                res["memory_report_bytes"] = memory_report_bytes(report.read_text())
            if found and pre.is_file():
                res["hlo_s"] = found.stat().st_mtime - json.loads(pre.read_text())["compile_started"]
            result.write_text(json.dumps(res))
        found = pick_hlo(dump)
        if found:
            found.replace(hlo)
        shutil.rmtree(dump, ignore_errors=True)
        shutil.rmtree(folder / "out", ignore_errors=True)
    res = json.loads(result.read_text())
    res["hlo"] = str(hlo) if hlo.is_file() else None
    return res


def project_run(run: Run, res: dict, *, anchors: dict) -> dict:
    """The projector's bound of MaxText's compiled program (tools/mfu_projection.py `program_bound`)."""
    import planner
    from parallelisms.tpu_topology import topology_of
    from tools import xla_projection as xp
    from tools.mfu_projection import program_bound
    from tools.xla_hlo import mxu_flops
    from trainer.runtime.flops import TPU_PEAK_TFLOPS

    target = planner.parse_target(run.target)
    gen = target.generation.name
    peak = TPU_PEAK_TFLOPS[gen] * 1e12
    hbm = anchors["hbm_gbps_per_device"][gen] * 1e9
    tokens = res["tokens_per_device"]
    model_flops = res["maxtext_tflops_per_device_step"] * 1e12
    facts = {
        "generation": gen,
        "peak": peak,
        "topology": topology_of(target),
        "tokens": tokens,
        "routed_rows": 0,
        "flops_per_token": {
            "causal": model_flops / tokens,
            "palm": (model_flops + res["maxtext_attention_tflops"] * 1e12) / tokens,
        },
    }
    text = Path(res["hlo"]).read_text()
    # the collectives name the axes of the program's own mesh declaration (`axis_<i>`, read as a<i>)
    radices = hlo_mesh(text) or [n for n in res["mesh_shape"] if n > 1] or [1]
    prog = {"radices": radices, "device_coords": res["device_coords"], "hlo": res["hlo"]}
    hlo = xp.parse_hlo(text)
    ops = xp.compute_ops(hlo)
    compute = kernel_compute(ops, attention_flops=res["maxtext_attention_tflops"] * 1e12, peak=peak, hbm=hbm)
    b = program_bound(prog, facts, anchors=anchors, compute_s=compute["compute_s"])
    b["comm_by_axis"] = ", ".join(
        f"{ax}({'x'.join(map(str, radices))}) {t:.3g} s" for ax, t in b["comm_by_axis"].items()
    )
    b.update(
        xla_s=compute["xla_s"],
        kernel_s=compute["kernel_s"],
        kernel_calls_unestimated=compute["unestimated"],
        attention_kernel_s=compute["attention_kernel_s"],
        gmm_s=compute["gmm_s"],
        gmm_flops_s=compute["gmm_flops_s"],
        host_transfer_gb=host_transfer_bytes(hlo) / 1e9,
    )
    topo = facts["topology"]
    own = xp.Placement(
        radices=list(radices), coords=[tuple(c) for c in res["device_coords"]], chips=topo.chips, wrap=topo.wrap[:3]
    )
    ici = anchors["ici"][gen]
    attention_s = attention_kernel_seconds(
        res["maxtext_attention_tflops"] * 1e12, run.head_dims, peak=peak * xp.MXU_EFFICIENCY
    )
    seconds = schedule_seconds(ops, compute, peak=peak, hbm=hbm, mxu=mxu_flops(hlo, MXU_TILE), attention_s=attention_s)
    s = xp.scheduled(
        hlo,
        colls=xp.collectives(hlo, own.mesh),
        ici=ici,
        placement=own,
        seconds=seconds,
        host_bytes_per_s=xp.host_link_bytes_per_s(gen, ici),
    )
    host_exposed = sum(v for k, v in s.exposed_by.items() if k.startswith("host"))
    b.update(
        step_s=s.step_s,
        mfu_pct=100.0 * model_flops / (peak * s.step_s),
        sched_compute_s=s.compute_s,
        exposed_s=s.exposed_s,
        exposed_comm_s=s.exposed_s - host_exposed,
        exposed_host_s=host_exposed,
        host_s=sum(v for k, v in s.busy_s.items() if k.startswith("host")),
        ici_busy_s=sum(v for k, v in s.busy_s.items() if k.startswith("ici")),
        unmatched_done=s.unmatched_done,
        exposed_by=", ".join(f"{k} {v:.3g} s" for k, v in sorted(s.exposed_by.items())),
    )
    return b


MXU_TILE = 256
"""Trillium (v6e) and Ironwood (v7x) MXUs are 256 x 256 (MaxText docs/guides/optimization/
custom_model.md; /work/shared/reference/anchors.md)."""


def attention_kernel_seconds(attention_flops: float, head_dims: tuple[int, int], *, peak: float) -> float:
    """Seconds of the splash kernels per step on a MXU_TILE-wide MXU. MaxText's attention FLOPs are 3 x
    the forward's two matmuls, Q K^T (a share qk / (qk + v) of them, contracting the query-key head dim)
    and P V (contracting the sequence). The kernels run 7 such matmuls: forward Q K^T and P V; the
    fused backward Q K^T again, dP = dO V^T (contracting the value head dim), dV, dQ, dK (contracting
    the sequence). A matmul contracting a head dim d < 256 fills d / 256 of the array
    (tools/xla_hlo.mxu_utilization); the others fill it (both free dims >= the block)."""
    from tools.xla_hlo import _pad

    qk, v = head_dims
    u_qk, u_v = qk / _pad(qk, MXU_TILE), v / _pad(v, MXU_TILE)
    a = attention_flops / 3 * qk / (qk + v)  # one Q K^T pass
    b = attention_flops / 3 - a  # one P V pass
    return (2 * a / u_qk + b + b / u_v + b + 2 * a) / peak


def schedule_seconds(
    ops: list, compute: dict, *, peak: float, hbm: float, mxu: dict[str, float] | None = None, attention_s=None
) -> dict[str, float]:
    """Seconds of one run of each op for the scheduled walk: the XLA ops and the estimated kernels
    (gmm) at their roofline, a dot or fusion's FLOPs taken as `mxu` says (its MXU FLOPs, tile padding
    included) where given; the attention kernels (and any kernel without an estimate) each an equal
    share of `attention_s` (default `kernel_compute`'s attention charge) per call."""
    from tools import xla_projection as xp

    eff = peak * xp.MXU_EFFICIENCY
    seconds = xp.op_seconds(ops, peak_flops=eff, hbm_bytes_per_s=hbm)
    for o in ops:
        if mxu and o.name in mxu and o.kind == "xla":
            seconds[o.name] = max(mxu[o.name] / eff, o.bytes / hbm)
    attn = [
        o
        for o in ops
        if o.kind in ("kernel", "kernel-unestimated") and (is_attention_kernel(o) or o.kind == "kernel-unestimated")
    ]
    calls = sum(o.times for o in attn)
    total = compute["attention_kernel_s"] if attention_s is None else max(attention_s, compute["attention_kernel_s"])
    for o in attn:
        seconds[o.name] = total / calls
    return seconds


def is_attention_kernel(op) -> bool:
    """A splash attention kernel call (by its metadata's op_name)."""
    return "splash" in op.source or "splash" in op.name


def kernel_compute(ops: list, *, attention_flops: float, peak: float, hbm: float) -> dict:
    """Compute seconds: the XLA ops' per-op roofline; the kernels with a cost estimate (the MoE
    runs' ragged-dot gmm) by it; the attention kernels at MaxText's attention FLOPs x
    ATTENTION_KERNEL_FACTOR or their operand and result bytes, whichever is slower, whether or not
    they carry an estimate (tokamax splash's counts the masked-out half: 2.6x MaxText's causal FLOPs
    on Qwen3-235B; the DeepSeek-V3 recipe sets its own, `cost_estimate_flops_fwd=5e12`). gmm_s /
    gmm_flops_s: the estimated kernels by their estimate / at their FLOPs alone."""
    from tools import xla_projection as xp

    xla_s = xp.compute_time(ops, peak_flops=peak, hbm_bytes_per_s=hbm, kinds=("xla",))
    kernels = [o for o in ops if o.kind in ("kernel", "kernel-unestimated")]
    attn = [o for o in kernels if is_attention_kernel(o) or o.kind == "kernel-unestimated"]
    est = [o for o in kernels if o not in attn]
    est_s = sum(o.times * max(o.flops / peak, o.bytes / hbm) for o in est)
    attn_io = sum(o.times * o.io for o in attn)
    attn_s = max(attention_flops * ATTENTION_KERNEL_FACTOR / peak, attn_io / hbm) if attn else 0.0
    return {
        "xla_s": xla_s,
        "kernel_s": est_s + attn_s,
        "attention_kernel_s": attn_s,
        "gmm_s": est_s,
        "gmm_flops_s": sum(o.times * o.flops for o in est) / peak,
        "compute_s": xla_s + est_s + attn_s,
        "unestimated": int(sum(o.times for o in kernels if o.kind == "kernel-unestimated")),
    }


# ------------------------------------------------------------------------------ main


def peak_of(run: Run) -> float:
    """The bf16 peak TFLOP/s of one device of the run's target (a v7x device is half a chip)."""
    import planner
    from trainer.runtime.flops import TPU_PEAK_TFLOPS

    return TPU_PEAK_TFLOPS[planner.parse_target(run.target).generation.name]


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def parse(argv: list[str]):
    from trainer.runtime import cli

    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    p.add_argument("--keep", type=Path, default=ROOT / "outputs" / "maxtext_compile", help="compile folders (reused)")
    p.add_argument("--out", type=Path, default=None, help="table path without extension")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per compile")
    p.add_argument("--table-only", action="store_true", help="read the kept compiles; compile nothing")
    p.add_argument(
        "--until",
        choices=("full", "hlo"),
        default="full",
        help="full: the whole compile (memory_analysis, compile time); hlo: stop at the optimized HLO dump "
        "(memory from the buffer assignment; the backend's codegen, most of the wall time, skipped)",
    )
    ns = p.parse_args(argv)
    ns.runs = [r for r in ns.runs.split(",") if r]
    ns.keep = ns.keep.resolve()  # the worker runs in the run's folder: its paths must not be relative
    bad = [r for r in ns.runs if r not in RUNS]
    if bad:
        p.error(f"--runs: unknown {', '.join(bad)}; allowed: {', '.join(RUNS)}")
    return ns


def main(argv: list[str] | None = None) -> int:
    from tools.mfu_report import load_anchors
    from trainer.runtime.device import cpu_model

    ns = parse(sys.argv[1:] if argv is None else argv)
    anchors = load_anchors()
    by_id = {a["id"]: a for a in anchors["anchor"]}
    python = maxtext_python()
    vers = versions(python)
    rows, failed = [], False
    for name in ns.runs:
        run, folder = RUNS[name], ns.keep / name
        anchor = by_id[run.anchor]
        if ns.table_only and not (folder / "result.json").is_file():
            rows.append(calibration_row(name, run, {}, None, anchor, error="not compiled (no kept result)"))
            continue
        try:
            res = compile_run(name, run, python=python, folder=folder, timeout=ns.timeout, until=ns.until)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failed = True
            rows.append(calibration_row(name, run, {}, None, anchor, error=str(e).splitlines()[0][:300]))
            continue
        bound, err = None, ""
        if res.get("hlo"):
            bound = project_run(run, res, anchors=anchors)
        else:
            err = "no optimized HLO in the dump"
        rows.append(calibration_row(name, run, res, bound, anchor, error=err, peak_tflops=peak_of(run)))
        print(json.dumps(rows[-1]), flush=True)
    commit = git_commit()
    out = ns.out or ROOT / "docs" / "results" / f"maxtext_calibration_{date.today().isoformat()}_{commit}"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = [
        f"MaxText's train step compiled deviceless (scripts/bench/maxtext_compile.py), projected by "
        f"tools/xla_projection.py; commit {commit}.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()) + f". CPU: {cpu_model()}.",
        "MFU in MaxText's convention (its own FLOPs per step, causal attention halved) against the bf16 peak.",
    ]
    write_csv(rows, out.with_suffix(".csv"))
    out.with_suffix(".md").write_text(markdown(rows, header))
    print(f"wrote {out}.csv and .md", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    from trainer.runtime import cli

    sys.exit(cli.run(main))
