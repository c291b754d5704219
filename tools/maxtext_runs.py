"""MaxText's published TPU runs, the calibration's inputs (scripts/bench/maxtext_compile.py,
docs/maxtext_calibration.md): each run's anchor in assets/anchors.toml, the slice MaxText compiles
for, MaxText's arguments and the recipe's XLA flags at the published settings (from
AI-Hypercomputer/tpu-recipes and maxtext's benchmarks/xla_flags_library.py), and the deviations
this venv's MaxText and libtpu force; and the tables' writer both scripts share
(`write_csv`, `write_tables`). Nothing here imports MaxText, jax or torch."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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

TRILLIUM_DENSE_FLAGS = [
    DENSE_VMEM_LIMIT_FLAG,
    LAYOUT_FOR_ALL_REDUCE_SCATTER,
    DATA_PARALLEL_OVERLAP,
    CF_FOR_ALL_GATHER_LIBTPU_0046,
]
"""The XLA flags both dense v6e recipes (Llama 3.1 8B and 70B) set first."""


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


# Qwen3-235B-A22B on v7x-512: what the bf16 and FP8 tpu-recipes share (the FP8 run adds its qwix
# quantization and GMM tiles), in the recipes' order.
_QWEN3_235B_V7X_ARGS = [
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
]
_QWEN3_235B_V7X_FLAGS = (
    "--xla_tpu_scoped_vmem_limit_kib=61440 --xla_tpu_enable_sparse_core_collective_offload_all_gather=true "
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
    "--xla_tpu_use_single_sparse_core_for_all_gather_offload=true " + HOST_OFFLOAD_FLAGS
)

RUNS: dict[str, Run] = {
    "llama3.1-8b_v6e-256": Run(
        anchor="maxtext-v6e-llama3.1-8b",
        topology="v6e-256",
        target="v6e-256",
        args=["model_name=llama3.1-8b", "per_device_batch_size=4", "out_proj=offload", *TRILLIUM_COMMON],
        xla_flags=" ".join([*TRILLIUM_DENSE_FLAGS, ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE, HOST_OFFLOAD_FLAGS]),
        source="tpu-recipes c8cfe2f training/trillium/Llama3.1-8B-MaxText/v6e-256/README.md (llama3_1_8b_8192)",
        deviation=V6E_DEVIATION,
    ),
    "llama3.1-70b_v6e-256": Run(
        anchor="maxtext-v6e-llama3.1-70b",
        topology="v6e-256",
        target="v6e-256",
        args=["model_name=llama3.1-70b", "per_device_batch_size=5", *TRILLIUM_COMMON],
        xla_flags=" ".join([*TRILLIUM_DENSE_FLAGS, HOST_OFFLOAD_FLAGS]),
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
    "llama3.1-405b-fp8_v7x-512": Run(
        anchor="maxtext-v7x-llama3.1-405b-fp8",
        topology="tpu7x-512",
        target="v7x-512",
        args=[
            "model_name=llama3.1-405b",
            "dtype=bfloat16",
            "per_device_batch_size=3",
            "use_iota_embed=True",
            "remat_policy=custom",
            "decoder_layer_input=offload",
            "ici_fsdp_parallelism=-1",
            "dataset_type=synthetic",
            "opt_type=adamw",
            "quantization=fp8_full",
            "use_qwix_quantization=True",
            "mu_dtype=bfloat16",
            "use_tokamax_splash=True",
            "use_max_logit_estimate=30",
            "sa_block_kv=2048",
            "sa_block_kv_compute=256",
            "sa_block_q=1024",
            "sa_block_kv_dkv=2048",
            "sa_block_kv_dkv_compute=1024",
            "sa_block_q_dkv=2048",
            "sa_k_layout=SEQ_MINOR",
            "sa_q_layout=HEAD_DIM_MINOR",
            "sa_v_layout=SEQ_MINOR",
            "attention=flash",
            "sa_use_fused_bwd_kernel=True",
            "max_target_length=8192",
            "enable_checkpointing=False",
        ],
        xla_flags=(
            "--xla_tpu_impure_enable_packed_bf16_math_ops=true --xla_tpu_enable_sparse_core_reduce_scatter_v2=true "
            "--xla_tpu_use_single_sparse_core_for_all_gather_offload=true "
            "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true "
            "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true "
            "--xla_tpu_enable_sparse_core_collective_offload_3d_all_gather=true "
            "--xla_tpu_enable_all_gather_offload_tracing=true --xla_tpu_use_tc_device_shape_on_sc=True "
            "--xla_sc_disable_megacore_partitioning=True --xla_tpu_enable_async_collective_fusion_fuse_all_gather=false "
            "--xla_enable_async_all_gather=true --xla_tpu_prefer_async_allgather_to_allreduce=true "
            "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
            "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true --xla_tpu_scoped_vmem_limit_kib=65536"
        ),
        source="tpu-recipes ce8bcf6 training/ironwood/llama3.1-405b/8k-fp8-tpu7x-4x8x8/run_recipe.sh",
        note="FP8 (qwix fp8_full: e4m3 activations and weights, e5m2 gradients); the low-precision projection's check",
    ),
    "qwen3-235b-a22b_v7x-512": Run(
        anchor="maxtext-v7x-qwen3-235b-a22b",
        topology="tpu7x-512",
        target="v7x-512",
        args=[
            *_QWEN3_235B_V7X_ARGS,
            "dataset_type=synthetic",
        ],
        xla_flags=_QWEN3_235B_V7X_FLAGS,
        source="tpu-recipes c8cfe2f training/ironwood/qwen3-235b-a22b/4k-bf16-tpu7x-4x8x8/xpk/run_recipe.sh",
        note="published with random routing (use_random_routing=True)",
        deviation=MOE_DEVIATION,
    ),
    "qwen3-235b-a22b-fp8_v7x-512": Run(
        anchor="maxtext-v7x-qwen3-235b-a22b-fp8",
        topology="tpu7x-512",
        target="v7x-512",
        args=[
            *_QWEN3_235B_V7X_ARGS,
            "use_qwix_quantization=True",
            "quantization=fp8_full",
            "weight_quantization_calibration_method=fixed,-224,224",
            "act_quantization_calibration_method=fixed,-224,224",
            "wi_tile_fwd_batch_seq=512",
            "wi_tile_fwd_embed_dim=4096",
            "wi_tile_fwd_mlp_dim=1536",
            "wi_tile_dlhs_batch_seq=512",
            "wi_tile_dlhs_embed_dim=1536",
            "wi_tile_dlhs_mlp_dim=4096",
            "wi_tile_drhs_batch_seq=1024",
            "wi_tile_drhs_embed_dim=1024",
            "wi_tile_drhs_mlp_dim=1536",
            "wo_tile_fwd_batch_seq=512",
            "wo_tile_fwd_embed_dim=1536",
            "wo_tile_fwd_mlp_dim=4096",
            "wo_tile_dlhs_batch_seq=512",
            "wo_tile_dlhs_embed_dim=4096",
            "wo_tile_dlhs_mlp_dim=1536",
            "wo_tile_drhs_batch_seq=512",
            "wo_tile_drhs_embed_dim=768",
            "wo_tile_drhs_mlp_dim=4096",
            "dataset_type=synthetic",
        ],
        xla_flags=_QWEN3_235B_V7X_FLAGS,
        source="tpu-recipes 1652241 training/ironwood/qwen3-235b-a22b/4k-fp8-tpu7x-4x8x8/cluster_toolkit/run_recipe.sh",
        note="FP8 (qwix fp8_full, fixed calibration +-224); published with random routing (use_random_routing=True)",
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


def write_csv(rows: list[dict], path: Path, columns: list[str]) -> None:
    """The rows as a CSV with `columns` in that order (keys outside them are left out)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def git_commit() -> str:
    """HEAD's short hash, the commit a table is named by ("unknown" outside a checkout)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def write_tables(
    rows: list[dict],
    *,
    name: str,
    out: Path | None,
    columns: list[str],
    header: Callable[[str], list[str]],
    markdown: Callable[[list[dict], list[str]], str],
) -> Path:
    """Write `<out>.csv` and `<out>.md` (default docs/results/<name>_<date>_<commit>); the markdown's
    `header` lines are made from the commit. Returns `out`."""
    commit = git_commit()
    out = out or ROOT / "docs" / "results" / f"{name}_{date.today().isoformat()}_{commit}"
    out.parent.mkdir(parents=True, exist_ok=True)
    # `out` names the files without their extension: a dot in it (llama3.1-70b) is not one
    write_csv(rows, out.parent / f"{out.name}.csv", columns)
    (out.parent / f"{out.name}.md").write_text(markdown(rows, header(commit)))
    print(f"wrote {out}.csv and .md", file=sys.stderr)
    return out
