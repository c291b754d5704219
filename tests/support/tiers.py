"""The test tiers (docs/testing.md).

- **default** (`scripts/test.sh`, what CI runs on every submission): everything not listed below,
  held under `BUDGET_S` of estimated wall time on 2 vCPUs by tests/unit/test_tiers.py over the
  durations recorded in `DURATIONS` (`scripts/test.sh --all --record`);
- **smoke** (`scripts/test.sh --smoke`): `SMOKE`, a minute of the default tier to run before
  every commit;
- **scheduled** (`scripts/test.sh --all`, `.ci/scheduled`, nightly or weekly): the default tier
  plus the tests in `SCHEDULED` and every test marked `exhaustive`. `.ci/scheduled` merges each
  test's result into docs/results/scheduled_tier.json (whole, or in parts: `--missing`).

Each entry of `SCHEDULED` names the default-tier tests that cover its mechanism (`covered_by`,
node-id prefixes): a regression the scheduled test would catch must also fail one of those, or at
least the same code path must run there. tests/unit/test_tiers.py checks that every entry matches
a collected test, that every `covered_by` matches a default-tier test, and that every
`exhaustive` test has an entry.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DURATIONS = ROOT / "tests" / "support" / "durations.json"
# Estimated pytest wall time of the default tier on 2 workers, from durations recorded on the slowest
# CI machine seen: a 2-vCPU AMD EPYC with AVX2 only (docs/testing.md "Tiers"; tests recorded only on
# a faster machine enter scaled by that machine's measured ratio). The goal is a default tier under
# 20 minutes there; scripts/test.sh on a clean clone adds the venv set-up (3-4 minutes on CI's empty
# machine). A session-scoped fixture's cost is spread over the tests that read it.
BUDGET_S = 20 * 60
WORKERS = 2

TIER = os.environ.get("TITAN_TEST_TIER") or ("all" if os.environ.get("TITAN_TEST_EXHAUSTIVE") == "1" else "default")
if TIER not in ("default", "all", "smoke"):
    raise SystemExit(f"error: TITAN_TEST_TIER={TIER!r}: allowed: default, all, smoke")

# The fast loop (`scripts/test.sh --smoke`, TITAN_TEST_TIER=smoke): about a minute of the default
# tier's tests that a change anywhere most often breaks, for a contributor to run before every commit:
# training end to end (losses, resume, accumulation), the step plan and its rule table, the package
# layout, the config. Node-id prefixes; tests/unit/test_tiers.py holds it under SMOKE_BUDGET_S by the
# recorded durations (one worker: `--smoke` runs in one process, no worker start-up).
SMOKE: tuple[str, ...] = (
    "tests/e2e/test_train_e2e.py::test_golden_losses_first_steps",
    "tests/e2e/test_train_e2e.py::test_fp32_and_grad_accumulation",
    "tests/e2e/test_train_e2e.py::test_resume_reproduces_uninterrupted_run",
    "tests/e2e/test_train_e2e.py::test_bad_validation_data_fails_before_any_step",
    "tests/unit/test_step_plan.py",
    "tests/unit/test_layout.py",
    "tests/unit/test_config.py::test_bad_values",
    "tests/unit/test_config.py::test_bad_recipe_files",
    "tests/unit/test_config.py::test_cli_forms",
    "tests/unit/test_config.py::test_precedence_cli_over_toml_over_defaults",
    "tests/unit/test_config.py::test_print_config_round_trips",
    "tests/unit/test_config.py::test_every_recipe_parses_and_builds_on_meta",
)
SMOKE_BUDGET_S = 90


@dataclass(frozen=True)
class Scheduled:
    pattern: str  # fnmatch pattern on the node id (relative to the repository root)
    covered_by: tuple[str, ...]  # default-tier node-id prefixes that run the same mechanism
    why: str


SCHEDULED: tuple[Scheduled, ...] = (
    Scheduled(
        "tests/unit/test_planner_dcn.py::test_the_search_puts_pp_first_only_where_it_wins_with_the_dcn_priced",
        ("tests/unit/test_planner_dcn.py::test_pp_ranks_compare_priced_tokens_per_s",),
        "two whole multislice searches of the debug Llama with every pipeline degree (2.2 s here, loaded): the "
        "default tier checks the ranking rule they end in (pp_ranks) on hand-made candidates",
    ),
    Scheduled(
        "tests/unit/test_planner_capacity.py::test_both_full_ac_modes_plan_the_capacity_dispatch",
        (
            "tests/unit/test_planner_capacity.py::test_qwen3_30b_a3b_recipe_within_the_compile_band",
            "tests/unit/test_planner_capacity.py::test_capacity_terms_by_hand",
        ),
        "the same recipe's plan again under full_save_attention (two whole plans, 20 s on the slow "
        "EPYC): the default tier plans it under full AC and checks the capacity terms by hand "
        "(moved for the 20-minute budget, 2026-12-07)",
    ),
    Scheduled(
        "tests/xla/test_maxtext_compile.py::test_maxtext_8b_program_is_bounded_above_its_published_mfu",
        (
            "tests/unit/test_maxtext_calibration.py::test_tuple_element_shorthand_in_the_hlo",
            "tests/unit/test_maxtext_calibration.py::test_hlo_mesh_reads_the_one_declaration",
            "tests/unit/test_maxtext_calibration.py::test_kernel_charge_attention_by_the_model",
            "tests/unit/test_maxtext_calibration.py::test_row_and_markdown",
        ),
        "MaxText's own 8B train step compiled deviceless in its own venv (the registry, minutes of compile): "
        "the default tier reads MaxText's HLO forms (the %t#k tuple shorthand, its mesh declaration), "
        "charges its kernels and builds the table from hand-written inputs",
    ),
    Scheduled(
        "tests/e2e/test_device_order_e2e.py::test_every_mesh_is_the_same_run_in_every_order*",
        (
            "tests/e2e/test_device_order_e2e.py::test_a_run_in_torch_tpus_order_is_the_identity_run",
            "tests/e2e/test_parallel_e2e.py",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/e2e/test_moe_capacity_train.py",
        ),
        "the full matrix of meshes x orders: the default tier runs FSDP in v6e-4's order bit for bit and "
        "every other multi-process parity test in a random order (launch_command)",
    ),
    Scheduled(
        "tests/e2e/test_device_order_e2e.py::test_a_checkpoint_and_an_hf_start_in_one_order_resume_in_another",
        (
            "tests/e2e/test_device_order_e2e.py::test_a_run_in_torch_tpus_order_is_the_identity_run",
            "tests/e2e/test_preemption.py::test_sigterm_checkpoints_and_the_relaunch_resumes_exactly",
            "tests/unit/test_device_order.py::test_checkpoints_initial_loads_experts_and_uneven_shards_hold",
        ),
        "a resume and an HF start across orders: the default tier reads the ordered run's checkpoint back byte "
        "for byte, resumes exactly after SIGTERM with its 2 ranks swapped (launch_command's order), and loads "
        "initial weights through local_box in v6e-8's order",
    ),
    # --- exhaustive matrix points (marker `exhaustive`): another mesh of a parallelism, another
    # wire of a pass, another recipe of the same family, whose mechanism a default test runs.
    Scheduled(
        "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[[]cp4]",
        ("tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",),
        "cp 4: the same ring and load-balanced chunks as cp 2, two more ranks",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[[]cp2x[dh]*]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_parallel_training.py::test_steps_match_single_process",
        ),
        "cp beside dp / hsdp: the mesh slicing cp x tp proves",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[[]cp2xtp2-loss-parallel]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_parallel_training.py::test_steps_match_single_process",
            "tests/e2e/test_parallel_e2e.py",
        ),
        "cp x tp with loss parallel: cp x tp here, loss parallel in test_parallel_e2e",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[[]cp2-compile]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "cp under torch.compile: the graph step with cp compiles the same attention",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_moe_cp_matches_single_process[[]cp2]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_expert_parallel.py",
        ),
        "MoE with cp and no EP: cp x ep runs the same MoE layer under cp",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_document_mask_cp2_matches_single_process[[]global]",
        (
            "tests/unit/test_document_mask.py",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
        ),
        "global positions: the same masked cp attention with other position ids",
    ),
    # Qwen 3.5 under CP (the Gated DeltaNet's ops of parallelisms/context_parallel_linear.py): the default
    # tier runs the ops at cp 2 with documents and their control, and the trainer's cp 2 step.
    Scheduled(
        "tests/unit/test_cp_linear_attention.py::test_ops_match_the_whole_sequence[[]cp2]",
        ("tests/unit/test_cp_linear_attention.py::test_ops_match_the_whole_sequence[cp2-docs]",),
        "the ops without documents: the same halo and state passing, no resets",
    ),
    Scheduled(
        "tests/unit/test_cp_linear_attention.py::test_ops_match_the_whole_sequence[[]cp4-docs]",
        ("tests/unit/test_cp_linear_attention.py::test_ops_match_the_whole_sequence[cp2-docs]",),
        "cp 4: the same fold over 8 chunks instead of 4, two more ranks",
    ),
    Scheduled(
        "tests/unit/test_cp_linear_attention.py::test_qwen3_5_cp2_matches_single_process[[]*]",
        (
            "tests/unit/test_cp_linear_attention.py::test_ops_match_the_whole_sequence[cp2-docs]",
            "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[cp2]",
        ),
        "the 4-block model at cp 2 against one process (with and without documents): the ops it calls "
        "are the default tier's with documents, and the trainer's cp 2 step runs the whole model "
        "(moved for the 20-minute budget, 2026-12-06)",
    ),
    Scheduled(
        "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[[]cp2xdp2]",
        (
            "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[cp2]",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
        ),
        "Qwen 3.5 cp beside dp_shard: SimpleFSDP over dp_shard x cp is family-generic",
    ),
    Scheduled(
        "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[[]cp4]",
        (
            "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[cp2]",
            "tests/unit/test_cp_linear_attention.py::test_ops_match_the_whole_sequence[cp2-docs]",
        ),
        "Qwen 3.5 at cp 4 through the trainer: the ops at cp 4 are the unit test's scheduled point",
    ),
    Scheduled(
        "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[[]cp2-compile]",
        (
            "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[cp2]",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
        ),
        "Qwen 3.5 cp with per-block compile: the same ops inside each compiled block",
    ),
    Scheduled(
        "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[[]cp2-graph]",
        (
            "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[cp2]",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "Qwen 3.5 cp in graph mode: the same ops captured; functional collectives as the cp attention's",
    ),
    Scheduled(
        "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_moe_cp2_ep2_matches_single_process",
        (
            "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[cp2]",
            "tests/unit/test_expert_parallel.py",
        ),
        "the MoE flavor under cp x ep: routing per token; EP and the family's cp each run by default",
    ),
    Scheduled(
        "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_document_mask_cp2_matches_single_process",
        (
            "tests/e2e/test_cp_train_qwen3_5.py::test_qwen3_5_cp_matches_single_process[cp2]",
            "tests/unit/test_cp_linear_attention.py::test_ops_match_the_whole_sequence[cp2-docs]",
        ),
        "documents through the trainer: the ops test with documents runs the same halo, state passing and resets",
    ),
    Scheduled(
        "tests/e2e/test_deepseek_v3.py::test_parallel_matches_single_process[[]fsdp2]",
        (
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
            "tests/e2e/test_deepseek_v3.py",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
            "tests/unit/test_expert_parallel.py",
        ),
        "SimpleFSDP is family-generic; the MoE families run it by default",
    ),
    Scheduled(
        "tests/e2e/test_deepseek_v3.py::test_parallel_matches_single_process[[]cp2]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_context_parallel.py",
        ),
        "MLA under cp: the cp attention path is the one every family runs",
    ),
    Scheduled(
        "tests/unit/test_deepseek_v4.py::test_tp_matches_single_process*",
        (
            "tests/unit/test_deepseek_v4.py::test_tp_styles_split_streams_groups_sinks_and_token_ids",
            "tests/unit/test_deepseek_v4.py::test_fsdp_and_ep_match_single_process",
            "tests/unit/test_deepseek_v4.py::test_refusals_tp_cp_kernels_and_layer_scan",
        ),
        "DeepSeek-V4 under TP 2 (and TP 2 x FSDP 2), 4-9 s of DTensor sharding propagation: the default tier "
        "runs the plan's new styles (streams, groups, sinks, token ids) on tiny modules against one process, "
        "the family under FSDP / EP and the TP degree checks",
    ),
    Scheduled(
        "tests/e2e/test_expert_balance.py::test_bias_trajectory_matches_single_process[[]cp2]",
        (
            "tests/e2e/test_expert_balance.py",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
        ),
        "the global expert load is reduced over every data rank, cp ranks among them",
    ),
    Scheduled(
        "tests/e2e/test_flux_train.py::test_flux_losses_match_single_process[[]4-degrees[23]]",
        (
            "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
        ),
        "FLUX at FSDP 4 and HSDP: FSDP 2 and the 4-rank point run the same wrapping",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_moe_losses_match_single_process[[]4-degrees3]",
        (
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
        ),
        "MoE at FSDP 4 x EP 2: the other 4-rank point runs EP beside FSDP",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]kimi_k2_v7x.toml]",
        (
            "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[deepseek_v3_debug.toml]",
            "tests/e2e/test_recipes.py::test_recipe_passes_the_rules_at_its_declared_degrees[kimi_k2_v7x.toml]",
            "tests/unit/test_planner_deepseek.py",
        ),
        "Kimi K2 is DeepSeek-V3's architecture at other sizes; the planner plans both",
    ),
    Scheduled(
        "tests/e2e/test_scan_tp.py::test_llama3_scan_tp2_loss_parallel_matches_single_process",
        (
            "tests/unit/test_parallel_training.py::test_steps_match_single_process",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
            "tests/e2e/test_parallel_e2e.py",
        ),
        "scan + TP is the test above; loss parallel on TP runs in test_parallel_e2e",
    ),
    Scheduled(
        "tests/e2e/test_scan_tp.py::test_llama3_scan_fsdp2_tp2_matches_single_process",
        (
            "tests/unit/test_parallel_training.py::test_steps_match_single_process",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "scan over FSDP x TP: the TP scan form plus SimpleFSDP's gathers in the body",
    ),
    Scheduled(
        "tests/e2e/test_scan_tp.py::test_qwen3_scan_tp2_matches_unrolled",
        (
            "tests/unit/test_parallel_training.py::test_steps_match_single_process",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "Qwen 3 shares the decoder block and its TP scan form with Llama 3",
    ),
    Scheduled(
        "tests/unit/test_context_parallel.py::test_graph_step_with_cp[[]scan]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "the graph step with cp, scanned: the e2e scan + cp run covers it",
    ),
    Scheduled(
        "tests/unit/test_expert_parallel.py::test_moe_layer_scan_matches_eager[[]fsdp2]",
        (
            "tests/unit/test_models_moe.py::test_moe_scan_forward_backward_matches_the_loop",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
        ),
        "MoE scan at FSDP 2 without EP: the fsdp2-ep2 point holds it",
    ),
    Scheduled(
        "tests/unit/test_flux_graph.py::test_*node_count_constant_with_scan",
        (
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
            "tests/xla/test_lowering.py::test_scan_is_one_loop_each_way_whatever_n_layers",
        ),
        "the real two-stack FLUX node count covers the toy two-stack one",
    ),
    Scheduled(
        "tests/unit/test_graph_fsdp.py::test_inductor_bucketing_merges_fsdp_collectives[[]*]",
        (
            "tests/unit/test_graph_passes.py",
            "tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives",
        ),
        "Inductor's bucketing of the FSDP collectives on both gloo wires (one to two minutes each): the graph "
        "passes and the FSDP graph step's parity run by default",
    ),
    Scheduled(
        "tests/unit/test_muon.py::test_graph_step_simple_fsdp_two_gloo_ranks[[]scan]",
        (
            "tests/unit/test_muon.py::test_simple_fsdp_two_gloo_ranks_equal_one_process",
            "tests/unit/test_muon.py::test_graph_step_matches_eager[unrolled]",
        ),
        "graph Muon over FSDP, scanned: each half runs by default",
    ),
    Scheduled(
        "tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives[[]4-degrees1]",
        ("tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives[2-degrees0]",),
        "the whole-step graph at FSDP x TP: the FSDP point runs the same capture",
    ),
    Scheduled(
        "tests/unit/test_parallel_compile.py::test_per_block_inductor_fsdp_tp",
        ("tests/unit/test_parallel_compile.py::test_per_block_compile_matches_eager[degrees0]",),
        "per-block compile under FSDP and under TP runs by default with aot_eager",
    ),
    Scheduled(
        "tests/xla/test_sink_splash.py::test_sink_splash_*",
        (
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference[splash]",
            "tests/unit/test_kernel_selfcheck.py::test_a_sink_kernel_that_drops_the_sinks_or_the_window_is_dropped",
            "tests/unit/test_gpt_oss.py::test_logits_match_transformers",
        ),
        "splash with sinks and a window in interpret mode (5 cases, ~40 s), compiled deviceless for v6e / "
        "TPU7x (minutes), and its torch-tpu ops on fake tensors (20 s): the default tier runs the same splash "
        "forward / residual backward in interpret mode "
        "(no sinks, causal), the self-check's verdict on a sink kernel that drops the sinks or the window, "
        "and the op's reference against transformers' gpt-oss",
    ),
    Scheduled(
        "tests/xla/test_tpu_program.py::test_every_tpu_recipe_compiles[[]*]",
        (
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
            "tests/xla/test_lowering.py",
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
        ),
        "each pod recipe's whole TPU program: the reduced dense / MoE EP / CP programs compile "
        "the same kernels and collectives by default",
    ),
    Scheduled(
        "tests/e2e/test_mtp_parallel.py::test_mtp_fsdp_ep_matches_single_process",
        (
            "tests/unit/test_mtp.py::test_debug_run_logs_each_depth_and_learns",
            "tests/unit/test_mtp.py::test_mtp_loss_matches_the_papers_equations",
        ),
        "DeepSeek-V3 MTP on dp_shard 2 x ep 2 (20 s, two processes): the MTP modules sit outside the "
        "plan's block stacks and run on each rank as in one process, which the default tier trains "
        "and checks against the paper's equations; SimpleFSDP and EP are the family's, proven by its "
        "own parallel tests",
    ),
    Scheduled(
        "tests/unit/test_mtp.py::test_graph_step_equals_eager_and_returns_each_depth*",
        (
            "tests/unit/test_mtp.py::test_mtp_loss_matches_the_papers_equations",
            "tests/unit/test_mtp.py::test_keys_checked_and_refused_where_unsupported",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "DeepSeek-V3 MTP in graph mode, unrolled and with layer scan, against the eager step (two captures "
        "of an MoE model, ~25 s each loaded): the default tier checks the MTP loss against the paper's "
        "equations, that graph mode is allowed with MTP, and the captured (scanned) step against eager",
    ),
    Scheduled(
        "tests/unit/test_indexer_loss.py::test_graph_step_with_layer_scan_equals_eager",
        (
            "tests/unit/test_deepseek_v4_scan.py::test_a_stack_scans_its_periodic_rest_after_the_prefix",
            "tests/unit/test_indexer_loss.py::test_main_gradients_are_unchanged_by_it",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "DeepSeek-V4's indexer loss through the graph step with layer scan (one capture of a 3-block V4, "
        "70 s here): the default tier sums aux terms through a toy stack's scan (the same line), checks "
        "the loss and its gradients eagerly, and the captured scanned step against eager",
    ),
    Scheduled(
        "tests/unit/test_indexer_loss.py::test_a_vector_aux_sums_per_element_through_the_scan*",
        (
            "tests/unit/test_deepseek_v4_scan.py::test_a_stack_scans_its_periodic_rest_after_the_prefix",
            "tests/unit/test_indexer_loss.py::test_main_gradients_are_unchanged_by_it",
        ),
        "a vector aux term ([balance, KL]) summed through a toy stack's scan (a dynamo trace each, 1-3 s "
        "here): the default tier runs the same sums with scalar terms through a toy scan, and the vector "
        "terms and their split through the loop",
    ),
    Scheduled(
        "tests/unit/test_indexer_loss.py::test_fsdp_and_ep_match_single_process_with_the_indexer_loss*",
        (
            "tests/unit/test_deepseek_v4.py::test_fsdp_and_ep_match_single_process",
            "tests/unit/test_indexer_loss.py::test_only_the_indexers_get_the_kl_gradient",
        ),
        "DeepSeek-V4's indexer loss under FSDP and EP x FSDP (thread ranks, 4-10 s each): the default tier "
        "runs the family's FSDP / EP parity and the KL's gradients in one process",
    ),
    Scheduled(
        "tests/unit/test_indexer_loss.py::test_debug_run_logs_the_indexer_loss",
        (
            "tests/unit/test_indexer_loss.py::test_the_log_names_the_terms_by_the_loss",
            "tests/unit/test_indexer_loss.py::test_the_loss_logs_the_kl_and_weights_its_gradient",
            "tests/unit/test_deepseek_v4.py::test_debug_recipe_trains_in_process",
        ),
        "DeepSeek-V4's debug recipe with the indexer loss through the trainer (8 steps, ~7 s here): the "
        "default tier trains the recipe without it, checks the loss object's value, gradient and logged "
        "term, and the callback's key for it",
    ),
    Scheduled(
        "tests/e2e/test_mtp_parallel.py::test_qwen3_5_mtp_fsdp_ep_matches_single_process",
        (
            "tests/unit/test_qwen3_5_mtp.py::test_debug_run_logs_the_mtp_loss_and_learns",
            "tests/unit/test_qwen3_5_mtp.py::test_mtp_loss_and_gradients_match_the_truncated_reference",
            "tests/unit/test_qwen3_5.py::test_ep_matches_single_process",
        ),
        "Qwen 3.5 MoE MTP on dp_shard 2 x ep 2 (35 s, two processes): the module's MoE block outside "
        "the plan's stack takes the global load-balance counts (parallelisms/expert_parallel.py); the "
        "default tier trains the module and checks its loss and gradients, and the family's EP parity "
        "in one process",
    ),
    # --- the rest of the scheduled tier: slow points whose mechanism a cheaper default test runs
    # (chosen by the durations recorded on 2026-12-04, docs/testing.md).
    Scheduled(
        "tests/e2e/test_readme_commands.py::test_readme_block_runs_on_a_fresh_clone[[]*]",
        (
            "tests/e2e/test_readme_commands.py::test_every_readme_command_has_a_row",
            "tests/e2e/test_train_e2e.py",
            "tests/e2e/test_launch.py",
            "tests/e2e/test_flux_sample.py",
        ),
        "README's blocks on a fresh clone (4 minutes); the commands they run are the trainer, the "
        "launcher and the sampler, which the default tier runs, and every block must have a row",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]*_v7x.toml]",
        (
            "tests/e2e/test_recipes.py::test_recipe_passes_the_rules_at_its_declared_degrees",
            "tests/e2e/test_recipes.py::test_the_check_names_the_recipe_and_the_rule_or_the_shortfall",
            "tests/unit/test_planner_deepseek.py::test_pod_recipe_is_the_planners_choice_and_passes_the_check[deepseek_v3_671b_v7x]",
            "tests/unit/test_planner.py::test_suggest_fixes_offers_a_cp_degree_for_a_long_sequence",
        ),
        "the v7x pod recipes' start-ups on a fake world: every recipe passes the rules at its target "
        "by default, and three v6e start-ups run the same build (dense, MoE EP, CP on a split mesh)",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]llama3_70b_v6e.toml]",
        (
            "tests/e2e/test_recipes.py::test_recipe_passes_the_rules_at_its_declared_degrees",
            "tests/e2e/test_recipes.py::test_the_check_names_the_recipe_and_the_rule_or_the_shortfall",
            "tests/unit/test_planner_deepseek.py::test_pod_recipe_is_the_planners_choice_and_passes_the_check[deepseek_v3_671b_v7x]",
        ),
        "the other v6e dense start-ups (70B, Qwen 3 8B / 32B): the same build as Llama 3 8B's",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]qwen3_8b_v6e.toml]",
        (
            "tests/e2e/test_recipes.py::test_recipe_passes_the_rules_at_its_declared_degrees",
            "tests/e2e/test_recipes.py::test_the_check_names_the_recipe_and_the_rule_or_the_shortfall",
            "tests/unit/test_planner_deepseek.py::test_pod_recipe_is_the_planners_choice_and_passes_the_check[deepseek_v3_671b_v7x]",
        ),
        "the other v6e dense start-ups (70B, Qwen 3 8B / 32B): the same build as Llama 3 8B's",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]qwen3_32b_v6e.toml]",
        (
            "tests/e2e/test_recipes.py::test_recipe_passes_the_rules_at_its_declared_degrees",
            "tests/e2e/test_recipes.py::test_the_check_names_the_recipe_and_the_rule_or_the_shortfall",
            "tests/unit/test_planner_deepseek.py::test_pod_recipe_is_the_planners_choice_and_passes_the_check[deepseek_v3_671b_v7x]",
        ),
        "the other v6e dense start-ups (70B, Qwen 3 8B / 32B): the same build as Llama 3 8B's",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]qwen3_32b_128k_v6e.toml]",
        (
            "tests/e2e/test_recipes.py::test_the_check_names_the_recipe_and_the_rule_or_the_shortfall",
            "tests/unit/test_planner.py::test_suggest_fixes_offers_a_cp_degree_for_a_long_sequence",
        ),
        "Qwen 3 32B at 128k: the same CP build on a split mesh as Llama 3 8B at 128k",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]flux_*]",
        (
            "tests/e2e/test_recipes.py::test_recipe_passes_the_rules_at_its_declared_degrees[flux_schnell_v6e.toml]",
            "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
        ),
        "the FLUX pod recipes' start-ups: their rules pass by default and FLUX's build runs in the parity tests",
    ),
    Scheduled(
        "tests/unit/test_flux_graph.py::test_flux_graph_*",
        (
            "tests/unit/test_flux_graph.py::test_two_stack_scan_matches_eager",
            "tests/unit/test_graph_step.py::test_unrolled_remat[full]",
        ),
        "the real FLUX model in graph mode (unrolled / scan / AC): the two-stack model of FLUX's layout "
        "runs the same capture, scan and AC",
    ),
    Scheduled(
        "tests/unit/test_flux_graph.py::test_two_stack_scan_ac_shrinks_saved_activations",
        ("tests/unit/test_graph_step.py::test_unrolled_remat",),
        "scan + AC saving less: proved on the decoder stack",
    ),
    Scheduled(
        "tests/unit/test_flux_graph.py::test_two_stack_scan_matches_eager_with_grad_accumulation",
        ("tests/unit/test_flux_graph.py::test_two_stack_scan_matches_eager", "tests/unit/test_graph_step.py"),
        "the two-stack scan with accumulation: scan and accumulation each run by default",
    ),
    Scheduled(
        "tests/unit/test_graph_fsdp.py::test_gloo_all_to_all_reduce_scatter_is_exact_in_bf16",
        ("tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives",),
        "the all-to-all reduce-scatter wire's bf16 exactness; the FSDP graph step's parity runs it",
    ),
    Scheduled(
        "tests/unit/test_context_parallel.py::test_attention_matches_full_sequence[[]cp4]",
        ("tests/unit/test_context_parallel.py::test_attention_matches_full_sequence[cp2]",),
        "cp 4: the same chunking and all-gather as cp 2",
    ),
    Scheduled(
        "tests/unit/test_context_parallel.py::test_torch_compile_fullgraph",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "cp attention under torch.compile: the graph step with cp compiles it",
    ),
    Scheduled(
        "tests/unit/test_context_parallel.py::test_parallelized_model_with_cp_axis[[]*[xk]*]",
        (
            "tests/unit/test_context_parallel.py::test_model_cp2_matches_single_process[llama3]",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_parallel_training.py::test_steps_match_single_process",
        ),
        "cp beside dp / tp / block compile on the parallelized model: cp 2 here, cp x tp end to end",
    ),
    Scheduled(
        "tests/unit/test_context_parallel.py::test_model_cp2_matches_single_process[[]qwen3]",
        ("tests/unit/test_context_parallel.py::test_model_cp2_matches_single_process[llama3]",),
        "Qwen 3 shares the decoder and its cp path with Llama 3",
    ),
    Scheduled(
        "tests/unit/test_context_parallel.py::test_graph_step_with_cp[[]unrolled]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "the graph step with cp: end to end through the trainer by default",
    ),
    Scheduled(
        "tests/unit/test_attention_widths.py::test_context_parallel_attention_takes_two_widths[[]kernel_interface]",
        (
            "tests/unit/test_context_parallel.py::test_attention_matches_full_sequence[cp2]",
            "tests/unit/test_attention_widths.py",
        ),
        "MLA's two widths through the kernel interface: the dense path and the kernel interface each run",
    ),
    Scheduled(
        "tests/e2e/test_deepseek_v3.py::test_graph_mode_scan_matches_eager",
        (
            "tests/unit/test_flux_graph.py::test_two_stack_scan_matches_eager",
            "tests/unit/test_models_moe.py::test_moe_scan_forward_backward_matches_the_loop",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
        ),
        "DeepSeek-V3's graph step with scan: its two-stack scan and the MoE graph scan run by default",
    ),
    Scheduled(
        "tests/unit/test_cpu_attention.py::test_avx2_build_matches_float64",
        ("tests/unit/test_cpu_attention.py::test_fp32_matches_float64_sdpa",),
        "the kernel built for AVX2 only (a second build): the same source, built for this CPU",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_graph_mode_with_ep_matches_eager",
        (
            "tests/unit/test_models_moe.py::test_moe_scan_forward_backward_matches_the_loop",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
        ),
        "graph mode with EP through the trainer: the MoE layer scan under FSDP x EP",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_checkpoint_from_ep2_resumes_with_ep1",
        (
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
            "tests/unit/test_parallel_fsdp.py::test_dcp_checkpoint_reshards_between_meshes",
            "tests/e2e/test_data_shards.py::test_torchrun_ranks_gather_the_state_and_resume_on_other_degrees",
        ),
        "resharding experts on resume: experts beyond ranks resume, and meshes change on resume",
    ),
    Scheduled(
        "tests/e2e/test_expert_balance.py::test_graph_mode_scan_bias_matches_eager",
        (
            "tests/e2e/test_expert_balance.py",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
            "tests/unit/test_models_moe.py::test_moe_scan_forward_backward_matches_the_loop",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
        ),
        "the bias update in the scanned graph step: the eager trajectory and the MoE graph scan",
    ),
    Scheduled(
        "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[[]4-degrees[23]]",
        ("tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",),
        "two more 4-rank meshes of the same parallelisms",
    ),
    Scheduled(
        "tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[[]*tp2]",
        ("tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[tp2-loss-parallel]",),
        "HF export from TP and FSDP x TP: FSDP and TP (loss parallel) each export by default",
    ),
    Scheduled(
        "tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[[]moe-*]",
        (
            "tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[tp2-loss-parallel]",
            "tests/unit/test_models_convert.py",
        ),
        "MoE export: FSDP export and the MoE key conversion each run",
    ),
    Scheduled(
        "tests/e2e/test_flux_train.py::test_flux_losses_match_single_process[[]2-degrees1]",
        (
            "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
        ),
        "another 2-rank FLUX mesh",
    ),
    Scheduled(
        "tests/unit/test_config.py::test_wrong_typed_optional_field_exits_2_on_the_cli[[][fhr]*]",
        (
            "tests/unit/test_config.py::test_wrong_typed_optional_field_exits_2_on_the_cli[n_kv_heads]",
            "tests/e2e/test_exit_codes.py::test_bad_input_exits_2_and_a_crash_never_75",
            "tests/e2e/test_cli.py::test_help_and_a_bad_flag",
            "tests/unit/test_config.py::test_cli_errors_exit_2_with_one_line",
        ),
        "one process per field; the contract table feeds every key a wrong type",
    ),
    Scheduled(
        "tests/unit/test_config.py::test_cli_errors_exit_2_with_one_line[[]argv[3-7]-*]",
        (
            "tests/unit/test_config.py::test_cli_errors_exit_2_with_one_line[argv0-configs/nope.toml]",
            "tests/e2e/test_exit_codes.py::test_bad_input_exits_2_and_a_crash_never_75",
            "tests/e2e/test_cli.py::test_help_and_a_bad_flag",
            "tests/unit/test_config.py::test_cli_errors_exit_2_with_one_line",
        ),
        "one process per bad argument; the contract table covers every class of bad input",
    ),
    Scheduled(
        "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process[[]tp2-compile]",
        (
            "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process[fsdp2]",
            "tests/unit/test_flux_model.py::test_tp2_bf16_forward_backward",
            "tests/unit/test_parallel_compile.py::test_per_block_compile_matches_eager[degrees0]",
        ),
        "FLUX under TP with per-block compile: TP here, per-block compile in test_parallel_compile",
    ),
    Scheduled(
        "tests/unit/test_document_mask.py::test_qwen3_moe_graph_scan_matches_eager_with_document_mask",
        (
            "tests/unit/test_document_mask.py::test_packed_row_equals_each_document_alone",
            "tests/unit/test_document_mask.py::test_tensor_parallel_passes_segment_ids",
        ),
        "the document mask in the MoE scanned graph step: the dense graph step with the mask",
    ),
    # XLA tier: the default tier keeps the lowering on XLA:CPU, the kernels' interpret-mode checks,
    # the reduced MoE EP program, the torch-tpu path of the plain step, the CP splash compile, the
    # launcher and runtime probes; these wait:
    Scheduled(
        "tests/xla/test_tpu_program.py::test_the_program_compiles_with_its_kernels_and_collectives[[]dense]",
        (
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
            "tests/xla/test_lowering.py",
        ),
        "the reduced dense program: the MoE EP program compiles the same attention, loss and FSDP "
        "collectives plus the expert dispatch",
    ),
    Scheduled(
        "tests/xla/test_tpu_program.py::test_the_low_precision_program_compiles_the_tpus_own_dots[[]*]",
        (
            "tests/unit/test_capture_kernels.py::test_the_quantized_ops_are_the_tpus_own_nodes_not_the_emulation",
            "tests/unit/test_tpu_compile_reports.py::test_every_kernel_op_is_lowered_with_the_targets_generation",
            "tests/xla/test_quantize_xla.py::test_xla_cpu_equals_the_torch_emulation",
        ),
        "two reduced [quantize] programs compiled deviceless (minutes): the default tier captures the quantized "
        "ops as the TPU's nodes, checks each has its lowering, and runs the dense op on XLA:CPU against the emulation",
    ),
    Scheduled(
        "tests/xla/test_tpu_program.py::test_the_program_compiles_with_its_kernels_and_collectives[[]gpt_oss]",
        (
            "tests/unit/test_capture_kernels.py::test_the_sink_op_keeps_shapes_and_autograd_on_fake_tensors",
            "tests/unit/test_capture_kernels.py::test_the_sink_and_delta_rule_kernels_are_priced",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
        ),
        "the reduced gpt-oss program: the sink op captured and priced, and an MoE program's lowering",
    ),
    Scheduled(
        "tests/xla/test_tpu_program.py::test_the_program_compiles_with_its_kernels_and_collectives[[]qwen3_5]",
        (
            "tests/unit/test_delta_rule_op.py::test_the_capture_op_keeps_shapes_and_autograd_on_fake_tensors",
            "tests/unit/test_capture_kernels.py::test_the_sink_and_delta_rule_kernels_are_priced",
            "tests/xla/test_convolution_backward.py::test_convolution_backward_matches_aten",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
        ),
        "the reduced Qwen 3.5 program: the delta rule op captured and priced, its conv1d backward's "
        "lowering, and an MoE program's lowering",
    ),
    Scheduled(
        "tests/xla/test_tpu_program.py::test_the_program_compiles_with_its_kernels_and_collectives[[]cp2]",
        (
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
        ),
        "the reduced CP program: the CP splash compile with its collectives, and the whole-program "
        "compile of the MoE recipe",
    ),
    Scheduled(
        "tests/xla/test_tpu_compile.py::test_deviceless_tpu_compile[[]*]",
        (
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
            "tests/xla/test_lowering.py",
        ),
        "the debug models' exported steps compiled for v5e / v6e / v7x: the reduced recipe program "
        "compiles for a TPU by default",
    ),
    Scheduled(
        "tests/xla/test_kernels.py::test_deviceless_tpu_compile_per_generation_with_the_runtime_libtpu",
        (
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
        ),
        "every kernel compiled for every generation: the kernels' numerics and one generation's "
        "compile of all of them run by default",
    ),
    Scheduled(
        "tests/xla/test_selfcheck_widths.py::test_the_70b_wide_loss_does_not_compile_for_v4_and_the_reference_serves_it",
        (
            "tests/unit/test_kernel_selfcheck.py",
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
        ),
        "the v4 fallback at the 70B's width: the self-check's fallback logic runs on the CPU",
    ),
    Scheduled(
        "tests/xla/test_splash_cp.py::test_interpreted_cp_splash_matches_the_dense_reference",
        (
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference[splash]",
            "tests/unit/test_context_parallel.py::test_attention_matches_full_sequence[cp2]",
        ),
        "the CP splash numerics in interpret mode: splash's numerics and the CP reference each run",
    ),
    Scheduled(
        "tests/xla/test_torch_tpu_path.py::test_moe_ep_*",
        (
            "tests/xla/test_lowering.py::test_step_on_xla_cpu_matches_aot_eager",
            "tests/unit/test_graph_tpu_reverse_scan.py::test_tpu_capture_tags_instead_of_looping",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
        ),
        "the MoE EP step on torch-tpu's lowering path: the plain step reaches it, and the EP "
        "program compiles through torchax",
    ),
    Scheduled(
        "tests/xla/test_torch_tpu_path.py::test_cp_*",
        (
            "tests/xla/test_lowering.py::test_step_on_xla_cpu_matches_aot_eager",
            "tests/unit/test_graph_tpu_reverse_scan.py::test_tpu_capture_tags_instead_of_looping",
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
        ),
        "the CP step on torch-tpu's lowering path: the plain step reaches it, CP splash compiles",
    ),
    Scheduled(
        "tests/xla/test_torch_tpu_path.py::test_compile_mode_*",
        (
            "tests/xla/test_lowering.py::test_step_on_xla_cpu_matches_aot_eager",
            "tests/unit/test_graph_tpu_reverse_scan.py::test_tpu_capture_tags_instead_of_looping",
        ),
        "per-block compile on torch-tpu's path: the partitioning check runs on the whole step",
    ),
    Scheduled(
        "tests/xla/test_estimate_xla.py::*",
        (
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
            "tests/unit/test_xla_projection.py",
        ),
        "the projection's compile (scripts/estimate_xla.py): the recipe program compiles, and the "
        "projection's arithmetic is unit-tested",
    ),
    Scheduled(
        "tests/e2e/test_flux_train.py::test_flux_debug_recipe_loss_falls",
        (
            "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
            "tests/e2e/test_train_e2e.py::test_resume_reproduces_uninterrupted_run",
            "tests/e2e/test_flux_train.py::test_flux_bad_key_from_the_command_line",
        ),
        "the FLUX debug recipe's loss over a longer run: FLUX training runs in the parity and checkpoint tests",
    ),
    Scheduled(
        "tests/e2e/test_parallel_e2e.py::test_graph_and_loss_parallel_with_tp_match_single_process[[]graph-tp2]",
        (
            "tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[tp2-loss-parallel]",
            "tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives",
        ),
        "the graph step on TP: the loss-parallel point runs the same graph step on TP",
    ),
    Scheduled(
        "tests/e2e/test_expert_balance.py::test_bias_trajectory_matches_single_process[[][te]p2]",
        (
            "tests/e2e/test_expert_balance.py",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
        ),
        "the bias trajectory on TP and EP: the global load is reduced over every rank, shown at FSDP 2",
    ),
    Scheduled(
        "tests/unit/test_flux_graph.py::test_two_stack_block_ac_unrolled[[]selective]",
        (
            "tests/unit/test_graph_step.py::test_unrolled_remat[full]",
            "tests/unit/test_flux_graph.py::test_two_stack_scan_matches_eager",
        ),
        "selective AC on the two-stack model: full AC runs the same wrapping",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_moe_losses_match_single_process[[]2-degrees2]",
        (
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
        ),
        "another 2-rank MoE mesh",
    ),
    Scheduled(
        "tests/unit/test_moe_routing.py::test_trainer_random_routing_scanned_graph_equals_eager",
        (
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
            "tests/unit/test_moe_routing.py",
            "tests/unit/test_models_moe.py::test_moe_scan_forward_backward_matches_the_loop",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
        ),
        "random routing in the scanned graph step: random routing through the trainer, and the MoE graph scan",
    ),
    Scheduled(
        "tests/xla/test_kernels.py::test_sweep_compile_mode_compiles_candidates_and_writes_the_table",
        (
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
            "tests/unit/test_kernel_tiles_sweep.py",
            "tests/e2e/test_cli.py::test_help_and_a_bad_flag[scripts/bench/sweep_kernel_tiles.py]",
        ),
        "the tile sweep (a developer tool) compiling candidates: the tile table and the sweep command line run by default",
    ),
    Scheduled(
        "tests/xla/test_tpu_compile.py::*",
        (
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
            "tests/xla/test_lowering.py",
        ),
        "the exported steps of the debug models compiled for each TPU generation: the reduced recipe program compiles for a TPU by default",
    ),
    Scheduled(
        "tests/xla/test_install_pins.py::*",
        ("tests/e2e/test_install.py",),
        "the TPU pins resolved from the package index for cp311 (a pip resolve): the consistency of the pins is checked by default",
    ),
    Scheduled(
        "tests/xla/test_selfcheck_widths.py::*",
        (
            "tests/unit/test_kernel_selfcheck.py",
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
        ),
        "the self-check at recipe widths with the real kernels: the logic of the self-check and the numerics of the kernels each run by default",
    ),
    Scheduled(
        "tests/e2e/test_flux_train.py::test_flux_losses_match_single_process[[]4-degrees4]",
        (
            "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
        ),
        "FLUX on 4 ranks: 2 ranks run the same wrapping",
    ),
    Scheduled(
        "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[[]4-degrees4]",
        ("tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",),
        "a 4-rank mesh of the parallelisms the 2-rank points run",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_moe_losses_match_single_process[[]*-degrees[1-9]]",
        (
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
            "tests/unit/test_expert_parallel.py",
        ),
        "more MoE meshes: FSDP 2 through the trainer and EP in the unit tests",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_resume_across_a_change_of_cp",
        (
            "tests/unit/test_parallel_fsdp.py::test_dcp_checkpoint_reshards_between_meshes",
            "tests/e2e/test_data_shards.py::test_torchrun_ranks_gather_the_state_and_resume_on_other_degrees",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
        ),
        "resuming on another cp degree: meshes change on resume, and cp trains",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_moe_cp_matches_single_process[[]cp2xep2]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_expert_parallel.py",
        ),
        "MoE with cp x ep: cp and EP each run",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_document_mask_cp2_matches_single_process[[]restart]",
        (
            "tests/unit/test_document_mask.py",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
        ),
        "document masking under cp: the mask and cp each run",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_dense_tp2_matches_single_process",
        (
            "tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[tp2-loss-parallel]",
            "tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives",
        ),
        "Qwen 3 dense on TP: the Llama 3 decoder on TP runs the same plan styles",
    ),
    Scheduled(
        "tests/e2e/test_parallel_e2e.py::test_graph_and_loss_parallel_with_tp_match_single_process[[]loss-parallel-tp2]",
        (
            "tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[tp2-loss-parallel]",
            "tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives",
        ),
        "eager loss parallel on TP: the graph point runs loss parallel on TP",
    ),
    Scheduled(
        "tests/unit/test_parallel_compile.py::test_per_block_compile_matches_eager[[]degrees1]",
        ("tests/unit/test_parallel_compile.py::test_per_block_compile_matches_eager[degrees0]",),
        "per-block compile on another mesh",
    ),
    Scheduled(
        "tests/e2e/test_new_family.py::test_new_family_graph_scan_matches_eager",
        (
            "tests/unit/test_models_params.py",
            "tests/unit/test_step_plan.py",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
            "tests/unit/test_parallel_compile.py::test_per_block_compile_matches_eager",
        ),
        "an outside family in the scanned graph step: the family trains in parallel, and the scan runs on the built-in decoder",
    ),
    # --- added 2026-12-05 (capacity dispatch, multislice, object storage, projection).
    Scheduled(
        "tests/e2e/test_hf_backend.py::test_tp_two_ranks_match_one",
        (
            "tests/e2e/test_hf_backend.py::test_hf_path_matches_native_families",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process",
            "tests/e2e/test_parallel_e2e.py",
        ),
        "a Hugging Face model on two ranks: FSDP runs by default, and TP's styles on the native families",
    ),
    Scheduled(
        "tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[[]hsdp-replicate2]",
        ("tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[tp2-loss-parallel]",),
        "the HF export from HSDP: the FSDP export gathers the same shards",
    ),
    Scheduled(
        "tests/e2e/test_runlock.py::test_the_refusal_reaches_every_rank[[]checkpoint_in_a_live_runs_dump]",
        ("tests/e2e/test_runlock.py::test_second_training_run_is_refused_and_the_first_keeps_its_folder",),
        "the lock's refusal on every rank for a second folder kind: the dump folder's runs by default",
    ),
    Scheduled(
        "tests/e2e/test_new_family.py::test_new_family_parallel_matches_single_process[[]tp2]",
        (
            "tests/unit/test_models_params.py",
            "tests/unit/test_step_plan.py",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
        ),
        "an outside family on TP: the same family on FSDP, and TP on the built-in families",
    ),
    Scheduled(
        "tests/unit/test_moe_capacity.py::test_capacity_is_mesh_independent[[]4-4-*]",
        ("tests/unit/test_moe_capacity.py::test_capacity_is_mesh_independent[4-2",),
        "capacity at EP 4: EP 2 x FSDP 2 on four ranks runs the same all-to-all",
    ),
    Scheduled(
        "tests/e2e/test_gcs_storage.py::test_gcs_save_kill9_mid_save_then_resume_is_exact",
        (
            "tests/e2e/test_gcs_storage.py::test_gcs_manifest_is_the_commit_point",
            "tests/e2e/test_gcs_storage.py::test_gcs_lock_refuses_a_second_writer_and_takes_over_a_dead_one",
            "tests/e2e/test_preemption.py::test_sigterm_checkpoints_and_the_relaunch_resumes_exactly",
            "tests/unit/test_checkpoint.py::test_killed_mid_save_leaves_newest_loadable",
        ),
        "kill -9 mid-save on gs:// and an exact resume: the manifest-last commit and the object lock against the "
        "emulator, and kill -9 / exact resume on a local folder, run by default",
    ),
    Scheduled(
        "tests/e2e/test_gcs_storage.py::test_gcs_two_ranks_async_save_resume_and_retention",
        (
            "tests/e2e/test_gcs_storage.py::test_gcs_manifest_is_the_commit_point",
            "tests/e2e/test_gcs_storage.py::test_gcs_lock_refuses_a_second_writer_and_takes_over_a_dead_one",
            "tests/e2e/test_preemption.py::test_sigterm_checkpoints_and_the_relaunch_resumes_exactly",
            "tests/unit/test_checkpoint.py::test_killed_mid_save_leaves_newest_loadable",
        ),
        "two ranks with async saves on gs://: the manifest-last commit and the object lock run by default",
    ),
    Scheduled(
        "tests/e2e/test_pipeline_multislice.py::test_graph_pp_over_two_slices_trains_like_one_process",
        (
            "tests/e2e/test_pipeline_multislice.py::test_pp_over_slices_rules_and_dcn_split",
            "tests/e2e/test_pipeline_multislice.py::test_pp_mesh_on_two_slices_keeps_fsdp_inside_a_slice",
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
            "tests/e2e/test_multislice.py::test_slice_count_from_the_environment_and_the_dcn_split",
        ),
        "graph-mode PP over 2 simulated slices trained through the launchers (109 s): the rules, the DCN split "
        "on pp and the 2-slice pp mesh run by default, and graph-mode PP's parity on one slice",
    ),
    Scheduled(
        "tests/e2e/test_multislice.py::test_two_slices_train_like_one_process",
        (
            "tests/e2e/test_launch.py::test_cli_error_is_one_line_exit_2_and_dry_run_prints_the_command",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
            "tests/e2e/test_multislice.py::test_xpk_two_slices_global_rank_and_coordinator",
            "tests/e2e/test_multislice.py::test_slice_count_from_the_environment_and_the_dcn_split",
        ),
        "2 slices x 2 hosts training: the multi-host launch trains by default, and the slice ranks and the DCN split are checked",
    ),
    Scheduled(
        "tests/xla/test_pipeline_multislice_compile.py::test_pp_over_two_slices_compiles_with_the_permutes_on_the_dcn",
        (
            "tests/xla/test_multislice_compile.py::test_topology_name_of_a_multislice_target",
            "tests/e2e/test_pipeline_multislice.py::test_pp_over_slices_rules_and_dcn_split",
            "tests/unit/test_graph_pipeline.py::test_permute_shift_reads_rank_zero_s_splits",
        ),
        "a deviceless 2-slice TPU compile with PP over the DCN (54 s): the slice topology, the DCN split on pp "
        "and the permute's lowering rule run by default",
    ),
    Scheduled(
        "tests/xla/test_multislice_compile.py::test_two_slice_program_compiles_with_the_dcn_split_on_dp_replicate",
        (
            "tests/xla/test_multislice_compile.py::test_topology_name_of_a_multislice_target",
            "tests/unit/test_tpu_env.py",
            "tests/unit/test_tpu_topology.py",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
        ),
        "the 2-slice deviceless compile (minutes): the topology name, torch-tpu's hybrid mesh and the one-slice program compile run by default",
    ),
    Scheduled(
        "tests/xla/test_program_projection.py::*",
        (
            "tests/unit/test_mfu_program.py",
            "tests/unit/test_xla_projection.py",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
        ),
        "the projection of a compiled EP program: its HLO reading and pricing are unit tested, the EP program compile runs by default",
    ),
    # --- moved 2026-12-05 (the default tier measured 20.2 min of pytest on CI's 2 vCPUs) ---
    Scheduled(
        "tests/e2e/test_tpu_smoke.py::test_shim_run_end_to_end",
        (
            "tests/e2e/test_tpu_smoke.py::test_ctrl_c_stops_the_run_and_still_reports",
            "tests/e2e/test_tpu_smoke.py::test_plan_and_commands",
        ),
        "every smoke run on the shim: a shim run (stopped by Ctrl-C, still reported) and the plan run by default",
    ),
    Scheduled(
        "tests/unit/test_quantize.py::test_graph_step_with_layer_scan_matches_eager[[]int8]",
        (
            "tests/unit/test_quantize.py::test_compile_aot_eager_matches_eager",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "int8 in the scanned graph step: float8 rowwise runs the same swap in the same step",
    ),
    Scheduled(
        "tests/xla/test_splash_cp.py::test_the_ranks_rows_in_global_order_are_the_causal_attention",
        (
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference[splash]",
        ),
        "CP splash in interpret mode against the whole sequence: the splash numerics, the CP program "
        "and the chunk layout each run by default",
    ),
    Scheduled(
        "tests/xla/test_fused_ce_capture.py::*",
        (
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
            "tests/unit/test_kernel_tiles_sweep.py",
        ),
        "the fused loss at the 70B and 405B widths (90 s on CI): the recipe program compiles its fused loss "
        "for the recipe's generation, and each generation's loss tiles compile, by default",
    ),
    Scheduled(
        "tests/unit/test_fsdp_float8_gather.py::test_graph_step_with_layer_scan_gathers_in_float8_and_equals_eager",
        (
            "tests/unit/test_fsdp_float8_gather.py::test_the_scan_body_gathers_in_float8_as_simple_fsdp_does",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "the scanned step with float8-gathered weights on gloo processes (90 s on the Xeon, two compiles per "
        "rank): the scan body's float8 gather equals SimpleFSDP's on thread ranks, and the scanned step "
        "equals eager, by default",
    ),
    Scheduled(
        "tests/xla/test_quantize_xla.py::test_the_float8_gathered_weight_compiles_without_a_weight_pass_on_v7x",
        ("tests/xla/test_quantize_xla.py::test_xla_cpu_equals_the_torch_emulation",),
        "the block with float8-gathered weights compiled for TPU7x (about 20 s, and the tpuc venv): the op on "
        "float8 weights runs on XLA:CPU against the emulation by default",
    ),
    Scheduled(
        "tests/xla/test_quantize_xla.py::test_the_block_compiles_to_float8_dots_on_v7x_and_int8_dots_on_v6e",
        ("tests/xla/test_quantize_xla.py::test_xla_cpu_equals_the_torch_emulation",),
        "a quantized block compiled for TPU7x and v6e (48 s on CI): the XLA dots of each recipe run on XLA:CPU "
        "and register through torch-tpu by default",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_debug_recipe_loss_falls[[]configs/qwen3_moe_debug.toml]",
        (
            "tests/e2e/test_train_e2e.py::test_loss_falls",
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
            "tests/unit/test_expert_parallel.py",
        ),
        "the MoE debug recipe's loss falls: the dense recipe's does, and the MoE recipe trains in the parity tests",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]*_*[pt]8.toml]",
        (
            "tests/unit/test_low_precision_recipes.py",
            "tests/e2e/test_recipes.py::test_recipe_passes_the_rules_at_its_declared_degrees",
            "tests/e2e/test_recipes.py::test_the_check_names_the_recipe_and_the_rule_or_the_shortfall",
            "tests/unit/test_planner_deepseek.py::test_pod_recipe_is_the_planners_choice_and_passes_the_check[deepseek_v3_671b_v7x]",
            "tests/unit/test_quantize.py::test_compile_aot_eager_matches_eager",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "the low-precision pod variants at their targets (45-260 s each): each is its parent plus [quantize] "
        "(checked), passes the rules at its degrees, its parent starts, and the quantized graph step captures",
    ),
    Scheduled(
        "tests/xla/test_launch_ttpu.py::*",
        (
            "tests/e2e/test_launch.py::test_gke_v6e_plan_and_torch_tpu_env",
            "tests/e2e/test_launch.py::test_tpu_vm_metadata_plan",
            "tests/e2e/test_launch.py::test_torch_tpu_failure_is_one_config_error_line",
        ),
        "the launcher's plans run through the real torch-tpu launch module (33 s): the same plans, the "
        "environment torch-tpu derives from them and its failure line are checked by default",
    ),
    Scheduled(
        "tests/unit/test_fsdp_float8_gather.py::test_gloo_moves_the_uint8_view_and_a_compiled_layer_equals_eager",
        (
            "tests/unit/test_fsdp_float8_gather.py::test_float8_all_gather_moves_e4m3_bytes_and_matches_the_bf16_gather",
            "tests/unit/test_quantize.py::test_compile_aot_eager_matches_eager",
        ),
        "the float8 gather over real gloo processes and compiled: the gather's bytes and values run on thread "
        "ranks, the quantized layer compiles, by default",
    ),
    Scheduled(
        "tests/unit/test_quantize_moe.py::test_experts_layer_eager_compile_and_capacity_agree[[]float8_rowwise]",
        ("tests/unit/test_quantize_moe.py::test_experts_layer_eager_compile_and_capacity_agree[int8]",),
        "the quantized experts compiled and in the capacity layout under float8: int8 runs the same paths",
    ),
    Scheduled(
        "tests/e2e/test_deepseek_v3.py::test_parallel_matches_single_process[[]tp2]",
        (
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
            "tests/e2e/test_deepseek_v3.py",
            "tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[tp2-loss-parallel]",
            "tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives",
        ),
        "DeepSeek-V3 on TP: its parity at EP 2 and the TP plans' styles on Llama 3 run by default",
    ),
    Scheduled(
        "tests/e2e/test_lost_slice.py::test_replaced_slice_restores_its_hosts_from_the_survivors_peer",
        ("tests/unit/test_checkpoint.py::test_replaced_host_receives_the_step_from_its_peer",),
        "a replaced slice through the launcher: the peer transfer runs on 2 gloo ranks, the lost slice's relaunch "
        "through the launcher, by default",
    ),
    Scheduled(
        "tests/e2e/test_parallel_e2e.py::test_replicate_reduce_once_per_step_matches_single_process[[]graph]",
        (
            "tests/unit/test_replicate_reduce.py",
            "tests/unit/test_replicate_reduce.py::test_graph_reduce_equals_the_eager_reducer",
        ),
        "the once-per-step replica mean in the captured step: the trainer's eager run under torchrun, and "
        "graph mode's reduce_grads equal to the eager reducer on thread ranks",
    ),
    Scheduled(
        "tests/xla/test_quantize_xla.py::test_the_grouped_op_compiles_to_float8_ragged_dots_on_v7x_and_int8_on_v6e",
        (
            "tests/xla/test_quantize_xla.py::test_xla_cpu_equals_the_torch_emulation",
            "tests/unit/test_quantize_moe.py",
        ),
        "the grouped op's deviceless TPU compile: the dense op's XLA:CPU check runs the same quantize "
        "helpers and jax_op path by default",
    ),
    Scheduled(
        "tests/xla/test_quantize_xla.py::test_grouped_xla_cpu_equals_the_torch_emulation",
        (
            "tests/unit/test_quantize_moe.py",
            "tests/xla/test_quantize_xla.py::test_xla_cpu_equals_the_torch_emulation",
        ),
        "the TPU grouped op on XLA:CPU: the torch emulation it must equal runs on the CPU trainer's path, and "
        "the dense TPU op (the same scale and cast helpers, the same jax_op registration) through XLA:CPU",
    ),
    Scheduled(
        "tests/e2e/test_moe_capacity_train.py::test_capacity_scanned_graph_equals_eager",
        (
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
            "tests/unit/test_models_moe.py::test_moe_scan_forward_backward_matches_the_loop",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
        ),
        "the capacity dispatch in the scanned graph: the capacity path's parity on EP 2 and the MoE scanned graph step",
    ),
    Scheduled(
        "tests/e2e/test_moe_capacity_train.py::test_full_ac_recompute_sends_nothing_back",
        (
            "tests/unit/test_moe_capacity.py::test_capacity_is_mesh_independent",
            "tests/unit/test_moe_capacity.py::test_forward_chunks_are_mesh_independent",
        ),
        "the all-to-alls of the scanned EP graph under full AC: the router weights applied on the expert's rank "
        "and the chunked block are the same code on thread ranks (outputs and every gradient against one process)",
    ),
    Scheduled(
        "tests/e2e/test_moe_capacity_train.py::test_dispatch_chunks_ep2_scanned_graph_equals_one_process",
        (
            "tests/unit/test_moe_capacity.py::test_dispatch_chunks_are_mesh_independent",
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
        ),
        "the chunked capacity dispatch in the EP scan body: the chunk-major layout's parity on thread ranks "
        "(the same forward_capacity_chunks) and the capacity path's on EP 2 through the trainer",
    ),
    # --- moved for the 2-vCPU AMD EPYC (AVX2) budget (2026-12-05): on that CPU the default tier
    # ran 51 min of pytest. Each of these is the second proof of a mechanism a cheaper default
    # test already runs, or a whole-program check whose parts a default test runs.
    Scheduled(
        "tests/unit/test_graph_step.py::test_inductor_scan_matches_eager",
        (
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
            "tests/unit/test_parallel_compile.py::test_per_block_compile_matches_eager",
        ),
        "the scanned step under Inductor: the scanned step under aot_eager here, Inductor on the blocks in test_parallel_compile",
    ),
    Scheduled(
        "tests/unit/test_graph_step.py::test_node_count_constant_with_scan",
        (
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
            "tests/xla/test_lowering.py::test_scan_is_one_loop_each_way_whatever_n_layers",
        ),
        "the scanned graph's size does not grow with depth: one loop each way whatever n_layers on XLA",
    ),
    Scheduled(
        "tests/unit/test_graph_step.py::test_scan_remat_shrinks_saved_activations",
        ("tests/unit/test_graph_step.py::test_unrolled_remat",),
        "remat inside the scanned body: the same remat policy on the unrolled graph",
    ),
    Scheduled(
        "tests/e2e/test_hf_backend.py::test_modes_match_eager[[]*]",
        (
            "tests/e2e/test_hf_backend.py::test_hub_kernel_routing_is_bypassed_for_scan",
            "tests/e2e/test_hf_backend.py::test_hf_path_matches_native_families",
        ),
        "an HF model under compile and graph mode: the HF model in the scanned graph and equal to the native family",
    ),
    Scheduled(
        "tests/e2e/test_hf_backend.py::test_fsdp_two_ranks_match_one",
        (
            "tests/e2e/test_hf_backend.py::test_hf_path_matches_native_families",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process",
        ),
        "an HF model on FSDP 2: it equals the native family, which FSDP 2 equals one process",
    ),
    Scheduled(
        "tests/xla/test_kernels.py::test_each_generation_gets_its_own_tiles",
        ("tests/xla/test_kernels.py::test_interpret_matches_torch_reference", "tests/unit/test_kernel_tiles_sweep.py"),
        "per-generation tile tables compiled for each TPU: the kernels run interpreted, and the tile pick by compiled cost",
    ),
    Scheduled(
        "tests/xla/test_tpu_program.py::test_the_program_compiles_with_its_kernels_and_collectives[[]moe_ep2]",
        (
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_expert_parallel.py::test_traced_ep_dispatch_has_no_data_dependent_ops",
        ),
        "the EP 2 MoE program compiled whole: the MoE step lowers to one program and the EP dispatch traces static",
    ),
    Scheduled(
        "tests/xla/test_splash_cp.py::test_deviceless_compile_has_the_cp_collectives_and_the_mosaic_splash",
        (
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
        ),
        "splash under CP compiled for a TPU: the splash kernel interpreted, and the CP ring in training",
    ),
    Scheduled(
        "tests/xla/test_layer_norm_backward.py::*",
        ("tests/xla/test_lowering.py::test_step_on_xla_cpu_matches_aot_eager",),
        "the layer-norm backward decomposition on XLA: the whole step on XLA:CPU equals aot_eager",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]qwen3_30b_a3b_v6e.toml]",
        (
            "tests/e2e/test_recipes.py::test_the_check_names_the_recipe_and_the_rule_or_the_shortfall",
            "tests/unit/test_planner_deepseek.py::test_pod_recipe_is_the_planners_choice_and_passes_the_check[deepseek_v3_671b_v7x]",
        ),
        "an MoE pod recipe on its fake world: the recipe check, and the DeepSeek-V3 MoE recipe passing it",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]qwen3_5_35b_a3b_v6e.toml]",
        (
            "tests/e2e/test_recipes.py::test_recipe_passes_the_rules_at_its_declared_degrees[qwen3_5_35b_a3b_v6e.toml]",
            "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[qwen3_5_moe_debug.toml]",
            "tests/unit/test_planner_new_families.py",
        ),
        "the Qwen 3.5 MoE pod recipe's start-up: its capture of 40 unscanned blocks with the delta rule's "
        "reference (a Python loop over 64 chunks in each of 30 blocks) ran over 18 minutes on a Zen 5 EPYC; "
        "the rules at its target, the same family's start-up at debug size and its plan run by default",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]gpt_oss_20b_v6e.toml]",
        (
            "tests/e2e/test_recipes.py::test_recipe_passes_the_rules_at_its_declared_degrees[gpt_oss_20b_v6e.toml]",
            "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[gpt_oss_debug.toml]",
            "tests/unit/test_planner_figures.py::test_recipe_header_figures_are_the_planners[gpt_oss_20b_v6e]",
        ),
        "the gpt-oss 20B pod recipe's start-up on a fake 64-rank world (17 s on a Zen 5 EPYC): the rules "
        "at its target, the family's start-up at debug size and the recipe's plan run by default",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]qwen3_5_9b_v6e.toml]",
        (
            "tests/e2e/test_recipes.py::test_recipe_passes_the_rules_at_its_declared_degrees[qwen3_5_9b_v6e.toml]",
            "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[qwen3_5_debug.toml]",
            "tests/unit/test_planner_figures.py::test_recipe_header_figures_are_the_planners[qwen3_5_9b_v6e]",
        ),
        "the Qwen 3.5 9B pod recipe's start-up: its capture of 32 unscanned blocks with the delta rule's "
        "reference (a Python loop over 64 chunks in each of 24 blocks), as the 35B-A3B's; the rules at its "
        "target, the family's dense start-up at debug size and the recipe's plan run by default",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]llama3_8b_128k_v6e.toml]",
        (
            "tests/e2e/test_recipes.py::test_the_check_names_the_recipe_and_the_rule_or_the_shortfall",
            "tests/unit/test_planner.py::test_suggest_fixes_offers_a_cp_degree_for_a_long_sequence",
        ),
        "the 128k recipe on its fake world: the recipe check, and the 128k recipes are the planner's choice",
    ),
    Scheduled(
        "tests/e2e/test_resume_e2e.py::test_torchrun_restarts_from_newest_checkpoint_after_a_killed_worker",
        (
            "tests/e2e/test_preemption.py::test_sigterm_checkpoints_and_the_relaunch_resumes_exactly",
            "tests/unit/test_checkpoint.py::test_killed_mid_save_leaves_newest_loadable",
        ),
        "kill -9 and torchrun's restart: the exact relaunch after SIGTERM and the newest-loadable rule after a killed save",
    ),
    Scheduled(
        "tests/e2e/test_resume_e2e.py::test_checkpoint_from_one_mesh_resumes_on_others",
        (
            "tests/unit/test_parallel_fsdp.py::test_dcp_checkpoint_reshards_between_meshes",
            "tests/e2e/test_data_shards.py::test_torchrun_ranks_gather_the_state_and_resume_on_other_degrees",
        ),
        "resume on another mesh: DCP resharding between meshes and the data state on other degrees",
    ),
    Scheduled(
        "tests/unit/test_expert_parallel.py::test_moe_layer_scan_matches_eager[[]fsdp2-ep2]",
        (
            "tests/unit/test_models_moe.py::test_moe_scan_forward_backward_matches_the_loop",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
        ),
        "the MoE layer scanned on EP 2: the scanned MoE layer and EP parity, each",
    ),
    Scheduled(
        "tests/unit/test_expert_parallel.py::test_experts_beyond_ranks_train_and_resume",
        (
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
        ),
        "several experts per rank through a resume: EP parity with several experts per rank, and the MoE run on EP 2",
    ),
    Scheduled(
        "tests/unit/test_muon.py::test_graph_step_simple_fsdp_two_gloo_ranks[[]unrolled]",
        (
            "tests/unit/test_muon.py::test_simple_fsdp_two_gloo_ranks_equal_one_process",
            "tests/unit/test_muon.py::test_graph_step_matches_eager[unrolled]",
        ),
        "Muon in the graph step on SimpleFSDP: Muon on SimpleFSDP eagerly, and in the graph step on one rank",
    ),
    Scheduled(
        "tests/unit/test_muon.py::test_graph_step_matches_eager[[]scan]",
        ("tests/unit/test_muon.py::test_graph_step_matches_eager[unrolled]",),
        "Muon in the scanned graph: the optimizer step is outside the scanned body, as in the unrolled graph",
    ),
    Scheduled(
        "tests/unit/test_muon.py::test_graph_muon_update_of_sharded_matrices",
        ("tests/unit/test_muon.py::test_simple_fsdp_two_gloo_ranks_equal_one_process",),
        "Muon's update of sharded matrices traced: the same update on SimpleFSDP shards eagerly",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_graph_scan_cp2_matches_single_process",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "CP in the scanned graph: CP 2 in training and the scanned graph, each",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[[]cp2xtp2]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_parallel_training.py::test_steps_match_single_process",
        ),
        "CP beside TP: CP 2 alone, and TP on its mesh slice",
    ),
    Scheduled(
        "tests/e2e/test_parallel_e2e.py::test_graph_and_loss_parallel_with_tp_match_single_process[[]graph-loss-parallel-tp2]",
        (
            "tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[tp2-loss-parallel]",
            "tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives",
        ),
        "graph mode with TP and loss parallel through torchrun: loss parallel on TP 2, and the parallel step as one graph",
    ),
    Scheduled(
        "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[[]2-degrees1]",
        ("tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",),
        "the second 2-rank mesh through torchrun: the first, on the same launcher and harness",
    ),
    Scheduled(
        "tests/e2e/test_parallel_e2e.py::test_replicate_reduce_once_per_step_matches_single_process[[]eager]",
        ("tests/unit/test_replicate_reduce.py",),
        "the once-per-step replica mean through torchrun: the reducer's parity, bf16 bound and bucket order on thread ranks",
    ),
    Scheduled(
        "tests/e2e/test_flux_train.py::test_flux_losses_match_single_process[[]2-degrees0]",
        (
            "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
        ),
        "FLUX on 2 ranks through torchrun: the FLUX model on FSDP and TP, and the launcher's parity on a language model",
    ),
    Scheduled(
        "tests/e2e/test_flux_train.py::test_flux_checkpoint_round_trip",
        (
            "tests/e2e/test_train_e2e.py::test_resume_reproduces_uninterrupted_run",
            "tests/e2e/test_flux_train.py::test_flux_bad_key_from_the_command_line",
        ),
        "the FLUX trainer's checkpoint: the same checkpointer on a language model, and the FLUX trainer's start",
    ),
    Scheduled(
        "tests/e2e/test_contract.py::test_contract_table",
        (
            "tests/e2e/test_exit_codes.py::test_bad_input_exits_2_and_a_crash_never_75",
            "tests/e2e/test_cli.py::test_help_and_a_bad_flag",
            "tests/unit/test_config.py::test_cli_errors_exit_2_with_one_line",
        ),
        "the contract on every entry point: the runner equals a real process, bad input exits 2 in the trainer, and every script's bad flag",
    ),
    Scheduled(
        "tests/e2e/test_scan_tp.py::test_llama3_scan_tp2_matches_single_process_and_unrolled",
        (
            "tests/unit/test_parallel_training.py::test_steps_match_single_process",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "the scanned step on TP 2: TP parity and the scanned step, each",
    ),
    Scheduled(
        "tests/unit/test_quantize.py::test_graph_step_with_layer_scan_matches_eager[[]float8_rowwise]",
        (
            "tests/unit/test_quantize.py::test_compile_aot_eager_matches_eager",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "quantized linears in the scanned graph: the quantized op traced under aot_eager, and the scanned step",
    ),
    Scheduled(
        "tests/e2e/test_deepseek_v3.py::test_layer_scan_over_both_stacks_matches_unrolled",
        ("tests/unit/test_flux_graph.py::test_two_stack_scan_matches_eager",),
        "a scan over two layer stacks: FLUX's double and single stacks scanned",
    ),
    Scheduled(
        "tests/e2e/test_deepseek_v3.py::test_parallel_matches_single_process[[]ep2]",
        ("tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2", "tests/e2e/test_deepseek_v3.py"),
        "DeepSeek-V3 on EP 2: the MoE e2e on EP, and DeepSeek-V3's model and conversion tests",
    ),
    Scheduled(
        "tests/unit/test_flux_graph.py::test_two_stack_block_ac_unrolled[[]full]",
        (
            "tests/unit/test_graph_step.py::test_unrolled_remat[full]",
            "tests/unit/test_flux_graph.py::test_two_stack_scan_matches_eager",
        ),
        "full AC on FLUX's unrolled graph: full AC on the unrolled graph, and FLUX's two-stack graph",
    ),
    Scheduled(
        "tests/unit/test_flux_graph.py::test_two_stack_unrolled_graph_matches_eager",
        ("tests/unit/test_flux_graph.py::test_two_stack_scan_matches_eager",),
        "FLUX's unrolled graph: the scanned one traces the same blocks",
    ),
    Scheduled(
        "tests/e2e/test_launch.py::test_launch_pod_local_sigterm_exits_75",
        (
            "tests/e2e/test_preemption.py::test_sigterm_checkpoints_and_the_relaunch_resumes_exactly",
            "tests/e2e/test_launch.py::test_launch_pod_passes_exit_codes_through",
        ),
        "SIGTERM to the pod launcher: SIGTERM to the trainer saves, and the pod launcher passes exit codes through",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_graph_mode_with_tp_and_loss_parallel_matches_single_process",
        (
            "tests/unit/test_expert_parallel.py::test_eager_step_adds_the_aux_loss_under_loss_parallel",
            "tests/unit/test_graph_step.py::test_unrolled_matches_eager",
        ),
        "graph mode for Qwen 3 MoE at TP 2 with loss parallel through the trainer (two launches): the eager step "
        "adds the DTensor LM loss and the plain aux loss the same way, and the graph step equals the eager step",
    ),
    Scheduled(
        "tests/unit/test_models_moe.py::test_moe_graph_step_with_scan_matches_unrolled_and_eager*",
        (
            "tests/unit/test_models_moe.py::test_moe_scan_forward_backward_matches_the_loop",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
            "tests/unit/test_stack_terms.py::test_two_scanned_forwards_in_one_program_each_pop_their_own_terms",
        ),
        "the MoE graph step scanned, alone and with 2 accumulation micro-batches: the scanned MoE layer's forward "
        "and backward, the MoE step as one program, and two scanned forwards popping their own terms in one program",
    ),
    Scheduled(
        "tests/unit/test_graph_fsdp.py::test_graph_step_simple_fsdp_matches_single_process",
        ("tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives",),
        "the graph step on SimpleFSDP: the whole parallel step as one graph with its FSDP collectives",
    ),
    Scheduled(
        "tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[[]fsdp2]",
        ("tests/e2e/test_engine.py::test_hf_export_one_rank_equals_two_ranks[tp2-loss-parallel]",),
        "the HF export from FSDP shards: the export from TP shards gathers the same DTensors",
    ),
    Scheduled(
        "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process[[]fsdp2xtp2]",
        (
            "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process[fsdp2]",
            "tests/unit/test_flux_model.py::test_tp2_bf16_forward_backward",
        ),
        "FLUX on FSDP x TP: each axis alone",
    ),
    Scheduled(
        "tests/e2e/test_exit_codes.py::test_sigterm_to_one_rank_stops_both_at_the_same_step",
        ("tests/e2e/test_preemption.py::test_sigterm_checkpoints_and_the_relaunch_resumes_exactly",),
        "SIGTERM agreed across ranks: the relaunch after SIGTERM resumes exactly",
    ),
    Scheduled(
        "tests/unit/test_planner_deepseek.py::test_pod_recipe_is_the_planners_choice_and_passes_the_check[[]kimi_k2_v7x]",
        (
            "tests/unit/test_planner_deepseek.py::test_pod_recipe_is_the_planners_choice_and_passes_the_check[deepseek_v3_671b_v7x]",
        ),
        "Kimi K2's pod recipe: the same family and planner as DeepSeek-V3's",
    ),
    Scheduled(
        "tests/unit/test_planner_deepseek_v4.py::test_v4_trained_indexer_activations_match_measured_saved_bytes*",
        (
            "tests/unit/test_planner_deepseek_v4.py::test_v4_activation_model_matches_measured_saved_bytes[none-64]",
            "tests/unit/test_indexer_loss.py::test_main_gradients_are_unchanged_by_it",
        ),
        "DeepSeek-V4's trained-indexer activation term against the measured saved bytes (two models per "
        "length, 1 s each here): the default tier checks the family's terms against the same measurement "
        "and runs the trained indexer's forward and backward",
    ),
    Scheduled(
        "tests/unit/test_planner_deepseek_v4.py::test_v4_activation_model_matches_measured_saved_bytes[[]none-128]",
        ("tests/unit/test_planner_deepseek_v4.py::test_v4_activation_model_matches_measured_saved_bytes[none-64]",),
        "DeepSeek-V4's activation terms at a second length (the per-head k / v and mask, quadratic in it): "
        "the default tier checks the same terms at 64 tokens",
    ),
    Scheduled(
        "tests/unit/test_planner_figures.py::test_recipe_header_figures_are_the_planners[[]deepseek_v4_flash_v7x]",
        (
            "tests/unit/test_planner_figures.py::test_recipe_header_figures_are_the_planners[deepseek_v3_671b_v7x]",
            "tests/unit/test_planner_deepseek_v4.py::test_v4_blocks_are_counted_per_kind_and_refuse_tp_and_cp",
        ),
        "DeepSeek-V4 Flash's header figures (10 s on the slow EPYC: its mixed blocks are sharded whole, "
        "no one-block probe): the check of the headers runs on DeepSeek-V3's, the family's terms at Flash's "
        "shape in a unit test",
    ),
    Scheduled(
        "tests/e2e/test_expert_balance.py::test_bias_trajectory_matches_single_process[[]fsdp2]",
        (
            "tests/e2e/test_expert_balance.py",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
        ),
        "the balance bias on FSDP 2: the bias update's unit tests, and the MoE layer on sharded ranks",
    ),
    Scheduled(
        "tests/unit/test_graph_checkpoint.py::test_scan_checkpoint_loads_without_scan_and_back",
        ("tests/unit/test_graph_checkpoint.py::test_scan_resyncs_replaced_tensors",),
        "a scanned run's checkpoint across scan and no scan: the scanned state's resync of replaced tensors",
    ),
    Scheduled(
        "tests/e2e/test_lost_slice.py::*",
        ("tests/unit/test_checkpoint.py::test_replaced_host_receives_the_step_from_its_peer",),
        "a lost slice resumes from the local tier: a replaced host receives the step from its peer",
    ),
    Scheduled(
        "tests/e2e/test_startup_checks.py::test_a_rank_frozen_before_the_first_collective_is_named_within_startup_timeout",
        ("tests/e2e/test_watchdog.py::test_arrival_barrier_names_the_ranks_that_did_not_arrive",),
        "a frozen rank named at start-up: the arrival barrier names the ranks that did not arrive",
    ),
    Scheduled(
        "tests/unit/test_moe_routing.py::test_trainer_random_routing_1_process_equals_ep2",
        ("tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2", "tests/unit/test_moe_routing.py"),
        "random routing on EP 2: the capacity run on EP 2 and the routing modes' unit tests",
    ),
    Scheduled(
        "tests/unit/test_graph_tpu_reverse_scan.py::test_tagged_backward_scan_is_the_flipped_scan[[]none]",
        ("tests/unit/test_graph_tpu_reverse_scan.py::test_tagged_backward_scan_is_the_flipped_scan[full]",),
        "the tagged backward scan without AC: the same tag with full AC",
    ),
    Scheduled(
        "tests/unit/test_parallel_training.py::test_steps_match_single_process[[]{'dp_replicate': 2, 'dp_shard': 2, 'tp': 2}]",
        ("tests/unit/test_parallel_training.py::test_steps_match_single_process",),
        "HSDP x TP on 8 ranks: FSDP x TP on the same harness",
    ),
    Scheduled(
        "tests/unit/test_qk_clip.py::test_deepseek_clip_tensor_parallel_two_gloo_processes",
        ("tests/unit/test_qk_clip.py::test_clip_tensor_parallel_two_ranks_equal_one_process",),
        "DeepSeek's clip on TP 2 as processes: the clip on TP 2 as thread ranks",
    ),
    Scheduled(
        "tests/unit/test_qk_clip.py::test_clip_fsdp_and_tensor_parallel_four_ranks_equal_one_process[[]mla_lora_q]",
        ("tests/unit/test_qk_clip.py::test_clip_fsdp_and_tensor_parallel_four_ranks_equal_one_process[gqa]",),
        "the clip of MLA's low-rank q on 4 ranks: the same mesh with GQA",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_debug_recipe_loss_falls[[]configs/qwen3_debug.toml]",
        ("tests/e2e/test_train_e2e.py::test_loss_falls",),
        "the Qwen3 debug recipe's loss falls: the Llama 3 debug recipe's, on the same trainer",
    ),
    Scheduled(
        "tests/unit/test_context_parallel.py::test_attention_matches_full_sequence[[]cp2_kernel_interface]",
        ("tests/unit/test_context_parallel.py::test_attention_matches_full_sequence[cp2]",),
        "CP attention through the kernel interface: the same ring on the default attention",
    ),
    Scheduled(
        "tests/xla/test_kernels.py::test_kernels_export_without_a_device",
        ("tests/xla/test_kernels.py::test_interpret_matches_torch_reference", "tests/unit/test_kernel_tiles_sweep.py"),
        "the kernels exported for each TPU (the same compiles as the per-generation tiles): the kernels run interpreted, and the tile pick",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]llama3_8b_v6e.toml]",
        (
            "tests/e2e/test_recipes.py::test_the_check_names_the_recipe_and_the_rule_or_the_shortfall",
            "tests/unit/test_planner_deepseek.py::test_pod_recipe_is_the_planners_choice_and_passes_the_check[deepseek_v3_671b_v7x]",
        ),
        "a dense pod recipe on its fake world: the recipe check's refusals, and the DeepSeek-V3 pod recipe passing the check",
    ),
    Scheduled(
        "tests/e2e/test_launch.py::test_simulated_two_host_slice_trains",
        (
            "tests/e2e/test_launch.py::test_cli_error_is_one_line_exit_2_and_dry_run_prints_the_command",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
        ),
        "two simulated hosts through the launcher: the launcher's plan and command, and torchrun ranks training",
    ),
    Scheduled(
        "tests/unit/test_moe_trace.py::test_qwen3_moe_graph_step_is_one_graph_without_scalar_capture",
        ("tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program", "tests/unit/test_moe_trace.py"),
        "the MoE step as one graph: it lowers to one program on XLA, and the routing traces without data-dependent shapes",
    ),
    Scheduled(
        "tests/unit/test_planner.py::test_recommend_adds_cp_only_when_the_sequence_needs_it",
        ("tests/unit/test_planner.py::test_suggest_fixes_offers_a_cp_degree_for_a_long_sequence",),
        "CP added only for long sequences: the planner's fix offers a CP degree for a long sequence",
    ),
    Scheduled(
        "tests/unit/test_graph_step.py::test_dump_graph",
        ("tests/unit/test_graph_golden.py::test_golden_graph_text",),
        "the step's graph written out: the golden graph text",
    ),
    Scheduled(
        "tests/unit/test_graph_step.py::test_reverse_scan_is_the_flipped_scan",
        ("tests/unit/test_graph_tpu_reverse_scan.py::test_tagged_backward_scan_is_the_flipped_scan[full]",),
        "the backward scan is the flipped forward scan: the same, tagged for the TPU lowering",
    ),
    Scheduled(
        "tests/unit/test_flux_model.py::test_per_block_compile_matches_eager",
        ("tests/unit/test_parallel_compile.py::test_per_block_compile_matches_eager",),
        "FLUX's blocks compiled one by one: the same per-block compile on a language model",
    ),
    # torch-tpu (the ttpu venv): CI's default tier neither loads nor installs it (the TPU stack is an
    # optional extra); the XLA:CPU lowering of the same step and the CPU-side TPU capture cover it.
    Scheduled(
        "tests/xla/test_torch_tpu_path.py::*",
        (
            "tests/xla/test_lowering.py::test_step_on_xla_cpu_matches_aot_eager",
            "tests/unit/test_graph_tpu_reverse_scan.py::test_tpu_capture_tags_instead_of_looping",
        ),
        "the step through torch-tpu's lowering: the same step lowered by torchax and run on XLA:CPU, and the TPU capture's tags",
    ),
    Scheduled(
        "tests/xla/test_kernels.py::test_torch_tpu_jax_op_registration",
        ("tests/xla/test_kernels.py::test_interpret_matches_torch_reference", "tests/unit/test_kernel_selfcheck.py"),
        "the kernels' torch-tpu registration: the kernels interpreted, and the start-up self-check",
    ),
    Scheduled(
        "tests/xla/test_quantize_xla.py::test_torch_tpu_registers_the_ops_with_autograd",
        ("tests/xla/test_quantize_xla.py::test_xla_cpu_equals_the_torch_emulation",),
        "the quantized op's torch-tpu registration: the same jax_op function through XLA:CPU",
    ),
    Scheduled(
        "tests/xla/test_*_ttpu.py::*",
        ("tests/unit/test_tpu_env.py", "tests/unit/test_tpu_topology.py"),
        "torch-tpu's runtime flags, topology and hybrid mesh: the same tables checked without torch-tpu",
    ),
    Scheduled(
        "tests/e2e/test_exit_codes.py::test_sigterm_to_the_launcher_saves_and_exits_75",
        ("tests/e2e/test_preemption.py::test_sigterm_checkpoints_and_the_relaunch_resumes_exactly",),
        "SIGTERM through the launcher: SIGTERM to the trainer saves and the relaunch resumes",
    ),
    Scheduled(
        "tests/e2e/test_cli.py::test_ctrl_c_through_the_launcher_stops_every_rank_without_a_traceback",
        ("tests/e2e/test_preemption.py::test_preempted_single_process_exits_75", "tests/e2e/test_cli.py"),
        "Ctrl-C through the launcher: the trainer's signal handling and every script's clean bad-input exit",
    ),
    Scheduled(
        "tests/e2e/test_quantize_train.py::test_a_quantized_run_trains_close_to_bf16",
        (
            "tests/unit/test_quantize.py::test_quantization_equals_a_hand_written_quantizer",
            "tests/unit/test_quantize.py::test_compile_aot_eager_matches_eager",
        ),
        "a quantized run through the trainer: the quantized op against a hand-written quantizer, eager and traced",
    ),
    Scheduled(
        "tests/e2e/test_data_shards.py::test_trainer_resumes_exactly_on_one_document",
        ("tests/e2e/test_data_shards.py::test_torchrun_ranks_gather_the_state_and_resume_on_other_degrees",),
        "the trainer resumes on the same document: the data state gathered and resumed on other degrees",
    ),
    Scheduled(
        "tests/unit/test_document_mask.py::test_training_runs_with_document_mask_eager_and_graph",
        (
            "tests/unit/test_document_mask.py::test_packed_row_equals_each_document_alone",
            "tests/unit/test_document_mask.py::test_tensor_parallel_passes_segment_ids",
        ),
        "training with document masks: each packed document equals itself alone, and the ids reach TP ranks",
    ),
    Scheduled(
        "tests/unit/test_hf_load_scale.py::test_streaming_conversion_peak_memory_is_bounded",
        ("tests/unit/test_hf_load_scale.py::test_sliced_load_equals_full_load_and_reads_only_owned_bytes",),
        "the streaming conversion's memory: the sliced load reads only the bytes a rank owns",
    ),
    Scheduled(
        "tests/unit/test_flux_data.py::test_concurrent_first_use_builds_once",
        ("tests/unit/test_flux_data.py::test_same_seed_same_bytes",),
        "two first users build the FLUX data once: the build is byte-reproducible",
    ),
    Scheduled(
        "tests/unit/test_attention_widths.py::test_context_parallel_attention_takes_two_widths[[]dense]",
        (
            "tests/unit/test_context_parallel.py::test_attention_matches_full_sequence[cp2]",
            "tests/unit/test_attention_widths.py",
        ),
        "CP attention at two head widths: CP attention at one width, and the widths without CP",
    ),
    Scheduled(
        "tests/e2e/test_runlock.py::test_a_lock_covers_the_folders_above_and_below_it_by_resolved_path",
        ("tests/e2e/test_runlock.py::test_second_training_run_is_refused_and_the_first_keeps_its_folder",),
        "the lock over nested folders: the lock refuses a second run on the same folder",
    ),
    Scheduled(
        "tests/e2e/test_runlock.py::test_the_refusal_reaches_every_rank[[]dump_folder]",
        ("tests/e2e/test_runlock.py::test_second_training_run_is_refused_and_the_first_keeps_its_folder",),
        "the lock's refusal on every rank: the refusal on one rank",
    ),
    Scheduled(
        "tests/unit/test_context_parallel.py::test_parallelized_model_with_cp_axis[[]llama3-cp2]",
        ("tests/unit/test_context_parallel.py::test_model_cp2_matches_single_process[llama3]",),
        "the parallelized model with a cp axis: the model on CP 2 equals one process",
    ),
    Scheduled(
        "tests/xla/test_lowering.py::test_step_on_xla_cpu_matches_aot_eager[[]qwen3:debugmodel:*[dl]:2]",
        (
            "tests/xla/test_lowering.py::test_step_on_xla_cpu_matches_aot_eager[llama3:debugmodel:unrolled:2]",
            "tests/xla/test_lowering.py::test_step_on_xla_cpu_matches_aot_eager[qwen3:debugmodel_moe:unrolled:2]",
        ),
        "the dense Qwen3 step on XLA:CPU (the session fixture lowers only the selected variants): Llama 3's step and the Qwen3 MoE step, which carries Qwen3's attention",
    ),
    Scheduled(
        "tests/unit/test_planner.py::test_shipped_128k_recipes_are_the_planners_choice",
        (
            "tests/unit/test_planner.py::test_suggest_fixes_offers_a_cp_degree_for_a_long_sequence",
            "tests/e2e/test_recipes.py::test_the_check_names_the_recipe_and_the_rule_or_the_shortfall",
        ),
        "the 128k recipes are the planner's choice: the planner offers CP for a long sequence, and the recipe check",
    ),
    Scheduled(
        "tests/e2e/test_expert_balance.py::test_resume_continues_the_bias_trajectory",
        ("tests/e2e/test_expert_balance.py", "tests/e2e/test_train_e2e.py::test_resume_reproduces_uninterrupted_run"),
        "the balance bias through a resume: the bias update's unit tests, and the exact resume of the trainer state",
    ),
    Scheduled(
        "tests/unit/test_graph_step.py::test_fenced_remat_reads_forward_values_through_barriers",
        ("tests/unit/test_graph_step.py::test_unrolled_remat",),
        "fenced remat: remat on the unrolled graph",
    ),
    Scheduled(
        "tests/unit/test_graph_step.py::test_full_save_attention[[]*",
        (
            "tests/unit/test_graph_step.py::test_scan_body_tags_for_full_save_attention",
            "tests/unit/test_parallel_ac.py::test_modes_give_the_same_grads",
            "tests/unit/test_graph_step.py::test_unrolled_remat",
        ),
        "full_save_attention in the graph step: the scan body's tags, the mode eagerly, and remat on the unrolled graph",
    ),
    Scheduled(
        "tests/unit/test_graph_step.py::test_fenced_remat_waits_for_the_backward",
        (
            "tests/unit/test_graph_step.py::test_unrolled_remat",
            "tests/unit/test_graph_step.py::test_remat_one_region_across_unmarked_backward_ops",
        ),
        "the fence tied to the backward: remat on the unrolled graph, and the backward regions on a hand-made graph",
    ),
    Scheduled(
        "tests/unit/test_planner.py::test_recommend_prefers_pure_fsdp_then_adds_tp",
        (
            "tests/unit/test_planner.py::test_too_big_gives_a_clear_verdict_and_suggestions",
            "tests/unit/test_planner.py::test_planner_bytes_equal_a_real_4_rank_run_with_adamw",
        ),
        "the planner's order of preference: its verdict and suggestions, and its bytes against a real run",
    ),
    Scheduled(
        "tests/unit/test_checkpoint.py::test_two_rank_sharded_save_loads_on_one_process",
        ("tests/unit/test_parallel_fsdp.py::test_dcp_checkpoint_reshards_between_meshes",),
        "a 2-rank save loaded on one process: DCP resharding between meshes",
    ),
    Scheduled(
        "tests/unit/test_graph_step.py::test_unrolled_remat[[]selective]",
        ("tests/unit/test_graph_step.py::test_unrolled_remat[full]", "tests/unit/test_parallel_ac.py"),
        "selective AC on the unrolled graph: full AC on the same graph, and the selective policy eagerly",
    ),
    Scheduled(
        "tests/e2e/test_cli.py::test_estimate_reads_the_recipes_target",
        ("tests/unit/test_planner.py::test_cli_does_not_fit_prints_table_and_exits_1",),
        "estimate.py reads a recipe's target: the planner's command line on a recipe",
    ),
    Scheduled(
        "tests/e2e/test_data_shards.py::test_small_data_sets_train_with_the_default_shards[[]files-one-empty-shard]",
        ("tests/e2e/test_data_shards.py::test_small_data_sets_train_with_the_default_shards",),
        "an empty file shard in a small data set: the other small data sets on the default shards",
    ),
    Scheduled(
        "tests/e2e/test_data_shards.py::test_resume_4_to_2_ranks_continues_the_global_order[[]documents-64-shards]",
        ("tests/e2e/test_data_shards.py::test_resume_4_to_2_ranks_continues_the_global_order",),
        "64 document shards resumed on fewer ranks: the other shard layouts",
    ),
    Scheduled(
        "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process[[]tp2]",
        (
            "tests/unit/test_flux_model.py::test_tp_and_fsdp_match_single_process[fsdp2]",
            "tests/unit/test_flux_model.py::test_tp2_bf16_forward_backward",
        ),
        "FLUX on TP 2 against one process in fp32: FLUX on FSDP 2 against one process, and FLUX's TP 2 forward and backward",
    ),
    Scheduled(
        "tests/e2e/test_hf_backend.py::test_bad_hf_config_is_one_error_line",
        ("tests/e2e/test_exit_codes.py::test_bad_input_exits_2_and_a_crash_never_75", "tests/e2e/test_hf_backend.py"),
        "a bad HF model config as one error line: the trainer's bad-input contract, and the HF adapter's own refusals",
    ),
    Scheduled(
        "tests/unit/test_quantize_moe.py::test_forward_equals_a_hand_written_per_group_quantizer[[]float8_tensorwise]",
        ("tests/unit/test_quantize_moe.py::test_forward_equals_a_hand_written_per_group_quantizer",),
        "the grouped op's tensorwise scales: its rowwise and blockwise scales against the same hand-written quantizer",
    ),
    Scheduled(
        "tests/e2e/test_contract.py::test_runner_matches_a_real_process",
        (
            "tests/e2e/test_exit_codes.py::test_bad_input_exits_2_and_a_crash_never_75",
            "tests/e2e/test_cli.py::test_help_and_a_bad_flag",
            "tests/unit/test_config.py::test_cli_errors_exit_2_with_one_line",
        ),
        "the contract table's forked runner equals a real process (it reads the whole table, 2-3 min on a 2-vCPU EPYC): real processes of the trainer, every script and the config's command line on bad input",
    ),
    Scheduled(
        "tests/e2e/test_new_family.py::test_new_family_parallel_matches_single_process[[]fsdp2]",
        (
            "tests/unit/test_models_params.py",
            "tests/unit/test_step_plan.py",
            "tests/e2e/test_parallel_e2e.py::test_losses_match_single_process[2-degrees0]",
        ),
        "an outside family on FSDP 2 through torchrun: the outside family built, counted and planned through models/contract.py, and FSDP 2 through torchrun on a built-in family",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_moe_losses_match_single_process[[]2-degrees0]",
        (
            "tests/e2e/test_moe_capacity_train.py::test_capacity_1_process_equals_ep2",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
        ),
        "the dropless MoE on EP 2 through torchrun: the capacity MoE on EP 2 through the trainer, and dropless EP parity on thread ranks",
    ),
    # --- pipeline parallelism (docs/pipeline_parallel.md): the default tier resumes a one-process run
    # on PP 2 through torchrun (1F1B: build_schedule, PipelineStep, the pruned model's DCP load and save)
    # and checks the stage split, placement and rules; these run every schedule and PP x FSDP.
    Scheduled(
        "tests/unit/test_pipeline_parallel.py::test_*_equal*_one_process",
        (
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
            "tests/unit/test_pipeline_parallel.py::test_stage_placement_per_schedule",
        ),
        "every schedule (one stage per rank, loop and V placement) and PP 2 x FSDP 2 with AC and accumulation "
        "against one process on spawned gloo ranks: the default tier runs the same step (1F1B) and schedule "
        "builder through the trainer, and the placement arithmetic of every schedule",
    ),
    Scheduled(
        "tests/unit/test_planner_pipeline_moe.py::test_planned_stage_params_equal_the_trainers_pp2_ep2_build",
        (
            "tests/unit/test_planner_pipeline_moe.py::test_pp2_ep2_rank_holds_its_layers_experts_and_capacity_rows_by_hand",
        ),
        "the planner's per-rank parameters of a PP 2 x EP 2 Qwen 3 MoE plan against the trainer's own build on 4 "
        "spawned gloo ranks: the default tier checks the same per-rank parameters by hand",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline_moe.py::test_graph_pp2_*",
        (
            "tests/unit/test_graph_pipeline_moe.py::test_bubble_iteration_aux_and_load_count_nothing",
            "tests/unit/test_graph_pipeline_moe.py::test_live_iterations_are_each_stage_s_m_chunks",
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
        ),
        "Qwen 3 MoE through graph-mode PP 2 (unrolled, the iterations as one scan, layer scan, accumulation, a "
        "dense first stage; x CP 2 and x EP 2, unrolled and as one scan) against one process on spawned gloo "
        "ranks (~4.5 min): the default tier checks the "
        "bubble mask of the aux terms and loads and runs the same captured pipeline on a dense model",
    ),
    Scheduled(
        "tests/unit/test_pipeline_moe.py::test_pp2_*",
        (
            "tests/unit/test_pipeline_moe.py::test_attach_aux_gives_earlier_stages_the_aux_gradient",
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
            "tests/unit/test_expert_parallel.py::test_qwen3_moe_matches_single_process",
        ),
        "Qwen 3 MoE on PP 2 and PP 2 x EP 2 (aux loss attached per stage, expert loads per layer, EP inside "
        "each stage), PP 2 x CP 2, a dense first stage, Qwen 3.5 MoE and gpt-oss on PP 2, against one process on "
        "spawned gloo ranks: the "
        "default tier checks the aux-gradient "
        "attachment on a two-stage split, runs the same PipelineStep and schedule builder on a dense model "
        "through the trainer, and EP parity on thread ranks",
    ),
    Scheduled(
        "tests/unit/test_pipeline_cp.py::test_*pp2_cp2*",
        (
            "tests/unit/test_pipeline_cp.py::test_eager_pp_with_cp_is_planned",
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
            "tests/unit/test_context_parallel.py::test_model_cp2_matches_single_process[llama3]",
        ),
        "PP 2 x CP 2 (4 spawned gloo ranks; 1F1B and Interleaved1F1B, and through the trainer) and PP 2 x CP 2 "
        "x TP 2 (8 ranks) against one "
        "process: the default tier plans eager PP x CP, runs the same PipelineStep and schedule builder on "
        "PP 2 through the trainer, and the CP attention, RoPE positions and loss on a CP 2 model",
    ),
    Scheduled(
        "tests/unit/test_pipeline_compile.py::test_*one_process*",
        (
            "tests/unit/test_pipeline_compile.py::test_compile_mode_pp_is_planned",
            "tests/unit/test_pipeline_compile.py::test_zero_bubble_calls_run_without_donated_buffers",
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
            "tests/unit/test_parallel_compile.py::test_per_block_compile_matches_eager[degrees0]",
        ),
        "PP in compile mode (Inductor per block on every spawned gloo rank: 1F1B and Interleaved1F1B, the "
        "zero-bubble schedules with donated buffers off, PP x FSDP "
        "with SAC and accumulation, MoE with and without EP, CP, and PP 2 / PP 2 x TP 2 through the trainer) "
        "against one process: the default tier plans compile-mode PP with the non-PP backend, runs the same "
        "PipelineStep and schedule builder on PP 2 through the trainer, and per-block compile under SimpleFSDP",
    ),
    Scheduled(
        "tests/unit/test_pipeline_pp4.py::test_pp4_schedules_equal_one_process",
        (
            "tests/unit/test_pipeline_pp4.py::test_the_pp4_stages_are_the_trainers_split",
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
            "tests/unit/test_pipeline_parallel.py::test_stage_placement_per_schedule",
        ),
        "four schedules on PP 4 (4 spawned gloo ranks, middle stages without embedding or head) against one "
        "process: the default tier checks the 4- and 8-stage split and every schedule's placement, and runs "
        "the same PipelineStep and schedule builder on PP 2 through the trainer",
    ),
    Scheduled(
        "tests/e2e/test_pipeline_moe_train.py::test_pp2_moe_trains_as_the_one_process_with_accumulation",
        (
            "tests/unit/test_pipeline_moe.py::test_attach_aux_gives_earlier_stages_the_aux_gradient",
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
        ),
        "Qwen 3 MoE on PP 2 through torchrun against one process with accumulation (the job's aux coefficient, "
        "expert balance and stage mesh handed to PipelineStep): the default tier checks the aux-gradient "
        "attachment and runs PipelineStep through the trainer on a dense model",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline.py::test_graph_pp2_*eager_pp",
        ("tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",),
        "graph-mode PP 2 over 4 chunks against eager PP's GPipe on the same ranks: the default tier runs the "
        "same captured pipeline (2 chunks) against one process, which eager GPipe equals (the scheduled "
        "test_pipeline_parallel.py rows)",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline.py::test_graph_pp2_layer_scan_and_fused_loss_equal_one_process",
        ("tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",),
        "graph-mode PP 2 with layer scan (each stage's blocks one scan per pipeline iteration) and with the "
        "fused loss: the default tier runs the same PipelinedLoss, permutes and pp reductions with the blocks "
        "unrolled and the plain loss; layer scan and the fused loss themselves run in the default tier "
        "(tests/unit/test_graph_step.py, test_scan_uneven.py)",
    ),
    Scheduled(
        "tests/xla/test_pipeline_step_xla.py::test_pipelined_step_is_one_program_with_collective_permutes",
        (
            "tests/xla/test_pipeline_permute_xla.py::test_stage_permute_lowers_to_one_collective_permute_each_way",
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
        ),
        "graph-mode PP's whole train step lowered by torchax and run on 2 XLA:CPU devices (~80 s): the default "
        "tier lowers the same permute rule on XLA:CPU and checks the same captured step, one program on both "
        "ranks, against one process on gloo",
    ),
    Scheduled(
        "tests/xla/test_pipeline_step_xla.py::test_pipelined_moe_step_returns_each_stage_s_aux_and_loads",
        (
            "tests/xla/test_pipeline_permute_xla.py::test_stage_permute_lowers_to_one_collective_permute_each_way",
            "tests/unit/test_graph_pipeline_moe.py::test_bubble_iteration_aux_and_load_count_nothing",
            "tests/xla/test_moe_xla.py::test_qwen3_moe_lowers_to_one_program",
        ),
        "graph-mode PP's MoE train step lowered by torchax and run on 2 XLA:CPU devices (~25 s): the default "
        "tier lowers the permute and the Qwen 3 MoE model on XLA:CPU and checks the bubble mask of the "
        "stage's aux terms and loads",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline.py::test_graph_pp2_rank_independent_permute_prints_identically_and_equals_one_process",
        (
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
            "tests/unit/test_graph_pipeline.py::test_rank_independent_permute_slots",
        ),
        "the rank-independent permute in the captured pipeline (64 s, two captures per rank): its slots and "
        "sum run by default, and graph-mode PP's parity and identical graphs up to the splits",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline.py::test_graph_pp2_scan_over_iterations_equals_one_process",
        ("tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",),
        "graph-mode PP 2 with the pipeline's iterations as one scan (36 s): the default tier runs the same "
        "PipelinedLoss, stage permute and pp reductions unrolled",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline.py::test_graph_pp2_fsdp2_accumulation_equals_one_process",
        (
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
            "tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives",
        ),
        "graph-mode PP 2 x FSDP 2 with accumulation on 4 processes (a minute): the default tier runs the "
        "captured pipeline on PP 2 and SimpleFSDP's collectives in the graph step",
    ),
    Scheduled(
        "tests/e2e/test_pipeline_train.py::test_pp2_from_scratch_is_the_one_process_run_and_resumes_at_pp1",
        ("tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",),
        "PP 2 x FSDP 2 from scratch (the replayed whole-model init) and a PP checkpoint resumed on one process: "
        "the default tier resumes the other way, which loads and saves the pruned model's DCP state",
    ),
    Scheduled(
        "tests/e2e/test_pipeline_train.py::test_pp2_tp2_is_the_one_process_run",
        (
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
            "tests/e2e/test_parallel_e2e.py",
        ),
        "PP 2 x TP 2 through torchrun: the default tier runs the pipeline step through torchrun and TP 2 "
        "against one process",
    ),
    Scheduled(
        "tests/e2e/test_pipeline_train.py::test_pp2_tp2_loss_parallel_is_the_one_process_run[[]*",
        (
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
            "tests/unit/test_pipeline_parallel.py::test_pp_with_tp_loss_parallel_is_planned",
            "tests/e2e/test_parallel_e2e.py",
        ),
        "PP 2 x TP 2 with loss parallel through torchrun (1F1B and ZBVZeroBubble with validation, 4 processes, "
        "40 s each): the default tier plans it, runs the pipeline step through torchrun and TP 2 against one "
        "process",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline.py::test_graph_pp2_tp2_*equals_one_process",
        (
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
            "tests/unit/test_graph_pipeline.py::test_graph_pp_rules",
            "tests/e2e/test_parallel_e2e.py",
        ),
        "graph-mode PP 2 x TP 2 (unrolled and layer scan, 4 processes, ~4 min) and PP 2 x TP 2 x FSDP 2 (8 "
        "processes) against one process: the default tier runs the same captured pipeline on PP 2, the rule "
        "that now accepts TP with it, and TP 2 against one process through the trainer",
    ),
    Scheduled(
        "tests/e2e/test_pipeline_train.py::test_graph_pp2_cp2_is_the_one_process_run",
        (
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
            "tests/unit/test_pipeline_cp.py::test_graph_pp_with_cp_is_planned",
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
        ),
        "graph-mode PP 2 x CP 2 through torchrun (4 processes, two captures, 90 s on the slow EPYC): the default "
        "tier runs the captured pipeline on PP 2, plans graph PP x CP, and runs PP through torchrun",
    ),
    Scheduled(
        "tests/e2e/test_pipeline_train.py::test_graph_pp2_cp2_iteration_scan_is_the_one_process_run",
        (
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
            "tests/unit/test_graph_pipeline.py::test_graph_pp_iteration_scan_rules",
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
        ),
        "graph-mode PP 2 x CP 2 with compile.scan_pipeline_iterations through torchrun (4 processes, two "
        "captures): the default tier runs the captured pipeline on PP 2, plans the iteration scan from its key, "
        "and runs PP through torchrun",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline.py::test_graph_pp2_fsdp2_scan_over_iterations_equals_one_process",
        (
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
            "tests/unit/test_graph_pipeline.py::test_graph_pp_iteration_scan_rules",
            "tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives",
        ),
        "graph-mode PP 2 x FSDP 2 with the iterations as one scan, the shards gathered in its body by group "
        "name (4 processes, ~3 min loaded): the default tier runs the captured pipeline unrolled, the "
        "iteration scan's rules, and SimpleFSDP's collectives in the graph step",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline.py::test_graph_pp2_scan_over_iterations_full_ac_keeps_stage_inputs",
        (
            "tests/unit/test_graph_pipeline.py::test_graph_pp_iteration_scan_rules",
            "tests/unit/test_graph_step.py::test_scan_body_tags_for_full_save_attention",
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
        ),
        "full AC inside graph-mode PP's iteration scan (2 processes, the captured pipeline and eager PP, ~1 min "
        "loaded): the default tier plans the iteration scan's AC into the scan body's partition (`scan_ac`), "
        "tags a scan body's joint graph for full AC, and runs the captured pipeline against one process",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline.py::test_graph_pp2_tp2_scan_over_iterations_with_full_ac_equals_one_process",
        (
            "tests/unit/test_graph_pipeline.py::test_graph_pp_iteration_scan_rules",
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
            "tests/unit/test_graph_step.py::test_scan_matches_eager_with_grad_accumulation",
        ),
        "graph-mode PP 2 x TP 2 with the iterations as one scan and full AC in it (4 processes, ~2 min "
        "loaded): the default tier plans the iteration scan with TP, runs the captured pipeline against "
        "one process, and a scanned body against eager",
    ),
    Scheduled(
        "tests/xla/test_pipeline_step_xla.py::test_pipelined_step_with_iteration_scan_has_one_permute_each_way",
        (
            "tests/xla/test_pipeline_permute_xla.py::test_stage_permute_lowers_to_one_collective_permute_each_way",
            "tests/xla/test_lowering.py::test_scan_is_one_loop_each_way_whatever_n_layers",
            "tests/unit/test_graph_pipeline.py::test_graph_pp_iteration_scan_rules",
        ),
        "graph-mode PP's iteration scan lowered on XLA:CPU (the torch-tpu probe, ~2 min loaded): the default "
        "tier lowers the permute rule and a layer scan on XLA:CPU, and plans the iteration scan",
    ),
    Scheduled(
        "tests/e2e/test_pipeline_train.py::test_graph_pp2_tp2_is_the_one_process_run",
        (
            "tests/unit/test_graph_pipeline.py::test_graph_pp2_equals_one_process",
            "tests/e2e/test_pipeline_train.py::test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run",
        ),
        "graph-mode PP 2 x TP 2 through torchrun in a drawn device order: the default tier runs the captured "
        "pipeline against one process and the pipeline's trainer path (DCP, validation) through torchrun",
    ),
    Scheduled(
        "tests/xla/test_delta_rule_kernel.py::*",
        (
            "tests/unit/test_delta_rule_op.py",
            "tests/unit/test_kernel_selfcheck.py::test_a_kernel_that_agrees_in_bf16_passes_within_the_argued_tolerance[gated_delta_rule]",
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
        ),
        "the delta rule kernel in interpret mode (a minute of jax start-up, interpretation and the VJP) and its "
        "torch-tpu op on fake tensors: the default tier routes the op, checks its self-check cases against the "
        "recurrence and runs the other Pallas kernels interpreted",
    ),
    Scheduled(
        "tests/xla/test_cp_delta_rule.py::*",
        (
            "tests/unit/test_cp_linear_attention.py::test_ops_match_the_whole_sequence[cp2-docs]",
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
        ),
        "the cp delta-rule wrapper over the interpreted Pallas kernel (a minute of jax start-up and "
        "interpretation): the default tier runs the wrapper over the torch reference on gloo ranks and the "
        "Pallas kernels interpreted",
    ),
    Scheduled(
        "tests/xla/test_delta_rule_compile.py::*",
        (
            "tests/unit/test_delta_rule_op.py",
            "tests/unit/test_kernel_selfcheck.py::test_a_kernel_that_agrees_in_bf16_passes_within_the_argued_tolerance[gated_delta_rule]",
            "tests/xla/test_kernels.py::test_interpret_matches_torch_reference",
        ),
        "the delta rule's kernels compiled deviceless for v6e and TPU7x (libtpu, a 4096-token program each): the "
        "default tier routes the op and checks its self-check cases; the scheduled interpret test runs the kernels",
    ),
    Scheduled(
        "tests/unit/test_hybrid_scan.py::test_hybrid_graph_step_with_scan_matches_eager*",
        (
            "tests/unit/test_hybrid_scan.py::test_the_period_is_the_layer_schedules",
            "tests/unit/test_models_moe.py::test_moe_scan_forward_backward_matches_the_loop",
        ),
        "Qwen 3.5's hybrid stack scanned one period per step through the graph trainer (two captures of "
        "the chunked delta rule, minutes): the default tier stacks the periods and runs the MoE scan",
    ),
    Scheduled(
        "tests/unit/test_deepseek_v4_scan.py::test_prefix_*",
        (
            "tests/unit/test_deepseek_v4_scan.py::test_a_stack_scans_its_periodic_rest_after_the_prefix",
            "tests/unit/test_deepseek_v4_scan.py::test_the_hash_blocks_are_an_unrolled_prefix",
            "tests/unit/test_models_moe.py::test_moe_scan_forward_backward_matches_the_loop",
        ),
        "DeepSeek-V4's stack scanned after its hash-routed prefix (a dynamo trace of its blocks, seconds; "
        "the graph step's captures, minutes): the default tier scans a toy stack after its prefix, checks "
        "V4's layouts and stacked rows, and runs the MoE scan",
    ),
    Scheduled(
        "tests/e2e/test_devices.py::test_cpu_pipeline_meets_the_cuda_bound_under_another_summation_order",
        (
            "tests/e2e/test_train_e2e.py::test_fp32_and_grad_accumulation",
            "tests/e2e/test_train_e2e.py::test_resume_reproduces_uninterrupted_run",
        ),
        "the device tests' CPU pipeline (a trained fp32 reference, then an accumulated step-1 loss within the "
        "CUDA bound): fp32 accumulation equal to one micro-batch and resuming from weights run by default",
    ),
    Scheduled(
        "tests/unit/test_scan_offload.py::test_graph_step_offload_matches_the_step_without",
        ("tests/unit/test_scan_offload.py::test_offload_moves_the_saved_block_inputs_and_keeps_the_numbers",),
        "the host offload of the scan's saved block inputs on the Llama graph step (two captures, 28 s on the "
        "slow EPYC): the same pass on a hand-built scan pair, its ops counted and its numbers bitwise equal",
    ),
    Scheduled(
        "tests/xla/test_host_offload.py::*",
        ("tests/unit/test_scan_offload.py::test_offload_moves_the_saved_block_inputs_and_keeps_the_numbers",),
        "the host offload's torchax rules on XLA:CPU (a jax start-up, 10 s on the slow EPYC): the same scan "
        "pair after the pass, run by torch, bitwise equal to before it",
    ),
    Scheduled(
        "tests/unit/test_graph_pipeline_offload.py::test_graph_pp2_offload_matches_the_step_without",
        (
            "tests/unit/test_scan_offload.py::test_offload_moves_the_saved_block_inputs_and_keeps_the_numbers",
            "tests/unit/test_graph_pipeline.py::test_graph_pp_rules",
        ),
        "the host offload inside graph-mode PP (2 gloo processes, two captures each, 136 s on the slow EPYC): "
        "the same pass on a hand-built scan pair, its ops counted and its numbers bitwise equal; graph PP's rules",
    ),
)


def scheduled(nodeid: str) -> Scheduled | None:
    """The `SCHEDULED` entry a test belongs to, or None (a default-tier test)."""
    for entry in SCHEDULED:
        if fnmatch.fnmatchcase(nodeid, entry.pattern):
            return entry
    return None


def in_smoke_tier(nodeid: str) -> bool:
    """A test of the fast loop (`SMOKE`)."""
    return nodeid.startswith(SMOKE)


def in_default_tier(nodeid: str, *, exhaustive: bool) -> bool:
    """A test runs in the default tier unless `SCHEDULED` lists it or it is marked `exhaustive`."""
    return not exhaustive and scheduled(nodeid) is None
